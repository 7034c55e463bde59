// RMSNorm over the last dimension, forward and backward (hybridq.nn.RMSNorm on CUDA), with max|y| of the output
// computed in the forward pass: a per-tensor FP8 cast of the normalized activations (the input of q/k/v, w1/w3)
// then skips its own max|x| pass, which is the one extra read of the tensor that per-tensor current scaling costs.
//
// Math (torch's rms_norm with its fp32 upcast; see docs/numerics.md, "RMSNorm"):
//   rstd = rsqrt(mean(x^2) + eps);  y = round((x * rstd) * w)
//   dx = (g - xhat * mean(xhat * g)) * rstd  with g = dy * w, xhat = x * rstd;   dw = sum over rows of dy * xhat
// Element-wise steps are rounded like torch's; the row sums are in another order than torch's reductions, so y can
// differ from the eager module in the last bit (documented). max|y| is exact: it is taken over the rounded outputs.
#include <cmath>
#include <initializer_list>
#include <tuple>

#include "binding_checks.h"
#include "numerics.cuh"
#include "ops.h"
#include "tile/common.cuh"

namespace hybridq {
namespace {

constexpr int kWarps = 8;  // rows per CTA (one warp per row)

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename W>
__device__ __forceinline__ float weight_at(const W* w, int64_t k) {
  return w == nullptr ? 1.0f : to_f32(w[k]);
}

// V consecutive elements as fp32 (V > 1: one 16-byte load; the caller checks alignment and K % V == 0)
template <int V, typename T>
__device__ __forceinline__ void load_f32(const T* p, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = to_f32(p[0]);
  } else {
    static_assert(V * sizeof(T) == 16, "one 16-byte vector");
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_f32(e[i]);
  }
}

template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const T (&v)[V]) {
  if constexpr (V == 1) {
    p[0] = v[0];
  } else {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
  }
}

// one warp per row, V elements per lane and step; the row is read twice (sum of squares, then the output), the
// second time mostly from L1/L2
template <int V, typename T, typename W>
__global__ void __launch_bounds__(kWarps * 32) rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w,
                                                                   T* __restrict__ y, float* __restrict__ rstd_out,
                                                                   uint32_t* amax, int64_t M, int64_t K, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  uint32_t m = 0;
  if (r < M) {
    const T* xr = x + r * K;
    float ss = 0.0f;
    for (int64_t k = lane * V; k < K; k += 32 * V) {
      float v[V];
      load_f32<V>(xr + k, v);
#pragma unroll
      for (int i = 0; i < V; ++i) ss = fmaf(v[i], v[i], ss);
    }
    ss = warp_sum(ss);
    const float rstd = rsqrtf(ss / static_cast<float>(K) + eps);
    T* yr = y + r * K;
    for (int64_t k = lane * V; k < K; k += 32 * V) {
      float v[V];
      load_f32<V>(xr + k, v);
      T o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        o[i] = from_f32<T>((v[i] * rstd) * weight_at(w, k + i));
        m = max(m, abs_bits(to_f32(o[i])));
      }
      store_vec<V>(yr + k, o);
    }
    if (lane == 0) rstd_out[r] = rstd;
  }
  m = warp_max(m);
  __shared__ uint32_t red[kWarps];
  if (lane == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t b = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) b = max(b, red[i]);
    atomicMax(amax, b);
  }
}

