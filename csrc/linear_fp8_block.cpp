// hybridq::fp8_block_linear: one eager FP8 block-scaled Linear call (fp8_block: 1x128 blocks of the input and the
// output gradient, 128x128 tiles or 1x128 blocks of the weight, current scaling) as ONE op whose autograd node is
// C++, as hybridq::fp8_linear (csrc/linear_fp8.cpp) is for per-tensor scaling (issue 33: the host cost of a Linear
// step). The Python node it replaces (nn/float8_graph.py `_Float8GraphLinear`) paid an autograd.Function's Python
// forward and backward, three quantize ops and three GEMMs each through hybridq's GEMM dispatch (its parts, the
// candidates, their checks) from Python, ~0.7 ms of host per forward + backward on an H200; here Python issues one op
// per forward and none in backward.
//
// The computation is `_Float8GraphLinear` step by step: the same `hybridq::fp8_block_quantize` calls (the op
// itself, through the dispatcher) with the same arguments, the same `hybridq::fp8_block_mm` GEMMs (what
// native_gemm._block_run runs: Python selects this op only where its dispatch would run that GEMM for all three,
// `float8_graph._block_gemms_native`), the same bias add, reductions, casts and saved tensors (save_for_backward:
// saved-tensor hooks see them as they see the Python node's). The results are bitwise that node's.
//
// FSDP2's gathered weight (w_row..w_col_scale_inv given), as hybridq::fp8_linear takes it (see linear_fp8.cpp): fprop
// reads its rowwise data and tile / block scales, and the node keeps its columnwise tensors for dgrad by reference,
// outside save_for_backward -- the unsharded weight's own tensors, which FSDP2's backward unshard refills in place.
//
// hybridq::fp8_block_linear_fprop / fp8_block_linear_grads: the same forward and gradients as two ops without an
// autograd node, for the compiled Linear's gathered ops (nn/compiled_linear.py; their graph saves the tensors):
// float8_graph's `_fprop` / `_grads` as one op call each (see the bottom of this file).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "linear_node.h"

namespace hybridq {
namespace ops {
namespace {

using at::Tensor;
using linear_node::given;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BlockCast {  // float8_graph.Float8Cast of a block cast
  at::ScalarType dtype;
  int64_t block_dim;  // 1: 1x128 blocks, 2: 128x128 tiles
  double eps;
  bool pow2;
};

struct BlockSpec {  // what a call depends on besides its tensors
  BlockCast input, weight, grad_output;
  bool need_dgrad, need_wgrad, save_original_input;
};

struct BlockParts {  // float8_graph._quantize's (rowwise, scale_inv, columnwise, scale_inv); [0] where not asked for
  Tensor row, row_scale_inv, col, col_scale_inv;
};

// (the op's whole schema, its optional row map included: a typed handle of another signature fails at its first call)
using QuantizeSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, at::ScalarType, int64_t, double, bool,
                                                               bool, bool, const std::optional<Tensor>&);
using MmSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, at::ScalarType);

// float8_graph._quantize of a block cast on CUDA: hybridq::fp8_block_quantize(x2d.contiguous(), ...)
BlockParts quantize(const Tensor& x2d, const BlockCast& c, bool rowwise, bool columnwise) {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("hybridq::fp8_block_quantize", "")
                              .typed<QuantizeSig>();
  auto [row, rs, col, cs] =
      op.call(x2d.contiguous(), c.dtype, c.block_dim, c.eps, c.pow2, rowwise, columnwise, std::nullopt);
  return {row, rs, col, cs};
}

// native_gemm._block_run's GEMM: a [M, K] (1x128 blocks) @ b [N, K]^T (b_tiles: 128x128 tiles, else 1x128 blocks)
Tensor mm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b, const Tensor& b_scale_inv, bool b_tiles,
          at::ScalarType out) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("hybridq::fp8_block_mm", "").typed<MmSig>();
  return op.call(a, a_scale_inv, b, b_scale_inv, b_tiles, out);
}

