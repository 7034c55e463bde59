// hybridq::fp8_linear: one eager per-tensor FP8 Linear call (current scaling) as ONE op whose autograd node is C++
// (torch::autograd::Function registered under the Autograd key). The forward quantizes x and the weight and runs the
// fprop GEMM; the engine calls the C++ backward, which quantizes dy and runs dgrad and wgrad. Python pays one op call
// per forward and nothing per backward: the host cost of a Linear step (issue 33) that a Python autograd.Function
// around the same kernels cannot reach (~0.1 ms of its own, plus the dispatch of each op from Python).
//
// The computation is nn/float8_graph.py's `_Float8GraphLinear` (the Python fast path) step by step: the same
// fp8_tensor_quantize calls (fp8_tensor_quantize itself, not a copy), the same `at::_scaled_mm` calls with the same
// flags (fast accumulation in fprop only, when asked), the same bias add, reductions, casts and saved tensors
// (save_for_backward: saved-tensor hooks -- offload, recompute -- see them as they see the Python node's). The
// results are bitwise that path's. Python decides when this op runs (float8_graph.eager_float8_linear).
//
// FSDP2's gathered weight (w_row..w_col_scale_inv given): the weight arrived quantized, so fprop reads its rowwise
// data and scale_inv, and the node keeps its columnwise tensors for dgrad as the Python node keeps the part -- by
// reference, outside save_for_backward. They are the unsharded weight's own tensors (distributed/buffers.py): FSDP2
// frees their storage at reshard and the backward unshard refills the same tensor objects (storage resize, `set_`,
// `copy_`), so dgrad reads them as the backward unshard left them. Saved variables would refuse that refill (their
// version counter moves) and would hand the bytes to saved-tensor hooks (offload, recompute), which must never hold
// the gathered weight: FSDP2 owns it.
//
// hybridq::fp8_linear_fprop / fp8_linear_grads: the same forward and gradients as two ops without an autograd node,
// for the compiled Linear's gathered ops (nn/compiled_linear.py; their graph saves the tensors): float8_graph's
// `_fprop` / `_grads` as one op call each (see the bottom of this file).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "binding_checks.h"
#include "cublaslt_fp8.h"
#include "linear_node.h"
#include "ops.h"