// dx, one warp per row
template <int V, typename T, typename W>
__global__ void __launch_bounds__(kWarps * 32) rms_norm_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                      const W* __restrict__ w,
                                                                      const float* __restrict__ rstd,
                                                                      T* __restrict__ dx, int64_t M, int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= M) return;
  const T* xr = x + r * K;
  const T* gr = dy + r * K;
  const float rs = rstd[r];
  float dot = 0.0f;
  for (int64_t k = lane * V; k < K; k += 32 * V) {
    float xv[V], gv[V];
    load_f32<V>(xr + k, xv);
    load_f32<V>(gr + k, gv);
#pragma unroll
    for (int i = 0; i < V; ++i) dot = fmaf(xv[i] * rs, gv[i] * weight_at(w, k + i), dot);
  }
  const float mean_dot = warp_sum(dot) / static_cast<float>(K);
  T* dr = dx + r * K;
  for (int64_t k = lane * V; k < K; k += 32 * V) {
    float xv[V], gv[V];
    load_f32<V>(xr + k, xv);
    load_f32<V>(gr + k, gv);
    T o[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float xhat = xv[i] * rs;
      const float g = gv[i] * weight_at(w, k + i);
      o[i] = from_f32<T>((g - xhat * mean_dot) * rs);
    }
    store_vec<V>(dr + k, o);
  }
}

// partial dw: CTA (column block, row chunk) sums dy * xhat over its rows, one column per thread; the chunks' sums
// are added by the caller in a fixed order (deterministic, no atomics)
template <typename T>
__global__ void __launch_bounds__(256) rms_norm_bwd_dw_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                              const float* __restrict__ rstd,
                                                              float* __restrict__ partial, int64_t M, int64_t K,
                                                              int64_t rows_per_chunk) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= K) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk, r1 = min64(M, r0 + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc = fmaf(to_f32(dy[r * K + k]), to_f32(x[r * K + k]) * rstd[r], acc);
  partial[static_cast<int64_t>(blockIdx.y) * K + k] = acc;
}

template <typename F>
void dispatch_types(at::ScalarType xt, at::ScalarType wt, F&& f) {
  auto with_w = [&](auto xtag) {
    using X = decltype(xtag);
    switch (wt) {
      case at::kFloat:
        f(X{}, float{});
        break;
      case at::kBFloat16:
        f(X{}, __nv_bfloat16{});
        break;
      default:
        f(X{}, __half{});
        break;
    }
  };
  switch (xt) {
    case at::kFloat:
      with_w(float{});
      break;
    case at::kBFloat16:
      with_w(__nv_bfloat16{});
      break;
    default:
      with_w(__half{});
      break;
  }
}

}  // namespace

