// The dense FP8 block-scaled GEMM of a Linear (issue 33: host time per GEMM) as one op, `hybridq::fp8_block_mm`:
// out [M, N] = a [M, K] @ b [N, K]^T with DeepSeek-style block scales -- a's 1x128 blocks, b's 128x128 tiles (fprop,
// dgrad: the weight) or 1x128 blocks (wgrad) -- the GEMM `native_gemm._block_run` ran through `F.scaled_mm`.
//
// [Note: the dense block GEMM op]
// The Python path paid, per GEMM: one copy of a's scales into the outer-dim-major layout cuBLAS reads
// (`s.t().contiguous()`), for 128x128 tiles an `F.pad` of the weight's tile scales (K blocks padded to a multiple of
// 4: an allocation, a fill and a copy) or for 1x128 b another outer-major copy, then `F.scaled_mm`'s Python layer and
// `_scaled_mm_v2`'s argument checks, cuBLASLt descriptors and heuristic query. Here both scale operands are written
// by ONE kernel into ONE allocation (the padding is part of that write: zeros, as F.pad's), and the GEMM runs through
// cublaslt_fp8.h (the same cuBLASLt call `_scaled_mm_v2` makes, its plan cached). Where the direct path declines
// (HYBRIDQ_CUBLASLT_DIRECT=0, a problem it does not cover) `_scaled_mm_v2_out` runs on views of the same buffers with
// the shapes and strides `_block_run` passes F.scaled_mm: the same GEMM, the same errors. The scales are copied,
// never computed: the result is bitwise `_block_run`'s. (The op's schema is declared with the format's other ops in
// quantize_fp8_block.cu.)
#include <ATen/BlasBackend.h>
#include <ATen/ops/_scaled_mm_v2.h>

#include "binding_checks.h"
#include "block_gemm_scales.cuh"
#include "cublaslt_fp8.h"

namespace hybridq {
namespace {

constexpr int kThreads = 256;

// The op's scale buffer: region A at out, region B at out + b_offset (block_gemm_scales.cuh)
__global__ void __launch_bounds__(kThreads) block_gemm_scales(const float* __restrict__ a_scale,
                                                              const float* __restrict__ b_scale,
                                                              float* __restrict__ out, BlockGemmScales s,
                                                              int64_t b_offset) {
  const int64_t n_a = s.n_a(), total = n_a + s.n_b();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    out[i < n_a ? i : b_offset + (i - n_a)] = block_gemm_scale(a_scale, b_scale, s, i);
  }
}

}  // namespace
}  // namespace hybridq

namespace hybridq {
namespace ops {
namespace {

constexpr const char* kOp = "fp8_block_mm";
constexpr int64_t kAlignFloats = 64;  // region B starts 256 bytes in, as a separate allocation would be aligned

void check_scale(const Tensor& s, const Tensor& like, const char* name, int64_t rows, int64_t cols,
                 const char* rule) {
  TORCH_CHECK(s.defined() && s.is_cuda(), "hybridq::", kOp, ": ", name, " must be a CUDA tensor");
  check_same_device(s, like, kOp, name);
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 2 && s.is_contiguous() && s.size(0) == rows &&
                  s.size(1) == cols,
              "hybridq::", kOp, ": ", name, " must be contiguous float32 of shape [", rows, ", ", cols, "] (", rule,
              "), got ", s.scalar_type(), " ", s.sizes(), " with strides ", s.strides());
}

// a [M, K] fp8 (1x128 blocks, scales a_scale [M, K/128] row-major) @ b [N, K]^T (b_tiles: 128x128 tiles, b_scale
// [ceil(N/128), K/128]; else 1x128 blocks, b_scale [N, K/128]) -> [M, N] of out_dtype (bfloat16 / float32 from the
// GEMM, float16 through float32, as native_gemm._block_run)
Tensor fp8_block_mm(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, bool b_tiles,
                    at::ScalarType out_dtype) {
  check_block_gemm_operand(a, a, kOp, "a");
  check_block_gemm_operand(b, a, kOp, "b");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  TORCH_CHECK(b.size(1) == k, "hybridq::", kOp, ": a [", m, ", ", k, "] and b [", n, ", ", b.size(1),
              "] must have the same contracted dim K");
  TORCH_CHECK(k % 128 == 0 && k > 0, "hybridq::", kOp, ": the contracted dim K (", k,
              ") must be a positive multiple of 128 (whole 1x128 blocks)");
  TORCH_CHECK(m % 16 == 0 && n % 16 == 0, "hybridq::", kOp, ": M (", m, ") and N (", n,
              ") must be multiples of 16 (the FP8 tensor cores)");
  const int64_t kb = k / 128, kb4 = round_up(kb, 4), nb = b_tiles ? (n + 127) / 128 : n;
  check_scale(a_scale, a, "a_scale", m, kb, "one per 1x128 block of a");
  check_scale(b_scale, a, "b_scale", nb, kb, b_tiles ? "one per 128x128 tile of b" : "one per 1x128 block of b");
  const at::ScalarType od = block_gemm_dtype(out_dtype, kOp);
  const c10::cuda::CUDAGuard guard(a.device());
  Tensor out = at::empty({m, n}, a.options().dtype(od));
  if (m == 0 || n == 0) return od == out_dtype ? out : out.to(out_dtype);

  const BlockGemmScales layout{m, nb, kb, kb4, b_tiles};
  const int64_t b_offset = round_up(layout.n_a(), kAlignFloats), total = layout.n_a() + layout.n_b();
  Tensor scales = at::empty({b_offset + layout.n_b()}, a_scale.options());
  float* s = scales.data_ptr<float>();
  const int64_t chunks = std::min<int64_t>((total + kThreads - 1) / kThreads, 1024);
  block_gemm_scales<<<static_cast<unsigned>(chunks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      a_scale.data_ptr<float>(), b_scale.data_ptr<float>(), s, layout, b_offset);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const at::blas::ScalingType b_scaling =
      b_tiles ? at::blas::ScalingType::BlockWise128x128 : at::blas::ScalingType::BlockWise1x128;
  // (cuBLASLt's column-major D = A^T B for torch's row-major out = a @ b^T: A = b, B = a)
  if (!cublaslt::run_block_scaled(out.data_ptr(), n, od, a.data_ptr(), k, s, b.data_ptr(), k, s + b_offset,
                                  b_scaling, m, n, k)) {
    // the views _block_run gives F.scaled_mm: a's scales [M, kb] strides (1, M); tiles [kb4, nb] strides (1, kb4);
    // 1x128 b's [N, kb] strides (1, N)
    const Tensor sa = scales.as_strided({m, kb}, {1, m}, 0);
    const Tensor sb = b_tiles ? scales.as_strided({kb4, nb}, {1, kb4}, b_offset)
                              : scales.as_strided({nb, kb}, {1, nb}, b_offset);
    at::_scaled_mm_v2_out(out, a, b.t(), {sa}, {static_cast<int64_t>(at::blas::ScalingType::BlockWise1x128)}, {},
                          {sb}, {static_cast<int64_t>(b_scaling)}, {}, std::nullopt, od);
  }
  return od == out_dtype ? out : out.to(out_dtype);
}

void impls(torch::Library& m) { m.impl("fp8_block_mm", &fp8_block_mm); }

}  // namespace
}  // namespace ops
}  // namespace hybridq

HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
