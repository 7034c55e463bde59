// Float8 block scaling: the tile kernel with Fp8BlockPolicy (1x128 / 128x1 blocks or 128x128 tiles), the dequantize
// kernel with the same policy, and their ops fp8_block_quantize / fp8_block_dequantize.
#include "binding_checks.h"
#include "tile/dequantize.cuh"
#include "tile/policy_fp8_block.cuh"

namespace hybridq {

namespace {
cudaError_t launch_quantize_fp8_block(InType t, bool two_d, const Fp8BlockArgs& a, cudaStream_t stream) {
  if (a.src_rows != nullptr) {  // (1x128 blocks only: checked by the op)
    HQ_DISPATCH_IN(t, return (launch_tile_slots<T, Fp8BlockPolicy<false>>(a, stream)));
  }
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fp8BlockPolicy<true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fp8BlockPolicy<false>>(a, stream)));
}
}  // namespace

namespace ops {

// ---- FP8 block ----------------------------------------------------------------------------------------
// returns (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv); block_dim 1: [M, ceil(K/128)] and
// [K, ceil(M/128)]; block_dim 2: [ceil(M/128), ceil(K/128)] and its transpose. src_rows (1x128 blocks): the [M, K]
// quantized is x's rows through that map (apply_row_map, binding_checks.h), M = src_rows.size(0)
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize(const Tensor& x, at::ScalarType dtype,
                                                              int64_t block_dim, double eps, bool pow2, bool rowwise,
                                                              bool columnwise, const std::optional<Tensor>& src_rows) {
  constexpr const char* op = "fp8_block_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(block_dim == 1 || block_dim == 2, "hybridq::", op,
              ": block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got ", block_dim);
  TORCH_CHECK(block_dim == 1 || !src_rows.has_value(), "hybridq::", op,
              ": a row map (src_rows) is implemented for 1x128 blocks only, got block_dim 2");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto a = tile_args<Fp8BlockArgs>(x, rowwise, columnwise);
  const int64_t M = apply_row_map(a, x, src_rows, op), K = x.size(1);
  const int64_t nbm = (M + 127) / 128, nbk = (K + 127) / 128;
  a.fp8 = fp8_encoding(dtype, eps, pow2, op);
  auto f32 = x.options().dtype(at::kFloat);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor row_s, col_s;
  if (block_dim == 1) {
    row_s = rowwise ? at::empty({M, nbk}, f32) : empty0(x, at::kFloat);
    col_s = columnwise ? at::empty({K, nbm}, f32) : empty0(x, at::kFloat);
  } else {
    row_s = rowwise ? at::empty({nbm, nbk}, f32) : empty0(x, at::kFloat);
    col_s = columnwise ? at::empty({nbk, nbm}, f32) : empty0(x, at::kFloat);
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  check_row_map_values(a, x, stream);
  C10_CUDA_CHECK(launch_quantize_fp8_block(it, block_dim == 2, a, stream));
  return {row, row_s, col, col_s};
}

// data [rows, cols] fp8 with scale_inv of 1x128 blocks [rows, ceil(cols/128)] (block_dim 1) or of 128x128 tiles
// [ceil(rows/128), ceil(cols/128)] (block_dim 2) -> [rows, cols] of out_dtype
Tensor fp8_block_dequantize(const Tensor& data, const Tensor& scale_inv, int64_t block_dim, at::ScalarType out_dtype) {
  constexpr const char* op = "fp8_block_dequantize";
  check_input(data, op, "data");
  TORCH_CHECK(block_dim == 1 || block_dim == 2, "hybridq::", op,
              ": block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got ", block_dim);
  const bool e5m2 = is_e5m2(data.scalar_type(), op);
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t nbc = (cols + 127) / 128;
  if (block_dim == 1) {
    check_part_scale(scale_inv, data, op, "scale_inv", at::kFloat, "float32", rows * nbc, "[rows, ceil(cols/128)]");
  } else {
    check_part_scale(scale_inv, data, op, "scale_inv", at::kFloat, "float32", ((rows + 127) / 128) * nbc,
                     "[ceil(rows/128), ceil(cols/128)]");
  }
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = dequant_out(data, cols, out_dtype, op);
  auto a = dequant_args<Fp8BlockDequantArgs>(data, cols);
  a.scale_inv = scale_inv.data_ptr<float>();
  a.e5m2 = e5m2;
  const bool bf16 = out_dtype == at::kBFloat16;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (block_dim == 2) {
    C10_CUDA_CHECK(launch_dequantize<Fp8BlockPolicy<true>>(a, bf16, out.data_ptr(), stream));
  } else {
    C10_CUDA_CHECK(launch_dequantize<Fp8BlockPolicy<false>>(a, bf16, out.data_ptr(), stream));
  }
  return out;
}

namespace {
void impls(torch::Library& m) {
  m.impl("fp8_block_quantize", &fp8_block_quantize);
  m.impl("fp8_block_dequantize", &fp8_block_dequantize);
}
}  // namespace

}  // namespace ops
}  // namespace hybridq

