// NVFP4: block-16 E4M3 scales and E2M1 codes, 16x16 tiles, the 16-point RHT fused into the columnwise
// quantization, stochastic rounding from a Philox stream.
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_nvfp4(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kNvfp4, true>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kNvfp4, false>(a, stream)));
}

}  // namespace hybridq
