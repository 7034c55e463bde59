// Global amax reductions: max|x| (per-tensor FP8, NVFP4) and, for NVFP4 with the Hadamard transform,
// max|x| and max|RHT16(x^T)| in one pass; each also per row group (the experts of a grouped linear) in one launch,
// and the row -> group index those take.
#include <cstdlib>

#include "binding_checks.h"
#include "ops.h"
#include "tile/common.cuh"

namespace hybridq {

int tile_num_sms() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    sms = n > 0 ? n : 132;
  }
  return sms;
}

int tile_cfg_override() {
  const char* s = std::getenv("HYBRIDQ_TILE_CFG");
  return (s != nullptr && s[0] >= '0' && s[0] <= '9') ? s[0] - '0' : -1;
}

int tile_group_default() {
  const char* s = std::getenv("HYBRIDQ_TILE_GROUP");
  if (s != nullptr && s[0] != '\0') {
    const int g = std::atoi(s);
    return g >= 1 ? g : 1;
  }
  return kTileGroupDefault;
}

namespace {

int num_sms() { return tile_num_sms(); }

// max over the |x| bit patterns of one 16-byte vector, as fp32 |x| bits
template <typename T>
__device__ __forceinline__ uint32_t absmax_vec(const uint4& r) {
  if constexpr (sizeof(T) == 4) {
    return max(max(r.x & kAbsMask, r.y & kAbsMask), max(r.z & kAbsMask, r.w & kAbsMask));
  } else {
    // |x| of a 16-bit float as an unsigned half-word is ordered like the value (NaN above inf)
    const uint32_t m = __vmaxu2(__vmaxu2(r.x & 0x7FFF7FFFu, r.y & 0x7FFF7FFFu),
                                __vmaxu2(r.z & 0x7FFF7FFFu, r.w & 0x7FFF7FFFu));
    return m;  // two packed half-words; converted by finish_absmax
  }
}

template <typename T>
__device__ __forceinline__ uint32_t finish_absmax(uint32_t m) {
  if constexpr (sizeof(T) == 4) {
    return m;
  } else {
    const uint32_t h = max(m & 0xFFFFu, m >> 16);
    return abs_bits(half_bits_to_f32<T>(h));
  }
}

template <typename T>
__device__ __forceinline__ uint32_t block_reduce_max(uint32_t v) {
  __shared__ uint32_t red[32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : 0u;
    v = warp_max(v);
  }
  return v;
}

template <typename T>
__global__ void __launch_bounds__(256) absmax_kernel(const T* __restrict__ x, int64_t n, uint32_t* out) {
  constexpr int CH = 16 / static_cast<int>(sizeof(T));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gt = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  const int64_t nvec = aligned ? n / CH : 0;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  uint32_t m = 0;  // packed like absmax_vec's result
  int64_t i = gt;
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = __ldg(xv + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if constexpr (sizeof(T) == 4) m = max(m, absmax_vec<T>(r[u]));
      else m = __vmaxu2(m, absmax_vec<T>(r[u]));
    }
  }
  for (; i < nvec; i += stride) {
    if constexpr (sizeof(T) == 4) m = max(m, absmax_vec<T>(__ldg(xv + i)));
    else m = __vmaxu2(m, absmax_vec<T>(__ldg(xv + i)));
  }
  uint32_t am = finish_absmax<T>(m);
  for (int64_t j = nvec * CH + gt; j < n; j += stride) am = max(am, abs_bits(to_f32(x[j])));
  am = block_reduce_max<T>(am);
  if (threadIdx.x == 0) atomicMax(out, am);
}

