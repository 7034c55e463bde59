// SwiGLU's element-wise step of a feed-forward, y = silu(a) * b with a = w1 x and b = w3 x (hybridq.nn.SwiGLU on
// CUDA), one warp per row: max|y| for the per-tensor cast of w2's input, and with a block format along K (MXFP8 1x32,
// FP8 block 1x128) w2's rowwise quantized input in the same pass (csrc/rows.cuh, hybridq/nn/fused_input.py).
//
// Math (torch's eager F.silu(a) * b, each op rounded to the input dtype; docs/numerics.md "SwiGLU"):
//   s = round(a / (1 + exp(-a)));  y = round(s * b)
//   backward: gs = round(dy * b); db = round(dy * s); sig = 1 / (1 + exp(-a)); da = round(gs * sig * (1 + a * (1 - sig)))
// exp is CUDA's expf (no fast math): y and the gradients can differ from torch's kernels in the last bit only where
// their exp differs. max|y| and the quantized part are exact (of the rounded y).
#include <cmath>
#include <tuple>

#include "binding_checks.h"
#include "ops.h"
#include "rows.cuh"

namespace hybridq {
namespace {

using namespace rows;

__device__ __forceinline__ float silu_f32(float a) { return a / (1.0f + expf(-a)); }

template <int V, typename T, int QB>
__global__ void __launch_bounds__(kWarps * 32) swiglu_fwd_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                                 T* __restrict__ y, uint32_t* amax, const RowQuant nq,
                                                                 int64_t M, int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  uint32_t m = 0;
  if (r < M) {  // (the whole warp: one row)
    for (int64_t base = 0; base < K; base += 32 * V) {
      const int64_t k = base + lane * V;
      const bool in = k < K;
      float yv[V];
      if (in) {
        float av[V], bv[V];
        load_f32<V>(a + r * K + k, av);
        load_f32<V>(b + r * K + k, bv);
        T o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float s = to_f32(from_f32<T>(silu_f32(av[i])));
          o[i] = from_f32<T>(s * bv[i]);
          yv[i] = to_f32(o[i]);
          m = max(m, abs_bits(yv[i]));
        }
        store_vec<V>(y + r * K + k, o);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) yv[i] = 0.0f;
      }
      if constexpr (QB > 0) quantize_chunk<QB, V>(nq, yv, r, k, K, in, lane);
    }
  }
  reduce_amax(m, amax);
}

// element-wise: V consecutive elements per thread (V = 1 when the tensors are not 16-byte vectors)
template <int V, typename T>
__global__ void __launch_bounds__(256) swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ a,
                                                         const T* __restrict__ b, T* __restrict__ da,
                                                         T* __restrict__ db, int64_t n) {
  for (int64_t i0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i0 < n;
       i0 += static_cast<int64_t>(gridDim.x) * blockDim.x * V) {
    float gv[V], av[V], bv[V];
    load_f32<V>(dy + i0, gv);
    load_f32<V>(a + i0, av);
    load_f32<V>(b + i0, bv);
    T oa[V], ob[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float s = to_f32(from_f32<T>(silu_f32(av[i])));
      const float gs = to_f32(from_f32<T>(gv[i] * bv[i]));
      ob[i] = from_f32<T>(gv[i] * s);
      const float sig = 1.0f / (1.0f + expf(-av[i]));
      oa[i] = from_f32<T>(gs * sig * (1.0f + av[i] * (1.0f - sig)));
    }
    store_vec<V>(da + i0, oa);
    store_vec<V>(db + i0, ob);
  }
}

template <typename F>
void dispatch_t(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(__nv_bfloat16{});
      break;
    default:
      f(__half{});
      break;
  }
}

}  // namespace

