// What the two C++ Linear autograd nodes share -- hybridq::fp8_linear (linear_fp8.cpp, per-tensor casts) and
// hybridq::fp8_block_linear (linear_fp8_block.cpp, block casts): the relation of their arguments (the x and weight
// parts handed over quantized), the non-tensor state forward leaves for backward, FSDP2's gathered weight kept by
// reference, and the output's shape. Each node keeps its casts, kernels and GEMMs; a cast type here is any struct with
// `dtype`, `eps` and `pow2` (float8_graph.Float8Cast's fields both nodes read in backward).
//
// Header-only and CUDA-free: tests/_block_linear_host.py builds linear_fp8_block.cpp for the CPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/bit_cast.h>
#include <torch/autograd.h>

#include <optional>
#include <utility>
#include <vector>

namespace hybridq {
namespace ops {
namespace linear_node {

inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// x @ weight^T must be defined: the first check of both ops
inline void check_shapes(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input of shape ", x.sizes(),
              " and weight of shape ", weight.sizes(), " do not make x @ weight^T");
}

// The parts handed over quantized (x: another layer's quantization of it; the weight: FSDP2's gathered one) against
// what the call needs: what the kernels' own checks do not see
inline void check_parts(const char* op, const at::Tensor& weight, const std::optional<at::Tensor>& x_row,
                        const std::optional<at::Tensor>& x_row_scale_inv, const std::optional<at::Tensor>& x_col,
                        const std::optional<at::Tensor>& x_col_scale_inv, const std::optional<at::Tensor>& w_row,
                        const std::optional<at::Tensor>& w_row_scale_inv, const std::optional<at::Tensor>& w_col,
                        const std::optional<at::Tensor>& w_col_scale_inv, at::ScalarType w_dtype, bool need_dgrad,
                        bool need_wgrad, bool save_original_input) {
  const bool row = given(x_row), col = given(x_col);
  TORCH_CHECK(!row || given(x_row_scale_inv), op, ": x_row given without x_row_scale_inv");
  TORCH_CHECK(!col || given(x_col_scale_inv), op, ": x_col given without x_col_scale_inv");
  TORCH_CHECK(!col || row, op, ": x_col given without x_row");
  TORCH_CHECK(!row || col || !need_wgrad || save_original_input, op,
              ": a quantized input needs its columnwise part (x_col) for wgrad");
  // the weight given quantized (FSDP2's gathered weight): checked on metadata only (w_col may have no storage yet)
  const bool w_r = given(w_row), w_c = given(w_col);
  TORCH_CHECK(!w_r || given(w_row_scale_inv), op, ": w_row given without w_row_scale_inv");
  TORCH_CHECK(!w_c || given(w_col_scale_inv), op, ": w_col given without w_col_scale_inv");
  TORCH_CHECK(!w_c || w_r, op, ": w_col given without w_row");
  TORCH_CHECK(!w_r || w_c || !need_dgrad, op, ": a quantized weight needs its columnwise part (w_col) for dgrad");
  // (TORCH_CHECK builds its message only on failure, where the part is given)
  TORCH_CHECK(!w_r || (w_row->sizes() == weight.sizes() && w_row->scalar_type() == w_dtype), op, ": w_row is ",
              w_row->sizes(), " ", w_row->scalar_type(), ", the weight's rowwise part must be ", weight.sizes(), " ",
              w_dtype);
  TORCH_CHECK(!w_c || (w_col->dim() == 2 && w_col->size(0) == weight.size(1) && w_col->size(1) == weight.size(0) &&
                       w_col->scalar_type() == w_dtype),
              op, ": w_col is ", w_col->sizes(), " ", w_col->scalar_type(), ", the weight's columnwise part must be [",
              weight.size(1), ", ", weight.size(0), "] ", w_dtype);
}

// The first check of both nodes' backward: under create_graph=True (grad mode on inside a backward) the gradients
// would come out of kernels and GEMMs on quantized operands with no graph of their own, so a second backward through
// them found nothing to differentiate and returned None / zeros silently. Refused before anything is unpacked, as the
// Python nodes refuse it ([Note: no double backward through quantized GEMMs], hybridq/nn/first_order.py).
inline void check_first_order(const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(!at::GradMode::is_enabled(), "hybridq: ", op,
                              " has no second derivative: its backward computes the gradients from quantized operands, "
                              "so it cannot run under create_graph=True (double backward, gradient penalties through "
                              "it); keep the layers whose second derivative you need out of the conversion "
                              "(module_filter_fn)");
}

// [Note: a Linear node's saved state]
// Backward needs a few flags, dtypes, two casts and x's shape besides its tensors. They go into ONE entry of
// ctx->saved_data holding ONE int list (each entry is a hash-map insert and each list an allocation, per call):
// the slots below, x's shape to the end. A node's own flags take the bits from kOwnBits up.
constexpr const char* kState = "state";
enum StateSlot : int64_t {
  kBits,         // need_dgrad | need_wgrad << 1 | save_original_input << 2 | has_bias << 3 | the node's own << 4..
  kWeightDtype,  // the weight's dtype (dW's)
  kBiasDtype,    // the bias's dtype (db's)
  kGradDtype,    // grad_output's fp8 dtype
  kInputDtype,   // the input's fp8 dtype
  kGradEps,      // grad_output's amax epsilon (a double's bits)
  kInputEps,     // the input's amax epsilon (a double's bits)
  kPow2,         // grad_output pow2 | input pow2 << 1
  kXShape,       // x's shape, to the end
};
constexpr int kOwnBits = 4;
// FSDP2's gathered weight: its columnwise data and scale_inv (by reference)
constexpr const char* kWeightCol = "w_col";
constexpr const char* kWeightColScaleInv = "w_col_scale_inv";

// The forward's part: the state, and the gathered weight's columnwise tensors by reference where dgrad reads them
// (outside save_for_backward: the backward unshard refills them in place; see linear_fp8.cpp's top)
template <class CastT>
void save_state(torch::autograd::AutogradContext* ctx, bool need_dgrad, bool need_wgrad, bool save_original_input,
                const std::optional<at::Tensor>& bias, at::ScalarType weight_dtype, const CastT& grad_output,
                const CastT& input, at::IntArrayRef x_shape, int64_t own_bits,
                const std::optional<at::Tensor>& w_col, const std::optional<at::Tensor>& w_col_scale_inv) {
  const bool has_bias = given(bias);
  std::vector<int64_t> state{int64_t(need_dgrad) | int64_t(need_wgrad) << 1 | int64_t(save_original_input) << 2 |
                                 int64_t(has_bias) << 3 | own_bits << kOwnBits,
                             int64_t(weight_dtype),
                             int64_t(has_bias ? bias->scalar_type() : at::kFloat),
                             int64_t(grad_output.dtype),
                             int64_t(input.dtype),
                             c10::bit_cast<int64_t>(grad_output.eps),
                             c10::bit_cast<int64_t>(input.eps),
                             int64_t(grad_output.pow2) | int64_t(input.pow2) << 1};
  state.insert(state.end(), x_shape.begin(), x_shape.end());
  ctx->saved_data[kState] = std::move(state);
  if (given(w_col) && need_dgrad) {  // (w_col is given exactly where the weight was: check_parts)
    ctx->saved_data[kWeightCol] = *w_col;
    ctx->saved_data[kWeightColScaleInv] = *w_col_scale_inv;
  }
}

struct CastState {  // a cast as save_state kept it
  at::ScalarType dtype;
  double eps;
  bool pow2;
};

struct State {  // save_state's state, read back in backward
  bool need_dgrad, need_wgrad, save_original_input, has_bias;
  int64_t own_bits;
  at::ScalarType weight_dtype, bias_dtype;
  CastState grad_output, input;
  std::vector<int64_t> x_shape;
};

inline State load_state(torch::autograd::AutogradContext* ctx) {
  const c10::List<int64_t> state = ctx->saved_data[kState].toIntList();
  const int64_t bits = state.get(kBits), pow2 = state.get(kPow2);
  State s{bool(bits & 1),
          bool(bits & 2),
          bool(bits & 4),
          bool(bits & 8),
          bits >> kOwnBits,
          at::ScalarType(state.get(kWeightDtype)),
          at::ScalarType(state.get(kBiasDtype)),
          {at::ScalarType(state.get(kGradDtype)), c10::bit_cast<double>(state.get(kGradEps)), bool(pow2 & 1)},
          {at::ScalarType(state.get(kInputDtype)), c10::bit_cast<double>(state.get(kInputEps)), bool(pow2 & 2)},
          {}};
  for (size_t i = kXShape; i < state.size(); ++i) s.x_shape.push_back(state.get(i));
  return s;
}

// The weight's columnwise part for dgrad: FSDP2's gathered one as the backward unshard left it, else the saved one
// (saved[2], saved[3] of save_for_backward)
inline std::pair<at::Tensor, at::Tensor> weight_col(torch::autograd::AutogradContext* ctx,
                                                    const torch::autograd::variable_list& saved) {
  const auto col = ctx->saved_data.find(kWeightCol);
  if (col == ctx->saved_data.end()) return {saved[2], saved[3]};
  return {col->second.toTensor(), ctx->saved_data.at(kWeightColScaleInv).toTensor()};
}

// What both gathered gradient phase ops (fp8_linear_grads, fp8_block_linear_grads) check of their arguments: a
// Linear's shapes, the parts dgrad and wgrad read given, the weight's columnwise part [in_features, out_features].
inline void check_grads_phase(const char* op, const at::Tensor& dy, const std::optional<at::Tensor>& x_saved,
                              const std::optional<at::Tensor>& x_col_scale_inv, const std::optional<at::Tensor>& w_col,
                              const std::optional<at::Tensor>& w_col_scale_inv, bool save_original_input,
                              bool need_dgrad, bool need_wgrad, at::IntArrayRef x_shape) {
  TORCH_CHECK(dy.dim() >= 1 && x_shape.size() >= 2, "hybridq::", op, ": grad_output of shape ", dy.sizes(),
              " and input shape ", x_shape, " are not a Linear's");
  TORCH_CHECK(!need_dgrad || (given(w_col) && given(w_col_scale_inv)), "hybridq::", op,
              ": dgrad needs the weight's columnwise part (w_col and w_col_scale_inv)");
  TORCH_CHECK(!need_wgrad || (given(x_saved) && (save_original_input || given(x_col_scale_inv))), "hybridq::", op,
              ": wgrad needs what the forward kept of x (x_saved, and x_col_scale_inv unless save_original_input)");
  TORCH_CHECK(!need_dgrad || (w_col->dim() == 2 && w_col->size(0) == x_shape.back() &&
                              w_col->size(1) == dy.size(-1)),
              "hybridq::", op, ": w_col of shape ", w_col.has_value() ? w_col->sizes() : at::IntArrayRef{},
              " is not the columnwise part [in_features, out_features] = [", x_shape.back(), ", ", dy.size(-1), "]");
}

// y [M, N] in x's shape with out_features last (a tensor of its own, not a view: see linear_function._output)
inline at::Tensor output_like(const at::Tensor& y, const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = y.size(1);
  return at::_unsafe_view(y, shape);
}

}  // namespace linear_node
}  // namespace ops
}  // namespace hybridq
