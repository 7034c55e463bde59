// RMSNorm and LayerNorm over the last dimension, forward and backward (hybridq.nn.RMSNorm / hybridq.nn.LayerNorm on
// CUDA), with max|y| of the output computed in the forward pass: a per-tensor FP8 cast of the normalized activations
// (the input of q/k/v, w1/w3) then skips its own max|x| pass, which is the one extra read of the tensor that
// per-tensor current scaling costs. norm_quantize_forward also writes the rowwise part of a block format along K
// (MXFP8 1x32, FP8 block 1x128) of y in the same pass: the reading Linear then skips that cast (hybridq/nn/fused_input.py).
//
// Math (torch's rms_norm / layer_norm with their fp32 upcast; see docs/numerics.md, "RMSNorm" and "LayerNorm"):
//   RMSNorm   rstd = rsqrt(mean(x^2) + eps);  y = round((x * rstd) * w)
//             dx = (g - xhat * mean(xhat * g)) * rstd  with g = dy * w, xhat = x * rstd;   dw = sum over rows of dy * xhat
//   LayerNorm mean = mean(x); rstd = rsqrt(mean((x - mean)^2) + eps); y = round(((x - mean) * rstd) * w + b)
//             dx = ((g - mean(g)) - xhat * mean(xhat * g)) * rstd with xhat = (x - mean) * rstd; dw as above; db =
//             sum over rows of dy
// Element-wise steps are rounded like torch's; the row sums are in another order than torch's reductions, so y can
// differ from the eager module in the last bit (documented). max|y| is exact: it is taken over the rounded outputs,
// and so is the fused quantized part: bitwise the format's own kernel applied to y.
#include <cmath>
#include <initializer_list>
#include <tuple>

#include "binding_checks.h"
#include "numerics.cuh"
#include "ops.h"
#include "rows.cuh"

namespace hybridq {
namespace {

using namespace rows;

template <typename W>
__device__ __forceinline__ float weight_at(const W* w, int64_t k) {
  return w == nullptr ? 1.0f : to_f32(w[k]);
}

// RMSNorm (CENTERED false) or LayerNorm (true), one warp per row, V elements per lane and step; the row is read two
// or three times (mean, sum of squares, the output), the later times mostly from L1/L2. Every lane runs every step
// (the fused quantization's block max is a shuffle). QB > 0: also the rowwise quantized y (RowQuant).
template <int V, typename T, typename W, bool CENTERED, int QB>
__global__ void __launch_bounds__(kWarps * 32) norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w,
                                                               const W* __restrict__ b, T* __restrict__ y,
                                                               float* __restrict__ mean_out,
                                                               float* __restrict__ rstd_out, uint32_t* amax,
                                                               const RowQuant nq, int64_t M, int64_t K, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  uint32_t m = 0;
  if (r < M) {  // (the whole warp: one row)
    const T* xr = x + r * K;
    float mean = 0.0f;
    if constexpr (CENTERED) {
      float s = 0.0f;
      for (int64_t k = lane * V; k < K; k += 32 * V) {
        float v[V];
        load_f32<V>(xr + k, v);
#pragma unroll
        for (int i = 0; i < V; ++i) s += v[i];
      }
      mean = warp_sum(s) / static_cast<float>(K);
    }
    float ss = 0.0f;
    for (int64_t k = lane * V; k < K; k += 32 * V) {
      float v[V];
      load_f32<V>(xr + k, v);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = CENTERED ? v[i] - mean : v[i];
        ss = fmaf(d, d, ss);
      }
    }
    ss = warp_sum(ss);
    const float rstd = rsqrtf(ss / static_cast<float>(K) + eps);
    T* yr = y + r * K;
    for (int64_t base = 0; base < K; base += 32 * V) {
      const int64_t k = base + lane * V;
      const bool in = k < K;
      float yv[V];
      if (in) {
        float v[V];
        load_f32<V>(xr + k, v);
        T o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float t = ((CENTERED ? v[i] - mean : v[i]) * rstd) * weight_at(w, k + i);
          if (b != nullptr) t = t + to_f32(b[k + i]);
          o[i] = from_f32<T>(t);
          yv[i] = to_f32(o[i]);
          m = max(m, abs_bits(yv[i]));
        }
        store_vec<V>(yr + k, o);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) yv[i] = 0.0f;
      }
      if constexpr (QB > 0) quantize_chunk<QB, V>(nq, yv, r, k, K, in, lane);
    }
    if (lane == 0) {
      rstd_out[r] = rstd;
      if constexpr (CENTERED) mean_out[r] = mean;
    }
  }
  reduce_amax(m, amax);
}

