// FP8 128x128-tile block scaling of many tensors at once: the weights of one FSDP2 unit, each an fp32 master shard
// rounded to the gather dtype in registers (bitwise `x.to(param_dtype)`), each quantized as its own tensor -- every
// 128x128 tile its own scale from its own max|x| -- into its own region of one byte buffer, and its tile-scale grid
// into its own 16-byte aligned slot of one fp32 buffer. One launch per kBlockTensorsPerLaunch tensors (a table of
// the tensors' tiles), instead of a cast, a tile quantize and their allocations per tensor
// (hybridq/distributed/unit_cast.py, hybridq/kernels/fp8_block_tensors.py). The op's schema is declared with the
// format's others (quantize_fp8_block.cu). The numerics are Fp8BlockPolicy<true>'s
// (tile/policy_fp8_block.cuh, run by the tile skeleton): the tile's amax of |round(x)| as ordered bits (a NaN above
// inf), scale_from_amax, scale_inv = 1 / scale, encode_fp8 of round(x) * scale -- so the bytes and scales are those
// of fp8_block_quantize(x.to(param_dtype), block_dim=2) (tests/test_fp8_block_tensors.py on the GPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "binding_checks.h"
#include "tile/common.cuh"

namespace hybridq {

namespace {

constexpr int kBlockTensorsPerLaunch = 16;  // tensors per launch (their entries travel as the kernel parameter)
constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kLanesPerRow = kTile / 16;          // 16 elements per thread and row
constexpr int kRowsPerPass = kThreads / kLanesPerRow;  // 32
constexpr int kPasses = kTile / kRowsPerPass;     // 4

// [Note: fp8 block tensors entries]
// One tensor of a batch: its fp32 input [rows, cols] (contiguous), its output bytes (rows * cols of them, row
// order; the bytes after them up to its region's end are zeroed by the host, one memset each), its tile-scale grid
// [tiles_m, tiles_k] (fp32 scale_inv, row-major) and its encoding. first_tile: its first tile in the launch's
// numbering (the tiles of the launch's tensors one tensor after another, row-major in each). Passed by value (the
// kernel parameter, < 4 KiB): no host-to-device copy.
struct Fp8BlockTensorsEntry {
  const float* x;
  uint8_t* out;
  float* scale_inv;
  int64_t rows;
  int64_t cols;
  int64_t tiles_k;
  int64_t first_tile;
  float fp8_max;
  float eps;
  int e5m2;
  int pow2;
};

struct Fp8BlockTensorsBatch {
  Fp8BlockTensorsEntry e[kBlockTensorsPerLaunch];
  int count;
};

// x rounded to the gather dtype P and back to fp32, exactly as torch's CUDA conversion `x.to(P)` (c10's BFloat16 /
// Half constructors use these intrinsics) followed by the tile kernel's exact widening (numerics.cuh to_f32)
template <typename P>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same<P, __nv_bfloat16>::value) {
    return to_f32(__float2bfloat16(v));
  } else if constexpr (std::is_same<P, __half>::value) {
    return to_f32(__float2half(v));
  } else {
    return v;
  }
}