namespace hybridq {
namespace ops {
namespace {

using linear_node::given;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Cast {  // float8_graph.Float8Cast of a per-tensor cast
  at::ScalarType dtype;
  double eps;
  bool pow2;
};

struct Spec {  // what a call depends on besides its tensors
  Cast input, weight, grad_output;
  bool need_dgrad, need_wgrad, save_original_input, fast_accum_fprop;
};

struct Quantized {  // one cast's outputs (a direction not asked for: undefined)
  Tensor row, col, scale_inv;
};

// [Note: delayed scaling in the Linear op]
// hybridq::fp8_linear_delayed (nn/delayed_linear.py's one-op path): the quantizers' scales and amax histories, the
// live state tensors. A cast with a history is fp8_tensor_quantize_delayed (the scale given, max|x| max-combined into
// history[0] in place by the cast kernel); without one it is a replay of a forward cast (activation recompute: the
// scale given, nothing recorded), fp8_tensor_quantize with that scale -- exactly the kernel calls of
// cuda_fp8_tensor.delayed_cast. Python does the rest of each cast's state steps around the op: the replay check and
// the pending update before (x and the weight before the call; dy in a pre-hook of this node, which runs before
// its backward), the pending flag after. dy's scale and history are kept on the node by reference (state the update
// changes in place, not data for saved-tensor hooks). No field defined: current scaling (hybridq::fp8_linear).
struct Delayed {
  Tensor x_scale, x_history, w_scale, w_history, g_scale, g_history;
  bool on() const { return x_scale.defined(); }
};

// a cast with the quantizer's scale (delayed scaling; see the Note above) -> its parts
Quantized quantize_delayed(const Tensor& x2d, const Cast& c, const Tensor& scale, const Tensor& history,
                           bool rowwise, bool columnwise) {
  const Tensor x = x2d.contiguous();
  Tensor row, col, scale_inv;
  if (history.defined()) {
    std::tie(row, col, scale_inv) =
        fp8_tensor_quantize_delayed(x, c.dtype, scale, history, c.eps, c.pow2, rowwise, columnwise);
  } else {
    std::tie(row, col, scale_inv, std::ignore) =
        fp8_tensor_quantize(x, c.dtype, scale, std::nullopt, c.eps, c.pow2, rowwise, columnwise, false);
  }
  return {rowwise ? row : Tensor(), columnwise ? col : Tensor(), scale_inv};
}

constexpr const char* kGradScale = "g_scale";
constexpr const char* kGradHistory = "g_amax_history";

Quantized quantize(const Tensor& x2d, const Cast& c, bool rowwise, bool columnwise) {
  auto out = fp8_tensor_quantize(x2d.contiguous(), c.dtype, std::nullopt, std::nullopt, c.eps, c.pow2, rowwise,
                                 columnwise, false);
  return {rowwise ? std::get<0>(out) : Tensor(), columnwise ? std::get<1>(out) : Tensor(), std::get<2>(out)};
}

// [Note: packed allocations of the Linear op]
// Each at::empty costs several microseconds of host time (the caching allocator, a TensorImpl): fp8_tensor_quantize
// allocates four tensors per cast (rowwise, columnwise, scale_inv, max|x|) and zeroes max|x| with a memset of its own,
// 15 allocations and 3 memsets per forward + backward. The op packs tensors of the same lifetime into one allocation
// and carves them out of it as tensors on its storage (`carve`: no allocation, no dispatch): the forward's two
// rowwise parts (read by the fprop GEMM only) in one, its max|x| and scale_inv values in one (zeroed by one memset;
// the scales are saved, so this 64-byte block lives until backward), dy's parts and values in one. What backward
// reads of x and the weight (their columnwise parts) stays in allocations of its own: packed with a rowwise part it
// would keep that part alive until backward. Every piece starts at a multiple of 256 bytes (16 would do: the kernels'
// vector stores and cuBLASLt's alignment, see cublaslt_fp8.cpp's plan key), and the kernels, their arguments and
// the GEMMs are those of fp8_tensor_quantize and `mm`: the same bits.
constexpr int64_t kAlign = 256;

bool packed_default() {
  const char* v = std::getenv("HYBRIDQ_LINEAR_PACKED");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// on unless HYBRIDQ_LINEAR_PACKED=0; set_linear_packed switches it (benchmarks compare the two in one process)
std::atomic<bool> g_packed{packed_default()};

int64_t padded(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// A tensor of `dtype` with contiguous `sizes` on `buf`'s storage, `byte_offset` bytes in (a multiple of kAlign)
Tensor carve(const Tensor& buf, at::ScalarType dtype, at::IntArrayRef sizes, int64_t byte_offset) {
  Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(buf.storage()), buf.key_set(),
                                                      c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  t.unsafeGetTensorImpl()->set_storage_offset(byte_offset / static_cast<int64_t>(c10::elementSize(dtype)));
  return t;
}

// fp8_tensor_quantize's checks of a cast of x (contiguous), before anything is allocated or launched
void check_cast(const Tensor& x, const Cast& c) {
  constexpr const char* op = "fp8_tensor_quantize";
  check_input(x, op);
  in_type(x, op);
  fp8_encoding(c.dtype, c.eps, c.pow2, op);
}

void zero_floats(float* p, int64_t n) {
  C10_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(float), c10::cuda::getCurrentCUDAStream()));
}

float* floats_at(const Tensor& buf, int64_t byte_offset) {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(buf.data_ptr()) + byte_offset);
}

void* data_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// `quantize` with its outputs in one allocation: [rowwise | columnwise | scale_inv, max|x|] (for dy, whose parts
// the two backward GEMMs read and drop)
Quantized quantize_packed(const Tensor& x2d, const Cast& c, bool rowwise, bool columnwise) {
  if (x2d.numel() == 0 || !g_packed.load(std::memory_order_relaxed)) {  // (nothing to pack, or packing off)
    return quantize(x2d, c, rowwise, columnwise);
  }
  const Tensor x = x2d.contiguous();
  check_cast(x, c);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), k = x.size(1), bytes = padded(m * k);
  const int64_t col_at = rowwise ? bytes : 0, values_at = col_at + (columnwise ? bytes : 0);
  Tensor buf = at::empty({values_at + kAlign}, x.options().dtype(at::kByte));
  float* values = floats_at(buf, values_at);  // [scale_inv, 3 unused, max|x|]
  zero_floats(values + 4, 1);
  Quantized q;
  if (rowwise) q.row = carve(buf, c.dtype, {m, k}, 0);
  if (columnwise) q.col = carve(buf, c.dtype, {k, m}, col_at);
  q.scale_inv = carve(buf, at::kFloat, {1}, values_at);
  fp8_tensor_quantize_into(x, c.dtype, c.eps, c.pow2, data_or_null(q.row), data_or_null(q.col), values + 4, values);
  return q;
}

// native_gemm.fp8_tensor_mm: a [m, k] x b [n, k]^T of per-tensor FP8 operands (a result dtype _scaled_mm cannot
// write is converted from fp32)
Tensor mm(const Tensor& a, const Tensor& sa, const Tensor& b, const Tensor& sb, at::ScalarType out, bool fast) {
  const bool direct = out == at::kBFloat16 || out == at::kHalf || out == at::kFloat;
  const at::ScalarType gemm_out = direct ? out : at::kFloat;
  // (cublaslt_fp8.h: the same cuBLASLt GEMM with its plan cached; at::_scaled_mm where it declines)
  Tensor y = cublaslt::scaled_mm_tensorwise(a, b, sa, sb, gemm_out, fast);
  if (!y.defined()) {
    y = at::_scaled_mm(a, b.t(), sa.reshape({}), sb.reshape({}), std::nullopt, std::nullopt, gemm_out, fast);
  }
  return direct ? y : y.to(out);
}

// float8_graph._fprop's GEMM and bias add: y [M, N] from x's and the weight's rowwise parts
Tensor fprop_mm(const Tensor& xr, const Tensor& xrs, const Tensor& wr, const Tensor& wrs,
                const std::optional<Tensor>& bias, at::ScalarType out, bool fast) {
  Tensor y = mm(xr, xrs, wr, wrs, out, fast);
  if (bias.has_value() && bias->defined()) y = y + bias->to(out);
  return y;
}

// float8_graph._grads: (dx in x_shape, dW, db), each undefined where not needed, from what the forward kept of x
// (x_saved: its columnwise data with scale_inv xcs, or its [M, K] view under save_original_input) and the weight's
// columnwise part wc, wcs
// g_scale, g_history: dy's delayed-scaling state (undefined: current scaling)
std::tuple<Tensor, Tensor, Tensor> linear_grads(const Tensor& dy, const Tensor& x_saved, const Tensor& xcs,
                                                const Tensor& wc, const Tensor& wcs, const Cast& g_cast,
                                                const Cast& x_cast, bool save_original_input, bool need_dgrad,
                                                bool need_wgrad, bool need_bgrad, at::IntArrayRef x_shape,
                                                at::ScalarType w_dtype, at::ScalarType b_dtype,
                                                const Tensor& g_scale = Tensor(), const Tensor& g_history = Tensor()) {
  const Tensor dy2d = dy.reshape({-1, dy.size(-1)}).contiguous();
  Tensor dx, dw, db;
  if (need_dgrad || need_wgrad) {
    Quantized g = g_scale.defined() ? quantize_delayed(dy2d, g_cast, g_scale, g_history, need_dgrad, need_wgrad)
                                    : quantize_packed(dy2d, g_cast, need_dgrad, need_wgrad);
    if (need_dgrad) dx = mm(g.row, g.scale_inv, wc, wcs, dy.scalar_type(), false).reshape(x_shape);
    if (need_wgrad) {
      Tensor xc = x_saved, xs = xcs;
      if (save_original_input) {
        Quantized q = quantize(x_saved, x_cast, false, true);
        xc = q.col;
        xs = q.scale_inv;
      }
      dw = mm(g.col, g.scale_inv, xc, xs, dy.scalar_type(), false).to(w_dtype);
    }
  }
  if (need_bgrad) db = dy2d.sum(0).to(b_dtype);
  return {dx, dw, db};
}

}  // namespace

