"""The eager fast path of a per-tensor FP8 Linear with delayed scaling (recipe fp8_delayed): the general path's casts,
GEMMs and state bookkeeping as the few calls they are, without its QuantizedTensors and dispatch lookups.

[Note: the delayed-scaling fast path] The general path (linear_function.py) quantizes each of x, the weight and dy
through `Quantizer.quantize` (checks, a QuantizedTensor of parts, a kernel looked up per call), looks each GEMM up in
the dispatch tables and saves QuantizedTensors split into parts (fp8_tensorwise's general path: 1.26 ms of host time
per forward + backward on an H200, its Python node 0.88, its one op 0.56; BENCHMARKS.md, issue 33); nn/float8_graph.py's
fast paths take current scaling only (a delayed scale is state, not a function of the tensor). Here a layer whose
three quantizers are exactly `Float8Quantizer` with delayed scaling runs the same per-cast steps in its own
autograd.Function (on CUDA mostly as one op: [Note: the delayed-scaling Linear as one op] below): `check_replay`,
then on CUDA `delayed_cast` (the
kernel's own run: the pending update by `update_before_cast`, the cast that max-combines max|x| into the history slot,
`mark_amax_recorded`; a replay -- activation recompute, save_original_input's backward cast -- casts with the
forward's scale and records nothing), on the CPU the format's reference (`quantize_parts`, what the general path
runs there); the GEMMs are float8_graph's `_mm` (the native per-tensor GEMM the dispatch picks, or the CPU
emulation), and backward counts the backward pass (`count_backward_pass`, as `saved_quantized` does) before dy's
cast. The calls, their order (x, weight, fprop; dy, dgrad, wgrad) and their arguments are the general path's, so
the outputs, gradients, amax histories and scales are bitwise the same (tests/test_delayed_fast_path.py).

It takes the calls float8_graph's fast path takes (`_cached_fast_call` on a per-tensor spec of the same dtypes:
the switch HYBRIDQ_EAGER_FAST_PATH, `takes`, the dispatch tables' own kernels, the shape rules) on a plain weight
without the is_first_microbatch cache and without a backward override; anything else (FSDP2's gathered weight -- a
delayed weight is gathered in high precision --, a quantized parameter, the weight cache, tensor parallelism) runs
the general path, which is also where every error is raised.
"""

from __future__ import annotations

import torch

from ..enums import Scaling
from ..formats.base import option_names
from ..formats.float8 import Float8Quantizer
from ..kernels import cuda_fp8_tensor, native_gemm
from ..kernels.cuda_fp8_tensor import OPTIONS as FP8_TENSOR_OPTIONS, delayed_cast
from ..kernels.delayed import _kernel_ok, update_before_cast, update_before_casts
from ..switches import Switch
from ..tensor import count_backward_pass
from .first_order import first_order_only
from .float8_graph import PER_TENSOR, Float8Cast, Float8GraphSpec, _cached_fast_call, _mm
from .linear_function import gradients_needed

__all__ = ["delayed_spec", "eager_delayed_linear"]

_ROLES = ("input", "weight", "grad_output")


def delayed_spec(quantizers: dict, save_original_input: bool) -> Float8GraphSpec | None:
    """A per-tensor `Float8GraphSpec` of the layer's dtypes when its input, weight and grad_output quantizers are
    all exactly `Float8Quantizer` with delayed scaling and no option the kernel does not implement, else None. (The
    spec carries the constants the shape and GEMM checks read; the scales are the quantizers' state.)"""
    casts = []
    for role in _ROLES:
        q = quantizers[role]
        if type(q) is not Float8Quantizer or q.scaling != Scaling.DELAYED or option_names(type(q)) - FP8_TENSOR_OPTIONS:
            return None
        casts.append(Float8Cast(q.dtype, float(q.amax_epsilon), bool(q.power_2_scale), PER_TENSOR))
    return Float8GraphSpec(*casts, bool(save_original_input))


def _cast(q: Float8Quantizer, x2d: torch.Tensor, rowwise: bool, columnwise: bool, name: str) -> tuple:
    """(rowwise data, columnwise data, scale_inv) of `q.quantize(x2d, ...)` on the general path (None for a
    direction not asked for): the replay check first, then the CUDA kernel's run or, on the CPU, the reference."""
    q.check_replay(name)
    if x2d.is_cuda:
        row, col, scale_inv = delayed_cast(q, x2d.contiguous(), rowwise, columnwise)
        return (row if rowwise else None), (col if columnwise else None), scale_inv
    row, col = q.quantize_parts(x2d, rowwise, columnwise)
    return (None if row is None else row.data, None if col is None else col.data,
            (row if row is not None else col).scale_inv)