namespace ops {

namespace {
// 16-byte vectors: every row starts on a vector boundary and every pointer is 16-byte aligned
bool vectorizable(int64_t K, int V, std::initializer_list<const void*> ptrs) {
  if (K % V != 0) return false;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

void check_norm_args(const Tensor& x, const std::optional<Tensor>& weight, const char* op) {
  check_input(x, op);
  in_type(x, op);
  if (weight.has_value()) {
    const Tensor& w = *weight;
    check_same_device(w, x, op, "weight");
    in_type(w, op, "weight");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), "hybridq::", op,
                ": weight must be a contiguous 1-D tensor of the input's ", x.size(1), " columns, got shape ",
                w.sizes());
  }
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> rms_norm_forward(const Tensor& x, const std::optional<Tensor>& weight, double eps) {
  check_norm_args(x, weight, "rms_norm_forward");
  TORCH_CHECK(eps >= 0.0, "hybridq::rms_norm_forward: eps must be >= 0, got ", eps);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1);
  Tensor y = at::empty_like(x);
  Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  Tensor amax = zeros_amax(x);
  if (M == 0 || K == 0) {
    if (M > 0) rstd.fill_(1.0 / std::sqrt(eps));  // (an empty row: mean 0)
    return {y, rstd, amax};
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::ScalarType wt = weight.has_value() ? weight->scalar_type() : at::kFloat;
  dispatch_types(x.scalar_type(), wt, [&](auto xtag, auto wtag) {
    using X = decltype(xtag);
    using W = decltype(wtag);
    const W* w = weight.has_value() ? static_cast<const W*>(weight->data_ptr()) : nullptr;
    constexpr int V = 16 / sizeof(X);
    const dim3 grid((M + kWarps - 1) / kWarps), block(kWarps * 32);
    auto args = std::make_tuple(static_cast<const X*>(x.data_ptr()), w, static_cast<X*>(y.data_ptr()),
                                rstd.data_ptr<float>(), amax_bits(amax), M, K, static_cast<float>(eps));
    if (vectorizable(K, V, {x.data_ptr(), y.data_ptr()})) {
      std::apply([&](auto... a) { rms_norm_fwd_kernel<V, X, W><<<grid, block, 0, stream>>>(a...); }, args);
    } else {
      std::apply([&](auto... a) { rms_norm_fwd_kernel<1, X, W><<<grid, block, 0, stream>>>(a...); }, args);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, rstd, amax};
}

std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, bool weight_grad) {
  check_norm_args(x, weight, "rms_norm_backward");
  check_input(dy, "rms_norm_backward", "dy");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "hybridq::rms_norm_backward: dy must have the input's shape and dtype, got ", dy.sizes(), " ",
              dy.scalar_type(), " for ", x.sizes(), " ", x.scalar_type());
  check_same_device(dy, x, "rms_norm_backward", "dy");
  check_same_device(rstd, x, "rms_norm_backward", "rstd");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.dim() == 1 && rstd.size(0) == x.size(0) && rstd.is_contiguous(),
              "hybridq::rms_norm_backward: rstd must be a contiguous float32 vector of the input's ", x.size(0),
              " rows, got ", rstd.sizes(), " ", rstd.scalar_type());
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1);
  Tensor dx = at::empty_like(x);
  const bool want_dw = weight_grad && weight.has_value();
  Tensor dw = want_dw ? at::zeros({K}, x.options().dtype(at::kFloat)) : empty0(x, at::kFloat);
  if (M == 0 || K == 0) return {dx, want_dw ? dw.to(weight->scalar_type()) : dw};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::ScalarType wt = weight.has_value() ? weight->scalar_type() : at::kFloat;
  // enough row chunks to fill the GPU with the column-block CTAs, each chunk at least 64 rows
  const int64_t col_blocks = (K + 255) / 256;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((M + 63) / 64, 4 * tile_num_sms() / col_blocks + 1));
  const int64_t rows_per_chunk = (M + chunks - 1) / chunks;
  chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = want_dw ? at::empty({chunks, K}, x.options().dtype(at::kFloat)) : Tensor();
  dispatch_types(x.scalar_type(), wt, [&](auto xtag, auto wtag) {
    using X = decltype(xtag);
    using W = decltype(wtag);
    const W* w = weight.has_value() ? static_cast<const W*>(weight->data_ptr()) : nullptr;
    constexpr int V = 16 / sizeof(X);
    const dim3 grid((M + kWarps - 1) / kWarps), block(kWarps * 32);
    auto args = std::make_tuple(static_cast<const X*>(dy.data_ptr()), static_cast<const X*>(x.data_ptr()), w,
                                rstd.data_ptr<float>(), static_cast<X*>(dx.data_ptr()), M, K);
    if (vectorizable(K, V, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()})) {
      std::apply([&](auto... a) { rms_norm_bwd_dx_kernel<V, X, W><<<grid, block, 0, stream>>>(a...); }, args);
    } else {
      std::apply([&](auto... a) { rms_norm_bwd_dx_kernel<1, X, W><<<grid, block, 0, stream>>>(a...); }, args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (want_dw) {
      rms_norm_bwd_dw_kernel<X><<<dim3(col_blocks, chunks), 256, 0, stream>>>(
          static_cast<const X*>(dy.data_ptr()), static_cast<const X*>(x.data_ptr()), rstd.data_ptr<float>(),
          partial.data_ptr<float>(), M, K, rows_per_chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (want_dw) dw = partial.sum(0).to(weight->scalar_type());
  return {dx, dw};
}

}  // namespace ops
}  // namespace hybridq