// One 128x128 tile per CTA (blockIdx.x: the tile in the launch's numbering). Thread t holds 16 consecutive elements
// (columns 16 * (t % 8) ...) of rows t / 8 + 32 p, p < 4, in registers: loaded once, the tile's amax reduced over
// the CTA, then encoded. Elements outside the tensor (a partial edge tile) load as 0, which never raises an amax,
// and are not stored. The non-finite rule's exact path is chosen per 16 elements (scaled_nonfinite of their own max:
// the encoder's result does not depend on how the elements are grouped, only on whether some product of the group is
// non-finite).
template <typename P>
__global__ void __launch_bounds__(kThreads) fp8_block_tensors_kernel(const __grid_constant__ Fp8BlockTensorsBatch b) {
  const int64_t t = blockIdx.x;
  int i = 0;
  while (i + 1 < b.count && t >= b.e[i + 1].first_tile) ++i;
  const Fp8BlockTensorsEntry& e = b.e[i];
  const int64_t local = t - e.first_tile;
  const int64_t tm = local / e.tiles_k, tk = local % e.tiles_k;
  const int lane = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  const int64_t gk = tk * kTile + lane * 16;
  const int64_t nk = gk < e.cols ? min64(16, e.cols - gk) : 0;  // this thread's valid columns
  const bool vec = nk == 16 && e.cols % 4 == 0 && (reinterpret_cast<uintptr_t>(e.x) & 15) == 0;

  float v[kPasses][16];
  uint32_t m = 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t gm = tm * kTile + p * kRowsPerPass + r0;
    const float* src = e.x + gm * e.cols + gk;
    if (gm < e.rows && vec) {
      const float4* q4 = reinterpret_cast<const float4*>(src);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 r = __ldg(q4 + q);
        v[p][4 * q] = r.x;
        v[p][4 * q + 1] = r.y;
        v[p][4 * q + 2] = r.z;
        v[p][4 * q + 3] = r.w;
      }
    } else {
      const bool row_in = gm < e.rows;
#pragma unroll
      for (int j = 0; j < 16; ++j) v[p][j] = row_in && j < nk ? __ldg(src + j) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) v[p][j] = round_to<P>(v[p][j]);
    m = max(m, absmax_n(v[p]));
  }

  __shared__ uint32_t red[kThreads / 32];
  __shared__ uint32_t tile_amax;
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t a = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) a = max(a, red[w]);
    tile_amax = a;
  }
  __syncthreads();
  const uint32_t am = tile_amax;
  const float mult = scale_from_amax(u2f(am), e.fp8_max, e.eps, e.pow2 != 0);
  if (threadIdx.x == 0) e.scale_inv[tm * e.tiles_k + tk] = 1.0f / mult;

  const bool e5m2 = e.e5m2 != 0;
  const bool vec_out = nk == 16 && e.cols % 16 == 0 && (reinterpret_cast<uintptr_t>(e.out) & 15) == 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t gm = tm * kTile + p * kRowsPerPass + r0;
    if (gm >= e.rows || nk == 0) continue;
    uint32_t w[4];
    encode_fp8(v[p], mult, e5m2, scaled_nonfinite(absmax_n(v[p]), mult), w);
    uint8_t* dst = e.out + gm * e.cols + gk;
    if (vec_out) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      store_bytes(dst, w, static_cast<int>(nk));
    }
  }
}

