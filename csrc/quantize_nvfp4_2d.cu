// NVFP4 with 16x16 tiles (one scale per tile for both directions).
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_nvfp4_2d(InType t, const QuantArgs& a, cudaStream_t stream) {
  if (a.sr) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kNvfp4, true, true>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kNvfp4, true, false>(a, stream)));
}

}  // namespace hybridq
