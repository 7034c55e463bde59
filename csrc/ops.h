// The format-independent torch ops of hybridq._C (schemas and registration in ops.cpp), each implemented next to its
// kernels: amax.cu, transpose.cu, delayed_scaling.cu, rms_norm.cu. A format's ops (quantize, dequantize) are
// declared, implemented and registered in its own csrc/quantize_<format>.cu.
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

Tensor amax_op(const Tensor& x);
Tensor transpose_bytes(const Tensor& x);
void fp8_delayed_update(at::TensorList histories, at::TensorList scales, at::ArrayRef<double> fp8_maxes,
                        at::ArrayRef<double> divisors, at::IntArrayRef most_recent);

}  // namespace ops
}  // namespace hybridq