template <typename P>
cudaError_t launch_fp8_block_tensors(const Fp8BlockTensorsBatch& b, int64_t tiles, cudaStream_t stream) {
  if (tiles == 0) return cudaSuccess;
  fp8_block_tensors_kernel<P><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace

namespace ops {

// FP8 128x128-tile block scaling of the 2-D fp32 tensors xs, each rounded to param_dtype first: tensor i's bytes
// [rows_i, cols_i] in row order at [sum(regions[:i]), + rows_i * cols_i) of the returned uint8 buffer, zeros up to
// its region's end; its tile scale_inv [ceil(rows_i/128), ceil(cols_i/128)] row-major at float offset
// sum(round_up(tiles_j, 4) for j < i) of the returned fp32 buffer (each grid 16-byte aligned; the floats between
// grids are not written). Checked before anything is allocated or launched.
std::tuple<Tensor, Tensor> fp8_block_tensors_quantize(at::TensorList xs, at::ScalarType param_dtype,
                                                      at::IntArrayRef e5m2, at::ArrayRef<double> eps,
                                                      at::IntArrayRef pow2, at::IntArrayRef regions) {
  constexpr const char* op = "fp8_block_tensors_quantize";
  const int64_t n = static_cast<int64_t>(xs.size());
  TORCH_CHECK(n >= 1, "hybridq::", op, ": needs at least one tensor");
  TORCH_CHECK(static_cast<int64_t>(e5m2.size()) == n && static_cast<int64_t>(eps.size()) == n &&
                  static_cast<int64_t>(pow2.size()) == n && static_cast<int64_t>(regions.size()) == n,
              "hybridq::", op, ": e5m2, eps, pow2 and regions must have one entry per tensor (", n,
              "), got lengths ", e5m2.size(), ", ", eps.size(), ", ", pow2.size(), ", ", regions.size());
  TORCH_CHECK(param_dtype == at::kBFloat16 || param_dtype == at::kHalf || param_dtype == at::kFloat, "hybridq::", op,
              ": param_dtype must be bfloat16, float16 or float32, got ", param_dtype);
  const auto dev = xs[0].device();
  int64_t total = 0, total_scales = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& x = xs[i];
    TORCH_CHECK(x.defined() && x.is_cuda() && x.device() == dev, "hybridq::", op, ": xs[", i,
                "] must be a CUDA tensor on ", dev);
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "hybridq::", op, ": xs[", i,
                "] must be a contiguous 2-D float32 tensor, got ", x.scalar_type(), " of shape ", x.sizes(),
                " and strides ", x.strides());
    TORCH_CHECK(regions[i] >= x.numel() && regions[i] % 16 == 0, "hybridq::", op, ": regions[", i, "] = ",
                regions[i], " must be a multiple of 16 and at least the ", x.numel(), " elements of xs[", i, "]");
    TORCH_CHECK(eps[i] >= 0.0, "hybridq::", op, ": eps[", i, "] must be >= 0, got ", eps[i]);
    total += regions[i];
    total_scales += round_up(((x.size(0) + kTile - 1) / kTile) * ((x.size(1) + kTile - 1) / kTile), 4);
  }
  c10::cuda::CUDAGuard guard(dev);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = xs[0].options();
  Tensor out = at::empty({total}, opts.dtype(at::kByte));
  Tensor scales = at::empty({total_scales}, opts.dtype(at::kFloat));
  uint8_t* const out0 = static_cast<uint8_t*>(out.data_ptr());
  float* const scales0 = scales.data_ptr<float>();
  int64_t offset = 0, scale_offset = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlockTensorsPerLaunch) {
    const int count = static_cast<int>(std::min<int64_t>(kBlockTensorsPerLaunch, n - i0));
    Fp8BlockTensorsBatch b{};
    b.count = count;
    int64_t tiles = 0;
    for (int k = 0; k < count; ++k) {
      const int64_t i = i0 + k;
      const Tensor& x = xs[i];
      const int64_t rows = x.size(0), cols = x.size(1);
      const int64_t tiles_m = (rows + kTile - 1) / kTile, tiles_k = (cols + kTile - 1) / kTile;
      const bool is_e5m2 = e5m2[i] != 0;
      b.e[k] = Fp8BlockTensorsEntry{x.data_ptr<float>(),
                                    out0 + offset,
                                    scales0 + scale_offset,
                                    rows,
                                    cols,
                                    std::max<int64_t>(tiles_k, 1),
                                    tiles,
                                    is_e5m2 ? 57344.0f : 448.0f,
                                    static_cast<float>(eps[i]),
                                    is_e5m2 ? 1 : 0,
                                    pow2[i] != 0 ? 1 : 0};
      if (regions[i] > x.numel()) {  // (the payload's row and alignment padding)
        C10_CUDA_CHECK(cudaMemsetAsync(out0 + offset + x.numel(), 0, regions[i] - x.numel(), stream));
      }
      tiles += tiles_m * tiles_k;
      offset += regions[i];
      scale_offset += round_up(tiles_m * tiles_k, 4);
    }
    TORCH_CHECK(tiles < (int64_t{1} << 31), "hybridq::", op, ": ", tiles, " tiles in one launch");
    cudaError_t err;
    switch (param_dtype) {
      case at::kBFloat16:
        err = launch_fp8_block_tensors<__nv_bfloat16>(b, tiles, stream);
        break;
      case at::kHalf:
        err = launch_fp8_block_tensors<__half>(b, tiles, stream);
        break;
      default:
        err = launch_fp8_block_tensors<float>(b, tiles, stream);
    }
    C10_CUDA_CHECK(err);
  }
  return {out, scales};
}

namespace {
void impls(torch::Library& m) { m.impl("fp8_block_tensors_quantize", &fp8_block_tensors_quantize); }
}  // namespace

}  // namespace ops
}  // namespace hybridq

HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
