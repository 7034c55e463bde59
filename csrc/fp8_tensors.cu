// Per-tensor FP8 (current scaling) of many tensors at once: the weights of one FSDP2 unit, each an fp32 master shard
// rounded to the gather dtype in registers (bitwise `x.to(param_dtype)`), each quantized as its own tensor (its
// max|x| or a given amax, its scale) into its own region of one byte buffer. One amax launch and one cast launch per
// kFp8TensorsPerLaunch tensors, instead of a cast, an amax, a quantize and their allocations per tensor
// (hybridq/distributed/unit_cast.py). The op's schema is declared with the format's others (quantize_fp8_tensor.cu);
// the numerics are Fp8TensorPolicy's (tile/policy_fp8_tensor.cuh): scale_from_amax, then encode_fp8 of
// round(x) * scale, so the bytes are those of fp8_tensor_quantize on `x.to(param_dtype)`.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <vector>

#include "binding_checks.h"
#include "tile/common.cuh"

namespace hybridq {

namespace {

constexpr int kFp8TensorsPerLaunch = 16;  // tensors per launch (their entries travel as the kernel parameter)
constexpr int kThreads = 256;

// [Note: fp8 tensors entries]
// One tensor of a batch: its fp32 input, its element count, its output region (region >= n bytes, a multiple of 16,
// 16-byte aligned: bytes [n, region) are written 0 -- the payload's row and alignment padding), where its scale_inv
// goes (4 floats: [1 / scale, 0, 0, 0], the 16-byte aligned `aligned_scales` row) and its encoding. amax_in: the
// amax to scale from (e.g. reduced across shards), or null: the tensor's own max|round(x)|, computed by the amax
// kernel into amax_bits[i]. The entries are passed by value (the kernel parameter, < 4 KiB): no host-to-device copy.
struct Fp8TensorsEntry {
  const float* x;
  const float* amax_in;
  uint8_t* out;
  float* scale_inv;
  int64_t n;
  int64_t region;
  float fp8_max;
  float eps;
  int e5m2;
  int pow2;
};

struct Fp8TensorsBatch {
  Fp8TensorsEntry e[kFp8TensorsPerLaunch];
  uint32_t* amax_bits;  // [count]: |x| max as fp32 bits (zeroed before the amax kernel), the amax used after the cast
};

// x rounded to the gather dtype P and back to fp32, exactly as torch's CUDA conversion `x.to(P)` (c10's BFloat16 /
// Half constructors use these intrinsics) followed by the quantize kernels' exact widening (numerics.cuh to_f32)
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

// 16 elements [j, j + 16) of x (zeros past n), rounded to P
template <typename P>
__device__ __forceinline__ void load16(const float* __restrict__ x, int64_t n, int64_t j, bool vec, float (&v)[16]) {
  if (vec && j + 16 <= n) {
    const float4* p = reinterpret_cast<const float4*>(x + j);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 r = __ldg(p + q);
      v[4 * q] = r.x;
      v[4 * q + 1] = r.y;
      v[4 * q + 2] = r.z;
      v[4 * q + 3] = r.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = j + i < n ? __ldg(x + j + i) : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = round_to<P>(v[i]);
}

__device__ __forceinline__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t red[kThreads / 32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < kThreads / 32 ? red[lane] : 0u;
    v = warp_max(v);
  }
  return v;
}

// blockIdx.y: the tensor; a grid-stride loop over its 16-element chunks. |x| bits are ordered like the values, NaN
// above inf: a NaN gives a NaN amax (scale 1), as the amax kernel of fp8_tensor_quantize does.
template <typename P>
__global__ void __launch_bounds__(kThreads) fp8_tensors_amax_kernel(const Fp8TensorsBatch b) {
  const Fp8TensorsEntry& e = b.e[blockIdx.y];
  if (e.amax_in != nullptr || e.n == 0) return;
  const bool vec = (reinterpret_cast<uintptr_t>(e.x) & 15) == 0;
  uint32_t m = 0;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c * 16 < e.n;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    float v[16];
    load16<P>(e.x, e.n, c * 16, vec, v);
    m = max(m, absmax_n(v));
  }
  m = block_max(m);
  if (threadIdx.x == 0 && m != 0u) atomicMax(b.amax_bits + blockIdx.y, m);
}

// blockIdx.y: the tensor; each thread writes 16 output bytes (one 16-byte store) per step over the whole region
template <typename P>
__global__ void __launch_bounds__(kThreads) fp8_tensors_cast_kernel(const Fp8TensorsBatch b) {
  const Fp8TensorsEntry& e = b.e[blockIdx.y];
  const float amax = e.amax_in != nullptr ? *e.amax_in : u2f(b.amax_bits[blockIdx.y]);
  const float mult = scale_from_amax(amax, e.fp8_max, e.eps, e.pow2 != 0);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    e.scale_inv[0] = 1.0f / mult;
    e.scale_inv[1] = e.scale_inv[2] = e.scale_inv[3] = 0.0f;
    if (e.amax_in != nullptr) b.amax_bits[blockIdx.y] = f2u(amax);
  }
  const bool vec = (reinterpret_cast<uintptr_t>(e.x) & 15) == 0;
  const bool e5m2 = e.e5m2 != 0;
  uint4* out = reinterpret_cast<uint4*>(e.out);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c * 16 < e.region;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t j = c * 16;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (j < e.n) {
      float v[16];
      load16<P>(e.x, e.n, j, vec, v);
      encode_fp8(v, mult, e5m2, scaled_nonfinite(absmax_n(v), mult), w);
      const int64_t valid = e.n - j;  // (< 16: the bytes past n are padding, 0)
      if (valid < 16) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
          if (i >= valid) w[i / 4] &= ~(0xFFu << (8 * (i % 4)));
      }
    }
    out[c] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <typename P>
