// NVFP4 with 1-D blocks: block-16 E4M3 scales and E2M1 codes, the 16-point RHT fused into the columnwise
// quantization, stochastic rounding from a Philox stream (compiled separately: SR is a template parameter).
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_nvfp4_2d(InType t, const QuantArgs& a, cudaStream_t stream);

cudaError_t launch_quantize_nvfp4(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) return launch_quantize_nvfp4_2d(t, a, stream);
  if (a.sr) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kNvfp4, false, true>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kNvfp4, false, false>(a, stream)));
}

}  // namespace hybridq