namespace ops {

namespace {
void check_pair(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn) {
  check_input(a, op, an);
  in_type(a, op, an);
  check_input(b, op, bn);
  check_same_device(b, a, op, bn);
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "hybridq::", op, ": ", an, " and ", bn,
              " must have one shape and dtype, got ", a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ",
              b.scalar_type());
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> swiglu_forward(const Tensor& a, const Tensor& b, int64_t block,
                                                          at::ScalarType dtype, double amax_eps, bool pow2) {
  constexpr const char* op = "swiglu_forward";
  check_pair(a, b, op, "a", "b");
  TORCH_CHECK(block == 0 || block == 32 || block == 128, "hybridq::", op,
              ": the quantized output's block must be 0 (none), 32 (MXFP8 1x32) or 128 (FP8 block 1x128), got ",
              block);
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), K = a.size(1);
  const int V = 16 / static_cast<int>(a.element_size());
  RowQuant nq{};
  Tensor q, qs;
  if (block > 0) {
    nq.fp8 = fp8_encoding(dtype, block == 128 ? amax_eps : 0.0, block == 128 && pow2, op);
    TORCH_CHECK(K % block == 0, "hybridq::", op, ": a fused quantized output needs K = a.size(1) divisible by its ",
                block, "-element blocks, got a of shape ", a.sizes());
    TORCH_CHECK(vectorizable(K, V, {a.data_ptr(), b.data_ptr()}), "hybridq::", op,
                ": a fused quantized output needs 16-byte aligned inputs");
    q = at::empty({M, K}, a.options().dtype(dtype));
    qs = at::empty({M, K / block}, a.options().dtype(block == 128 ? at::kFloat : at::kByte));
    nq.q = u8(q);
    nq.s = qs.data_ptr();
  } else {
    q = empty0(a, at::kByte);
    qs = empty0(a, at::kFloat);
  }
  Tensor y = at::empty_like(a);
  Tensor amax = zeros_amax(a);
  if (M == 0 || K == 0) return {y, amax, q, qs};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_t(a.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int VT = 16 / sizeof(T);
    const dim3 grid((M + kWarps - 1) / kWarps), threads(kWarps * 32);
    auto args = std::make_tuple(static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()),
                                static_cast<T*>(y.data_ptr()), amax_bits(amax), nq, M, K);
    if (block == 128) {
      std::apply([&](auto... x) { swiglu_fwd_kernel<VT, T, 128><<<grid, threads, 0, stream>>>(x...); }, args);
    } else if (block == 32) {
      std::apply([&](auto... x) { swiglu_fwd_kernel<VT, T, 32><<<grid, threads, 0, stream>>>(x...); }, args);
    } else if (vectorizable(K, VT, {a.data_ptr(), b.data_ptr(), y.data_ptr()})) {
      std::apply([&](auto... x) { swiglu_fwd_kernel<VT, T, 0><<<grid, threads, 0, stream>>>(x...); }, args);
    } else {
      std::apply([&](auto... x) { swiglu_fwd_kernel<1, T, 0><<<grid, threads, 0, stream>>>(x...); }, args);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, amax, q, qs};
}

std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b) {
  constexpr const char* op = "swiglu_backward";
  check_pair(a, b, op, "a", "b");
  check_pair(a, dy, op, "a", "dy");
  c10::cuda::CUDAGuard guard(a.device());
  Tensor da = at::empty_like(a), db = at::empty_like(a);
  const int64_t n = a.numel();
  if (n == 0) return {da, db};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_t(a.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int VT = 16 / sizeof(T);
    const bool vec = vectorizable(n, VT, {dy.data_ptr(), a.data_ptr(), b.data_ptr(), da.data_ptr(), db.data_ptr()});
    const int v = vec ? VT : 1;
    const int64_t blocks = std::min<int64_t>((n / v + 255) / 256, 65535);
    auto args = std::make_tuple(static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(a.data_ptr()),
                                static_cast<const T*>(b.data_ptr()), static_cast<T*>(da.data_ptr()),
                                static_cast<T*>(db.data_ptr()), n);
    if (vec) {
      std::apply([&](auto... x) { swiglu_bwd_kernel<VT, T><<<blocks, 256, 0, stream>>>(x...); }, args);
    } else {
      std::apply([&](auto... x) { swiglu_bwd_kernel<1, T><<<blocks, 256, 0, stream>>>(x...); }, args);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {da, db};
}

}  // namespace ops
}  // namespace hybridq
