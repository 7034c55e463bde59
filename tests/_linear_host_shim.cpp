// Built with csrc/linear_fp8.cpp by tests/_delayed_linear_host.py (a host build: no CUDA libraries): the functions that
// file calls from the format's CUDA code, as calls of ops the harness defines with the CPU reference code the general
// path runs (`hybridq_host::quantize`, `quantize_delayed`, `mm`), and the CUDA runtime / c10::cuda symbols it
// references, each raising if reached (the op's delayed-scaling path and its node reach none of them; the packed
// current-scaling path, which needs CUDA memory, is switched off by the harness).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <optional>
#include <tuple>
#include <vector>

using at::Tensor;

namespace {
// `hybridq_host::<name>` called boxed (the ops are defined from Python: no C++ signature to type the call with)
std::vector<c10::IValue> call_host(const char* name, std::vector<c10::IValue> stack) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxed(&stack);
  return stack;
}
[[noreturn]] void no_cuda(const char* what) { TORCH_CHECK(false, "host build of the Linear op: ", what, " needs CUDA"); }
}  // namespace

namespace hybridq {
namespace ops {

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize(const Tensor& x, at::ScalarType dtype,
                                                               const std::optional<Tensor>& scale,
                                                               const std::optional<Tensor>& amax, double eps,
                                                               bool pow2, bool rowwise, bool columnwise,
                                                               bool want_amax) {
  const auto out = call_host("hybridq_host::quantize",
                             {x, dtype, scale, amax, eps, pow2, rowwise, columnwise, want_amax});
  return {out[0].toTensor(), out[1].toTensor(), out[2].toTensor(), out[3].toTensor()};
}

std::tuple<Tensor, Tensor, Tensor> fp8_tensor_quantize_delayed(const Tensor& x, at::ScalarType dtype,
                                                               const Tensor& scale, const Tensor& amax_history,
                                                               double eps, bool pow2, bool rowwise, bool columnwise) {
  const auto out = call_host("hybridq_host::quantize_delayed",
                             {x, dtype, scale, amax_history, eps, pow2, rowwise, columnwise});
  return {out[0].toTensor(), out[1].toTensor(), out[2].toTensor()};
}

void fp8_tensor_quantize_into(const Tensor&, at::ScalarType, double, bool, void*, void*, float*, float*) {
  no_cuda("fp8_tensor_quantize_into (the packed allocations)");
}

}  // namespace ops

namespace cublaslt {
Tensor scaled_mm_tensorwise(const Tensor& a, const Tensor& b, const Tensor& sa, const Tensor& sb,
                            at::ScalarType out, bool fast) {
  return call_host("hybridq_host::mm", {a, b, sa, sb, out, fast})[0].toTensor();
}
}  // namespace cublaslt
}  // namespace hybridq

// ---- what the CUDA headers' inline code references (never reached on the host path) ----
namespace c10 {
namespace cuda {
namespace CUDACachingAllocator {
std::atomic<CUDAAllocator*> allocator;
}
bool CUDAStream::query() const { no_cuda("CUDAStream::query"); }
void CUDAStream::synchronize() const { no_cuda("CUDAStream::synchronize"); }
cudaStream_t CUDAStream::stream() const { no_cuda("CUDAStream::stream"); }
DeviceIndex ExchangeDevice(DeviceIndex) { no_cuda("ExchangeDevice"); }
cudaError_t GetDevice(DeviceIndex*) { no_cuda("GetDevice"); }
DeviceIndex MaybeExchangeDevice(DeviceIndex) { no_cuda("MaybeExchangeDevice"); }
cudaError_t MaybeSetDevice(DeviceIndex) { no_cuda("MaybeSetDevice"); }
cudaError_t SetDevice(DeviceIndex, bool) { no_cuda("SetDevice"); }
void c10_cuda_check_implementation(const int32_t, const char*, const char*, uint32_t, const bool) {
  no_cuda("a CUDA call");
}
DeviceIndex device_count() noexcept { return 0; }
CUDAStream getCurrentCUDAStream(DeviceIndex) { no_cuda("getCurrentCUDAStream"); }
CUDAStream getDefaultCUDAStream(DeviceIndex) { no_cuda("getDefaultCUDAStream"); }
CUDAStream getStreamFromPool(const bool, DeviceIndex) { no_cuda("getStreamFromPool"); }
CUDAStream getStreamFromPool(const int, DeviceIndex) { no_cuda("getStreamFromPool"); }
void setCurrentCUDAStream(CUDAStream) { no_cuda("setCurrentCUDAStream"); }
}  // namespace cuda
}  // namespace c10

extern "C" {
cudaError_t cudaDeviceSynchronize() { no_cuda("cudaDeviceSynchronize"); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t*, unsigned int) { no_cuda("cudaEventCreateWithFlags"); }
cudaError_t cudaEventDestroy(cudaEvent_t) { no_cuda("cudaEventDestroy"); }
cudaError_t cudaEventElapsedTime(float*, cudaEvent_t, cudaEvent_t) { no_cuda("cudaEventElapsedTime"); }
cudaError_t cudaEventQuery(cudaEvent_t) { no_cuda("cudaEventQuery"); }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { no_cuda("cudaEventRecord"); }
cudaError_t cudaEventSynchronize(cudaEvent_t) { no_cuda("cudaEventSynchronize"); }
const char* cudaGetErrorString(cudaError_t) { return "no CUDA (host build)"; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaMemsetAsync(void*, int, size_t, cudaStream_t) { no_cuda("cudaMemsetAsync"); }
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus*) { no_cuda("cudaStreamIsCapturing"); }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { no_cuda("cudaStreamWaitEvent"); }
}
