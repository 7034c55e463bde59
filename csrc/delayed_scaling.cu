// Delayed-scaling state update of many per-tensor FP8 quantizers in one launch (Float8Quantizer.update(),
// docs/numerics.md "Per-tensor FP8"): per tensor, amax = max(history) (NaN propagates) or history[0]
// ("most_recent"); history = roll(history, -1) with history[0] = 0; scale = (fp8_max / amax) / 2^margin, +-inf ->
// FLT_MAX, kept unchanged when amax <= 0 or amax is not finite. One CTA per tensor, in place.
#include "binding_checks.h"
#include "ops.h"
#include "numerics.cuh"

namespace hybridq {

namespace {

constexpr int kDsThreads = 256;

// one quantizer's update by one CTA of kDsThreads threads
__device__ __forceinline__ void delayed_update_one(const DelayedEntry e) {
  const int tid = threadIdx.x;
  const int64_t L = e.len;
  // every thread reads the values it will write (new[j] = old[(j + 1) % L]) before anyone writes: the amax over
  // those is the amax over the whole history (a permutation of it)
  float v[kDelayedMaxPerThread];
  float m = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < kDelayedMaxPerThread; ++k) {
    const int64_t j = tid + static_cast<int64_t>(k) * kDsThreads;
    v[k] = 0.0f;
    if (j < L) {
      v[k] = e.hist[j + 1 < L ? j + 1 : 0];
      nan |= is_nan(v[k]);
      m = fmaxf(m, v[k]);
    }
  }
  const float first = e.hist[0];
  // CTA max (NaN sticky)
  __shared__ float s_m[kDsThreads / 32];
  __shared__ int s_nan[kDsThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    nan = __any_sync(0xffffffffu, nan);
  }
  if ((tid & 31) == 0) {
    s_m[tid >> 5] = m;
    s_nan[tid >> 5] = nan ? 1 : 0;
  }
  __syncthreads();  // also: every read of the history is done
#pragma unroll
  for (int k = 0; k < kDelayedMaxPerThread; ++k) {
    const int64_t j = tid + static_cast<int64_t>(k) * kDsThreads;
    if (j < L) e.hist[j] = j == 0 ? 0.0f : v[k];
  }
  if (tid == 0) {
    float hmax = -INFINITY;
    bool any_nan = false;
#pragma unroll
    for (int i = 0; i < kDsThreads / 32; ++i) {
      hmax = fmaxf(hmax, s_m[i]);
      any_nan |= s_nan[i] != 0;
    }
    const float amax = e.most_recent ? first : (any_nan ? u2f(0x7FC00000u) : hmax);
    float scale = (e.fp8_max / amax) / e.divisor;  // IEEE divisions, like the fp32 tensor ops of the reference
    if (is_inf(scale)) scale = kFltMax;
    const bool keep = (amax <= 0.0f) || is_nan(amax) || is_inf(amax);
    if (!keep) *e.scale = scale;
  }
}

__global__ void __launch_bounds__(kDsThreads) delayed_update_kernel(const DelayedEntry* __restrict__ entries) {
  delayed_update_one(entries[blockIdx.x]);
}

// A few entries (a delayed cast's own pending update): passed by value as the kernel parameter, so the launch needs
// no pinned host buffer and no host-to-device copy (a pinned allocation per cast cost ~70 us of host time and
// could wait for the GPU).
constexpr int64_t kInlineEntries = 16;
struct InlineEntries {
  DelayedEntry e[kInlineEntries];
};

__global__ void __launch_bounds__(kDsThreads) delayed_update_inline_kernel(const InlineEntries entries) {
  delayed_update_one(entries.e[blockIdx.x]);
}

}  // namespace

