// MXFP8: the tile kernel with Mxfp8Policy (1x32 rowwise + 32x1 columnwise in one pass, or 32x32 tiles; compact or
// GEMM-swizzled E8M0 scales) and the mxfp8_quantize op.
#include "binding_checks.h"
#include "ops.h"
#include "tile/policy_mxfp8.cuh"

namespace hybridq {

cudaError_t launch_quantize_mxfp8(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Mxfp8Policy<true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Mxfp8Policy<false>>(a, stream)));
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize(const Tensor& x, at::ScalarType dtype, bool block_2d,
                                                          bool rowwise, bool columnwise, bool swizzle) {
  constexpr const char* op = "mxfp8_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 32), "hybridq::", op, ": MXFP8 ",
              block_2d ? "32x32 tiles need" : "rowwise (1x32 blocks along K) needs",
              " K = x.size(1) divisible by 32, got x of shape ", x.sizes());
  TORCH_CHECK(!((columnwise || block_2d) && M % 32), "hybridq::", op, ": MXFP8 ",
              block_2d ? "32x32 tiles need" : "columnwise (32x1 blocks along M) needs",
              " M = x.size(0) divisible by 32, got x of shape ", x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, 0.0, false, op);
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
  C10_CUDA_CHECK(hybridq::launch_quantize_mxfp8(it, block_2d, a, stream));
  return {row, row_s, col, col_s};
}

}  // namespace ops
}  // namespace hybridq
