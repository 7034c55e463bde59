// The format-independent torch ops of hybridq._C (schemas and registration in ops.cpp), each implemented next to its
// kernels: amax.cu, transpose.cu, delayed_scaling.cu, rms_norm.cu (RMSNorm, LayerNorm, norm + quantize), swiglu.cu
// (rows.cuh: what the last two share). A format's ops (quantize, dequantize) are implemented and registered in its
// own csrc/quantize_<format>.cu; those that other C++ code calls are declared here too (linear_fp8.cpp: a per-tensor
// FP8 Linear as one op, which registers itself).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace hybridq {
namespace ops {

using at::Tensor;

// RMSNorm over the last dimension -> (y, rstd [M] fp32, max|y| [1] fp32); backward -> (dx, dweight | [0])
std::tuple<Tensor, Tensor, Tensor> rms_norm_forward(const Tensor& x, const std::optional<Tensor>& weight, double eps);
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, bool weight_grad);
// LayerNorm -> (y, mean [M] fp32, rstd [M] fp32, max|y| [1] fp32); backward -> (dx, dweight | [0], dbias fp32 | [0])
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_forward(const Tensor& x, const std::optional<Tensor>& weight,
                                                              const std::optional<Tensor>& bias, double eps);
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                       const std::optional<Tensor>& weight, const Tensor& mean,
                                                       const Tensor& rstd, bool weight_grad, bool bias_grad);
// RMSNorm (centered false) or LayerNorm (true) and the rowwise part of y in a block format along K, in one pass:
// block 32 (MXFP8 1x32, E8M0 scales [M, K/32]) or 128 (FP8 block 1x128, fp32 scale_inv [M, K/128]) ->
// (y, mean | [0], rstd, max|y|, fp8 data [M, K], scales)
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_quantize_forward(
    const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias, double eps, bool centered,
    int64_t block, at::ScalarType dtype, double amax_eps, bool pow2);

// SwiGLU's element-wise step y = silu(a) * b -> (y, max|y|, rowwise block-format part of y | [0], its scales | [0]):
// block 0 (none), 32 (MXFP8 1x32) or 128 (FP8 block 1x128); backward -> (da, db)
std::tuple<Tensor, Tensor, Tensor, Tensor> swiglu_forward(const Tensor& a, const Tensor& b, int64_t block,
                                                          at::ScalarType dtype, double amax_eps, bool pow2);
std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b);

// Per-tensor FP8 cast (csrc/quantize_fp8_tensor.cu; also called by linear_fp8.cpp) -> (rowwise [M, K] | [0],
// columnwise [K, M] | [0], scale_inv [1], amax [1] | [0])
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize(const Tensor& x, at::ScalarType dtype,
                                                               const std::optional<Tensor>& scale,
                                                               const std::optional<Tensor>& amax, double eps,
                                                               bool pow2, bool rowwise, bool columnwise,
                                                               bool want_amax);

// Delayed scaling's cast (csrc/quantize_fp8_tensor.cu; also called by linear_fp8.cpp): with `scale`, max|x|
// max-combined into amax_history[0] in place -> (rowwise [M, K] | [0], columnwise [K, M] | [0], scale_inv [1])
std::tuple<Tensor, Tensor, Tensor> fp8_tensor_quantize_delayed(const Tensor& x, at::ScalarType dtype,
                                                               const Tensor& scale, const Tensor& amax_history,
                                                               double eps, bool pow2, bool rowwise, bool columnwise);

// The same cast (current scaling) into caller-allocated memory: row [M, K] / col [K, M] fp8 bytes, 16-byte aligned
// (nullptr: not asked for), amax one zeroed fp32, scale_inv one fp32 (see quantize_fp8_tensor.cu)
void fp8_tensor_quantize_into(const Tensor& x, at::ScalarType dtype, double eps, bool pow2, void* row, void* col,
                              float* amax, float* scale_inv);

// Whether the FP8 Linear op packs its tensors into fewer allocations (linear_fp8.cpp, [Note: packed allocations of
// the Linear op]; default on, HYBRIDQ_LINEAR_PACKED=0 off): sets it, returns what it was
bool set_linear_packed(bool on);

Tensor amax_op(const Tensor& x);
Tensor transpose_bytes(const Tensor& x);
void transpose_bytes_into(const Tensor& x, const Tensor& out);
void transpose_bytes_into_list(at::TensorList x, at::TensorList out);
void fp8_delayed_update(at::TensorList histories, at::TensorList scales, at::ArrayRef<double> fp8_maxes,
                        at::ArrayRef<double> divisors, at::IntArrayRef most_recent);

}  // namespace ops
}  // namespace hybridq