// What the node's forward and backward share with the gathered phase ops (bottom of this file): float8_graph._fprop's
// GEMM and bias add -- y [M, N] from x's and the weight's rowwise parts
Tensor fprop_mm(const Tensor& xr, const Tensor& xrs, const Tensor& wr, const Tensor& wrs, bool tiles,
                const std::optional<Tensor>& bias, at::ScalarType out) {
  Tensor y = mm(xr, xrs, wr, wrs, tiles, out);
  if (given(bias)) y = y + bias->to(out);
  return y;
}

// float8_graph._grads: (dx in x_shape, dW, db), each undefined where not needed, from what the forward kept of x
// (x_saved: its columnwise data with scale_inv xcs, or its [M, K] view under save_original_input) and the weight's
// columnwise part wc, wcs (128x128 tiles: `tiles`)
std::tuple<Tensor, Tensor, Tensor> linear_grads(const Tensor& dy, const Tensor& x_saved, const Tensor& xcs,
                                                const Tensor& wc, const Tensor& wcs, bool tiles,
                                                const BlockCast& g_cast, const BlockCast& x_cast,
                                                bool save_original_input, bool need_dgrad, bool need_wgrad,
                                                bool need_bgrad, at::IntArrayRef x_shape, at::ScalarType w_dtype,
                                                at::ScalarType b_dtype) {
  const Tensor dy2d = dy.reshape({-1, dy.size(-1)}).contiguous();
  Tensor dx, dw, db;
  if (need_dgrad || need_wgrad) {
    const BlockParts g = quantize(dy2d, g_cast, need_dgrad, need_wgrad);
    if (need_dgrad) dx = mm(g.row, g.row_scale_inv, wc, wcs, tiles, dy.scalar_type()).reshape(x_shape);
    if (need_wgrad) {
      Tensor xc = x_saved, xs = xcs;
      if (save_original_input) {
        BlockParts q = quantize(x_saved, x_cast, false, true);
        xc = q.col;
        xs = q.col_scale_inv;
      }
      dw = mm(g.col, g.col_scale_inv, xc, xs, false, dy.scalar_type()).to(w_dtype);
    }
  }
  if (need_bgrad) db = dy2d.sum(0).to(b_dtype);
  return {dx, dw, db};
}

}  // namespace