TORCH_LIBRARY_FRAGMENT(hybridq, m) {
  m.def(
      "fp8_block_quantize(Tensor x, ScalarType dtype, int block_dim, float eps, bool pow2, bool rowwise, "
      "bool columnwise, Tensor? src_rows=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_block_dequantize(Tensor data, Tensor scale_inv, int block_dim, ScalarType out_dtype) -> Tensor");
  // many fp32 tensors (an FSDP2 unit's master shards), each rounded to param_dtype and quantized in 128x128 tiles as
  // its own tensor into its region of one byte buffer, its tile scales into one fp32 buffer: implemented in
  // csrc/fp8_block_tensors.cu
  m.def(
      "fp8_block_tensors_quantize(Tensor[] xs, ScalarType param_dtype, int[] e5m2, float[] eps, int[] pow2, "
      "int[] regions) -> (Tensor, Tensor)");
  // the dense block GEMM of a Linear (implemented in csrc/block_gemm.cu)
  m.def(
      "fp8_block_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool b_tiles, ScalarType out_dtype) -> "
      "Tensor");
  // the packed path's cuBLAS loop over the expert slots (implemented in csrc/grouped_block_gemm.cu)
  m.def(
      "grouped_block_cublas_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool b_tiles, int b_dim, "
      "int[] offsets, int[] rows, int[] tokens, Tensor slot_offsets, Tensor slot_rows, ScalarType out_dtype, "
      "int streams=1) -> Tensor");
  m.def(
      "grouped_block_cublas_wgrad(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, int[] offsets, int[] rows, "
      "ScalarType out_dtype, int streams=1) -> Tensor");
  // the eager Linear as one op with a C++ autograd node (implemented in csrc/linear_fp8_block.cpp)
  m.def(
      "fp8_block_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? x_row, Tensor? x_row_scale_inv, "
      "Tensor? x_col, Tensor? x_col_scale_inv, ScalarType x_dtype, float x_eps, bool x_pow2, ScalarType w_dtype, "
      "int w_block_dim, float w_eps, bool w_pow2, ScalarType g_dtype, float g_eps, bool g_pow2, bool need_dgrad, "
      "bool need_wgrad, bool save_original_input, Tensor? w_row=None, Tensor? w_row_scale_inv=None, "
      "Tensor? w_col=None, Tensor? w_col_scale_inv=None) -> Tensor");
  // the compiled Linear's gathered FP8 block fast path, one op per phase (implemented in csrc/linear_fp8_block.cpp)
  m.def(
      "fp8_block_linear_fprop(Tensor x, Tensor w_row, Tensor w_row_scale_inv, Tensor? bias, ScalarType x_dtype, "
      "float x_eps, bool x_pow2, int w_block_dim, bool need_wgrad, bool save_original_input) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "fp8_block_linear_grads(Tensor dy, Tensor? x_saved, Tensor? x_col_scale_inv, Tensor? w_col, "
      "Tensor? w_col_scale_inv, ScalarType x_dtype, float x_eps, bool x_pow2, ScalarType g_dtype, float g_eps, "
      "bool g_pow2, int w_block_dim, bool save_original_input, bool need_dgrad, bool need_wgrad, bool need_bgrad, "
      "int[] x_shape, ScalarType w_dtype, ScalarType b_dtype) -> (Tensor, Tensor, Tensor)");
}
HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
