// FP8 block (1x128 / 128x128) quantization, both directions in one pass.
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_fp8_block(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kFp8Block, true, false>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kFp8Block, false, false>(a, stream)));
}

}  // namespace hybridq