// (outside the anonymous namespace: the node's name, `y.grad_fn.name()`, is torch::autograd::CppNode<hybridq::ops::
// Fp8BlockLinear>)
struct Fp8BlockLinear : public torch::autograd::Function<Fp8BlockLinear> {
  // x_row..x_col_scale_inv: x already quantized (another layer's quantization of the same tensor, or a norm's
  // rowwise part), as float8_graph._quantize returns it; x_col given where wgrad reads it
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const std::optional<Tensor>& x_row,
                        const std::optional<Tensor>& x_row_scale_inv, const std::optional<Tensor>& x_col,
                        const std::optional<Tensor>& x_col_scale_inv, const std::optional<Tensor>& w_row,
                        const std::optional<Tensor>& w_row_scale_inv, const std::optional<Tensor>& w_col,
                        const std::optional<Tensor>& w_col_scale_inv, const BlockSpec& s) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // (the inner ops record nothing: skip their autograd keys)
    const Tensor x2d = x.reshape({-1, x.size(-1)});
    const bool keep_x = s.need_wgrad && s.save_original_input;  // wgrad quantizes the original input in backward
    // the weight first, then x (_Float8GraphLinear.forward's order); a gathered weight's columnwise part is not read
    // here (FSDP2 may refill it only at the backward unshard)
    const bool gathered = given(w_row);
    const BlockParts w = gathered ? BlockParts{*w_row, *w_row_scale_inv, Tensor(), Tensor()}
                                  : quantize(weight, s.weight, true, s.need_dgrad);
    Tensor xr, xrs, xc, xcs;
    if (given(x_row)) {
      xr = *x_row;
      xrs = *x_row_scale_inv;
      if (given(x_col)) {
        xc = *x_col;
        xcs = *x_col_scale_inv;
      }
    } else {
      const bool columnwise = s.need_wgrad && !keep_x;
      BlockParts q = quantize(x2d, s.input, true, columnwise);
      xr = q.row;
      xrs = q.row_scale_inv;
      if (columnwise) {
        xc = q.col;
        xcs = q.col_scale_inv;
      }
    }
    const Tensor y = fprop_mm(xr, xrs, w.row, w.row_scale_inv, s.weight.block_dim == 2, bias, x.scalar_type());
    if (ctx != nullptr) {
      ctx->save_for_backward({keep_x ? x2d : xc, keep_x ? Tensor() : xcs, s.need_dgrad ? w.col : Tensor(),
                              s.need_dgrad ? w.col_scale_inv : Tensor()});
      // (the node's own bit: the weight's 128x128 tiles; a gathered weight's columnwise part by reference, read in
      // backward: see the top of this file)
      linear_node::save_state(ctx, s.need_dgrad, s.need_wgrad, s.save_original_input, bias, weight.scalar_type(),
                              s.grad_output, s.input, x.sizes(), int64_t(s.weight.block_dim == 2), w_col,
                              w_col_scale_inv);
    }
    return linear_node::output_like(y, x);
  }

  // float8_graph._grads
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    linear_node::check_first_order("hybridq::fp8_block_linear (an FP8 block Linear)");
    // (unpacked before the guard: an unpack hook may run Python, e.g. a checkpoint's recompute)
    const variable_list saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const linear_node::State s = linear_node::load_state(ctx);
    const bool tiles = s.own_bits & 1;  // the weight's 128x128 tiles
    const BlockCast g_cast{s.grad_output.dtype, 1, s.grad_output.eps, s.grad_output.pow2};
    const BlockCast x_cast{s.input.dtype, 1, s.input.eps, s.input.pow2};
    Tensor wc, wcs;  // (a gathered weight's as the backward unshard left them)
    if (s.need_dgrad) std::tie(wc, wcs) = linear_node::weight_col(ctx, saved);
    auto [dx, dw, db] = linear_grads(grads[0], saved[0], saved[1], wc, wcs, tiles, g_cast, x_cast,
                                     s.save_original_input, s.need_dgrad, s.need_wgrad,
                                     s.has_bias && ctx->needs_input_grad(2), s.x_shape, s.weight_dtype, s.bias_dtype);
    return {dx, dw, db, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

namespace {

BlockSpec spec_of(at::ScalarType x_dtype, double x_eps, bool x_pow2, at::ScalarType w_dtype, int64_t w_block_dim,
                  double w_eps, bool w_pow2, at::ScalarType g_dtype, double g_eps, bool g_pow2, bool need_dgrad,
                  bool need_wgrad, bool save_original_input) {
  return {{x_dtype, 1, x_eps, x_pow2}, {w_dtype, w_block_dim, w_eps, w_pow2}, {g_dtype, 1, g_eps, g_pow2},
          need_dgrad, need_wgrad, save_original_input};
}

// What the kernels' own checks do not see: the operands' relation (the quantize and GEMM ops check each tensor)
void check_args(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& x_row,
                const std::optional<Tensor>& x_row_scale_inv, const std::optional<Tensor>& x_col,
                const std::optional<Tensor>& x_col_scale_inv, const std::optional<Tensor>& w_row,
                const std::optional<Tensor>& w_row_scale_inv, const std::optional<Tensor>& w_col,
                const std::optional<Tensor>& w_col_scale_inv, at::ScalarType w_dtype, int64_t w_block_dim,
                bool need_dgrad, bool need_wgrad, bool save_original_input) {
  constexpr const char* op = "hybridq::fp8_block_linear";
  linear_node::check_shapes(op, x, weight);
  TORCH_CHECK(w_block_dim == 1 || w_block_dim == 2, op,
              ": w_block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got ", w_block_dim);
  linear_node::check_parts(op, weight, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row, w_row_scale_inv, w_col,
                           w_col_scale_inv, w_dtype, need_dgrad, need_wgrad, save_original_input);
}

// The Autograd-key kernel: the C++ node records the backward
Tensor fp8_block_linear_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                 const std::optional<Tensor>& x_row, const std::optional<Tensor>& x_row_scale_inv,
                                 const std::optional<Tensor>& x_col, const std::optional<Tensor>& x_col_scale_inv,
                                 at::ScalarType x_dtype, double x_eps, bool x_pow2, at::ScalarType w_dtype,
                                 int64_t w_block_dim, double w_eps, bool w_pow2, at::ScalarType g_dtype, double g_eps,
                                 bool g_pow2, bool need_dgrad, bool need_wgrad, bool save_original_input,
                                 const std::optional<Tensor>& w_row, const std::optional<Tensor>& w_row_scale_inv,
                                 const std::optional<Tensor>& w_col, const std::optional<Tensor>& w_col_scale_inv) {
  check_args(x, weight, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row, w_row_scale_inv, w_col,
             w_col_scale_inv, w_dtype, w_block_dim, need_dgrad, need_wgrad, save_original_input);
  return Fp8BlockLinear::apply(x, weight, bias, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row,
                               w_row_scale_inv, w_col, w_col_scale_inv,
                               spec_of(x_dtype, x_eps, x_pow2, w_dtype, w_block_dim, w_eps, w_pow2, g_dtype, g_eps,
                                       g_pow2, need_dgrad, need_wgrad, save_original_input));
}

// The backend kernel (reached without autograd, e.g. under inference_mode): the forward alone
Tensor fp8_block_linear_forward(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                const std::optional<Tensor>& x_row, const std::optional<Tensor>& x_row_scale_inv,
                                const std::optional<Tensor>& x_col, const std::optional<Tensor>& x_col_scale_inv,
                                at::ScalarType x_dtype, double x_eps, bool x_pow2, at::ScalarType w_dtype,
                                int64_t w_block_dim, double w_eps, bool w_pow2, at::ScalarType g_dtype, double g_eps,
                                bool g_pow2, bool need_dgrad, bool need_wgrad, bool save_original_input,
                                const std::optional<Tensor>& w_row, const std::optional<Tensor>& w_row_scale_inv,
                                const std::optional<Tensor>& w_col, const std::optional<Tensor>& w_col_scale_inv) {
  check_args(x, weight, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row, w_row_scale_inv, w_col,
             w_col_scale_inv, w_dtype, w_block_dim, need_dgrad, need_wgrad, save_original_input);
  return Fp8BlockLinear::forward(nullptr, x, weight, bias, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row,
                                 w_row_scale_inv, w_col, w_col_scale_inv,
                                 spec_of(x_dtype, x_eps, x_pow2, w_dtype, w_block_dim, w_eps, w_pow2, g_dtype, g_eps,
                                         g_pow2, need_dgrad, need_wgrad, save_original_input));
}

// ---- the compiled Linear's gathered fast path: one op per phase, no autograd node ----------------------------
// nn/compiled_linear.py's gathered ops (plain ops of a compiled graph: AOTAutograd split forward and backward, and the
// graph saves the tensors) run float8_graph's `_fprop` / `_grads` on FSDP2's gathered block weight at every step;
// these are those two functions as single ops -- the node's forward and backward bodies above, minus the node -- so a
// phase costs one op call from Python instead of the casts and each GEMM through hybridq's GEMM dispatch. Python calls
// them only where that dispatch would run every GEMM of the call as hybridq::fp8_block_mm (float8_graph's
// `_block_phase_op`, as for the node): bitwise the Python functions.

void check_block_dim(const char* op, int64_t w_block_dim) {
  TORCH_CHECK(w_block_dim == 1 || w_block_dim == 2, "hybridq::", op,
              ": w_block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got ", w_block_dim);
}

// float8_graph._fprop on the weight's rowwise part (x quantized here) -> (y in x's shape with out_features last,
// x's columnwise data [K, M] | [0], its scale_inv [K, ceil(M/128)] | [0]): the columnwise part only where wgrad reads
// it (need_wgrad, not save_original_input: then wgrad quantizes x itself, which the caller keeps)
std::tuple<Tensor, Tensor, Tensor> fp8_block_linear_fprop(const Tensor& x, const Tensor& w_row,
                                                          const Tensor& w_row_scale_inv,
                                                          const std::optional<Tensor>& bias, at::ScalarType x_dtype,
                                                          double x_eps, bool x_pow2, int64_t w_block_dim,
                                                          bool need_wgrad, bool save_original_input) {
  constexpr const char* op = "fp8_block_linear_fprop";
  TORCH_CHECK(x.dim() >= 2 && w_row.dim() == 2 && x.size(-1) == w_row.size(1), "hybridq::", op, ": input of shape ",
              x.sizes(), " and weight rowwise part of shape ", w_row.sizes(), " do not make x @ weight^T");
  TORCH_CHECK(!given(bias) || (bias->dim() == 1 && bias->size(0) == w_row.size(0)), "hybridq::", op,
              ": bias of shape ", bias.has_value() ? bias->sizes() : at::IntArrayRef{}, " does not match ",
              w_row.size(0), " output features");
  check_block_dim(op, w_block_dim);
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // (the inner ops record nothing: skip their autograd keys)
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  const bool columnwise = need_wgrad && !save_original_input;
  const BlockParts q = quantize(x2d, BlockCast{x_dtype, 1, x_eps, x_pow2}, true, columnwise);
  const Tensor y = linear_node::output_like(
      fprop_mm(q.row, q.row_scale_inv, w_row, w_row_scale_inv, w_block_dim == 2, bias, x.scalar_type()), x);
  if (!columnwise) {
    return {y, at::empty({0}, x.options().dtype(x_dtype)), at::empty({0}, x.options().dtype(at::kFloat))};
  }
  return {y, q.col, q.col_scale_inv};
}

// float8_graph._grads -> (dx in x_shape | [0], dW of w_dtype | [0], db of b_dtype | [0]), each [0] where not
// needed. x_saved: x's columnwise data with its scale_inv x_col_scale_inv, or (save_original_input) x's [M, K]
// values, which wgrad quantizes here; w_col, w_col_scale_inv: the weight's columnwise part (dgrad)
std::tuple<Tensor, Tensor, Tensor> fp8_block_linear_grads(
    const Tensor& dy, const std::optional<Tensor>& x_saved, const std::optional<Tensor>& x_col_scale_inv,
    const std::optional<Tensor>& w_col, const std::optional<Tensor>& w_col_scale_inv, at::ScalarType x_dtype,
    double x_eps, bool x_pow2, at::ScalarType g_dtype, double g_eps, bool g_pow2, int64_t w_block_dim,
    bool save_original_input, bool need_dgrad, bool need_wgrad, bool need_bgrad, at::IntArrayRef x_shape,
    at::ScalarType w_dtype, at::ScalarType b_dtype) {
  constexpr const char* op = "fp8_block_linear_grads";
  check_block_dim(op, w_block_dim);
  linear_node::check_grads_phase(op, dy, x_saved, x_col_scale_inv, w_col, w_col_scale_inv, save_original_input,
                                 need_dgrad, need_wgrad, x_shape);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto [dx, dw, db] = linear_grads(dy, need_wgrad ? *x_saved : Tensor(),
                                   need_wgrad && !save_original_input ? *x_col_scale_inv : Tensor(),
                                   need_dgrad ? *w_col : Tensor(), need_dgrad ? *w_col_scale_inv : Tensor(),
                                   w_block_dim == 2, BlockCast{g_dtype, 1, g_eps, g_pow2},
                                   BlockCast{x_dtype, 1, x_eps, x_pow2}, save_original_input, need_dgrad, need_wgrad,
                                   need_bgrad, x_shape, w_dtype, b_dtype);
  const auto none = [&] { return at::empty({0}, dy.options()); };
  return {dx.defined() ? dx : none(), dw.defined() ? dw : none(), db.defined() ? db : none()};
}

void linear_impls(torch::Library& m) {
  m.impl("fp8_block_linear", &fp8_block_linear_forward);
  m.impl("fp8_block_linear_fprop", &fp8_block_linear_fprop);
  m.impl("fp8_block_linear_grads", &fp8_block_linear_grads);
}

}  // namespace
}  // namespace ops
}  // namespace hybridq

// (the schemas: csrc/quantize_fp8_block.cu, with the format's other ops)

TORCH_LIBRARY_IMPL(hybridq, Autograd, m) { m.impl("fp8_block_linear", &hybridq::ops::fp8_block_linear_autograd); }
// (CPU: the casts' argument checks reject CPU tensors with a clear message; the CPU path is float8_graph's Python)
TORCH_LIBRARY_IMPL(hybridq, CUDA, m) { hybridq::ops::linear_impls(m); }
TORCH_LIBRARY_IMPL(hybridq, CPU, m) { hybridq::ops::linear_impls(m); }
