// Per-expert GEMMs issued on more than one CUDA stream (issue 30).
//
// [Note: per-expert GEMMs on two streams]
// A grouped op that runs one cuBLAS GEMM per expert on one stream pays each GEMM's last wave: an expert of ~2,048
// tokens at d 2,048 / h 3,072 is ~1.5 waves of 128x256 output tiles on an H200's 132 SMs, so half the SMs idle for
// the last third of every GEMM. Issued alternately on the current stream and one side stream, the next expert's
// tiles fill the SMs the last wave leaves (one H200, the per-expert GEMMs of bench_grouped's configs captured in a
// CUDA graph, 2026-11-29: 64 experts fprop / dgrad / wgrad 1.40 / 1.41 / 1.97 ms on one stream, 1.28 / 1.32 / 1.55
// on two; 16 experts 10-12% faster; 8 experts of ~450 us GEMMs 4-8% SLOWER, which is why the caller decides).
// Three or four streams measured slower than two.
//
// Ordering: the side stream first waits for everything issued on the current stream before the op (the inputs), and
// the current stream waits for the side stream's work before anything issued after the op (the output, the inputs'
// reuse): to the caller the op is ordered on the current stream as one launch would be, CUDA graph capture included
// (the side stream joins and leaves the capture through the two event waits). GEMMs on different streams must not
// write overlapping regions (grouped_block_gemm.cu's fprop / dgrad, whose padded rows overlap the next expert's, run
// two runs of consecutive experts and write a boundary expert's rows aside). Each stream has its own cuBLASLt
// workspace (torch's, per handle and stream), so two GEMMs in flight never share one. The results are bitwise those
// of one stream: every GEMM is the same call with the same plan; only when it runs changes.
#pragma once

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <mutex>
#include <optional>

namespace hybridq {

// The side stream of `device` (one per device and process: each stream that runs cuBLASLt holds a workspace)
inline c10::cuda::CUDAStream expert_side_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::array<std::optional<c10::cuda::CUDAStream>, C10_COMPILE_TIME_MAX_GPUS> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& s = streams.at(device);
  if (!s) s = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
  return *s;
}

// Spreads the experts' GEMMs over `count` (1 or 2) streams: `use(i)` makes the current stream (even i) or the side
// stream (odd i; with count 2) current until the next use() or join() -- i an expert's index to alternate, or a run's;
// join() (or the destructor) orders the side stream's work before the current stream's later work.
class ExpertStreams {
 public:
  ExpertStreams(int64_t count, const char* op) : main_(c10::cuda::getCurrentCUDAStream()), side_(main_) {
    TORCH_CHECK(count == 1 || count == 2, "hybridq::", op, ": streams must be 1 or 2, got ", count);
    if (count == 2) {
      side_ = expert_side_stream(main_.device_index());
      forked_.record(main_);
      forked_.block(side_);
      split_ = true;
    }
  }
  ExpertStreams(const ExpertStreams&) = delete;
  ExpertStreams& operator=(const ExpertStreams&) = delete;

  void use(int64_t i) { guard_.emplace(split_ && i % 2 == 1 ? side_ : main_); }

  void join() {
    guard_.reset();
    if (split_) {
      split_ = false;
      done_.record(side_);
      done_.block(main_);
    }
  }

  ~ExpertStreams() {
    try {
      join();
    } catch (...) {  // (an op already raising: its error is the one to report)
    }
  }

 private:
  c10::cuda::CUDAStream main_, side_;
  bool split_ = false;
  at::cuda::CUDAEvent forked_, done_;
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
};

}  // namespace hybridq