// one warp per row (grid-stride); consecutive rows of a warp mostly share a group, so the warp keeps a running max
// and flushes it with one atomicMax when the group changes
template <typename T>
__global__ void __launch_bounds__(256) grouped_absmax_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                             const int32_t* __restrict__ row_group, uint32_t* out) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t rows_per_warp = (M + nwarps - 1) / nwarps;  // a contiguous run of rows per warp
  const int64_t r0 = warp * rows_per_warp, r1 = min64(M, r0 + rows_per_warp);
  constexpr int CH = 16 / static_cast<int>(sizeof(T));
  const bool vec = K % CH == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  int32_t group = -1;
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t g = row_group[r];
    if (g != group) {
      if (group >= 0) {
        const uint32_t v = warp_max(m);
        if (lane == 0) atomicMax(out + group, v);
      }
      group = g;
      m = 0;
    }
    const T* row = x + r * K;
    if (vec) {  // 16-byte loads
      const uint4* rv = reinterpret_cast<const uint4*>(row);
      uint32_t pm = 0;
      for (int64_t k = lane; k < K / CH; k += 32) {
        if constexpr (sizeof(T) == 4) pm = max(pm, absmax_vec<T>(__ldg(rv + k)));
        else pm = __vmaxu2(pm, absmax_vec<T>(__ldg(rv + k)));
      }
      m = max(m, finish_absmax<T>(pm));
    } else {
      for (int64_t k = lane; k < K; k += 32) m = max(m, abs_bits(to_f32(row[k])));
    }
  }
  if (group >= 0) {
    const uint32_t v = warp_max(m);
    if (lane == 0) atomicMax(out + group, v);
  }
}

// One thread's part of a (16-row group g, column c) item of the RHT amax kernels: the 16 values' max|x| into ra (the
// rowwise amax) and, after the 16-point RHT along the rows (of the values rounded to bf16 first where T is not
// bf16), their max into ca (the columnwise amax); as bit patterns of non-negative floats
template <typename T>
__device__ __forceinline__ void rht_amax_item(const T* __restrict__ x, int64_t K, int64_t g, int64_t c, uint32_t& ra,
                                              uint32_t& ca) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = to_f32(x[(g * 16 + i) * K + c]);
#pragma unroll
  for (int i = 0; i < 16; ++i) ra = max(ra, abs_bits(v[i]));
  if constexpr (!std::is_same<T, __nv_bfloat16>::value) {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = round_bf16(v[i]);
  }
  rht16_forward(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) ca = max(ca, abs_bits(v[i]));
}

template <typename T>
__global__ void __launch_bounds__(256) rht_amax_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                       uint32_t* row_amax, uint32_t* col_amax) {
  const int64_t cblocks = (K + 255) / 256, groups = M / 16;
  uint32_t ra = 0, ca = 0;
  for (int64_t b = blockIdx.x; b < groups * cblocks; b += gridDim.x) {
    const int64_t g = b / cblocks, c = (b % cblocks) * 256 + threadIdx.x;
    if (c < K) rht_amax_item(x, K, g, c, ra, ca);
  }
  ra = block_reduce_max<T>(ra);
  __syncthreads();
  ca = block_reduce_max<T>(ca);
  if (threadIdx.x == 0) {
    atomicMax(row_amax, ra);
    atomicMax(col_amax, ca);
  }
}

// the row-group variant of rht_amax_kernel: each CTA takes a contiguous run of (16-row group, 256-column block)
// items, 16-row group major, so consecutive items mostly share a row group (uniform over the CTA: all its threads
// work on one item) and the CTA flushes its running maxima with one atomicMax pair per row group it touched.
// Row groups are whole 16-row groups (the caller checks), so row_group[16 g] is the group of all 16 rows.
template <typename T>
__global__ void __launch_bounds__(256) grouped_rht_amax_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                               const int32_t* __restrict__ row_group,
                                                               uint32_t* row_amax, uint32_t* col_amax) {
  const int64_t cblocks = (K + 255) / 256, work = (M / 16) * cblocks;
  const int64_t per = (work + gridDim.x - 1) / gridDim.x;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * per, b1 = min64(work, b0 + per);
  int32_t group = -1;
  uint32_t ra = 0, ca = 0;
  auto flush = [&]() {  // (called by every thread of the CTA: group is uniform)
    const uint32_t r = block_reduce_max<T>(ra);
    __syncthreads();
    const uint32_t c = block_reduce_max<T>(ca);
    if (threadIdx.x == 0) {
      atomicMax(row_amax + group, r);
      atomicMax(col_amax + group, c);
    }
    __syncthreads();  // block_reduce_max's shared slots are free for the next flush
  };
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t g = b / cblocks, c = (b % cblocks) * 256 + threadIdx.x;
    const int32_t grp = row_group[g * 16];
    if (grp != group) {
      if (group >= 0) flush();
      group = grp;
      ra = ca = 0;
    }
    if (c < K) rht_amax_item(x, K, g, c, ra, ca);
  }
  if (group >= 0) flush();
}

