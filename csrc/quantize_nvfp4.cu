// NVFP4: the tile kernel with Nvfp4Policy for 1-D blocks (block-16 E4M3 scales and E2M1 codes, the 16-point RHT
// fused into the columnwise quantization, stochastic rounding from a Philox stream; the 16x16 tiles are compiled
// in quantize_nvfp4_2d.cu), the nvfp4_quantize op and its row-group variant nvfp4_quantize_grouped.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <mutex>

#include "binding_checks.h"
#include "tile/dequantize.cuh"
#include "tile/policy_nvfp4.cuh"

namespace hybridq {

cudaError_t launch_quantize_nvfp4_2d(InType t, const Nvfp4Args& a, cudaStream_t stream);  // quantize_nvfp4_2d.cu

cudaError_t launch_quantize_nvfp4(InType t, bool two_d, const Nvfp4Args& a, cudaStream_t stream) {
  if (two_d) return launch_quantize_nvfp4_2d(t, a, stream);
  if (a.sr) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Nvfp4Policy<false, true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Nvfp4Policy<false, false>>(a, stream)));
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

namespace {

// The Philox stream of `launches` consecutive quantize launches, each of which takes 4 offset steps (one for the
// rowwise draws, one for the columnwise ones, rounded up as torch rounds): one reservation of 4 * launches steps
// gives the first launch's offset, and launch j's is that plus 4 j -- what j + 1 separate reservations give.
PhiloxArgs philox_args(const std::optional<at::Generator>& generator, const Tensor& x, int64_t launches) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      generator, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
  at::PhiloxCudaState st;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    st = gen->philox_cuda_state(static_cast<uint64_t>(4 * launches));
  }
  PhiloxArgs p{};
  p.captured = st.captured_;
  if (st.captured_) {
    p.seed_ptr = st.seed_.ptr;
    p.offset_ptr = st.offset_.ptr;
    p.offset_intragraph = st.offset_intragraph_;
  } else {
    p.seed = st.seed_.val;
    p.offset = st.offset_.val;
  }
  return p;
}

void check_generator(bool stochastic_rounding, const std::optional<at::Generator>& generator, const char* op) {
  if (stochastic_rounding && generator.has_value() && generator->defined()) {
    TORCH_CHECK(generator->device().is_cuda(), "hybridq::", op,
                ": the stochastic-rounding generator must be a CUDA generator, got one on ", generator->device());
  }
}

}  // namespace