// dx, one warp per row: RMSNorm dx = (g - xhat * mean(xhat * g)) * rstd; LayerNorm (CENTERED, xhat = (x - mean) *
// rstd) dx = ((g - mean(g)) - xhat * mean(xhat * g)) * rstd; g = dy * w
template <int V, typename T, typename W, bool CENTERED>
__global__ void __launch_bounds__(kWarps * 32) norm_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                  const W* __restrict__ w,
                                                                  const float* __restrict__ mean,
                                                                  const float* __restrict__ rstd,
                                                                  T* __restrict__ dx, int64_t M, int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= M) return;
  const T* xr = x + r * K;
  const T* gr = dy + r * K;
  const float rs = rstd[r];
  const float mu = CENTERED ? mean[r] : 0.0f;
  float dot = 0.0f, gsum = 0.0f;
  for (int64_t k = lane * V; k < K; k += 32 * V) {
    float xv[V], gv[V];
    load_f32<V>(xr + k, xv);
    load_f32<V>(gr + k, gv);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float g = gv[i] * weight_at(w, k + i);
      dot = fmaf((CENTERED ? xv[i] - mu : xv[i]) * rs, g, dot);
      if constexpr (CENTERED) gsum += g;
    }
  }
  const float mean_dot = warp_sum(dot) / static_cast<float>(K);
  const float mean_g = CENTERED ? warp_sum(gsum) / static_cast<float>(K) : 0.0f;
  T* dr = dx + r * K;
  for (int64_t k = lane * V; k < K; k += 32 * V) {
    float xv[V], gv[V];
    load_f32<V>(xr + k, xv);
    load_f32<V>(gr + k, gv);
    T o[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float xhat = (CENTERED ? xv[i] - mu : xv[i]) * rs;
      const float g = gv[i] * weight_at(w, k + i);
      o[i] = from_f32<T>(((CENTERED ? g - mean_g : g) - xhat * mean_dot) * rs);
    }
    store_vec<V>(dr + k, o);
  }
}

// partial dw (and db): CTA (column block, row chunk) sums dy * xhat (and dy) over its rows, one column per thread;
// the chunks' sums are added by the caller in a fixed order (deterministic, no atomics). mean: nullptr for RMSNorm
template <typename T>
__global__ void __launch_bounds__(256) norm_bwd_dw_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd,
                                                          float* __restrict__ partial, float* __restrict__ partial_b,
                                                          int64_t M, int64_t K, int64_t rows_per_chunk) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= K) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk, r1 = min64(M, r0 + rows_per_chunk);
  float acc = 0.0f, accb = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float g = to_f32(dy[r * K + k]);
    const float xv = to_f32(x[r * K + k]);
    if (partial != nullptr) acc = fmaf(g, (mean != nullptr ? xv - mean[r] : xv) * rstd[r], acc);
    if (partial_b != nullptr) accb += g;
  }
  if (partial != nullptr) partial[static_cast<int64_t>(blockIdx.y) * K + k] = acc;
  if (partial_b != nullptr) partial_b[static_cast<int64_t>(blockIdx.y) * K + k] = accb;
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
void check_param(const Tensor& p, const Tensor& x, const char* op, const char* name) {
  check_same_device(p, x, op, name);
  in_type(p, op, name);
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(1) && p.is_contiguous(), "hybridq::", op, ": ", name,
              " must be a contiguous 1-D tensor of the input's ", x.size(1), " columns, got shape ", p.sizes());
}

void check_norm_args(const Tensor& x, const std::optional<Tensor>& weight, const char* op,
                     const std::optional<Tensor>& bias = std::nullopt) {
  check_input(x, op);
  in_type(x, op);
  if (weight.has_value()) check_param(*weight, x, op, "weight");
  if (bias.has_value()) {
    check_param(*bias, x, op, "bias");
    TORCH_CHECK(!weight.has_value() || weight->scalar_type() == bias->scalar_type(), "hybridq::", op,
                ": weight and bias must have one dtype, got ", weight->scalar_type(), " and ", bias->scalar_type());
  }
}

