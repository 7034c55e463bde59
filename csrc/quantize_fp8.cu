// Per-tensor FP8: fused cast + transpose (the amax pass is in amax.cu).
#include "quantize_tile.cuh"

namespace hybridq {

cudaError_t launch_quantize_fp8_tensor(InType t, const QuantArgs& a, cudaStream_t stream) {
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fmt::kFp8Tensor, false, false>(a, stream)));
}

}  // namespace hybridq
