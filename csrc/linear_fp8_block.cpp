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

using QuantizeSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, at::ScalarType, int64_t, double, bool,
                                                               bool, bool);
using MmSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, at::ScalarType);

// float8_graph._quantize of a block cast on CUDA: hybridq::fp8_block_quantize(x2d.contiguous(), ...)
BlockParts quantize(const Tensor& x2d, const BlockCast& c, bool rowwise, bool columnwise) {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("hybridq::fp8_block_quantize", "")
                              .typed<QuantizeSig>();
  auto [row, rs, col, cs] = op.call(x2d.contiguous(), c.dtype, c.block_dim, c.eps, c.pow2, rowwise, columnwise);
  return {row, rs, col, cs};
}

// native_gemm._block_run's GEMM: a [M, K] (1x128 blocks) @ b [N, K]^T (b_tiles: 128x128 tiles, else 1x128 blocks)
Tensor mm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b, const Tensor& b_scale_inv, bool b_tiles,
          at::ScalarType out) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("hybridq::fp8_block_mm", "").typed<MmSig>();
  return op.call(a, a_scale_inv, b, b_scale_inv, b_tiles, out);
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
    Tensor y = mm(xr, xrs, w.row, w.row_scale_inv, s.weight.block_dim == 2, x.scalar_type());
    if (given(bias)) y = y + bias->to(x.scalar_type());
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
    // (unpacked before the guard: an unpack hook may run Python, e.g. a checkpoint's recompute)
    const variable_list saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const linear_node::State s = linear_node::load_state(ctx);
    const bool tiles = s.own_bits & 1;  // the weight's 128x128 tiles
    const BlockCast g_cast{s.grad_output.dtype, 1, s.grad_output.eps, s.grad_output.pow2};
    const BlockCast x_cast{s.input.dtype, 1, s.input.eps, s.input.pow2};
    const Tensor& dy = grads[0];
    const Tensor dy2d = dy.reshape({-1, dy.size(-1)}).contiguous();
    Tensor dx, dw, db;
    if (s.need_dgrad || s.need_wgrad) {
      const BlockParts g = quantize(dy2d, g_cast, s.need_dgrad, s.need_wgrad);
      if (s.need_dgrad) {
        const auto [wc, wcs] = linear_node::weight_col(ctx, saved);  // (a gathered one as the backward unshard left it)
        dx = mm(g.row, g.row_scale_inv, wc, wcs, tiles, dy.scalar_type()).reshape(s.x_shape);
      }
      if (s.need_wgrad) {
        Tensor xc = saved[0], xs = saved[1];
        if (s.save_original_input) {
          BlockParts q = quantize(saved[0], x_cast, false, true);
          xc = q.col;
          xs = q.col_scale_inv;
        }
        dw = mm(g.col, g.col_scale_inv, xc, xs, false, dy.scalar_type()).to(s.weight_dtype);
      }
    }
    if (s.has_bias && ctx->needs_input_grad(2)) db = dy2d.sum(0).to(s.bias_dtype);
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

}  // namespace
}  // namespace ops
}  // namespace hybridq

// (the schema: csrc/quantize_fp8_block.cu, with the format's other ops)

TORCH_LIBRARY_IMPL(hybridq, Autograd, m) { m.impl("fp8_block_linear", &hybridq::ops::fp8_block_linear_autograd); }
// (CPU: the casts' argument checks reject CPU tensors with a clear message; the CPU path is float8_graph's Python)
TORCH_LIBRARY_IMPL(hybridq, CUDA, m) { m.impl("fp8_block_linear", &hybridq::ops::fp8_block_linear_forward); }
TORCH_LIBRARY_IMPL(hybridq, CPU, m) { m.impl("fp8_block_linear", &hybridq::ops::fp8_block_linear_forward); }
