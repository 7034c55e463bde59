// Per-tensor FP8 grouped GEMMs of the jagged expert path (hybridq/kernels/grouped_fp8.py) as one cuBLAS GEMM per
// expert, issued from C++ in one op call per phase (issue 30: a Python `torch._scaled_mm` per expert costs ~30-100 us
// of host, this loop ~10 us through cublaslt_fp8.h's cached plans). Where the host has the token counts and the
// experts' GEMMs are long, cuBLAS runs them at 1.0-1.4 PFLOP/s on an H200, where the Triton grouped kernels with
// promoted accumulation (dgrad, wgrad) run at 0.45-0.85 (BENCHMARKS.md, "Session of 2026-11-29 03:14 UTC").
//   - `grouped_fp8_tensor_cublas_mm` (fprop, dgrad): out[rows of g] = a[rows of g] @ b_g^T * (sa[g] * sb[g]), the
//     GEMM `torch._scaled_mm(a[rows of g], b_g.t(), sa[g], sb[g])` runs -- bitwise, the same cuBLASLt call;
//   - `grouped_fp8_tensor_cublas_wgrad` (wgrad): out[g] = a_t[:, slot g] @ b_t[:, slot g]^T * (sa[g] * sb[g]) over
//     each expert's slot of the columnwise forms (the padded layout: slots start and end at multiples of 16 tokens,
//     zero-padded, as cuBLAS needs them), an expert without tokens a zero product.
// Every expert's operands are pointers into the given tensors (no view tensors per expert); where the direct
// cuBLASLt path declines (cublaslt_fp8.h: not covered), `at::_scaled_mm_out` runs the same GEMM on views (the same
// errors: no high-precision fallback). cuBLASLt reads the per-tensor scales through 16-byte aligned pointers: each
// expert's scale is used in place where it is so aligned (a column of the gathered experts' `[E, 4]` buffer), else
// from an aligned copy made in the call. `streams` 2 issues the experts' GEMMs alternately on the current stream and a
// side stream (expert_streams.h: the caller decides where that pays).
#include <ATen/ops/_scaled_mm.h>

#include <vector>

#include "binding_checks.h"
#include "cublaslt_fp8.h"
#include "expert_streams.h"

namespace hybridq {
namespace ops {
namespace {

constexpr const char* kMm = "grouped_fp8_tensor_cublas_mm";
constexpr const char* kWgrad = "grouped_fp8_tensor_cublas_wgrad";

void check_operand(const Tensor& t, const Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.defined() && t.is_cuda(), "hybridq::", op, ": ", name, " must be a CUDA tensor");
  check_same_device(t, like, op, name);
  is_e5m2(t.scalar_type(), op);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) % 16 == 0 && t.stride(0) >= t.size(1), "hybridq::", op,
              ": ", name, " must be 2-D with unit stride along its rows and a row pitch that is a multiple of 16 "
              "bytes, got shape ", t.sizes(), " and strides ", t.strides());
}

// Each expert's scale as an fp32 pointer cuBLASLt takes (16-byte aligned): `scale` ([E] fp32, any stride) in place
// where every element is so aligned, else from `keep`, an aligned copy ([E, 4], column 0)
std::vector<const float*> scale_pointers(const Tensor& scale, int64_t e, const Tensor& like, const char* op,
                                         const char* name, Tensor& keep) {
  TORCH_CHECK(scale.defined() && scale.is_cuda(), "hybridq::", op, ": ", name, " must be a CUDA tensor");
  check_same_device(scale, like, op, name);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == e, "hybridq::", op, ": ",
              name, " must be float32 of shape [", e, "] (one scale per expert), got ", scale.scalar_type(), " ",
              scale.sizes());
  const float* base = scale.data_ptr<float>();
  bool aligned = true;
  for (int64_t g = 0; g < e && aligned; ++g) {
    aligned = (reinterpret_cast<uintptr_t>(base + g * scale.stride(0)) & 15u) == 0;
  }
  std::vector<const float*> out(e);
  if (aligned) {
    for (int64_t g = 0; g < e; ++g) out[g] = base + g * scale.stride(0);
    return out;
  }
  keep = at::zeros({e, 4}, scale.options());
  keep.select(1, 0).copy_(scale);
  for (int64_t g = 0; g < e; ++g) out[g] = keep.data_ptr<float>() + 4 * g;
  return out;
}