def _fprop(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec, cfg,
           x_col: bool, w_col: bool) -> tuple:
    """(y `[M, N]`, x's columnwise data, its scale_inv, the weight's columnwise data, its scale_inv): linear_function
    `_fprop`'s casts (x, then the weight) and GEMM."""
    xr, xc, xs = _cast(cfg.input_q, x2d, True, x_col, f"input of {cfg.name}")
    wr, wc, ws = _cast(cfg.weight_q, weight, True, w_col, f"weight of {cfg.name}")
    y = _mm(xr, xs, spec.input, False, wr, ws, spec.weight, False, x2d.dtype, f"fprop of {cfg.name}")
    if bias is not None:
        y = y + bias.to(x2d.dtype)
    return y, xc, xs, wc, ws


class _DelayedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec, cfg,
                need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        keep_x = need_wgrad and spec.save_original_input  # wgrad quantizes (replays) the original input in backward
        y, xc, xs, wc, ws = _fprop(x2d, weight, bias, spec, cfg, need_wgrad and not keep_x, need_dgrad)
        ctx.save_for_backward(x2d if keep_x else xc, xs if need_wgrad and not keep_x else None, wc,
                              ws if need_dgrad else None)
        ctx.spec, ctx.cfg, ctx.need_dgrad, ctx.need_wgrad = spec, cfg, need_dgrad, need_wgrad
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        # (a tensor of its own, not a view: see linear_function._output)
        return torch.ops.aten._unsafe_view(y.contiguous(), (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    @first_order_only(lambda ctx: ctx.cfg.describe())
    def backward(ctx, dy: torch.Tensor):
        count_backward_pass()  # (as the general path's saved_quantized, before the unpack: the step counter)
        x_saved, xs, wc, ws = ctx.saved_tensors
        spec, cfg, need_dgrad, need_wgrad = ctx.spec, ctx.cfg, ctx.need_dgrad, ctx.need_wgrad
        dy2d = dy.reshape(-1, dy.shape[-1])
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        dx = dw = db = None
        if need_dgrad or need_wgrad:  # (a bias-only backward quantizes nothing)
            gr, gc, gs = _cast(cfg.grad_output_q, dy2d, need_dgrad, need_wgrad, f"grad_output of {cfg.name}")
            if need_dgrad:
                dx = _mm(gr, gs, spec.grad_output, False, wc, ws, spec.weight, True, dy.dtype,
                         f"dgrad of {cfg.name}").reshape(ctx.x_shape)
            if need_wgrad:
                xc = x_saved
                if spec.save_original_input:  # (a replay of the forward's cast: its scale, nothing recorded)
                    _, xc, xs = _cast(cfg.input_q, x_saved, False, True, f"input of {cfg.name}")
                dw = _mm(gc, gs, spec.grad_output, True, xc, xs, spec.input, True, dy.dtype,
                         f"wgrad of {cfg.name}").to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None


# [Note: the delayed-scaling Linear as one op] On CUDA the call is the extension's op `hybridq::fp8_linear_delayed`
# (csrc/linear_fp8.cpp: hybridq::fp8_linear's C++ node, its casts given the quantizers' scales and histories), so
# Python pays one op call per forward and one hook call per backward instead of a Python autograd node and its op
# calls. Python keeps each cast's state steps, in the general path's order per quantizer: for x and the weight before
# the op (the replay check, `begin_delayed_cast` -- the pending update by `update_before_cast` -- and whether it is a
# replay: then the op is given no history, records nothing; both pending updates in one launch where the update
# kernel takes both, `update_before_casts`) and `mark_amax_recorded` after it; for dy in a pre-hook
# of the op's node (`_GradOutputState`: runs before its backward; the backward-pass count first, as the general
# path's `saved_quantized`). The node holds dy's scale and history by reference, so dy's update must be in place: the
# update kernel takes that quantizer (`_kernel_ok`: state on the call's device) -- always so after its first step;
# a state a load replaced between forward and backward is copied into the held tensors, which become the state again.
# It takes the calls `_Float8GraphLinear`-style fast path takes on CUDA, outside a TorchDispatchMode (which would see
# the op, not the casts), without save_original_input (its backward cast replays the forward's scale, which a batched
# update may have copied) and with three quantizers whose state tensors are all distinct (their steps are reordered
# around one op). HYBRIDQ_DELAYED_LINEAR_OP=0 starts a process with the Python node
# (bitwise equal; benchmarks compare the two).
_DELAYED_OP = Switch("HYBRIDQ_DELAYED_LINEAR_OP")


def _one_op(x: torch.Tensor, spec: Float8GraphSpec, cfg) -> bool:
    xq, wq, gq = cfg.input_q, cfg.weight_q, cfg.grad_output_q
    if not (_DELAYED_OP.on and x.is_cuda and not spec.save_original_input
            and not torch._C._len_torch_dispatch_stack()):
        return False
    states = (xq.scale, xq.amax_history, wq.scale, wq.amax_history, gq.scale, gq.amax_history)
    return (len({id(t) for t in states}) == 6 and xq is not wq and wq is not gq and xq is not gq
            and gq.amax_history.device == x.device and _kernel_ok(gq))


class _GradOutputState:
    """The pre-hook of a `hybridq::fp8_linear_delayed` node: dy's state steps before its cast in the node's backward
    (see the Note above)."""

    __slots__ = ("q", "scale", "history")

    def __init__(self, q: Float8Quantizer | None):
        self.q = q
        self.scale, self.history = (None, None) if q is None else (q.scale, q.amax_history)

    def __call__(self, grad_outputs):
        count_backward_pass()  # (as the general path's saved_quantized: the delayed quantizers' step counter)
        q = self.q
        if q is None:  # (a bias-only backward casts nothing)
            return None
        q.begin_delayed_cast(self.history.device, lambda: update_before_cast(q))
        if q.scale is not self.scale or q.amax_history is not self.history:  # (replaced since forward: a load)
            self.scale.copy_(q.scale)
            self.history.copy_(q.amax_history)
            q.scale, q.amax_history = self.scale, self.history
        q.mark_amax_recorded()
        return None


def _run_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec, cfg,
            need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
    xq, wq, gq = cfg.input_q, cfg.weight_q, cfg.grad_output_q
    xq.check_replay(f"input of {cfg.name}")  # (both before any state changes: the errors name the tensor)
    wq.check_replay(f"weight of {cfg.name}")
    x_replay, w_replay = xq.replaying(), wq.replaying()
    if not (x_replay or w_replay):  # (both pending updates in one launch where the kernel takes both)
        update_before_casts([xq, wq], x.device)
    x_scale = xq.begin_delayed_cast(x.device, lambda: update_before_cast(xq))
    w_scale = wq.begin_delayed_cast(weight.device, lambda: update_before_cast(wq))
    casts_dy = need_dgrad or need_wgrad
    xi, w, g = spec.input, spec.weight, spec.grad_output
    y = cuda_fp8_tensor.linear_op("fp8_linear_delayed")(
        x, weight, bias, x_scale, None if x_replay else xq.amax_history, w_scale,
        None if w_replay else wq.amax_history, gq.scale if casts_dy else None, gq.amax_history if casts_dy else None,
        xi.dtype, xi.amax_epsilon, xi.power_2_scale, w.dtype, w.amax_epsilon, w.power_2_scale, g.dtype,
        g.amax_epsilon, g.power_2_scale, need_dgrad, need_wgrad, native_gemm.FAST_ACCUM_FPROP)
    if not x_replay:
        xq.mark_amax_recorded()
    if not w_replay:
        wq.mark_amax_recorded()
    if y.grad_fn is not None:
        y.grad_fn.register_prehook(_GradOutputState(gq if casts_dy else None))
    return y


def eager_delayed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec,
                         cfg) -> torch.Tensor | None:
    """`x W^T + b` of an eager delayed-scaling FP8 Linear on this module's calls, or None where the general path
    must run (see the module docstring; the caller checks the weight's form, the cache and the override). `cfg`:
    the layer's linear_function configuration (its quantizers hold the state)."""
    if cfg.input_gather is not None:
        return None
    need_dgrad, need_wgrad = gradients_needed(x, weight)
    if not _cached_fast_call(x, weight, spec, cfg, need_dgrad, need_wgrad):
        return None
    if not (need_dgrad or need_wgrad or (torch.is_grad_enabled() and bias is not None and bias.requires_grad)):
        # no gradient flows: rowwise forms only, nothing saved (linear_function._forward_only)
        x2d = x.reshape(-1, x.shape[-1])
        y = _fprop(x2d, weight, bias, spec, cfg, False, False)[0]
        return torch.ops.aten._unsafe_view(y.contiguous(), (*x.shape[:-1], y.shape[-1]))
    if _one_op(x, spec, cfg):
        return _run_op(x, weight, bias, spec, cfg, need_dgrad, need_wgrad)
    return _DelayedLinear.apply(x, weight, bias, spec, cfg, need_dgrad, need_wgrad)