// ---- NVFP4 ------------------------------------------------------------------------------------------------
// returns (row data [M, K/2], row scale [M, K/16] e4m3, row amax [1], col data [K, M/2], col scale [K, M/16],
// col amax [1]); empty [0] tensors for a direction not asked for
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nvfp4_quantize(const Tensor& x, bool block_2d, bool rht,
                                                                          bool stochastic_rounding,
                                                                          const std::optional<at::Generator>& generator,
                                                                          bool rowwise, bool columnwise,
                                                                          const std::optional<Tensor>& amax,
                                                                          const std::optional<Tensor>& amax_col) {
  constexpr const char* op = "nvfp4_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(!(block_2d && rht), "hybridq::", op, ": NVFP4 rht applies to 1-D blocks, not to 16x16 tiles");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 16), "hybridq::", op, ": NVFP4 ",
              block_2d ? "16x16 tiles need" : "rowwise (1x16 blocks along K) needs",
              " K = x.size(1) divisible by 16, got x of shape ", x.sizes());
  TORCH_CHECK(!((columnwise || block_2d) && M % 16), "hybridq::", op, ": NVFP4 ",
              block_2d ? "16x16 tiles need" : "columnwise (16x1 blocks along M) needs",
              " M = x.size(0) divisible by 16, got x of shape ", x.sizes());
  check_generator(stochastic_rounding, generator, op);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto a = tile_args<Nvfp4Args>(x, rowwise, columnwise);
  auto u8o = x.options().dtype(at::kByte);
  auto e4 = x.options().dtype(at::kFloat8_e4m3fn);
  Tensor row = rowwise ? at::empty({M, K / 2}, u8o) : empty0(x, at::kByte);
  Tensor col = columnwise ? at::empty({K, M / 2}, u8o) : empty0(x, at::kByte);
  Tensor row_s = rowwise ? at::empty({M, K / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  Tensor col_s = columnwise ? at::empty({K, M / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  // global amaxes: given (a row shard of a larger tensor, FSDP: the all-reduced amaxes of the whole tensor; with
  // rht, amax_col is the amax after the transform), else computed here
  const bool given = amax.has_value() && amax->defined();
  if (given) {
    TORCH_CHECK(amax->numel() == 1, "hybridq::", op, ": amax must have one element, got shape ", amax->sizes());
    check_same_device(*amax, x, op, "amax");
  }
  const bool given_col = amax_col.has_value() && amax_col->defined();
  if (given_col) {
    TORCH_CHECK(given, "hybridq::", op, ": amax_col is only accepted together with amax");
    TORCH_CHECK(amax_col->numel() == 1, "hybridq::", op, ": amax_col must have one element, got shape ",
                amax_col->sizes());
    check_same_device(*amax_col, x, op, "amax_col");
  }
  TORCH_CHECK(!(given && !given_col && !block_2d && rht && columnwise), "hybridq::", op,
              ": a given amax with rht needs amax_col, the amax of the transformed columnwise input");
  Tensor amax_r, amax_c;
  if (given) {
    amax_r = amax->to(at::kFloat).reshape({1}).clone();
    amax_c = columnwise ? (given_col ? amax_col->to(at::kFloat).reshape({1}).clone() : amax_r.clone())
                        : empty0(x, at::kFloat);
  } else if (!block_2d && rht && columnwise) {
    amax_r = zeros_amax(x);
    amax_c = zeros_amax(x);
    C10_CUDA_CHECK(hybridq::launch_nvfp4_rht_amax(it, x.data_ptr(), M, K, amax_bits(amax_r), amax_bits(amax_c), stream));
  } else {
    amax_r = zeros_amax(x);
    C10_CUDA_CHECK(hybridq::launch_absmax(it, x.data_ptr(), M * K, amax_bits(amax_r), stream));
    amax_c = columnwise ? (rowwise ? amax_r.clone() : amax_r) : empty0(x, at::kFloat);
  }
  if (!rowwise) {
    if (block_2d) a.amax_row = amax_c.data_ptr<float>();  // the 2-D tiles use one amax for both directions
    amax_r = empty0(x, at::kFloat);
  } else {
    a.amax_row = amax_r.data_ptr<float>();
  }
  if (columnwise) a.amax_col = amax_c.data_ptr<float>();
  else amax_c = empty0(x, at::kFloat);
  a.rht = rht;
  a.sr = stochastic_rounding;
  if (stochastic_rounding) a.philox = philox_args(generator, x, 1);
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  C10_CUDA_CHECK(hybridq::launch_quantize_nvfp4(it, block_2d, a, stream));
  return {row, row_s, amax_r, col, col_s, amax_c};
}


// NVFP4 of row groups (the experts of a grouped linear): group g (the next sizes[g] rows of x) quantized exactly as
// nvfp4_quantize quantizes it alone -- its own global amax per direction -- in one amax launch for all groups and
// one quantize launch. Stochastic rounding: group g draws what its own launch would draw as the draw_rank[g]-th of
// n_draws consecutive launches (the groups with rows, in the caller's order). Every group with rows must satisfy
// the shape rule on its own (M % 16 == 0 columnwise or with tiles), so no block, tile or Hadamard group spans two.
// returns (row data [M, K/2], row scales [M, K/16], row amax [G], col data [K, M/2], col scales [K, M/16],
// col amax [G]); empty [0] tensors for a direction not asked for
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nvfp4_quantize_grouped(
    const Tensor& x, bool block_2d, bool rht, bool stochastic_rounding, const std::optional<at::Generator>& generator,
    bool rowwise, bool columnwise, at::IntArrayRef sizes, at::IntArrayRef draw_rank, int64_t n_draws) {
  constexpr const char* op = "nvfp4_quantize_grouped";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(!(block_2d && rht), "hybridq::", op, ": NVFP4 rht applies to 1-D blocks, not to 16x16 tiles");
  const int64_t M = x.size(0), K = x.size(1), G = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(G >= 1 && G <= (int64_t{1} << 30), "hybridq::", op, ": needs at least one row group, got ", G);
  TORCH_CHECK(static_cast<int64_t>(draw_rank.size()) == G, "hybridq::", op, ": draw_rank must have one entry per row "
              "group (", G, "), got ", draw_rank.size());
  TORCH_CHECK(!((rowwise || block_2d) && K % 16), "hybridq::", op, ": NVFP4 ",
              block_2d ? "16x16 tiles need" : "rowwise (1x16 blocks along K) needs",
              " K = x.size(1) divisible by 16, got x of shape ", x.sizes());
  const bool blocks_along_m = columnwise || block_2d;
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(sizes[g] >= 0, "hybridq::", op, ": row group ", g, " has ", sizes[g], " rows");
    TORCH_CHECK(!(blocks_along_m && sizes[g] % 16), "hybridq::", op, ": NVFP4 ",
                block_2d ? "16x16 tiles need" : "columnwise (16x1 blocks along M) needs",
                " every row group's rows divisible by 16, got ", sizes[g], " rows in group ", g);
    TORCH_CHECK(draw_rank[g] >= 0 && draw_rank[g] < std::max<int64_t>(n_draws, 1), "hybridq::", op, ": draw_rank[",
                g, "] = ", draw_rank[g], " is outside [0, ", n_draws, ")");
    total += sizes[g];
  }
  TORCH_CHECK(total == M, "hybridq::", op, ": the row groups hold ", total, " rows, x has ", M);
  check_generator(stochastic_rounding, generator, op);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto u8o = x.options().dtype(at::kByte);
  auto e4 = x.options().dtype(at::kFloat8_e4m3fn);
  Tensor row = rowwise ? at::empty({M, K / 2}, u8o) : empty0(x, at::kByte);
  Tensor col = columnwise ? at::empty({K, M / 2}, u8o) : empty0(x, at::kByte);
  Tensor row_s = rowwise ? at::empty({M, K / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  Tensor col_s = columnwise ? at::empty({K, M / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  // the group table on the device, one copy: group_start [G + 1] then draw_rank [G] (as int32 words after it)
  Tensor host = at::empty({G + 1 + (G + 1) / 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* hs = host.data_ptr<int64_t>();
  hs[0] = 0;
  for (int64_t g = 0; g < G; ++g) hs[g + 1] = hs[g] + sizes[g];
  int32_t* hr = reinterpret_cast<int32_t*>(hs + G + 1);
  for (int64_t g = 0; g < G; ++g) hr[g] = static_cast<int32_t>(draw_rank[g]);
  Tensor table = host.to(x.device(), /*non_blocking=*/true);
  const int64_t* group_start = table.data_ptr<int64_t>();
  const int32_t* ranks = reinterpret_cast<const int32_t*>(group_start + G + 1);
  Tensor row_group = at::empty({M}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(hybridq::launch_row_groups_from_starts(group_start, static_cast<int>(G), M,
                                                        row_group.data_ptr<int32_t>(), stream));
  // per-group global amaxes in one launch (with rht and columnwise: max|x| and max|RHT16(x^T)| together)
  auto f32 = x.options().dtype(at::kFloat);
  Tensor amax_r = zeros_on_stream({G}, f32), amax_c;
  if (!block_2d && rht && columnwise) {
    amax_c = zeros_on_stream({G}, f32);
    C10_CUDA_CHECK(hybridq::launch_grouped_nvfp4_rht_amax(it, x.data_ptr(), M, K, row_group.data_ptr<int32_t>(),
                                                          amax_bits(amax_r), amax_bits(amax_c), stream));
  } else {
    C10_CUDA_CHECK(hybridq::launch_grouped_absmax(it, x.data_ptr(), M, K, row_group.data_ptr<int32_t>(),
                                                  amax_bits(amax_r), stream));
    amax_c = columnwise ? (rowwise ? amax_r.clone() : amax_r) : empty0(x, at::kFloat);
  }
  auto a = tile_args<Nvfp4Args>(x, rowwise, columnwise);
  // 16x16 tiles read one global amax for both directions (amax_row), also when only the columnwise part is asked
  a.amax_row = (rowwise || block_2d) ? amax_r.data_ptr<float>() : nullptr;
  a.amax_col = columnwise ? amax_c.data_ptr<float>() : nullptr;
  a.rht = rht;
  a.sr = stochastic_rounding;
  if (stochastic_rounding && n_draws > 0) a.philox = philox_args(generator, x, n_draws);
  a.row_group = row_group.data_ptr<int32_t>();
  a.group_start = group_start;
  a.draw_rank = ranks;
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  if (M > 0 && K > 0) C10_CUDA_CHECK(hybridq::launch_quantize_nvfp4(it, block_2d, a, stream));
  // (amax_r stays alive until the launch above: the tiles read it without a rowwise part)
  return {row, row_s, rowwise ? amax_r : empty0(x, at::kFloat), col, col_s, amax_c};
}

// data [rows, cols/2] packed E2M1 with E4M3 scales [rows, cols/16] and the global amax [1] -> [rows, cols] of
// out_dtype: codes times scales, times amax / 2688 if apply_global (nvfp4_apply_global), then the inverse RHT of
// each block if rht_inverse
Tensor nvfp4_dequantize(const Tensor& data, const Tensor& scale, const Tensor& amax, bool rht_inverse,
                        bool apply_global, at::ScalarType out_dtype) {
  constexpr const char* op = "nvfp4_dequantize";
  check_input(data, op, "data");
  TORCH_CHECK(data.scalar_type() == at::kByte, "hybridq::", op, ": data must be uint8 (packed E2M1), got ",
              data.scalar_type());
  TORCH_CHECK(amax.is_cuda() && amax.scalar_type() == at::kFloat && amax.numel() == 1,
              "hybridq::", op, ": amax must be a CUDA float32 tensor of one element");
  check_same_device(amax, data, op, "amax");
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  TORCH_CHECK(cols % 16 == 0, "hybridq::", op, ": NVFP4 needs cols (2 * data.size(1)) divisible by 16, got data of "
              "shape ", data.sizes());
  TORCH_CHECK(scale.element_size() == 1, "hybridq::", op,
              ": scale must be E4M3 bytes (float8_e4m3fn or uint8), got ", scale.scalar_type());
  check_part_scale_layout(scale, data, op, "scale", rows * (cols / 16), "[rows, cols/16]");
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = dequant_out(data, cols, out_dtype, op);
  const Tensor amax_c = amax.contiguous();
  auto a = dequant_args<Nvfp4DequantArgs>(data, cols);
  a.scale = static_cast<const uint8_t*>(scale.data_ptr());
  a.amax = amax_c.data_ptr<float>();
  a.rht_inverse = rht_inverse;
  a.apply_global = apply_global;
  using P = Nvfp4Policy<false, false>;  // (one dequantize step for every block kind)
  C10_CUDA_CHECK(
      launch_dequantize<P>(a, out_dtype == at::kBFloat16, out.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

namespace {
void impls(torch::Library& m) {
  m.impl("nvfp4_quantize", &nvfp4_quantize);
  m.impl("nvfp4_quantize_grouped", &nvfp4_quantize_grouped);
  m.impl("nvfp4_dequantize", &nvfp4_dequantize);
}
}  // namespace

}  // namespace ops
}  // namespace hybridq

TORCH_LIBRARY_FRAGMENT(hybridq, m) {
  m.def(
      "nvfp4_quantize(Tensor x, bool block_2d, bool rht, bool stochastic_rounding, Generator? generator, "
      "bool rowwise, bool columnwise, Tensor? amax=None, Tensor? amax_col=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "nvfp4_quantize_grouped(Tensor x, bool block_2d, bool rht, bool stochastic_rounding, Generator? generator, "
      "bool rowwise, bool columnwise, int[] sizes, int[] draw_rank, int n_draws) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "nvfp4_dequantize(Tensor data, Tensor scale, Tensor amax, bool rht_inverse, bool apply_global, "
      "ScalarType out_dtype) -> Tensor");
}
HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