// row_group[r] = the group g with starts[g] <= r < starts[g + 1] (starts: G + 1 non-decreasing row offsets, the
// last one M; empty groups own no row)
__global__ void __launch_bounds__(256) row_groups_from_starts_kernel(const int64_t* __restrict__ starts, int n_groups,
                                                                     int64_t M, int32_t* __restrict__ row_group) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < M; r += stride) {
    int lo = 0, hi = n_groups;  // the last g in [0, n_groups) with starts[g] <= r
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (starts[mid] <= r) lo = mid;
      else hi = mid;
    }
    row_group[r] = lo;
  }
}

// src_rows[m] for m in [0, width) of the padded row-group layout: the input row placed at row m (group g's rows at
// [padded_ends[g-1], padded_ends[g-1] + size_g), size_g = ends[g] - ends[g-1]), else -1 (the zero rows up to
// padded_ends[g] and from padded_ends[n-1] to width). Block 0's thread 0 checks the bounds first (device-side
// assert): the input's M rows end the groups, each padded group holds its rows in a multiple of 16, width holds all.
__global__ void __launch_bounds__(256) padded_rows_kernel(const int32_t* __restrict__ ends,
                                                          const int32_t* __restrict__ padded_ends, int n_groups,
                                                          int64_t M, int64_t width, int32_t* __restrict__ src_rows) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    bool ok = ends[n_groups - 1] == M && padded_ends[n_groups - 1] <= width;
    for (int g = 0; g < n_groups; ++g) {
      const int32_t size = ends[g] - (g ? ends[g - 1] : 0), psize = padded_ends[g] - (g ? padded_ends[g - 1] : 0);
      ok = ok && size >= 0 && psize >= size && psize % 16 == 0;
    }
    CUDA_KERNEL_ASSERT(ok && "padded row groups: bounds inconsistent with the rows or the width");
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; m < width; m += stride) {
    int lo = 0, hi = n_groups;  // the first g with padded_ends[g] > m (n_groups: past the last group)
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (padded_ends[mid] <= m) lo = mid + 1;
      else hi = mid;
    }
    int32_t src = -1;
    if (lo < n_groups) {
      const int64_t pstart = lo ? padded_ends[lo - 1] : 0, start = lo ? ends[lo - 1] : 0;
      if (m - pstart < ends[lo] - start) src = static_cast<int32_t>(start + (m - pstart));
    }
    src_rows[m] = src;
  }
}

// Every value of a quantize op's row map (`src_rows`, binding_checks.h apply_row_map) in [-1, src_M): another stops
// the stream with a device-side assert before the quantize reads through the map (a separate pass over the map's 4
// bytes per row keeps the check out of the tile kernel's registers)
__global__ void __launch_bounds__(256) check_row_map_kernel(const int32_t* __restrict__ src_rows, int64_t n,
                                                            int64_t src_M) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; m < n; m += stride) {
    const int32_t v = src_rows[m];
    CUDA_KERNEL_ASSERT(v >= -1 && v < src_M && "row map (src_rows): a value outside [-1, rows of x)");
  }
}

}  // namespace

