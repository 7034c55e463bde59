// MXFP8: 1x32 rowwise + 32x1 columnwise in one pass, or 32x32 tiles; compact or GEMM-swizzled E8M0 scales.
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_mxfp8(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kMxfp8, true, false>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kMxfp8, false, false>(a, stream)));
}

}  // namespace hybridq