cudaError_t launch_fp8_tensors(const Fp8TensorsBatch& b, int count, int64_t max_region, cudaStream_t stream) {
  const int64_t chunks = (max_region + 15) / 16;
  const int64_t want = (chunks + kThreads - 1) / kThreads;
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(tile_num_sms()) * 8 / count);
  const dim3 grid(static_cast<unsigned int>(std::max<int64_t>(1, std::min(want, cap))), count);
  fp8_tensors_amax_kernel<P><<<grid, kThreads, 0, stream>>>(b);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  fp8_tensors_cast_kernel<P><<<grid, kThreads, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace

namespace ops {

// Per-tensor FP8 of the fp32 tensors xs, each rounded to param_dtype first: tensor i's bytes at
// [sum(regions[:i]), + numel) of the returned uint8 buffer, zeros up to its region's end; its scale_inv at [i, 0] of
// the returned [N, 4] fp32 (the other columns 0); the amax each was scaled from [N] (its own max|x| where amax[i]
// is None). Checked before anything is allocated or launched.
std::tuple<Tensor, Tensor, Tensor> fp8_tensors_quantize(at::TensorList xs, at::ScalarType param_dtype,
                                                        const c10::List<std::optional<Tensor>>& amax,
                                                        at::IntArrayRef e5m2, at::ArrayRef<double> eps,
                                                        at::IntArrayRef pow2, at::IntArrayRef regions) {
  constexpr const char* op = "fp8_tensors_quantize";
  const int64_t n = static_cast<int64_t>(xs.size());
  TORCH_CHECK(n >= 1, "hybridq::", op, ": needs at least one tensor");
  TORCH_CHECK(static_cast<int64_t>(amax.size()) == n && static_cast<int64_t>(e5m2.size()) == n &&
                  static_cast<int64_t>(eps.size()) == n && static_cast<int64_t>(pow2.size()) == n &&
                  static_cast<int64_t>(regions.size()) == n,
              "hybridq::", op, ": amax, e5m2, eps, pow2 and regions must have one entry per tensor (", n,
              "), got lengths ", amax.size(), ", ", e5m2.size(), ", ", eps.size(), ", ", pow2.size(), ", ",
              regions.size());
  TORCH_CHECK(param_dtype == at::kBFloat16 || param_dtype == at::kHalf || param_dtype == at::kFloat, "hybridq::", op,
              ": param_dtype must be bfloat16, float16 or float32, got ", param_dtype);
  const auto dev = xs[0].device();
  int64_t total = 0, max_region = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& x = xs[i];
    TORCH_CHECK(x.defined() && x.is_cuda() && x.device() == dev, "hybridq::", op, ": xs[", i,
                "] must be a CUDA tensor on ", dev);
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "hybridq::", op, ": xs[", i,
                "] must be a contiguous float32 tensor, got ", x.scalar_type(), " of shape ", x.sizes(),
                " and strides ", x.strides());
    TORCH_CHECK(regions[i] >= x.numel() && regions[i] % 16 == 0, "hybridq::", op, ": regions[", i, "] = ",
                regions[i], " must be a multiple of 16 and at least the ", x.numel(), " elements of xs[", i, "]");
    const std::optional<Tensor> a = amax.get(i);
    if (a.has_value()) {
      TORCH_CHECK(a->is_cuda() && a->device() == dev && a->scalar_type() == at::kFloat && a->numel() == 1,
                  "hybridq::", op, ": amax[", i, "] must be one float32 value on ", dev, ", got ", a->scalar_type(),
                  " of shape ", a->sizes(), " on ", a->device());
    }
    TORCH_CHECK(eps[i] >= 0.0, "hybridq::", op, ": eps[", i, "] must be >= 0, got ", eps[i]);
    total += regions[i];
    max_region = std::max<int64_t>(max_region, regions[i]);
  }
  c10::cuda::CUDAGuard guard(dev);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = xs[0].options();
  Tensor out = at::empty({total}, opts.dtype(at::kByte));
  Tensor aux = at::empty({n * 5}, opts.dtype(at::kFloat));  // [N, 4] scale_inv, then [N] amax bits
  Tensor scale_inv = aux.narrow(0, 0, n * 4).view({n, 4});
  Tensor amax_out = aux.narrow(0, n * 4, n);
  C10_CUDA_CHECK(cudaMemsetAsync(amax_out.data_ptr(), 0, n * sizeof(float), stream));
  std::vector<Tensor> given(n);  // (the given amaxes as contiguous fp32 values, held until the launches)
  int64_t offset = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kFp8TensorsPerLaunch) {
    const int count = static_cast<int>(std::min<int64_t>(kFp8TensorsPerLaunch, n - i0));
    Fp8TensorsBatch b{};
    b.amax_bits = amax_bits(amax_out) + i0;
    int64_t chunk_max = 0;
    for (int k = 0; k < count; ++k) {
      const int64_t i = i0 + k;
      const std::optional<Tensor> a = amax.get(i);
      if (a.has_value()) given[i] = a->contiguous();
      const bool is_e5m2 = e5m2[i] != 0;
      b.e[k] = Fp8TensorsEntry{xs[i].data_ptr<float>(),
                               a.has_value() ? given[i].data_ptr<float>() : nullptr,
                               static_cast<uint8_t*>(out.data_ptr()) + offset,
                               scale_inv.data_ptr<float>() + 4 * i,
                               xs[i].numel(),
                               regions[i],
                               is_e5m2 ? 57344.0f : 448.0f,
                               static_cast<float>(eps[i]),
                               is_e5m2 ? 1 : 0,
                               pow2[i] != 0 ? 1 : 0};
      offset += regions[i];
      chunk_max = std::max<int64_t>(chunk_max, regions[i]);
    }
    cudaError_t err;
    switch (param_dtype) {
      case at::kBFloat16:
        err = launch_fp8_tensors<__nv_bfloat16>(b, count, chunk_max, stream);
        break;
      case at::kHalf:
        err = launch_fp8_tensors<__half>(b, count, chunk_max, stream);
        break;
      default:
        err = launch_fp8_tensors<float>(b, count, chunk_max, stream);
    }
    C10_CUDA_CHECK(err);
  }
  return {out, scale_inv, amax_out};
}

namespace {
void impls(torch::Library& m) { m.impl("fp8_tensors_quantize", &fp8_tensors_quantize); }
}  // namespace

}  // namespace ops
}  // namespace hybridq

HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
