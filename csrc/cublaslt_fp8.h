// An FP8 GEMM through cuBLASLt with a cached plan (issues 30 and 33: host time per GEMM).
//
// `at::_scaled_mm` / `at::_scaled_mm_v2_out` re-check their arguments, create cuBLASLt descriptors and query
// cuBLASLt's heuristic (`cublasLtMatmulAlgoGetHeuristic`) at every call: tens of microseconds of host per GEMM. Here
// the descriptors and the heuristic's algorithm are made ONCE per problem key and kept; a call sets the scale
// pointers and runs `cublasLtMatmul` on the current stream with torch's cuBLASLt handle and workspace.
//
// Bitwise `at::_scaled_mm`: the descriptors, layouts, workspace size and heuristic preference are those of torch
// 2.11's `at::cuda::blas::scaled_gemm` (aten/src/ATen/cuda/CUDABlas.cpp) for what `_scaled_mm` passes it
// (cublasCommonArgs, aten/src/ATen/native/cuda/cuBlasCommonArgs.h): a row-major out = mat1 @ mat2 runs as cuBLAS's
// column-major D = A^T B with A = mat2 (transposed, 't'), B = mat1 ('n'), the scales and scaling types swapped the
// same way, no bias (C's type is the out dtype), no D scale, host alpha 1 / beta 0, fast accumulation as passed.
// The same inputs give the heuristic the same algorithm, hence the same result.
//
// Covered: per-tensor scales (E4M3 / E5M2 operands, not both E5M2; fp32 scalar scales) and DeepSeek-style block
// scales (1x128 x 128x128, 128x128 x 1x128, 1x128 x 1x128, fp32, no fast accumulation), out bfloat16 / float16 /
// float32. Anything else -- or an SM carveout, or a problem the heuristic has no algorithm for -- returns "not run"
// and the caller runs `at::_scaled_mm*` as before (the same GEMM, the same errors: no high-precision fallback).
// HYBRIDQ_CUBLASLT_DIRECT=0 (read once per process) turns the direct path off.
//
// Cache: per thread (a plan's descriptor holds the scale pointers it is called with, so a plan is never shared
// between threads: the autograd engine's threads each have their own), keyed by everything the heuristic reads
// (device, m, n, k, leading dims, dtypes, scaling modes, fast accumulation, workspace size) plus each pointer's
// 16-byte alignment; at most kMaxPlans plans per thread (then the thread's cache starts over).
#pragma once

#include <ATen/ATen.h>
#include <ATen/BlasBackend.h>

#include <cstdint>

namespace hybridq {
namespace cublaslt {

using at::Tensor;
using at::blas::ScalingType;

constexpr size_t kMaxPlans = 4096;

// One GEMM as cuBLASLt sees it (column-major): D [m, n] (ld ldd) = A^T B, A stored [k, m] (ld lda), B [k, n] (ld
// ldb). For torch's row-major out [M, N] = mat1 [M, K] @ mat2 [K, N]: A = mat2 (m = N, lda = mat2.stride(1)), B = mat1
// (n = M, ldb = mat1.stride(0)), ldd = out.stride(0), a_scale / a_scaling = mat2's, b_scale / b_scaling = mat1's.
struct Gemm {
  int64_t m, n, k, lda, ldb, ldd;
  at::ScalarType a_dtype, b_dtype, d_dtype;
  ScalingType a_scaling, b_scaling;
  bool fast_accum;
  const void* a;
  const void* a_scale;
  const void* b;
  const void* b_scale;
  void* d;
};

// HYBRIDQ_CUBLASLT_DIRECT (default on; "0" turns it off), read at the first call
bool enabled();

// Runs `g` on the current CUDA device and stream (the caller holds the device guard); false: not covered, nothing
// ran (the caller runs at::_scaled_mm*). A cuBLASLt error raises.
bool run(const Gemm& g);

// A DeepSeek-style block-scaled GEMM from pointers, as `at::_scaled_mm_v2_out(d, x, w.t(), ...)` passes it to
// cuBLASLt (A = w, B = x): d [rows, n] (ld ldd, d_dtype) = x [rows, k] (E4M3, ld ldx, 1x128 scales x_scale in the
// outer-dim-major layout cuBLAS reads) @ w [n, k]^T (E4M3, ld ldw, scales w_scale of scaling w_scaling: 1x128 or
// 128x128), no fast accumulation; false: not covered, nothing ran (the caller runs `at::_scaled_mm_v2_out`)
bool run_block_scaled(void* d, int64_t ldd, at::ScalarType d_dtype, const void* x, int64_t ldx, const float* x_scale,
                      const void* w, int64_t ldw, const float* w_scale, ScalingType w_scaling, int64_t rows, int64_t n,
                      int64_t k);

// out [M, N] (out_dtype) = a [M, K] @ b [N, K]^T with per-tensor scales sa, sb (one fp32 each), as
// at::_scaled_mm(a, b.t(), sa, sb, nullopt, nullopt, out_dtype, fast_accum); undefined where not covered
Tensor scaled_mm_tensorwise(const Tensor& a, const Tensor& b, const Tensor& sa, const Tensor& sb,
                            at::ScalarType out_dtype, bool fast_accum);

// The counters (process-wide) and this thread's plan count, for tests and benchmarks
struct Stats {
  int64_t calls;               // GEMMs run by the direct path
  int64_t heuristic_queries;   // cublasLtMatmulAlgoGetHeuristic calls (one per new plan)
  int64_t declined;            // calls left to at::_scaled_mm* (not covered, or no algorithm)
  int64_t plans;               // plans cached by the calling thread
};
Stats stats();
void clear_plans();  // the calling thread's

}  // namespace cublaslt
}  // namespace hybridq

// Python methods of hybridq._C (added to its module in ops.cpp): cublaslt_stats() -> dict, cublaslt_clear_plans()
// -> None, cublaslt_enabled() -> bool
struct PyMethodDef;
PyMethodDef* hq_cublaslt_py_methods();
