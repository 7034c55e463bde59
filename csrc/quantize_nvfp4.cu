// NVFP4: the tile kernel with Nvfp4Policy for 1-D blocks (block-16 E4M3 scales and E2M1 codes, the 16-point RHT
// fused into the columnwise quantization, stochastic rounding from a Philox stream; the 16x16 tiles are compiled
// in quantize_nvfp4_2d.cu) and the nvfp4_quantize op.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <mutex>

#include "binding_checks.h"
#include "ops.h"
#include "tile/policy_nvfp4.cuh"

namespace hybridq {

cudaError_t launch_quantize_nvfp4_2d(InType t, const QuantArgs& a, cudaStream_t stream);  // quantize_nvfp4_2d.cu

cudaError_t launch_quantize_nvfp4(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream) {
  if (two_d) return launch_quantize_nvfp4_2d(t, a, stream);
  if (a.sr) {
    HQ_DISPATCH_IN(t, return (launch_tile<T, Nvfp4Policy<false, true>>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Nvfp4Policy<false, false>>(a, stream)));
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

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
  if (stochastic_rounding && generator.has_value() && generator->defined()) {
    TORCH_CHECK(generator->device().is_cuda(), "hybridq::", op,
                ": the stochastic-rounding generator must be a CUDA generator, got one on ", generator->device());
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto a = base_args(x, rowwise, columnwise);
  a.fp8_max = 448.0f;
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
  if (stochastic_rounding) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        generator, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
    at::PhiloxCudaState st;
    {
      std::lock_guard<std::mutex> lock(gen->mutex_);
      st = gen->philox_cuda_state(4);
    }
    a.philox.captured = st.captured_;
    if (st.captured_) {
      a.philox.seed_ptr = st.seed_.ptr;
      a.philox.offset_ptr = st.offset_.ptr;
      a.philox.offset_intragraph = st.offset_intragraph_;
    } else {
      a.philox.seed = st.seed_.val;
      a.philox.offset = st.offset_.val;
    }
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  C10_CUDA_CHECK(hybridq::launch_quantize_nvfp4(it, block_2d, a, stream));
  return {row, row_s, amax_r, col, col_s, amax_c};
}

}  // namespace ops
}  // namespace hybridq