cudaError_t launch_delayed_update(const DelayedEntry* entries_dev, int64_t n, cudaStream_t stream) {
  for (int64_t i0 = 0; i0 < n; i0 += 65535) {
    const int64_t nb = min64(65535, n - i0);
    delayed_update_kernel<<<static_cast<unsigned int>(nb), kDsThreads, 0, stream>>>(entries_dev + i0);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_delayed_update_inline(const InlineEntries& entries, int64_t n, cudaStream_t stream) {
  delayed_update_inline_kernel<<<static_cast<unsigned int>(n), kDsThreads, 0, stream>>>(entries);
  return cudaGetLastError();
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

// ---- delayed scaling: Float8Quantizer.update() of many quantizers in one launch (in place) ----------------
void fp8_delayed_update(at::TensorList histories, at::TensorList scales, at::ArrayRef<double> fp8_maxes,
                        at::ArrayRef<double> divisors, at::IntArrayRef most_recent) {
  constexpr const char* op = "fp8_delayed_update";
  const int64_t n = static_cast<int64_t>(histories.size());
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == n && static_cast<int64_t>(fp8_maxes.size()) == n &&
                  static_cast<int64_t>(divisors.size()) == n && static_cast<int64_t>(most_recent.size()) == n,
              "hybridq::", op, ": histories, scales, fp8_maxes, divisors and most_recent must have one entry per "
              "quantizer, got lengths ", histories.size(), ", ", scales.size(), ", ", fp8_maxes.size(), ", ",
              divisors.size(), ", ", most_recent.size());
  if (n == 0) return;
  const auto dev = histories[0].device();
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& h = histories[i];
    const Tensor& s = scales[i];
    TORCH_CHECK(h.defined() && h.is_cuda() && h.device() == dev, "hybridq::", op, ": histories[", i,
                "] must be a CUDA tensor on ", dev, ", got ", h.defined() ? h.device() : c10::Device("cpu"));
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 1 && h.is_contiguous(), "hybridq::", op, ": histories[", i,
                "] must be a contiguous 1-D float32 tensor, got ", h.scalar_type(), " of shape ", h.sizes());
    TORCH_CHECK(h.numel() >= 1 && h.numel() <= hybridq::kDelayedMaxLen, "hybridq::", op, ": histories[", i,
                "] must have 1 to ", hybridq::kDelayedMaxLen, " elements, got ", h.numel());
    TORCH_CHECK(s.defined() && s.is_cuda() && s.device() == dev, "hybridq::", op, ": scales[", i,
                "] must be a CUDA tensor on ", dev);
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1 && s.is_contiguous(), "hybridq::", op, ": scales[", i,
                "] must be a float32 tensor of one element, got ", s.scalar_type(), " of shape ", s.sizes());
  }
  const auto entry = [&](int64_t i) {
    return hybridq::DelayedEntry{histories[i].data_ptr<float>(), scales[i].data_ptr<float>(), histories[i].numel(),
                                 static_cast<float>(fp8_maxes[i]), static_cast<float>(divisors[i]),
                                 most_recent[i] != 0 ? 1 : 0, 0};
  };
  c10::cuda::CUDAGuard guard(dev);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (n <= hybridq::kInlineEntries) {
    hybridq::InlineEntries inline_entries{};
    for (int64_t i = 0; i < n; ++i) inline_entries.e[i] = entry(i);
    C10_CUDA_CHECK(hybridq::launch_delayed_update_inline(inline_entries, n, stream));
    return;
  }
  Tensor host = at::empty({n * static_cast<int64_t>(sizeof(hybridq::DelayedEntry))},
                          at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* e = reinterpret_cast<hybridq::DelayedEntry*>(host.data_ptr());
  for (int64_t i = 0; i < n; ++i) e[i] = entry(i);
  Tensor entries = host.to(dev, /*non_blocking=*/true);
  C10_CUDA_CHECK(hybridq::launch_delayed_update(reinterpret_cast<const hybridq::DelayedEntry*>(entries.data_ptr()), n,
                                                stream));
}

}  // namespace ops
}  // namespace hybridq
