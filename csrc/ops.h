// The torch ops of hybridq._C (schemas and registration in ops.cpp); each is implemented next to its kernels:
// quantize_<format>.cu, amax.cu, transpose.cu, dequantize.cu, delayed_scaling.cu, rms_norm.cu.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace hybridq {
namespace ops {

using at::Tensor;

// per-tensor FP8 -> (rowwise [M, K] | [0], columnwise [K, M] | [0], scale_inv [1], amax [1] | [0])
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize_grouped(const Tensor& x, at::ScalarType dtype,
                                                                       const Tensor& row_group, int64_t n_groups,
                                                                       double eps, bool pow2, bool columnwise,
                                                                       int64_t col_pitch);
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize(const Tensor& x, at::ScalarType dtype,
                                                               const std::optional<Tensor>& scale,
                                                               const std::optional<Tensor>& amax, double eps,
                                                               bool pow2, bool rowwise, bool columnwise,
                                                               bool want_amax);
// delayed scaling: cast with scale, max|x| max-combined into amax_history[0] in place -> (rowwise, columnwise, scale_inv)
std::tuple<Tensor, Tensor, Tensor> fp8_tensor_quantize_delayed(const Tensor& x, at::ScalarType dtype,
                                                               const Tensor& scale, const Tensor& amax_history,
                                                               double eps, bool pow2, bool rowwise, bool columnwise);
// FP8 block scaling -> (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv)
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize(const Tensor& x, at::ScalarType dtype,
                                                              int64_t block_dim, double eps, bool pow2, bool rowwise,
                                                              bool columnwise);
// MXFP8 -> (rowwise, rowwise E8M0 scales, columnwise, columnwise E8M0 scales)
std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize(const Tensor& x, at::ScalarType dtype, bool block_2d,
                                                          bool rowwise, bool columnwise, bool swizzle);
// NVFP4 -> (row data, row scales, row amax, col data, col scales, col amax)
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nvfp4_quantize(
    const Tensor& x, bool block_2d, bool rht, bool stochastic_rounding, const std::optional<at::Generator>& generator,
    bool rowwise, bool columnwise, const std::optional<Tensor>& amax, const std::optional<Tensor>& amax_col);

// NVFP4 of row groups (one amax launch and one quantize launch for all groups) -> (row data, row scales,
// row amax [G], col data, col scales, col amax [G])
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nvfp4_quantize_grouped(
    const Tensor& x, bool block_2d, bool rht, bool stochastic_rounding, const std::optional<at::Generator>& generator,
    bool rowwise, bool columnwise, at::IntArrayRef sizes, at::IntArrayRef draw_rank, int64_t n_draws);

// RMSNorm over the last dimension -> (y, rstd [M] fp32, max|y| [1] fp32); backward -> (dx, dweight | [0])
std::tuple<Tensor, Tensor, Tensor> rms_norm_forward(const Tensor& x, const std::optional<Tensor>& weight, double eps);
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, bool weight_grad);

Tensor amax_op(const Tensor& x);
Tensor transpose_bytes(const Tensor& x);
Tensor dequantize_fp8(const Tensor& data, const Tensor& scale, int64_t mode, at::ScalarType out_dtype);
Tensor dequantize_nvfp4(const Tensor& data, const Tensor& scale, const Tensor& amax, bool rht_inverse,
                        bool apply_global, at::ScalarType out_dtype);
void fp8_delayed_update(at::TensorList histories, at::TensorList scales, at::ArrayRef<double> fp8_maxes,
                        at::ArrayRef<double> divisors, at::IntArrayRef most_recent);

}  // namespace ops
}  // namespace hybridq