cudaError_t launch_check_row_map(const int32_t* src_rows, int64_t n, int64_t src_M, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = static_cast<int>(min64((n + 255) / 256, static_cast<int64_t>(num_sms()) * 4));
  check_row_map_kernel<<<blocks, 256, 0, stream>>>(src_rows, n, src_M);
  return cudaGetLastError();
}

cudaError_t launch_padded_rows(const int32_t* ends, const int32_t* padded_ends, int n_groups, int64_t M,
                               int64_t width, int32_t* src_rows, cudaStream_t stream) {
  if (width == 0 || n_groups == 0) return cudaSuccess;
  const int blocks = static_cast<int>(min64((width + 255) / 256, static_cast<int64_t>(num_sms()) * 8));
  padded_rows_kernel<<<blocks, 256, 0, stream>>>(ends, padded_ends, n_groups, M, width, src_rows);
  return cudaGetLastError();
}

cudaError_t launch_absmax(InType t, const void* x, int64_t n, uint32_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  HQ_DISPATCH_IN(t, {
    constexpr int CH = 16 / static_cast<int>(sizeof(T));
    const int64_t want = (n / CH + 1023) / 1024 + 1;
    const int blocks = static_cast<int>(min64(want, static_cast<int64_t>(num_sms()) * 8));
    absmax_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(x), n, out);
    return cudaGetLastError();
  });
}

cudaError_t launch_grouped_absmax(InType t, const void* x, int64_t M, int64_t K, const int32_t* row_group,
                                  uint32_t* out, cudaStream_t stream) {
  if (M == 0 || K == 0) return cudaSuccess;
  HQ_DISPATCH_IN(t, {
    const int blocks = static_cast<int>(min64((M + 7) / 8, static_cast<int64_t>(num_sms()) * 8));
    grouped_absmax_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(x), M, K, row_group, out);
    return cudaGetLastError();
  });
}

cudaError_t launch_nvfp4_rht_amax(InType t, const void* x, int64_t M, int64_t K, uint32_t* row_amax,
                                  uint32_t* col_amax, cudaStream_t stream) {
  const int64_t work = (M / 16) * ((K + 255) / 256);
  if (work == 0) return cudaSuccess;
  HQ_DISPATCH_IN(t, {
    const int blocks = static_cast<int>(min64(work, static_cast<int64_t>(num_sms()) * 8));
    rht_amax_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(x), M, K, row_amax, col_amax);
    return cudaGetLastError();
  });
}

cudaError_t launch_grouped_nvfp4_rht_amax(InType t, const void* x, int64_t M, int64_t K, const int32_t* row_group,
                                          uint32_t* row_amax, uint32_t* col_amax, cudaStream_t stream) {
  const int64_t work = (M / 16) * ((K + 255) / 256);
  if (work == 0) return cudaSuccess;
  HQ_DISPATCH_IN(t, {
    const int blocks = static_cast<int>(min64(work, static_cast<int64_t>(num_sms()) * 8));
    grouped_rht_amax_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(x), M, K, row_group, row_amax,
                                                           col_amax);
    return cudaGetLastError();
  });
}

cudaError_t launch_row_groups_from_starts(const int64_t* starts, int n_groups, int64_t M, int32_t* row_group,
                                          cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  const int blocks = static_cast<int>(min64((M + 255) / 256, static_cast<int64_t>(num_sms()) * 8));
  row_groups_from_starts_kernel<<<blocks, 256, 0, stream>>>(starts, n_groups, M, row_group);
  return cudaGetLastError();
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

Tensor amax_op(const Tensor& x) {
  check_input(x, "amax");
  const auto it = in_type(x, "amax");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor out = zeros_amax(x);
  C10_CUDA_CHECK(hybridq::launch_absmax(it, x.data_ptr(), x.numel(), amax_bits(out),
                                        c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace ops
}  // namespace hybridq
