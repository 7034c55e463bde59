// Float8 block scaling: the tile kernel with Fp8BlockPolicy (1x128 / 128x1 blocks or 128x128 tiles) and the
// fp8_block_quantize op.
#include "binding_checks.h"
#include "ops.h"
#include "tile/policy_fp8_block.cuh"

namespace hybridq {

cudaError_t launch_quantize_fp8_block(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fp8BlockPolicy<true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fp8BlockPolicy<false>>(a, stream)));
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

// ---- FP8 block ----------------------------------------------------------------------------------------
// returns (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv); block_dim 1: [M, ceil(K/128)] and
// [K, ceil(M/128)]; block_dim 2: [ceil(M/128), ceil(K/128)] and its transpose
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize(const Tensor& x, at::ScalarType dtype,
                                                              int64_t block_dim, double eps, bool pow2, bool rowwise,
                                                              bool columnwise) {
  constexpr const char* op = "fp8_block_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(block_dim == 1 || block_dim == 2, "hybridq::", op,
              ": block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got ", block_dim);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t nbm = (M + 127) / 128, nbk = (K + 127) / 128;
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, eps, pow2, op);
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
  C10_CUDA_CHECK(hybridq::launch_quantize_fp8_block(it, block_dim == 2, a, stream));
  return {row, row_s, col, col_s};
}

}  // namespace ops
}  // namespace hybridq
