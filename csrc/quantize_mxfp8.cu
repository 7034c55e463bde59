// MXFP8: the tile kernel with Mxfp8Policy (1x32 rowwise + 32x1 columnwise in one pass, or 32x32 tiles; compact or
// GEMM-swizzled E8M0 scales), the dequantize kernel with the same policy, and their ops mxfp8_quantize /
// mxfp8_dequantize.
#include "binding_checks.h"
#include "tile/dequantize.cuh"
#include "tile/policy_mxfp8.cuh"

namespace hybridq {

namespace {
cudaError_t launch_quantize_mxfp8(InType t, bool two_d, const Mxfp8Args& a, cudaStream_t stream) {
  if (a.src_rows != nullptr) {  // (1x32 blocks only: checked by the op)
    HQ_DISPATCH_IN(t, return (launch_tile_slots<T, Mxfp8Policy<false>>(a, stream)));
  }
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Mxfp8Policy<true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Mxfp8Policy<false>>(a, stream)));
}
}  // namespace

namespace ops {

// src_rows (1x32 blocks): the [M, K] quantized is x's rows through that map (apply_row_map, binding_checks.h),
// M = src_rows.size(0)
std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize(const Tensor& x, at::ScalarType dtype, bool block_2d,
                                                          bool rowwise, bool columnwise, bool swizzle,
                                                          const std::optional<Tensor>& src_rows) {
  constexpr const char* op = "mxfp8_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(!block_2d || !src_rows.has_value(), "hybridq::", op,
              ": a row map (src_rows) is implemented for 1x32 blocks only, got block_2d");
  auto a = tile_args<Mxfp8Args>(x, rowwise, columnwise);
  const int64_t M = apply_row_map(a, x, src_rows, op), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 32), "hybridq::", op, ": MXFP8 ",
              block_2d ? "32x32 tiles need" : "rowwise (1x32 blocks along K) needs",
              " K = x.size(1) divisible by 32, got x of shape ", x.sizes());
  TORCH_CHECK(!((columnwise || block_2d) && M % 32), "hybridq::", op, ": MXFP8 ",
              block_2d ? "32x32 tiles need" : "columnwise (32x1 blocks along M) needs", " M = ",
              src_rows.has_value() ? "src_rows.size(0)" : "x.size(0)", " divisible by 32, got M ", M, " (x of shape ",
              x.sizes(), ")");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  a.fp8 = fp8_encoding(dtype, 0.0, false, op);
  auto u8o = x.options().dtype(at::kByte);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor row_s, col_s;
  a.swizzle = swizzle;
  if (swizzle) {
    a.row_s_cols_pad = round_up(K / 32, 4);
    a.col_s_cols_pad = round_up(M / 32, 4);
    row_s = rowwise ? zeros_on_stream({round_up(M, 128) * a.row_s_cols_pad}, u8o) : empty0(x, at::kByte);
    col_s = columnwise ? zeros_on_stream({round_up(K, 128) * a.col_s_cols_pad}, u8o) : empty0(x, at::kByte);
  } else {
    row_s = rowwise ? at::empty({M, K / 32}, u8o) : empty0(x, at::kByte);
    col_s = columnwise ? at::empty({K, M / 32}, u8o) : empty0(x, at::kByte);
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  check_row_map_values(a, x, stream);
  C10_CUDA_CHECK(launch_quantize_mxfp8(it, block_2d, a, stream));
  return {row, row_s, col, col_s};
}

// data [rows, cols] fp8 with compact E8M0 scales [rows, cols/32] (1x32 blocks; a 32x32 tile's scale is stored for
// each of its rows) -> [rows, cols] of out_dtype
Tensor mxfp8_dequantize(const Tensor& data, const Tensor& scale, at::ScalarType out_dtype) {
  constexpr const char* op = "mxfp8_dequantize";
  check_input(data, op, "data");
  const bool e5m2 = is_e5m2(data.scalar_type(), op);
  const int64_t rows = data.size(0), cols = data.size(1);
  TORCH_CHECK(cols % 32 == 0, "hybridq::", op, ": MXFP8 data needs cols divisible by 32, got data of shape ",
              data.sizes());
  check_part_scale(scale, data, op, "scale", at::kByte, "uint8 (E8M0)", rows * (cols / 32), "[rows, cols/32]");
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = dequant_out(data, cols, out_dtype, op);
  auto a = dequant_args<Mxfp8DequantArgs>(data, cols);
  a.scale = u8(scale);
  a.e5m2 = e5m2;
  // (one dequantize step for both block kinds)
  C10_CUDA_CHECK(launch_dequantize<Mxfp8Policy<false>>(a, out_dtype == at::kBFloat16, out.data_ptr(),
                                                       c10::cuda::getCurrentCUDAStream()));
  return out;
}

namespace {
void impls(torch::Library& m) {
  m.impl("mxfp8_quantize", &mxfp8_quantize);
  m.impl("mxfp8_dequantize", &mxfp8_dequantize);
}
}  // namespace

}  // namespace ops
}  // namespace hybridq

TORCH_LIBRARY_FRAGMENT(hybridq, m) {
  m.def(
      "mxfp8_quantize(Tensor x, ScalarType dtype, bool block_2d, bool rowwise, bool columnwise, bool swizzle, "
      "Tensor? src_rows=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("mxfp8_dequantize(Tensor data, Tensor scale, ScalarType out_dtype) -> Tensor");
}
HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