at::ScalarType gemm_dtype(at::ScalarType out_dtype, const char* op) {
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat || out_dtype == at::kHalf, "hybridq::", op,
              ": out_dtype must be bfloat16, float32 or float16, got ", out_dtype);
  return out_dtype;
}

// One expert's scale as the 1-element tensor at::_scaled_mm takes (the fallback only)
Tensor scale_tensor(const float* p, const Tensor& like) {
  return at::from_blob(const_cast<float*>(p), {1}, like.options().dtype(at::kFloat));
}

// fprop / dgrad: a [T, K] (the tokens, expert g's `sizes[g]` rows after the previous experts'), expert g's operand b_g
// [n, K] at element g * b_group_stride of b (rows b_row_stride apart, contiguous along K) -> [T, n]
Tensor grouped_fp8_tensor_cublas_mm(const Tensor& a, const Tensor& a_scale, const Tensor& b, int64_t b_group_stride,
                                    int64_t b_row_stride, int64_t n, const Tensor& b_scale, at::IntArrayRef sizes,
                                    at::ScalarType out_dtype, bool fast_accum, int64_t streams) {
  check_operand(a, a, kMm, "a");
  TORCH_CHECK(a.is_contiguous(), "hybridq::", kMm, ": a must be contiguous, got strides ", a.strides());
  TORCH_CHECK(b.defined() && b.is_cuda(), "hybridq::", kMm, ": b must be a CUDA tensor");
  check_same_device(b, a, kMm, "b");
  is_e5m2(b.scalar_type(), kMm);
  const int64_t t = a.size(0), k = a.size(1), e = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(e > 0, "hybridq::", kMm, ": needs at least one expert");
  TORCH_CHECK(n > 0 && n % 16 == 0 && k % 16 == 0, "hybridq::", kMm, ": the output width n (", n,
              ") and the contracted K (", k, ") must be positive multiples of 16");
  TORCH_CHECK(b_group_stride >= 0 && b_row_stride >= k && b_row_stride % 16 == 0 &&
                  (e - 1) * b_group_stride + (n - 1) * b_row_stride + k <=
                      static_cast<int64_t>(b.storage().nbytes()) - b.storage_offset(),
              "hybridq::", kMm, ": the experts' operands (group stride ", b_group_stride, ", row stride ", b_row_stride,
              ", ", n, " rows of ", k, ") do not fit b's storage from its first element, or its rows are not 16-byte "
              "aligned");
  int64_t total = 0;
  for (int64_t g = 0; g < e; ++g) {
    TORCH_CHECK(sizes[g] >= 0, "hybridq::", kMm, ": expert ", g, " has ", sizes[g], " tokens");
    total += sizes[g];
  }
  TORCH_CHECK(total == t, "hybridq::", kMm, ": the experts' token counts sum to ", total, ", a has ", t, " rows");
  const at::ScalarType od = gemm_dtype(out_dtype, kMm);
  const c10::cuda::CUDAGuard guard(a.device());
  Tensor keep_a, keep_b;
  const std::vector<const float*> sa = scale_pointers(a_scale, e, a, kMm, "a_scale", keep_a);
  const std::vector<const float*> sb = scale_pointers(b_scale, e, a, kMm, "b_scale", keep_b);
  Tensor out = at::empty({t, n}, a.options().dtype(od));
  const auto* a_ptr = static_cast<const uint8_t*>(a.data_ptr());
  const auto* b_ptr = static_cast<const uint8_t*>(b.data_ptr());
  auto* out_ptr = static_cast<uint8_t*>(out.data_ptr());
  const int64_t out_row = n * out.element_size();
  ExpertStreams on(streams, kMm);
  int64_t o = 0, issued = 0;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t m = sizes[g];
    if (m == 0) continue;
    on.use(issued++);
    // (torch's row-major out = mat1 @ mat2 as cuBLAS's column-major A^T B: A = b_g, B = a's rows; cublaslt_fp8.h)
    cublaslt::Gemm gemm{n, m, k, b_row_stride, k, n, b.scalar_type(), a.scalar_type(), od,
                        at::blas::ScalingType::TensorWise, at::blas::ScalingType::TensorWise, fast_accum,
                        b_ptr + g * b_group_stride, sb[g], a_ptr + o * k, sa[g], out_ptr + o * out_row};
    if (!cublaslt::run(gemm)) {
      Tensor y = out.narrow(0, o, m);
      const Tensor bg = b.as_strided({n, k}, {b_row_stride, 1}, b.storage_offset() + g * b_group_stride);
      at::_scaled_mm_out(y, a.narrow(0, o, m), bg.t(), scale_tensor(sa[g], a), scale_tensor(sb[g], a), std::nullopt,
                         std::nullopt, od, fast_accum);
    }
    o += m;
  }
  on.join();
  return out;
}

