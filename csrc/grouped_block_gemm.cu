// Grouped FP8 block-scaled GEMMs of GroupedLinear's packed path (hybridq/kernels/grouped_blocks.py) as one cuBLAS
// block-scaled GEMM per expert (torch's `_scaled_mm_v2` out variant: the GEMM `F.scaled_mm` runs with BlockWise1x128
// / BlockWise128x128 scales, which the per-expert path calls through native_gemm._block_run), issued from C++ in one
// op call per phase: no Python per expert. Every expert's operands are views of the packed slot buffers; only the
// scales move, in one pass per operand, into the layouts cuBLAS reads (it takes no leading dimension for them):
//   - 1x128 scales of an `[M, K]` operand: `[M, K/128]` with strides (1, M) ("outer-dim-major");
//   - 128x128 tile scales of the weight: `[round_up(K/128, 4), N/128]` with strides (1, round_up(K/128, 4)).
// fprop / dgrad (`grouped_block_cublas_mm`): expert g's GEMM reads rows [offsets[g], offsets[g] + rows[g]) of the
// token operand (its padded count, the per-expert path's M) and writes them at its first token's output row; the
// rows after its tokens land on the next expert's first rows, which that expert's GEMM (issued after it on the same
// stream) overwrites, and past the last expert in a tail that the result leaves out. `streams` 2 (expert_streams.h:
// the caller decides where that pays) runs the experts in two contiguous runs, the first on the current stream and the
// second on a side stream (split where half the rows are issued); a first-run expert whose padded rows would reach
// the second run's rows writes them into a scratch buffer instead, and its tokens' rows are copied out after it.
// wgrad (`grouped_block_cublas_wgrad`): expert g contracts the columnwise token operands over its slot.
// Each expert's GEMM runs through cublaslt_fp8.h (the same cuBLASLt call `_scaled_mm_v2_out` makes, its plan cached:
// the host cost per expert is the launch, not torch's argument checks, descriptors and heuristic query), from
// pointers into the operands -- no view tensors per expert; `_scaled_mm_v2_out` on the views where it declines.
#include <ATen/BlasBackend.h>
#include <ATen/ops/_scaled_mm_v2.h>

#include <vector>

#include "binding_checks.h"
#include "cublaslt_fp8.h"
#include "expert_streams.h"

namespace hybridq {
namespace {

constexpr int kThreads = 256;

// out[offsets[g] * kb + c * rows[g] + r] = in[(offsets[g] + r) * kb + c]: each slot's [rows, kb] scales stored
// transposed in place of its own rows (the slots tile the buffer, so the regions do not overlap)
__global__ void __launch_bounds__(kThreads) slot_scales_outer_major(const float* __restrict__ in,
                                                                    float* __restrict__ out,
                                                                    const int32_t* __restrict__ offsets,
                                                                    const int32_t* __restrict__ rows, int64_t kb) {
  const int g = blockIdx.y;
  const int64_t o = offsets[g], m = rows[g], n = m * kb;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / kb, c = i - r * kb;
    out[o * kb + c * m + r] = in[(o + r) * kb + c];
  }
}

}  // namespace
}  // namespace hybridq