bool set_linear_packed(bool on) { return g_packed.exchange(on); }

// (outside the anonymous namespace: the node's name, `y.grad_fn.name()`, is torch::autograd::CppNode<hybridq::ops::
// Fp8Linear>)
struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  // x_row..x_col_scale_inv: x already quantized (another layer's quantization of the same tensor, or one from a
  // known max|x|), as float8_graph._quantize returns it; x_col given where wgrad reads it
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const std::optional<Tensor>& x_row,
                        const std::optional<Tensor>& x_row_scale_inv, const std::optional<Tensor>& x_col,
                        const std::optional<Tensor>& x_col_scale_inv, const std::optional<Tensor>& w_row,
                        const std::optional<Tensor>& w_row_scale_inv, const std::optional<Tensor>& w_col,
                        const std::optional<Tensor>& w_col_scale_inv, const Spec& s,
                        const Delayed& d = Delayed()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // (the inner ops record nothing: skip their autograd keys)
    const int64_t k = x.size(-1);
    const Tensor x2d = x.reshape({-1, k});
    const bool keep_x = s.need_wgrad && s.save_original_input;  // wgrad quantizes the original input in backward
    Tensor xr, xrs, xc, xcs;
    const bool x_here = !given(x_row), gathered = given(w_row);
    if (d.on()) {  // delayed scaling: x and the weight cast here with their scales ([Note: delayed scaling in ...])
      Quantized xq = quantize_delayed(x2d, s.input, d.x_scale, d.x_history, true, s.need_wgrad && !keep_x);
      Quantized wq = quantize_delayed(weight, s.weight, d.w_scale, d.w_history, true, s.need_dgrad);
      Tensor y = fprop_mm(xq.row, xq.scale_inv, wq.row, wq.scale_inv, bias, x.scalar_type(), s.fast_accum_fprop);
      if (ctx != nullptr) {
        ctx->save_for_backward({keep_x ? x2d : xq.col, xq.col.defined() ? xq.scale_inv : Tensor(), wq.col,
                                wq.col.defined() ? wq.scale_inv : Tensor()});
        linear_node::save_state(ctx, s.need_dgrad, s.need_wgrad, s.save_original_input, bias,
                                weight.scalar_type(), s.grad_output, s.input, x.sizes(), 0, std::nullopt,
                                std::nullopt);
        if (d.g_scale.defined()) {
          ctx->saved_data[kGradScale] = d.g_scale;
          ctx->saved_data[kGradHistory] = d.g_history;
        }
      }
      return linear_node::output_like(y, x);
    }
    if (!x_here) {
      xr = *x_row;
      xrs = x_row_scale_inv.value();
      if (x_col.has_value() && x_col->defined()) {
        xc = *x_col;
        xcs = x_col_scale_inv.value();
      }
    }
    Quantized w;
    if (gathered) {  // (the columnwise part is not read here: FSDP2 may refill it only at the backward unshard)
      w.row = *w_row;
      w.scale_inv = *w_row_scale_inv;
    }
    const bool x_col_here = s.need_wgrad && !keep_x;
    if ((x_here || !gathered) && x2d.numel() > 0 && weight.numel() > 0 && g_packed.load(std::memory_order_relaxed)) {
      // the casts here with packed allocations ([Note: packed allocations of the Linear op])
      const Tensor xq = x_here ? x2d.contiguous() : Tensor(), wq = gathered ? Tensor() : weight.contiguous();
      if (x_here) check_cast(xq, s.input);
      if (!gathered) {
        check_cast(wq, s.weight);
        TORCH_CHECK(wq.device() == x.device(), "hybridq::fp8_linear: the weight is on ", wq.device(),
                    " but the input is on ", x.device());
      }
      const c10::cuda::CUDAGuard guard(x.device());
      const int64_t m = x2d.size(0), n = weight.size(0);
      // values: [scale_inv of x, 3 unused, scale_inv of the weight, 3 unused, max|x|, max|weight|]
      Tensor values = at::empty({12}, x.options().dtype(at::kFloat));
      float* v = values.data_ptr<float>();
      zero_floats(v + 8, 2);
      const int64_t x_bytes = x_here ? padded(m * k) : 0;
      const Tensor rows = at::empty({x_bytes + (gathered ? 0 : n * k)}, x.options().dtype(at::kByte));
      if (x_here) {
        xr = carve(rows, s.input.dtype, {m, k}, 0);
        xrs = carve(values, at::kFloat, {1}, 0);
        if (x_col_here) {
          xc = at::empty({k, m}, x.options().dtype(s.input.dtype));
          xcs = xrs;
        }
        fp8_tensor_quantize_into(xq, s.input.dtype, s.input.eps, s.input.pow2, xr.data_ptr(), data_or_null(xc),
                                 v + 8, v);
      }
      if (!gathered) {
        w.row = carve(rows, s.weight.dtype, {n, k}, x_bytes);
        w.scale_inv = carve(values, at::kFloat, {1}, 16);
        if (s.need_dgrad) w.col = at::empty({k, n}, weight.options().dtype(s.weight.dtype));
        fp8_tensor_quantize_into(wq, s.weight.dtype, s.weight.eps, s.weight.pow2, w.row.data_ptr(),
                                 data_or_null(w.col), v + 9, v + 4);
      }
    } else {
      if (x_here) {
        Quantized q = quantize(x2d, s.input, true, x_col_here);
        xr = q.row;
        xrs = xcs = q.scale_inv;
        xc = q.col;
        if (!xc.defined()) xcs = Tensor();
      }
      if (!gathered) w = quantize(weight, s.weight, true, s.need_dgrad);
    }
    Tensor y = fprop_mm(xr, xrs, w.row, w.scale_inv, bias, x.scalar_type(), s.fast_accum_fprop);
    if (ctx != nullptr) {
      ctx->save_for_backward({keep_x ? x2d : xc, xc.defined() ? xcs : Tensor(), w.col,
                              w.col.defined() ? w.scale_inv : Tensor()});
      // (a gathered weight's columnwise part by reference, read in backward: see the top of this file)
      linear_node::save_state(ctx, s.need_dgrad, s.need_wgrad, s.save_original_input, bias, weight.scalar_type(),
                              s.grad_output, s.input, x.sizes(), 0, w_col, w_col_scale_inv);
    }
    return linear_node::output_like(y, x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    linear_node::check_first_order("hybridq::fp8_linear (a per-tensor FP8 Linear)");
    // (unpacked before the guard: an unpack hook may run Python -- a checkpoint's recompute runs the forward, this
    // op's autograd kernel included, in it)
    const variable_list saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const linear_node::State s = linear_node::load_state(ctx);
    const Cast g_cast{s.grad_output.dtype, s.grad_output.eps, s.grad_output.pow2};
    const Cast x_cast{s.input.dtype, s.input.eps, s.input.pow2};
    const auto [wc, wcs] = linear_node::weight_col(ctx, saved);  // (a gathered one as the backward unshard left it)
    // dy's delayed-scaling state, as the node's pre-hook left it (its pending update applied in place)
    const auto g_scale = ctx->saved_data.find(kGradScale);
    const bool delayed = g_scale != ctx->saved_data.end();
    auto [dx, dw, db] = linear_grads(grads[0], saved[0], saved[1], wc, wcs, g_cast, x_cast, s.save_original_input,
                                     s.need_dgrad, s.need_wgrad, s.has_bias && ctx->needs_input_grad(2), s.x_shape,
                                     s.weight_dtype, s.bias_dtype, delayed ? g_scale->second.toTensor() : Tensor(),
                                     delayed ? ctx->saved_data.at(kGradHistory).toTensor() : Tensor());
    return {dx, dw, db, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

namespace {

Spec spec_of(at::ScalarType x_dtype, double x_eps, bool x_pow2, at::ScalarType w_dtype, double w_eps, bool w_pow2,
             at::ScalarType g_dtype, double g_eps, bool g_pow2, bool need_dgrad, bool need_wgrad,
             bool save_original_input, bool fast_accum_fprop) {
  return {{x_dtype, x_eps, x_pow2},    {w_dtype, w_eps, w_pow2},         {g_dtype, g_eps, g_pow2},
          need_dgrad,                  need_wgrad,                       save_original_input,
          fast_accum_fprop};
}

void check_args(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& x_row,
                const std::optional<Tensor>& x_row_scale_inv, const std::optional<Tensor>& x_col,
                const std::optional<Tensor>& x_col_scale_inv, const std::optional<Tensor>& w_row,
                const std::optional<Tensor>& w_row_scale_inv, const std::optional<Tensor>& w_col,
                const std::optional<Tensor>& w_col_scale_inv, at::ScalarType w_dtype, bool need_dgrad,
                bool need_wgrad, bool save_original_input) {
  constexpr const char* op = "hybridq::fp8_linear";
  linear_node::check_shapes(op, x, weight);
  linear_node::check_parts(op, weight, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row, w_row_scale_inv, w_col,
                           w_col_scale_inv, w_dtype, need_dgrad, need_wgrad, save_original_input);
}

// Fp8Linear's forward with its C++ node recording the backward (`kRecord`: the Autograd-key kernel) or alone (the
// backend kernel, reached without autograd, e.g. under inference_mode): each op below registers both instantiations
template <bool kRecord, typename... Args>
Tensor run_fp8_linear(Args&&... args) {
  if constexpr (kRecord) {
    return Fp8Linear::apply(std::forward<Args>(args)...);
  } else {
    return Fp8Linear::forward(nullptr, std::forward<Args>(args)...);
  }
}

template <bool kRecord>
Tensor fp8_linear_kernel(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                         const std::optional<Tensor>& x_row, const std::optional<Tensor>& x_row_scale_inv,
                         const std::optional<Tensor>& x_col, const std::optional<Tensor>& x_col_scale_inv,
                         at::ScalarType x_dtype, double x_eps, bool x_pow2, at::ScalarType w_dtype, double w_eps,
                         bool w_pow2, at::ScalarType g_dtype, double g_eps, bool g_pow2, bool need_dgrad,
                         bool need_wgrad, bool save_original_input, bool fast_accum_fprop,
                         const std::optional<Tensor>& w_row, const std::optional<Tensor>& w_row_scale_inv,
                         const std::optional<Tensor>& w_col, const std::optional<Tensor>& w_col_scale_inv) {
  check_args(x, weight, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row, w_row_scale_inv, w_col,
             w_col_scale_inv, w_dtype, need_dgrad, need_wgrad, save_original_input);
  return run_fp8_linear<kRecord>(x, weight, bias, x_row, x_row_scale_inv, x_col, x_col_scale_inv, w_row,
                                 w_row_scale_inv, w_col, w_col_scale_inv,
                                 spec_of(x_dtype, x_eps, x_pow2, w_dtype, w_eps, w_pow2, g_dtype, g_eps, g_pow2,
                                         need_dgrad, need_wgrad, save_original_input, fast_accum_fprop));
}

// hybridq::fp8_linear_delayed: fp8_linear with delayed scaling ([Note: delayed scaling in the Linear op]); x and
// the weight quantized here (no parts handed over), save_original_input off. x_amax_history / w_amax_history None:
// that cast is a replay (record nothing); g_scale / g_amax_history: dy's state, None where backward casts nothing.
// Eager only (nn/delayed_linear.py calls it outside torch.compile); the histories change in place.
Delayed delayed_of(const Tensor& x, const Tensor& x_scale, const std::optional<Tensor>& x_amax_history,
                   const Tensor& w_scale, const std::optional<Tensor>& w_amax_history,
                   const std::optional<Tensor>& g_scale, const std::optional<Tensor>& g_amax_history,
                   bool need_dgrad, bool need_wgrad) {
  constexpr const char* op = "hybridq::fp8_linear_delayed";
  const auto state_ok = [&](const Tensor& t, bool history) {
    return t.device() == x.device() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous() &&
           (history ? t.numel() >= 1 : t.numel() == 1);
  };
  for (const Tensor* t : {&x_scale, &w_scale}) {
    TORCH_CHECK(state_ok(*t, false), op, ": a scale must be a contiguous fp32 [1] on ", x.device(), ", got ",
                t->scalar_type(), " ", t->sizes(), " on ", t->device());
  }
  for (const auto* t : {&x_amax_history, &w_amax_history, &g_amax_history}) {
    TORCH_CHECK(!given(*t) || state_ok(**t, true), op, ": an amax history must be a contiguous 1-D fp32 tensor on ",
                x.device(), ", got ", (*t)->scalar_type(), " ", (*t)->sizes(), " on ", (*t)->device());
  }
  TORCH_CHECK(given(g_scale) == given(g_amax_history), op, ": g_scale and g_amax_history come together");
  TORCH_CHECK(given(g_scale) == (need_dgrad || need_wgrad), op, ": dy's state (g_scale, g_amax_history) is given ",
              "exactly where backward casts dy (need_dgrad or need_wgrad)");
  TORCH_CHECK(!given(g_scale) || state_ok(*g_scale, false), op, ": g_scale must be a contiguous fp32 [1] on ",
              x.device());
  const auto or_none = [](const std::optional<Tensor>& t) { return given(t) ? *t : Tensor(); };
  return {x_scale, or_none(x_amax_history), w_scale, or_none(w_amax_history), or_none(g_scale),
          or_none(g_amax_history)};
}

template <bool kRecord>
Tensor fp8_linear_delayed_kernel(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                 const Tensor& x_scale, const std::optional<Tensor>& x_amax_history,
                                 const Tensor& w_scale, const std::optional<Tensor>& w_amax_history,
                                 const std::optional<Tensor>& g_scale, const std::optional<Tensor>& g_amax_history,
                                 at::ScalarType x_dtype, double x_eps, bool x_pow2, at::ScalarType w_dtype,
                                 double w_eps, bool w_pow2, at::ScalarType g_dtype, double g_eps, bool g_pow2,
                                 bool need_dgrad, bool need_wgrad, bool fast_accum_fprop) {
  linear_node::check_shapes("hybridq::fp8_linear_delayed", x, weight);
  const Delayed d = delayed_of(x, x_scale, x_amax_history, w_scale, w_amax_history, g_scale, g_amax_history,
                               need_dgrad, need_wgrad);
  const std::optional<Tensor> none;
  return run_fp8_linear<kRecord>(x, weight, bias, none, none, none, none, none, none, none, none,
                                 spec_of(x_dtype, x_eps, x_pow2, w_dtype, w_eps, w_pow2, g_dtype, g_eps, g_pow2,
                                         need_dgrad, need_wgrad, false, fast_accum_fprop),
                                 d);
}

// ---- the compiled Linear's gathered fast path: one op per phase, no autograd node ----------------------------
// nn/compiled_linear.py's gathered ops (plain ops of a compiled graph: AOTAutograd split forward and backward, and
// the op saves the tensors) run float8_graph's `_fprop` / `_grads` on FSDP2's gathered weight at every step; these
// are those two functions as single ops, so a phase costs one op call from Python instead of ~10 (the casts, the
// GEMM, the bias add, reshapes). Same kernels and GEMMs, same flags, same order: bitwise the Python functions.

void check_linear_op(bool ok, const char* op, const char* rule) {
  TORCH_CHECK(ok, "hybridq::", op, ": ", rule);
}

// float8_graph._fprop on the weight's rowwise part (x quantized here) -> (y in x's shape with out_features last,
// x's columnwise data [K, M] | [0], its scale_inv [1] | [0]): the columnwise part only where wgrad reads it
// (need_wgrad, not save_original_input: then wgrad quantizes x itself, which the caller keeps).
// x_row, x_row_scale_inv: x already quantized rowwise (hybridq::linear_input_quantize in a compiled graph, shared by
// the layers reading x): the GEMM reads them, nothing is quantized here and no columnwise part is returned (the
// caller holds x's parts)
std::tuple<Tensor, Tensor, Tensor> fp8_linear_fprop(const Tensor& x, const Tensor& w_row,
                                                    const Tensor& w_row_scale_inv, const std::optional<Tensor>& bias,
                                                    at::ScalarType x_dtype, double x_eps, bool x_pow2,
                                                    bool need_wgrad, bool save_original_input,
                                                    bool fast_accum_fprop, const std::optional<Tensor>& x_row,
                                                    const std::optional<Tensor>& x_row_scale_inv) {
  constexpr const char* op = "fp8_linear_fprop";
  check_linear_op(given(x_row) == given(x_row_scale_inv), op, "x_row and x_row_scale_inv come together");
  TORCH_CHECK(x.dim() >= 2 && w_row.dim() == 2 && x.size(-1) == w_row.size(1), "hybridq::", op, ": input of shape ",
              x.sizes(), " and weight rowwise part of shape ", w_row.sizes(), " do not make x @ weight^T");
  TORCH_CHECK(w_row_scale_inv.numel() == 1, "hybridq::", op, ": w_row_scale_inv must hold the one per-tensor ",
              "scale, got shape ", w_row_scale_inv.sizes());
  TORCH_CHECK(!given(bias) || (bias->dim() == 1 && bias->size(0) == w_row.size(0)), "hybridq::", op,
              ": bias of shape ", bias.has_value() ? bias->sizes() : at::IntArrayRef{}, " does not match ",
              w_row.size(0), " output features");
  if (given(x_row)) {
    const int64_t k = x.size(-1), m = k ? x.numel() / k : 0;
    TORCH_CHECK(x_row->dim() == 2 && x_row->size(0) == m && x_row->size(1) == k && x_row->scalar_type() == x_dtype,
                "hybridq::", op, ": x_row of shape ", x_row->sizes(), " and dtype ", x_row->scalar_type(),
                " is not x's rowwise part [", m, ", ", k, "] of ", x_dtype);
    TORCH_CHECK(x_row_scale_inv->numel() == 1 && x_row_scale_inv->scalar_type() == at::kFloat, "hybridq::", op,
                ": x_row_scale_inv must hold the one per-tensor fp32 scale, got shape ", x_row_scale_inv->sizes());
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Tensor y = linear_node::output_like(
        fprop_mm(*x_row, *x_row_scale_inv, w_row, w_row_scale_inv, bias, x.scalar_type(), fast_accum_fprop), x);
    return {y, at::empty({0}, x_row->options()), at::empty({0}, x_row_scale_inv->options())};
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // (the inner ops record nothing: skip their autograd keys)
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  const bool columnwise = need_wgrad && !save_original_input;
  Quantized q = quantize(x2d, Cast{x_dtype, x_eps, x_pow2}, true, columnwise);
  const Tensor y = linear_node::output_like(
      fprop_mm(q.row, q.scale_inv, w_row, w_row_scale_inv, bias, x.scalar_type(), fast_accum_fprop), x);
  if (!columnwise) return {y, at::empty({0}, q.row.options()), at::empty({0}, q.scale_inv.options())};
  return {y, q.col, q.scale_inv};
}

// float8_graph._grads -> (dx in x_shape | [0], dW of w_dtype | [0], db of b_dtype | [0]), each [0] where not
// needed. x_saved: x's columnwise data with its scale_inv x_col_scale_inv, or (save_original_input) x's [M, K]
// values, which wgrad quantizes here; w_col, w_col_scale_inv: the weight's columnwise part (dgrad)
std::tuple<Tensor, Tensor, Tensor> fp8_linear_grads(
    const Tensor& dy, const std::optional<Tensor>& x_saved, const std::optional<Tensor>& x_col_scale_inv,
    const std::optional<Tensor>& w_col, const std::optional<Tensor>& w_col_scale_inv, at::ScalarType x_dtype,
    double x_eps, bool x_pow2, at::ScalarType g_dtype, double g_eps, bool g_pow2, bool save_original_input,
    bool need_dgrad, bool need_wgrad, bool need_bgrad, at::IntArrayRef x_shape, at::ScalarType w_dtype,
    at::ScalarType b_dtype) {
  constexpr const char* op = "fp8_linear_grads";
  linear_node::check_grads_phase(op, dy, x_saved, x_col_scale_inv, w_col, w_col_scale_inv, save_original_input,
                                 need_dgrad, need_wgrad, x_shape);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto [dx, dw, db] = linear_grads(dy, need_wgrad ? *x_saved : Tensor(),
                                   need_wgrad && !save_original_input ? *x_col_scale_inv : Tensor(),
                                   need_dgrad ? *w_col : Tensor(), need_dgrad ? *w_col_scale_inv : Tensor(),
                                   Cast{g_dtype, g_eps, g_pow2}, Cast{x_dtype, x_eps, x_pow2}, save_original_input,
                                   need_dgrad, need_wgrad, need_bgrad, x_shape, w_dtype, b_dtype);
  const auto none = [&] { return at::empty({0}, dy.options()); };
  return {dx.defined() ? dx : none(), dw.defined() ? dw : none(), db.defined() ? db : none()};
}

}  // namespace
}  // namespace ops
}  // namespace hybridq

// the schemas: fp8_linear's, fp8_linear_delayed's and the gathered fast path's two, with the per-tensor FP8 format's
// other ops
// (csrc/quantize_fp8_tensor.cu)

TORCH_LIBRARY_IMPL(hybridq, Autograd, m) {
  m.impl("fp8_linear", &hybridq::ops::fp8_linear_kernel<true>);
  m.impl("fp8_linear_delayed", &hybridq::ops::fp8_linear_delayed_kernel<true>);
}

namespace {
void linear_impls(torch::Library& m) {
  m.impl("fp8_linear", &hybridq::ops::fp8_linear_kernel<false>);
  m.impl("fp8_linear_delayed", &hybridq::ops::fp8_linear_delayed_kernel<false>);
  m.impl("fp8_linear_fprop", &hybridq::ops::fp8_linear_fprop);
  m.impl("fp8_linear_grads", &hybridq::ops::fp8_linear_grads);
}
}  // namespace

// (CPU: the casts' argument checks reject CPU tensors with a clear message; the CPU path is float8_graph's Python)
TORCH_LIBRARY_IMPL(hybridq, CUDA, m) { linear_impls(m); }
TORCH_LIBRARY_IMPL(hybridq, CPU, m) { linear_impls(m); }