// The rows' statistics (mean [M] for LayerNorm, else [0]; rstd [M]), y and max|y| of RMSNorm / LayerNorm, and with
// qblock 32 / 128 the rowwise MXFP8 / FP8 block part of y (data [M, K] of qdtype, scales [M, K / qblock])
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_forward_impl(
    const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias, double eps, bool centered,
    int64_t qblock, at::ScalarType qdtype, double qeps, bool qpow2, const char* op) {
  check_norm_args(x, weight, op, bias);
  TORCH_CHECK(eps >= 0.0, "hybridq::", op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(qblock == 0 || qblock == 32 || qblock == 128, "hybridq::", op,
              ": the quantized output's block must be 32 (MXFP8 1x32) or 128 (FP8 block 1x128), got ", qblock);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1);
  RowQuant nq{};
  Tensor q, qs;
  if (qblock > 0) {
    nq.fp8 = fp8_encoding(qdtype, qblock == 128 ? qeps : 0.0, qblock == 128 && qpow2, op);
    TORCH_CHECK(K % qblock == 0, "hybridq::", op, ": a fused quantized output needs K = x.size(1) divisible by its ",
                qblock, "-element blocks, got x of shape ", x.sizes());
    TORCH_CHECK(vectorizable(K, 16 / static_cast<int>(x.element_size()), {x.data_ptr()}), "hybridq::", op,
                ": a fused quantized output needs a 16-byte aligned input, got data pointer ", x.data_ptr());
    q = at::empty({M, K}, x.options().dtype(qdtype));
    qs = at::empty({M, K / qblock}, x.options().dtype(qblock == 128 ? at::kFloat : at::kByte));
    nq.q = u8(q);
    nq.s = qs.data_ptr();
  } else {
    q = empty0(x, at::kByte);
    qs = empty0(x, at::kFloat);
  }
  Tensor y = at::empty_like(x);
  Tensor mean = centered ? at::empty({M}, x.options().dtype(at::kFloat)) : empty0(x, at::kFloat);
  Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  Tensor amax = zeros_amax(x);
  if (M == 0 || K == 0) {
    if (M > 0) {  // (an empty row: mean 0, variance 0)
      rstd.fill_(1.0 / std::sqrt(eps));
      if (centered) mean.zero_();
    }
    return {y, mean, rstd, amax, q, qs};
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const std::optional<Tensor>& wt_src = weight.has_value() ? weight : bias;
  const at::ScalarType wt = wt_src.has_value() ? wt_src->scalar_type() : at::kFloat;
  dispatch_types(x.scalar_type(), wt, [&](auto xtag, auto wtag) {
    using X = decltype(xtag);
    using W = decltype(wtag);
    const W* w = weight.has_value() ? static_cast<const W*>(weight->data_ptr()) : nullptr;
    const W* b = bias.has_value() ? static_cast<const W*>(bias->data_ptr()) : nullptr;
    constexpr int V = 16 / sizeof(X);
    const dim3 grid((M + kWarps - 1) / kWarps), block(kWarps * 32);
    auto args = std::make_tuple(static_cast<const X*>(x.data_ptr()), w, b, static_cast<X*>(y.data_ptr()),
                                centered ? mean.data_ptr<float>() : nullptr, rstd.data_ptr<float>(), amax_bits(amax),
                                nq, M, K, static_cast<float>(eps));
    auto launch = [&](auto centered_tag) {
      constexpr bool C = decltype(centered_tag)::value;
      if (qblock == 128) {
        std::apply([&](auto... a) { norm_fwd_kernel<V, X, W, C, 128><<<grid, block, 0, stream>>>(a...); }, args);
      } else if (qblock == 32) {
        std::apply([&](auto... a) { norm_fwd_kernel<V, X, W, C, 32><<<grid, block, 0, stream>>>(a...); }, args);
      } else if (vectorizable(K, V, {x.data_ptr(), y.data_ptr()})) {
        std::apply([&](auto... a) { norm_fwd_kernel<V, X, W, C, 0><<<grid, block, 0, stream>>>(a...); }, args);
      } else {
        std::apply([&](auto... a) { norm_fwd_kernel<1, X, W, C, 0><<<grid, block, 0, stream>>>(a...); }, args);
      }
    };
    if (centered) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd, amax, q, qs};
}

std::tuple<Tensor, Tensor, Tensor> norm_backward_impl(const Tensor& dy, const Tensor& x,
                                                      const std::optional<Tensor>& weight,
                                                      const std::optional<Tensor>& mean, const Tensor& rstd,
                                                      bool weight_grad, bool bias_grad, const char* op) {
  check_norm_args(x, weight, op);
  check_input(dy, op, "dy");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "hybridq::", op,
              ": dy must have the input's shape and dtype, got ", dy.sizes(), " ", dy.scalar_type(), " for ",
              x.sizes(), " ", x.scalar_type());
  check_same_device(dy, x, op, "dy");
  const std::pair<const Tensor*, const char*> stats[] = {{&rstd, "rstd"}, {mean ? &*mean : nullptr, "mean"}};
  for (const auto& [t, name] : stats) {
    if (t == nullptr) continue;
    check_same_device(*t, x, op, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == x.size(0) && t->is_contiguous(),
                "hybridq::", op, ": ", name, " must be a contiguous float32 vector of the input's ", x.size(0),
                " rows, got ", t->sizes(), " ", t->scalar_type());
  }
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1);
  Tensor dx = at::empty_like(x);
  const bool want_dw = weight_grad && weight.has_value();
  const at::ScalarType pt = weight.has_value() ? weight->scalar_type() : at::kFloat;
  Tensor dw = want_dw ? at::zeros({K}, x.options().dtype(at::kFloat)) : empty0(x, at::kFloat);
  Tensor db = bias_grad ? at::zeros({K}, x.options().dtype(at::kFloat)) : empty0(x, at::kFloat);
  if (M == 0 || K == 0) return {dx, want_dw ? dw.to(pt) : dw, db};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const float* mp = mean.has_value() ? mean->data_ptr<float>() : nullptr;
  // enough row chunks to fill the GPU with the column-block CTAs, each chunk at least 64 rows
  const int64_t col_blocks = (K + 255) / 256;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((M + 63) / 64, 4 * tile_num_sms() / col_blocks + 1));
  const int64_t rows_per_chunk = (M + chunks - 1) / chunks;
  chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = want_dw ? at::empty({chunks, K}, x.options().dtype(at::kFloat)) : Tensor();
  Tensor partial_b = bias_grad ? at::empty({chunks, K}, x.options().dtype(at::kFloat)) : Tensor();
  dispatch_types(x.scalar_type(), pt, [&](auto xtag, auto wtag) {
    using X = decltype(xtag);
    using W = decltype(wtag);
    const W* w = weight.has_value() ? static_cast<const W*>(weight->data_ptr()) : nullptr;
    constexpr int V = 16 / sizeof(X);
    const dim3 grid((M + kWarps - 1) / kWarps), block(kWarps * 32);
    auto args = std::make_tuple(static_cast<const X*>(dy.data_ptr()), static_cast<const X*>(x.data_ptr()), w, mp,
                                rstd.data_ptr<float>(), static_cast<X*>(dx.data_ptr()), M, K);
    const bool vec = vectorizable(K, V, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()});
    auto launch = [&](auto centered_tag) {
      constexpr bool C = decltype(centered_tag)::value;
      if (vec) {
        std::apply([&](auto... a) { norm_bwd_dx_kernel<V, X, W, C><<<grid, block, 0, stream>>>(a...); }, args);
      } else {
        std::apply([&](auto... a) { norm_bwd_dx_kernel<1, X, W, C><<<grid, block, 0, stream>>>(a...); }, args);
      }
    };
    if (mp != nullptr) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (want_dw || bias_grad) {
      norm_bwd_dw_kernel<X><<<dim3(col_blocks, chunks), 256, 0, stream>>>(
          static_cast<const X*>(dy.data_ptr()), static_cast<const X*>(x.data_ptr()), mp, rstd.data_ptr<float>(),
          want_dw ? partial.data_ptr<float>() : nullptr, bias_grad ? partial_b.data_ptr<float>() : nullptr, M, K,
          rows_per_chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (want_dw) dw = partial.sum(0).to(pt);
  if (bias_grad) db = partial_b.sum(0);
  return {dx, dw, db};
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> rms_norm_forward(const Tensor& x, const std::optional<Tensor>& weight, double eps) {
  auto [y, mean, rstd, amax, q, qs] =
      norm_forward_impl(x, weight, std::nullopt, eps, false, 0, at::kFloat8_e4m3fn, 0.0, false, "rms_norm_forward");
  return {y, rstd, amax};
}

std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, bool weight_grad) {
  auto [dx, dw, db] = norm_backward_impl(dy, x, weight, std::nullopt, rstd, weight_grad, false, "rms_norm_backward");
  return {dx, dw};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_forward(const Tensor& x, const std::optional<Tensor>& weight,
                                                              const std::optional<Tensor>& bias, double eps) {
  auto [y, mean, rstd, amax, q, qs] =
      norm_forward_impl(x, weight, bias, eps, true, 0, at::kFloat8_e4m3fn, 0.0, false, "layer_norm_forward");
  return {y, mean, rstd, amax};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                       const std::optional<Tensor>& weight, const Tensor& mean,
                                                       const Tensor& rstd, bool weight_grad, bool bias_grad) {
  return norm_backward_impl(dy, x, weight, mean, rstd, weight_grad, bias_grad, "layer_norm_backward");
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_quantize_forward(
    const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias, double eps, bool centered,
    int64_t block, at::ScalarType dtype, double amax_eps, bool pow2) {
  TORCH_CHECK(block == 32 || block == 128, "hybridq::norm_quantize_forward: block must be 32 (MXFP8 1x32) or 128 "
              "(FP8 block 1x128), got ", block);
  TORCH_CHECK(centered || !bias.has_value(), "hybridq::norm_quantize_forward: RMSNorm (centered=False) has no bias");
  return norm_forward_impl(x, weight, bias, eps, centered, block, dtype, amax_eps, pow2, "norm_quantize_forward");
}

}  // namespace ops
}  // namespace hybridq