// wgrad: a_t [M, W], b_t [N, W] (the columnwise forms), expert g contracted over its slot [offsets[g], offsets[g] +
// rows[g]) (multiples of 16) -> [E, M, N], no fast accumulation (the backward GEMMs' precise sums)
Tensor grouped_fp8_tensor_cublas_wgrad(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t,
                                       const Tensor& b_scale, at::IntArrayRef offsets, at::IntArrayRef rows,
                                       at::ScalarType out_dtype, int64_t streams) {
  check_operand(a_t, a_t, kWgrad, "a_t");
  check_operand(b_t, a_t, kWgrad, "b_t");
  const int64_t m = a_t.size(0), n = b_t.size(0), w = a_t.size(1), e = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(b_t.size(1) == w, "hybridq::", kWgrad, ": a_t and b_t must hold the same ", w, " token columns, b_t has ",
              b_t.size(1));
  TORCH_CHECK(e > 0 && static_cast<int64_t>(rows.size()) == e, "hybridq::", kWgrad,
              ": offsets and rows need one entry per expert, got ", offsets.size(), " and ", rows.size());
  TORCH_CHECK(m % 16 == 0 && n % 16 == 0, "hybridq::", kWgrad, ": M (", m, ") and N (", n,
              ") must be multiples of 16");
  for (int64_t g = 0; g < e; ++g) {
    TORCH_CHECK(offsets[g] >= 0 && rows[g] >= 0 && offsets[g] + rows[g] <= w && offsets[g] % 16 == 0 &&
                    rows[g] % 16 == 0,
                "hybridq::", kWgrad, ": expert ", g, "'s slot [", offsets[g], ", ", offsets[g] + rows[g],
                ") must lie in the ", w, " token columns, start and size multiples of 16");
  }
  const at::ScalarType od = gemm_dtype(out_dtype, kWgrad);
  const c10::cuda::CUDAGuard guard(a_t.device());
  Tensor keep_a, keep_b;
  const std::vector<const float*> sa = scale_pointers(a_scale, e, a_t, kWgrad, "a_scale", keep_a);
  const std::vector<const float*> sb = scale_pointers(b_scale, e, a_t, kWgrad, "b_scale", keep_b);
  Tensor out = at::empty({e, m, n}, a_t.options().dtype(od));
  const auto* a_ptr = static_cast<const uint8_t*>(a_t.data_ptr());
  const auto* b_ptr = static_cast<const uint8_t*>(b_t.data_ptr());
  auto* out_ptr = static_cast<uint8_t*>(out.data_ptr());
  const int64_t out_expert = m * n * out.element_size();
  ExpertStreams on(streams, kWgrad);
  int64_t issued = 0;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t o = offsets[g], p = rows[g];
    on.use(issued++);
    if (p == 0) {
      out.select(0, g).zero_();
      continue;
    }
    // (mat1 = a_t's slot [M, p] row-major, mat2 = b_t's slot transposed: cuBLAS's A = b_t's slot, B = a_t's)
    cublaslt::Gemm gemm{n, m, p, b_t.stride(0), a_t.stride(0), n, b_t.scalar_type(), a_t.scalar_type(), od,
                        at::blas::ScalingType::TensorWise, at::blas::ScalingType::TensorWise, false,
                        b_ptr + o, sb[g], a_ptr + o, sa[g], out_ptr + g * out_expert};
    if (!cublaslt::run(gemm)) {
      Tensor y = out.select(0, g);
      at::_scaled_mm_out(y, a_t.narrow(1, o, p), b_t.narrow(1, o, p).t(), scale_tensor(sa[g], a_t),
                         scale_tensor(sb[g], a_t), std::nullopt, std::nullopt, od, false);
    }
  }
  on.join();
  return out;
}

void impls(torch::Library& m) {
  m.impl("grouped_fp8_tensor_cublas_mm", &grouped_fp8_tensor_cublas_mm);
  m.impl("grouped_fp8_tensor_cublas_wgrad", &grouped_fp8_tensor_cublas_wgrad);
}

}  // namespace
}  // namespace ops
}  // namespace hybridq

HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