namespace hybridq {
namespace ops {
namespace {

constexpr const char* kMm = "grouped_block_cublas_mm";
constexpr const char* kWgrad = "grouped_block_cublas_wgrad";

int64_t recipe(at::blas::ScalingType t) { return static_cast<int64_t>(t); }

void check_scales(const Tensor& s, const Tensor& like, const char* op, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(s.defined() && s.is_cuda(), "hybridq::", op, ": ", name, " must be a CUDA tensor");
  check_same_device(s, like, op, name);
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.sizes() == shape, "hybridq::", op, ": ", name,
              " must be contiguous float32 of shape ", shape, ", got ", s.scalar_type(), " ", s.sizes());
}

void scaled_mm_into(Tensor& out, const Tensor& a, const Tensor& b, const Tensor& sa, int64_t ra, const Tensor& sb,
                    int64_t rb) {
  at::_scaled_mm_v2_out(out, a, b, {sa}, {ra}, {}, {sb}, {rb}, {}, std::nullopt, out.scalar_type());
}

// Host counts of `e` experts, checked against the slot buffer of `s` rows (`block`: what offsets and rows must be
// multiples of)
void check_counts(at::IntArrayRef offsets, at::IntArrayRef rows, int64_t e, int64_t s, int64_t block,
                  const char* op) {
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == e && static_cast<int64_t>(rows.size()) == e, "hybridq::", op,
              ": offsets and rows need one entry per expert (", e, "), got ", offsets.size(), " and ", rows.size());
  for (int64_t g = 0; g < e; ++g) {
    TORCH_CHECK(offsets[g] >= 0 && rows[g] >= 0 && offsets[g] + rows[g] <= s && offsets[g] % block == 0 &&
                    rows[g] % block == 0,
                "hybridq::", op, ": expert ", g, "'s slot [", offsets[g], ", ", offsets[g] + rows[g],
                ") must lie in the ", s, " packed rows, start and size multiples of ", block);
  }
}

// fprop / dgrad of every expert: a [S, K] (token slots, 1x128 blocks, scales a_scale [S, K/128] row-major), b the
// packed weight with the experts along dim `b_dim` (expert g's [N, K] operand: b.narrow(b_dim, g * b.size(b_dim) / E,
// ...), the GEMM reads its transpose), b_scale [E, R, C] with expert g's cuBLAS scale operand b_scale[g].t() (tiles:
// [N/128, round_up(K/128, 4)] per expert; 1x128 rows: [K/128, N]); `slot_offsets` / `slot_rows`: the same offsets and
// rows as int32 device tensors (the scales' relayout reads them); `streams` 1 or 2 (the header). -> [sum(tokens), N]
// in token order.
Tensor grouped_block_cublas_mm(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale,
                               bool b_tiles, int64_t b_dim, at::IntArrayRef offsets, at::IntArrayRef rows,
                               at::IntArrayRef tokens, const Tensor& slot_offsets, const Tensor& slot_rows,
                               at::ScalarType out_dtype, int64_t streams) {
  check_block_gemm_operand(a, a, kMm, "a");
  check_block_gemm_operand(b, a, kMm, "b");
  const int64_t s = a.size(0), k = a.size(1), e = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(k % 128 == 0, "hybridq::", kMm, ": the contracted dim K (", k, ") must be a multiple of 128");
  const int64_t kb = k / 128;
  check_scales(a_scale, a, kMm, "a_scale", {s, kb});
  TORCH_CHECK(b_dim == 0 || b_dim == 1, "hybridq::", kMm, ": b_dim must be 0 or 1, got ", b_dim);
  TORCH_CHECK(e > 0 && b.size(b_dim) % e == 0, "hybridq::", kMm, ": b's dim ", b_dim, " (", b.size(b_dim),
              ") must hold ", e, " experts");
  const int64_t per = b.size(b_dim) / e, n = b_dim == 0 ? per : b.size(0), bk = b_dim == 0 ? b.size(1) : per;
  TORCH_CHECK(bk == k, "hybridq::", kMm, ": each expert of b contracts ", bk, " elements, a has K = ", k);
  TORCH_CHECK(n % 16 == 0, "hybridq::", kMm, ": the output width N (", n, ") must be a multiple of 16");
  if (b_tiles) {
    TORCH_CHECK(n % 128 == 0, "hybridq::", kMm, ": 128x128 tiles need N (", n, ") a multiple of 128");
    check_scales(b_scale, a, kMm, "b_scale", {e, n / 128, round_up(kb, 4)});
  } else {
    check_scales(b_scale, a, kMm, "b_scale", {e, kb, n});
  }
  check_counts(offsets, rows, e, s, 16, kMm);
  TORCH_CHECK(streams == 1 || streams == 2, "hybridq::", kMm, ": streams must be 1 or 2, got ", streams);
  for (const auto* t : {&slot_offsets, &slot_rows}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == e, "hybridq::",
                kMm, ": slot_offsets / slot_rows must be contiguous int32 CUDA tensors of ", e, " elements");
  }
  int64_t total = 0, tail = 0, max_rows = 0;
  for (int64_t g = 0; g < e; ++g) {
    TORCH_CHECK(tokens[g] >= 0 && tokens[g] <= rows[g] && (tokens[g] > 0 || rows[g] == 0), "hybridq::", kMm,
                ": expert ", g, " has ", tokens[g], " tokens in ", rows[g], " rows (need 0 < tokens <= rows, or none)");
    total += tokens[g];
    tail = std::max(tail, rows[g] - tokens[g]);
    max_rows = std::max(max_rows, rows[g]);
  }
  const at::ScalarType od = block_gemm_dtype(out_dtype, kMm);
  const c10::cuda::CUDAGuard guard(a.device());
  Tensor out = at::empty({total + tail, n}, a.options().dtype(od));
  if (total > 0) {
    Tensor sa = at::empty({s * kb}, a_scale.options());
    const int64_t chunks = std::min<int64_t>((max_rows * kb + kThreads - 1) / kThreads, 1024);
    slot_scales_outer_major<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(e)), kThreads, 0,
                              c10::cuda::getCurrentCUDAStream()>>>(a_scale.data_ptr<float>(), sa.data_ptr<float>(),
                                                                   slot_offsets.data_ptr<int32_t>(),
                                                                   slot_rows.data_ptr<int32_t>(), kb);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::blas::ScalingType b_scaling =
        b_tiles ? at::blas::ScalingType::BlockWise128x128 : at::blas::ScalingType::BlockWise1x128;
    const int64_t ra = recipe(at::blas::ScalingType::BlockWise1x128), rb = recipe(b_scaling);
    // (expert g's weight: b's bytes from g * per * b.stride(b_dim), rows b.stride(0) apart)
    const auto* a_ptr = static_cast<const uint8_t*>(a.data_ptr());
    const auto* b_ptr = static_cast<const uint8_t*>(b.data_ptr());
    const float* sa_ptr = sa.data_ptr<float>();
    const float* bs_ptr = b_scale.data_ptr<float>();
    const int64_t out_row = n * out.element_size();
    // the second run's first expert (e: one run) and its first output row
    int64_t second = e, second_row = total;
    if (streams == 2) {
      int64_t issued = 0, row = 0, used = 0, rows_total = 0;
      for (int64_t g = 0; g < e; ++g) rows_total += tokens[g] > 0 ? rows[g] : 0;
      for (int64_t g = 0; g < e && second == e; ++g) {
        if (tokens[g] == 0) continue;
        if (used > 0 && 2 * issued >= rows_total) second = g, second_row = row;
        issued += rows[g], row += tokens[g], ++used;
      }
    }
    Tensor scratch;  // (a first-run expert's rows where they would reach the second run's)
    int64_t first = 0;
    ExpertStreams on(second < e ? 2 : 1, kMm);
    for (int64_t g = 0; g < e; ++g) {
      if (tokens[g] == 0) continue;
      on.use(g >= second ? 1 : 0);
      const int64_t o = offsets[g], m = rows[g];
      const bool aside = g < second && first + m > second_row;
      if (aside && (!scratch.defined() || scratch.size(0) < m)) scratch = at::empty({m, n}, out.options());
      const Tensor& dst = aside ? scratch : out;
      const int64_t dst_row = aside ? 0 : first;
      if (!cublaslt::run_block_scaled(static_cast<uint8_t*>(dst.data_ptr()) + dst_row * out_row, n, od, a_ptr + o * k,
                                      k, sa_ptr + o * kb, b_ptr + g * per * b.stride(b_dim), b.stride(0),
                                      bs_ptr + g * b_scale.stride(0), b_scaling, m, n, k)) {
        Tensor y = dst.narrow(0, dst_row, m);
        scaled_mm_into(y, a.narrow(0, o, m), b.narrow(b_dim, g * per, per).t(),
                       sa.narrow(0, o * kb, m * kb).view({kb, m}).t(), ra, b_scale.select(0, g).t(), rb);
      }
      if (aside) out.narrow(0, first, tokens[g]).copy_(scratch.narrow(0, 0, tokens[g]));
      first += tokens[g];
    }
    on.join();
  }
  Tensor result = out.narrow(0, 0, total);
  return od == out_dtype ? result : result.to(out_dtype);
}

