// Per-tensor FP8 (amax + fused cast/transpose) and FP8 block (1x128 / 128x128) quantization.
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_fp8_tensor(InType t, const QuantArgs& a, cudaStream_t stream) {
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kFp8Tensor, false>(a, stream)));
}

cudaError_t launch_quantize_fp8_block(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kFp8Block, true>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kFp8Block, false>(a, stream)));
}

}  // namespace hybridq
