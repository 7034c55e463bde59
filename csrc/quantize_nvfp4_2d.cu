// NVFP4 with 16x16 tiles (one scale per tile for both directions): the tile kernel with Nvfp4Policy<true, SR>,
// compiled apart from the 1-D blocks so the two compile in parallel.
#include "tile/policy_nvfp4.cuh"

namespace hybridq {

cudaError_t launch_quantize_nvfp4_2d(InType t, const Nvfp4Args& a, cudaStream_t stream) {
  if (a.sr) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Nvfp4Policy<true, true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Nvfp4Policy<true, false>>(a, stream)));
}

}  // namespace hybridq