// wgrad of every expert: a_t [M, S], b_t [N, S] (columnwise token parts, 1x128 blocks along the slots, scales
// [M, S/128], [N, S/128] row-major), each expert contracted over its slot [offsets[g], offsets[g] + rows[g]) (128
// multiples) -> [E, M, N]; an expert without rows gets zeros.
Tensor grouped_block_cublas_wgrad(const Tensor& a_t, const Tensor& a_scale, const Tensor& b_t, const Tensor& b_scale,
                                  at::IntArrayRef offsets, at::IntArrayRef rows, at::ScalarType out_dtype,
                                  int64_t streams) {
  check_block_gemm_operand(a_t, a_t, kWgrad, "a_t");
  check_block_gemm_operand(b_t, a_t, kWgrad, "b_t");
  const int64_t m = a_t.size(0), n = b_t.size(0), s = a_t.size(1), e = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(b_t.size(1) == s, "hybridq::", kWgrad, ": a_t and b_t must hold the same ", s, " slot rows, b_t has ",
              b_t.size(1));
  TORCH_CHECK(s % 128 == 0 && m % 16 == 0 && n % 16 == 0, "hybridq::", kWgrad, ": need slot rows (", s,
              ") a multiple of 128 and M (", m, "), N (", n, ") multiples of 16");
  check_scales(a_scale, a_t, kWgrad, "a_scale", {m, s / 128});
  check_scales(b_scale, a_t, kWgrad, "b_scale", {n, s / 128});
  check_counts(offsets, rows, e, s, 128, kWgrad);
  const at::ScalarType od = block_gemm_dtype(out_dtype, kWgrad);
  const c10::cuda::CUDAGuard guard(a_t.device());
  Tensor out = at::empty({e, m, n}, a_t.options().dtype(od));
  // [S/128, M]: an expert's block rows are then a contiguous [rows/128, M] whose transpose is cuBLAS's layout
  const Tensor sa = a_scale.t().contiguous(), sb = b_scale.t().contiguous();
  const int64_t r1 = recipe(at::blas::ScalingType::BlockWise1x128);
  auto* out_ptr = static_cast<uint8_t*>(out.data_ptr());
  const auto* a_ptr = static_cast<const uint8_t*>(a_t.data_ptr());
  const auto* b_ptr = static_cast<const uint8_t*>(b_t.data_ptr());
  const float* sa_ptr = sa.data_ptr<float>();
  const float* sb_ptr = sb.data_ptr<float>();
  const int64_t out_expert = m * n * out.element_size();
  ExpertStreams on(streams, kWgrad);
  for (int64_t g = 0; g < e; ++g) {
    on.use(g);
    if (rows[g] == 0) {
      out.select(0, g).zero_();
      continue;
    }
    const int64_t o = offsets[g], p = rows[g];
    if (!cublaslt::run_block_scaled(out_ptr + g * out_expert, n, od, a_ptr + o, s, sa_ptr + o / 128 * m, b_ptr + o,
                                    s, sb_ptr + o / 128 * n, at::blas::ScalingType::BlockWise1x128, m, n, p)) {
      Tensor y = out.select(0, g);
      scaled_mm_into(y, a_t.narrow(1, o, p), b_t.narrow(1, o, p).t(), sa.narrow(0, o / 128, p / 128).t(), r1,
                     sb.narrow(0, o / 128, p / 128).t(), r1);
    }
  }
  on.join();
  return od == out_dtype ? out : out.to(out_dtype);
}

void impls(torch::Library& m) {
  m.impl("grouped_block_cublas_mm", &grouped_block_cublas_mm);
  m.impl("grouped_block_cublas_wgrad", &grouped_block_cublas_wgrad);
}

}  // namespace
}  // namespace ops
}  // namespace hybridq

HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
