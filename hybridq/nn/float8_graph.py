"""An FP8 Linear (per-tensor or block scaling) inside torch.compile's graph as the individual ops it is made of.

compiled_linear.py puts any hybridq Linear into a compiled graph as two opaque custom ops whose bodies run the eager
Python: exact for every format, but each call still pays that Python (~0.25 ms forward, ~0.23 ms backward on the
host), and Inductor sees nothing inside. A layer whose three quantizers are per-tensor FP8 with current scaling, or
all FP8 block scaling (1x128 activations and gradients, 1x128 or 128x128 weights), needs none of that machinery:
each cast is one call of the extension's C++ op (`hybridq::fp8_tensor_quantize` / `hybridq::fp8_block_quantize`,
with fakes), each GEMM one `torch._scaled_mm` (per-tensor) or one `hybridq::fp8_block_gemm` (block scaling: a small
op around hybridq's eager GEMM dispatch, since torch 2.11's block-scaled GEMM cannot run on fake tensors). Here that
layer is an autograd.Function dynamo traces through, so the graph holds those ops themselves, and AOTAutograd's
common-subexpression pass merges the casts of one tensor read by several layers (q/k/v, w1/w3) into one, as the
eager path's input sharing does.

The same ops run the eager layer too (`eager_float8_linear`, called by `Linear` outside torch.compile): its general
path (linear_function.py) builds quantized tensors, looks kernels and GEMMs up in the dispatch tables and checks
every call, ~0.8 ms of host time per forward + backward on a GPU; this one is the few op calls themselves. It takes
a call only where the general path would run exactly these kernels and GEMMs (see `eager_float8_linear`), and
keeps what that path does around them: the quantized input shared by layers reading one tensor, the max|x| a norm
handed over, the shape errors (by declining: the general path raises them). A per-tensor layer on CUDA goes one step
further (`_one_op`): the whole call is the extension's op `hybridq::fp8_linear` (csrc/linear_fp8.cpp), the same
kernels and GEMMs with a C++ autograd node, so Python issues one op per forward and none in backward -- on a plain
weight and on FSDP2's gathered one (the op is handed the gathered parts; its node reads the columnwise part after
the backward unshard refilled it), and on the is_first_microbatch cache's quantized weight, handed over as the gathered
one ([Note: a cached weight on the fast path]). An FP8 block layer on CUDA does the same (`_one_block_op`: `hybridq::
fp8_block_linear`, csrc/linear_fp8_block.cpp), on a plain or a gathered weight, where its GEMMs all run as the
extension's block GEMM op.

The results are bitwise those of the eager layer: the same kernels (or, on the CPU, the same reference ops) with the
same arguments, the same GEMMs, the same saved directions. Where the eager layer would take another path -- no
extension or no FP8 tensor cores on the device, a per-tensor GEMM dimension that is not a multiple of 16 (the eager
layer warns and emulates), an input dtype the kernels do not read -- `takes` says no and the layer runs as
compiled_linear's ops, which run the eager code. On the CPU the casts are the pure-PyTorch reference and the GEMMs
the fp32 emulation (dequantize, multiply), as in eager (the block reference as one opaque op: see below).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch

from .. import dispatch
from ..enums import COLUMNWISE, ROWWISE, Scaling
from ..formats.float8 import Float8Quantizer, Float8TensorPart, float8_current_scaling
from ..formats.float8_block import Float8BlockPart, Float8BlockQuantizer, float8_block_current
from ..formats.base import option_names
from ..gemm import gemm
from ..kernels import _ext, cuda_fp8_block, cuda_fp8_tensor, native_gemm
from ..kernels.cuda import IN_DTYPES
from ..kernels.cuda_fp8_block import OPTIONS as FP8_BLOCK_OPTIONS
from ..kernels.cuda_fp8_tensor import OPTIONS as FP8_TENSOR_OPTIONS
from ..switches import Switch, Turned
from ..tensor import QuantizedTensor
from ..torch_private import graph_task_id
from .fused_input import prequantized_input
from .first_order import first_order_only
from .known_amax import known_amax
from .linear_function import _SHARED, _SHARING, SharedParts, gradients_needed
from .plain_ops import plain_op

__all__ = ["Float8Cast", "Float8GraphSpec", "graph_spec", "takes", "float8_graph_linear", "eager_float8_linear",
           "eager_fast_path", "gathered_cpp_ops"]

PER_TENSOR = 0  # Float8Cast.block_dim of a per-tensor scale (1: 1x128 blocks, 2: 128x128 tiles)


class Float8Cast(NamedTuple):
    """What one FP8 cast with current scaling depends on."""

    dtype: torch.dtype
    amax_epsilon: float
    power_2_scale: bool
    block_dim: int  # PER_TENSOR, 1 or 2


class Float8GraphSpec(NamedTuple):
    """A layer's configuration as the traced code reads it (plain constants: dynamo guards on them)."""

    input: Float8Cast
    weight: Float8Cast
    grad_output: Float8Cast
    save_original_input: bool

    @property
    def per_tensor(self) -> bool:
        return self.input.block_dim == PER_TENSOR

    def describe(self) -> str:
        """Its casts, for messages."""
        blocks = {PER_TENSOR: "per-tensor", 1: "1x128 blocks", 2: "128x128 tiles"}
        names = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2"}
        return ", ".join(f"{t} FP8 {names.get(c.dtype, c.dtype)} {blocks[c.block_dim]}"
                         for t, c in (("input", self.input), ("weight", self.weight), ("grad_output", self.grad_output)))


def _cast(q) -> Float8Cast | None:
    """The cast of a quantizer this module implements (exactly `Float8Quantizer` with current scaling or exactly
    `Float8BlockQuantizer`, with no option it does not know), else None."""
    if type(q) is Float8Quantizer and q.scaling == Scaling.CURRENT:
        options, block_dim = FP8_TENSOR_OPTIONS, PER_TENSOR
    elif type(q) is Float8BlockQuantizer:
        options, block_dim = FP8_BLOCK_OPTIONS, q.block_dim
    else:
        return None
    if option_names(type(q)) - options:
        return None  # an option added later is never silently ignored here
    return Float8Cast(q.dtype, float(q.amax_epsilon), bool(q.power_2_scale), block_dim)


def graph_spec(quantizers: dict, save_original_input: bool) -> Float8GraphSpec | None:
    """The spec of a layer whose input, weight and grad_output quantizers are all per-tensor FP8 with current
    scaling, or all FP8 block scaling with 1x128 input and grad_output blocks (the GEMMs' first operands), else
    None."""
    casts = [_cast(quantizers[role]) for role in ("input", "weight", "grad_output")]
    if any(c is None for c in casts):
        return None
    x, w, g = casts
    per_tensor = all(c.block_dim == PER_TENSOR for c in casts)
    blocks = x.block_dim == g.block_dim == 1 and w.block_dim in (1, 2)
    if not (per_tensor or blocks):
        return None
    return Float8GraphSpec(x, w, g, bool(save_original_input))


@torch.compiler.assume_constant_result
def _cuda_fp8_ready(index: int) -> bool:
    """The extension's kernels and the FP8 tensor cores (sm_89+) are there on CUDA device `index` (a fact of the
    machine: compiled code reads it as a constant)."""
    ready = _FP8_READY.get(index)
    if ready is None:
        device = torch.device("cuda", index)
        # (the extension is loaded once and stays loaded or not: the answer never changes)
        ready = _FP8_READY[index] = (_ext.available_for(device)
                                     and torch.cuda.get_device_capability(device) >= (8, 9))
    return ready


_FP8_READY: dict = {}  # device index -> _cuda_fp8_ready's answer (asked once: several us per call otherwise)


def takes(spec: Float8GraphSpec | None, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call runs as the ops of this module: the eager layer would run exactly these kernels and GEMMs
    (see the module docstring). Traced by dynamo."""
    if spec is None or x.device != weight.device:
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or x.dtype not in IN_DTYPES or weight.dtype not in IN_DTYPES:
        return False
    if not _cuda_fp8_ready(x.device.index or 0):
        return False
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if not spec.per_tensor:  # (the block GEMM op runs the eager GEMM dispatch, whatever the shapes)
        return m > 0
    pairs = ((spec.input.dtype, spec.weight.dtype), (spec.grad_output.dtype, spec.weight.dtype),
             (spec.grad_output.dtype, spec.input.dtype))
    # fprop [m, k] x [n, k], dgrad [m, n] x [k, n], wgrad [n, m] x [k, m]: the same three dimensions
    return (native_gemm.native_enabled() and m > 0 and native_gemm.fp8_tensor_shape_supported(m, k, n)
            and all(native_gemm.fp8_tensor_pair_supported(a, b) for a, b in pairs))


def _quantize(x2d: torch.Tensor, cast: Float8Cast, rowwise: bool, columnwise: bool,
              amax: torch.Tensor | None = None) -> tuple:
    """(rowwise fp8 `[M, K]`, its scale_inv, columnwise fp8 `[K, M]`, its scale_inv), each None for a direction
    not asked for; per-tensor scaling: both directions share the one scale_inv `[1]`. `amax`: max|x2d| known
    beforehand (per-tensor only; the same value the cast would compute, so the same bits)."""
    if cast.block_dim == PER_TENSOR:
        if x2d.is_cuda:
            if amax is not None and not (amax.dtype is torch.float32 and amax.shape == (1,) and amax.device == x2d.device):
                # (a norm's max|y| is already fp32 [1] on y's device: two dispatcher round trips fewer per call)
                amax = amax.to(device=x2d.device, dtype=torch.float32).reshape(1)
            row, col, rs, _ = torch.ops.hybridq.fp8_tensor_quantize(
                x2d.contiguous(), cast.dtype, None, amax, cast.amax_epsilon, cast.power_2_scale, rowwise, columnwise,
                False)
        else:
            row, rs = float8_current_scaling(x2d, cast.dtype, cast.amax_epsilon, cast.power_2_scale, amax)
            col = row.t().contiguous() if columnwise else None
        cs = rs
    elif x2d.is_cuda:
        row, rs, col, cs = torch.ops.hybridq.fp8_block_quantize(
            x2d.contiguous(), cast.dtype, cast.block_dim, cast.amax_epsilon, cast.power_2_scale, rowwise, columnwise)
    else:
        row, rs, col, cs = torch.ops.hybridq.fp8_block_quantize_reference(
            x2d, cast.dtype, cast.block_dim, cast.amax_epsilon, cast.power_2_scale, rowwise, columnwise)
    return ((row, rs) if rowwise else (None, None)) + ((col, cs) if columnwise else (None, None))


# [Note: one dense input quantization in the graph] A transformer block's q/k/v projections read one tensor (the
# attention norm's output) and its gate/up projections (w1, w3) another (the MLP norm's); eager quantizes each once
# for all its readers (linear_function's input sharing). A compiled Linear on FSDP2's gathered weight is one opaque op
# per phase (compiled_linear.py's gathered ops), so each call quantized its input inside and the graph could not see
# that three calls quantize one x. For a per-tensor FP8 input with current scaling (the fast spec), the compiled layer
# quantizes its input in an op of its own, `linear_input_quantize`, a pure function of x and the input's cast (dtype,
# epsilon, power-of-2 scales) and of whether wgrad reads the columnwise form; the gathered forward op takes its
# outputs (x_row, x_scale_inv, x_col) and runs the fprop GEMM on them (on CUDA `hybridq::fp8_linear_fprop`'s handed
# parts), and the layer's autograd saves x_col and x_scale_inv for wgrad. Current scaling is deterministic (the scale
# is a function of max|x| alone), so calls with equal arguments give the same bytes, and AOTAutograd's min-cut
# partitioner's CSE (fx_graph_cse: equal call_function nodes, custom ops included; Inductor and aot_eager, torch 2.11
# and 2.13) merges them: one quantization and one saved columnwise form per norm output. Calls that differ -- another
# input cast, save_original_input or a frozen weight (no columnwise form) -- stay apart; a graph without backward
# (no_grad) is not partitioned, and there the layer quantizes inside the forward op as before. Cost: one more op call
# per layer (the split) against two quantize kernels and the op's host work fewer per repeated read.
@plain_op("hybridq::linear_input_quantize")
def linear_input_quantize(x: torch.Tensor, dtype: torch.dtype, amax_epsilon: float, power_2_scale: bool,
                          columnwise: bool, amax: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[x's rowwise FP8 data `[M, K]`, its scale_inv `[1]`, its columnwise data `[K, M]` (empty without
    `columnwise`)] of x's `[M, K]` view, per-tensor FP8 with current scaling: the cast `_quantize` runs, so the
    bytes the gathered forward would have made itself. `amax`: max|x| as x's producer computed it (handed over in
    the graph by compiled_amax.py's pass: the same value, so the same bytes)."""
    x2d = x.reshape(-1, x.shape[-1])
    row, rs, col, _ = _quantize(x2d, Float8Cast(dtype, amax_epsilon, power_2_scale, PER_TENSOR), True, columnwise,
                                amax)
    # (contiguous tensors of their own, as the fake's)
    return [row.contiguous(), rs.contiguous(), col.contiguous() if columnwise else x.new_empty(0, dtype=dtype)]


@linear_input_quantize.register_fake
def _(x, dtype, amax_epsilon, power_2_scale, columnwise, amax=None):
    k = x.shape[-1]
    m = x.numel() // k
    return [x.new_empty((m, k), dtype=dtype), x.new_empty(1, dtype=torch.float32),
            x.new_empty((k, m), dtype=dtype) if columnwise else x.new_empty(0, dtype=dtype)]


def _block_reference(x2d, dtype, block_dim, amax_epsilon, power_2_scale, rowwise, columnwise) -> list[torch.Tensor]:
    out = float8_block_current(x2d, dtype, block_dim, amax_epsilon, power_2_scale, rowwise, columnwise)
    # (copies: an op's outputs may alias neither its input nor one another, e.g. a one-tile scale and its transpose)
    return [x2d.new_empty(0) if t is None else t.clone(memory_format=torch.contiguous_format) for t in out]


# The CPU reference of block scaling as one opaque op: Inductor's CPU code generation fails on its padded block
# views for some shapes (an internal assertion, e.g. 192 columns in 128-wide blocks, torch 2.13), and CPU speed does
# not matter. Real and fake run the same reference (on fake tensors for the fake).
@torch.library.custom_op("hybridq::fp8_block_quantize_reference", mutates_args=())
def fp8_block_quantize_reference(x2d: torch.Tensor, dtype: torch.dtype, block_dim: int, amax_epsilon: float,
                                 power_2_scale: bool, rowwise: bool, columnwise: bool) -> list[torch.Tensor]:
    """`float8_block_current` as an op: [rowwise data, scale_inv, columnwise data, scale_inv] (empty when not
    asked for)."""
    return _block_reference(x2d, dtype, block_dim, amax_epsilon, power_2_scale, rowwise, columnwise)


fp8_block_quantize_reference.register_fake(_block_reference)


def _block_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, a_block_dim: int, a_columnwise: bool,
                b: torch.Tensor, b_scale_inv: torch.Tensor, b_block_dim: int, b_columnwise: bool,
                out_dtype: torch.dtype, what: str) -> torch.Tensor:
    """`a @ b^T` of two FP8-block operands as plain tensors, by hybridq's GEMM dispatch: the native block GEMM
    where it takes them, else the emulation (with the eager layer's warnings; `what` names the GEMM)."""
    parts = [Float8BlockPart(rows=t.shape[0], cols=t.shape[1], columnwise=c, data=t, scale_inv=s, block_dim=d)
             for t, s, d, c in ((a, a_scale_inv, a_block_dim, a_columnwise), (b, b_scale_inv, b_block_dim,
                                                                            b_columnwise))]
    return gemm(*parts, out_dtype, what)


fp8_block_gemm = torch.library.custom_op("hybridq::fp8_block_gemm", _block_gemm, mutates_args=())


@fp8_block_gemm.register_fake
def _(a, a_scale_inv, a_block_dim, a_columnwise, b, b_scale_inv, b_block_dim, b_columnwise, out_dtype, what):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _mm(a: torch.Tensor, a_scale_inv: torch.Tensor, a_cast: Float8Cast, a_columnwise: bool, b: torch.Tensor,
        b_scale_inv: torch.Tensor, b_cast: Float8Cast, b_columnwise: bool, out_dtype: torch.dtype,
        what: str) -> torch.Tensor:
    """`a @ b^T` of two FP8 operands in GEMM orientation, as the eager `gemm` computes it."""
    if a_cast.block_dim != PER_TENSOR:
        if not torch.compiler.is_compiling():  # (eager: the op's body itself, without the custom op's dispatch)
            return _block_gemm(a, a_scale_inv, a_cast.block_dim, a_columnwise, b, b_scale_inv, b_cast.block_dim,
                               b_columnwise, out_dtype, what)
        return torch.ops.hybridq.fp8_block_gemm(a, a_scale_inv, a_cast.block_dim, a_columnwise, b, b_scale_inv,
                                                b_cast.block_dim, b_columnwise, out_dtype, what)
    if a.is_cuda:
        fast = native_gemm.FAST_ACCUM_FPROP and not a_columnwise and not b_columnwise
        return native_gemm.fp8_tensor_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, fast)
    return native_gemm.fp8_tensor_emulated_mm(a, a_scale_inv, b, b_scale_inv, out_dtype)


class _Float8GraphLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec,
                need_dgrad: bool, need_wgrad: bool, x_parts: tuple | None = None,
                w_parts: tuple | None = None, name: str | None = None) -> torch.Tensor:
        # x_parts: x already quantized (eager: another layer's quantization of the same tensor, or one from a known
        # max|x|), as _quantize returns it. w_parts (eager): the weight arrived quantized (FSDP2's gathered weight):
        # (rowwise data, its scale_inv, the columnwise part or None), the part kept as a handle whose tensors the
        # backward unshard refills (as linear_function keeps the gathered weight). name (eager): the layer's, for
        # messages (traced code passes none: dynamo would guard on it and trace every layer anew)
        x2d = x.reshape(-1, x.shape[-1])
        ctx.w_col = None
        if w_parts is not None:
            wr, wrs, ctx.w_col = w_parts
            wc = wcs = None
        else:
            wr, wrs, wc, wcs = _quantize(weight, spec.weight, True, need_dgrad)
        y, x_saved, xcs = _fprop(x2d, x_parts, wr, wrs, bias, spec, need_wgrad)
        ctx.save_for_backward(x_saved, xcs, wc, wcs)
        # (not ctx.name: that would hide the node's own name())
        ctx.spec, ctx.need_dgrad, ctx.need_wgrad, ctx.layer_name = spec, need_dgrad, need_wgrad, name
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        # (a tensor of its own, not a view: see linear_function._output)
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    @first_order_only(lambda ctx: f"{ctx.layer_name or 'an FP8 Linear'} ({ctx.spec.describe()})")
    def backward(ctx, dy: torch.Tensor):
        x_saved, xcs, wc, wcs = ctx.saved_tensors
        if ctx.w_col is not None:
            wc, wcs = ctx.w_col.data, ctx.w_col.scale_inv
        dx, dw, db = _grads(ctx.spec, dy, x_saved, xcs, wc, wcs, ctx.need_dgrad, ctx.need_wgrad,
                            ctx.b_dtype is not None and ctx.needs_input_grad[2], ctx.x_shape, ctx.w_dtype,
                            ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _fprop(x2d: torch.Tensor, x_parts: tuple | None, wr: torch.Tensor, wrs: torch.Tensor,
           bias: torch.Tensor | None, spec: Float8GraphSpec, need_wgrad: bool) -> tuple:
    """(y `[M, N]`, what wgrad reads of x: its `[M, K]` view (save_original_input) or columnwise data, that
    data's scale_inv) of the layer's forward on the weight's rowwise `wr`, `wrs`; `x_parts` as `_quantize` returns
    them (None: x is quantized here)."""
    keep_x = need_wgrad and spec.save_original_input  # wgrad quantizes the original input in backward
    xr, xrs, xc, xcs = x_parts or _quantize(x2d, spec.input, True, need_wgrad and not keep_x)
    y = _mm(xr, xrs, spec.input, False, wr, wrs, spec.weight, False, x2d.dtype, "fprop of a compiled layer")
    if bias is not None:
        y = y + bias.to(x2d.dtype)
    return y, x2d if keep_x else xc, xcs


def _grads(spec: Float8GraphSpec, dy: torch.Tensor, x_saved, xcs, wc, wcs, need_dgrad: bool, need_wgrad: bool,
           need_bgrad: bool, x_shape, w_dtype: torch.dtype, b_dtype: torch.dtype | None) -> tuple:
    """(dx in `x_shape`, dW, db), each None where not needed, from what `_fprop` saved and the weight's
    columnwise `wc`, `wcs`."""
    dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
    dx = dw = db = None
    if need_dgrad or need_wgrad:
        gr, grs, gc, gcs = _quantize(dy2d, spec.grad_output, need_dgrad, need_wgrad)
        if need_dgrad:
            dx = _mm(gr, grs, spec.grad_output, False, wc, wcs, spec.weight, True, dy.dtype,
                     "dgrad of a compiled layer").reshape(x_shape)
        if need_wgrad:
            xc = x_saved
            if spec.save_original_input:
                _, _, xc, xcs = _quantize(x_saved, spec.input, False, True)
            dw = _mm(gc, gcs, spec.grad_output, True, xc, xcs, spec.input, True, dy.dtype,
                     "wgrad of a compiled layer").to(w_dtype)
    if need_bgrad:
        db = dy2d.sum(0).to(b_dtype)
    return dx, dw, db


def float8_graph_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        spec: Float8GraphSpec) -> torch.Tensor:
    """`x W^T + b` of an FP8 layer as traceable ops (call only where `takes` says yes)."""
    need_dgrad, need_wgrad = gradients_needed(x, weight)  # neither: rowwise forms only, nothing saved
    return _Float8GraphLinear.apply(x, weight, bias, spec, need_dgrad, need_wgrad)


# ---- eager: the same ops outside torch.compile -----------------------------------------------------------------

# Eager FP8 Linears as this module's ops or through the general path of linear_function.py (bitwise equal; tests
# and benchmarks compare the two). HYBRIDQ_EAGER_FAST_PATH=0 starts a process with the general path.
_EAGER = Switch("HYBRIDQ_EAGER_FAST_PATH")


def eager_fast_path(enabled: bool) -> Turned:
    """Whether eager FP8 Linears whose quantizers `graph_spec` describes run as this module's ops (default: on; the
    environment variable HYBRIDQ_EAGER_FAST_PATH=0 starts a process with it off) or through the general path of
    linear_function.py; results are bitwise equal either way (tests and benchmarks compare the two).
    `eager_fast_path(False)` from then on; `with eager_fast_path(False): ...` only inside the block."""
    return _EAGER.turned(enabled)


_BUILTIN_QUANTIZE = {Float8Quantizer: "cuda-fp8-tensor", Float8BlockQuantizer: "cuda-fp8-block"}
_PART = {PER_TENSOR: Float8TensorPart, 1: Float8BlockPart, 2: Float8BlockPart}


def _dispatch_is_builtin(quantizers, device_type: str, part_type: type) -> bool:
    """Whether the general path would run this module's kernels and GEMMs on `device_type`: no quantize kernel or
    GEMM registered ahead of the extension's (a user's kernel for these types, tried first there), and no
    quantizer whose `quantize` an instance attribute replaced (a wrapper or a spy sees the general path's calls)."""
    if dispatch._GEMM.get((part_type, part_type)):
        return False
    for q in quantizers:
        if "quantize" in q.__dict__:
            return False
        if device_type != "cpu":
            impls = dispatch._QUANTIZE.get(type(q))
            if not impls or impls[0].name != _BUILTIN_QUANTIZE[type(q)]:
                return False
    return True


def _part(cast: Float8Cast, data: torch.Tensor, scale_inv: torch.Tensor, columnwise: bool):
    """A part holding `_quantize`'s tensors of one direction, as the format's kernels and reference build it."""
    rows, cols = data.shape
    if cast.block_dim == PER_TENSOR:
        return Float8TensorPart(rows=rows, cols=cols, columnwise=columnwise, data=data, scale_inv=scale_inv)
    return Float8BlockPart(rows=rows, cols=cols, columnwise=columnwise, data=data, scale_inv=scale_inv,
                           block_dim=cast.block_dim)


def _shared_input(x: torch.Tensor, q, cast: Float8Cast, columnwise: bool) -> tuple | None:
    """x quantized as `_quantize` returns it, shared with the other layers reading x through linear_function's
    table (the same entries, so layers on either path share with one another: this path puts SharedParts, which
    the general path turns into a QuantizedTensor only where it reads one), or from the max|x| its producer handed
    over; None when neither applies (the Function quantizes x itself)."""
    share = _SHARING.on and not x.is_inference()  # (current scaling is deterministic)
    xq = _SHARED.find_any(x, q, columnwise) if share else None
    if isinstance(xq, SharedParts):
        xr, xrs, xc, xcs = xq.tensors
        return (xr, xrs, xc, xcs) if columnwise else (xr, xrs, None, None)
    # (x's [M, K] view; a 2-D x is its own: a reshape is a view op, several us of host time)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if xq is None:  # a norm may have written the rowwise form ([Note: pre-quantized norm outputs], fused_input.py)
        xq = prequantized_input(q, x, x2d, columnwise, "input")
        if xq is not None and share:
            _SHARED.put(x, q, xq)
    if xq is not None:
        r = xq.part(ROWWISE)
        c = xq.part(COLUMNWISE) if columnwise else None
        return (r.data, r.scale_inv) + ((c.data, c.scale_inv) if c is not None else (None, None))
    amax = known_amax(x) if cast.block_dim == PER_TENSOR else None
    if not share and amax is None:
        return None
    parts = _quantize(x2d.detach(), cast, True, columnwise, amax)  # (outside the Function: record nothing)
    if share:
        xr, xrs, xc, xcs = parts
        shape, dtype = x2d.shape, x2d.dtype
        _SHARED.put(x, q, SharedParts(parts, lambda: QuantizedTensor(
            _part(cast, xr, xrs, False), None if xc is None else _part(cast, xc, xcs, True), shape=shape,
            dtype=dtype)))
    return parts


def _gathered_parts(weight: QuantizedTensor, cast: Float8Cast, need_dgrad: bool) -> tuple | None:
    """`w_parts` of a weight that arrived quantized (FSDP2's gathered weight) in the parts `cast` makes, contiguous
    (what the hardware GEMM reads), else None."""
    # (the columnwise part is held for backward, whose unshard fills it: `held_part`, not read here)
    parts = [weight.part(ROWWISE)] + ([weight.held_part(COLUMNWISE)] if need_dgrad else [])
    if not all(_part_fits(p, cast) for p in parts):
        return None
    return parts[0].data, parts[0].scale_inv, parts[1] if need_dgrad else None


def _part_fits(p, cast: Float8Cast) -> bool:
    """Whether the quantized part `p` is one `cast` makes, contiguous (what the hardware GEMM reads)."""
    return (type(p) is _PART[cast.block_dim] and p.data.dtype == cast.dtype and p.data.is_contiguous()
            and (cast.block_dim == PER_TENSOR or p.block_dim == cast.block_dim))


# `_fast_call`'s answers (falsy: the general path runs)
NO_FAST_PATH = 0
FAST_PATH = 1  # this module's ops
FAST_PATH_BLOCK_GEMMS = 2  # FP8 blocks whose every GEMM native_gemm's dispatch runs as `hybridq::fp8_block_mm`


def _fast_call(x: torch.Tensor, weight: torch.Tensor, spec: Float8GraphSpec, cfg, need_dgrad: bool,
               need_wgrad: bool) -> int:
    """The checks of `eager_float8_linear` that do not depend on the weight's form: the fast path is on, `takes`,
    the dispatch tables' own kernels, a floating-point input with at least one row, every shape rule met
    (NO_FAST_PATH where one fails); FAST_PATH_BLOCK_GEMMS where moreover the call's block GEMMs all run as the
    extension's op (`_block_gemms_native`), else FAST_PATH."""
    if not _EAGER.on or not x.is_floating_point() or x.dim() < 2:
        return NO_FAST_PATH
    if not (takes(spec, x, weight) and _dispatch_is_builtin(
            (cfg.input_q, cfg.weight_q, cfg.grad_output_q), x.device.type, _PART[spec.input.block_dim])):
        return NO_FAST_PATH
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if m == 0 or k == 0 or n == 0:
        return NO_FAST_PATH
    if not (cfg.input_q.shape_rule(m, k, True, need_wgrad) is None
            and not ((need_dgrad or need_wgrad)
                     and cfg.grad_output_q.shape_rule(m, n, need_dgrad, need_wgrad) is not None)):
        return NO_FAST_PATH
    if not spec.per_tensor and _block_gemms_native(spec, x, m, k, n, need_dgrad, need_wgrad):
        return FAST_PATH_BLOCK_GEMMS
    return FAST_PATH


def _block_gemms_native(spec: Float8GraphSpec, x: torch.Tensor, m: int, k: int, n: int, need_dgrad: bool,
                        need_wgrad: bool) -> bool:
    """Whether native_gemm's dispatch takes each block GEMM of this call (fprop; dgrad, wgrad where needed) by its
    shapes, dtypes and device (`native_gemm._block_supports`: native GEMMs on, sm_90, E4M3 operands, the contracted
    dim a multiple of 128, the others of 16; the parts `_quantize` makes are contiguous): then it runs
    `hybridq::fp8_block_mm` on each, unless the op is switched off or a block GEMM failed before (read per call:
    `_one_block_op`)."""
    if not x.is_cuda or not native_gemm.native_enabled() or not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    gemms = [(spec.input, spec.weight, m, k, n)]  # (a's cast, b's, a's rows, the contracted dim, b's rows)
    if need_dgrad:
        gemms.append((spec.grad_output, spec.weight, m, n, k))  # dy [M, N] x the weight's columnwise [K, N]
    if need_wgrad:
        gemms.append((spec.grad_output, spec.input, n, m, k))  # dy's columnwise [N, M] x x's columnwise [K, M]
    e4 = torch.float8_e4m3fn
    return (all(a.dtype == e4 and b.dtype == e4 and rows % 16 == 0 and inner % 128 == 0 and b_rows % 16 == 0
                for a, b, rows, inner, b_rows in gemms)
            and native_gemm._cap(x) == (9, 0))


def eager_float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec,
                        cfg, weight_cache: Callable[[bool], QuantizedTensor] | None = None) -> torch.Tensor | None:
    """`x W^T + b` of an eager FP8 Linear as this module's ops, or None where the general path must run: the call
    is one the general path (linear_function.apply_linear, `cfg` its configuration, `weight_cache` the same
    argument) would run as exactly these kernels and GEMMs -- a plain weight, FSDP2's gathered one or the
    is_first_microbatch cache's quantization of a plain weight (`weight_cache`) in this spec's parts (not a quantized
    parameter), no backward override, no sequence-parallel input (the caller checks those), `takes`, the dispatch
    tables' own kernels (`_dispatch_is_builtin`), a floating-point input with at least one row, and every shape rule
    met (else the general path raises its error). `weight_cache` is asked only once the call runs here (a call that
    declines before leaves the cache as it was: the general path asks it)."""
    if spec is None:
        return None
    need_dgrad, need_wgrad = gradients_needed(x, weight)
    fast = _cached_fast_call(x, weight, spec, cfg, need_dgrad, need_wgrad)
    if not fast:
        return None
    w_parts = None
    if weight_cache is not None:
        # [Note: a cached weight on the fast path] the cache (linear_function.cached_quantized_weight) decides as on
        # the general path, asked with the same need_columnwise (override None: need_dgrad): quantize on the first
        # micro-batch, on a change of the weight (key, fingerprint) or for a direction missing (usage
        # preservation), else reuse. Its quantization is this spec's format (`_dispatch_is_builtin`: the format's
        # own kernels), so its parts are handed to the ops as FSDP2's gathered weight's are (the columnwise part
        # held for backward, never saved through the saved-tensor hooks: the general path keeps the cached weight
        # as a handle too), and the GEMMs read exactly what the general path's read.
        w_parts = _gathered_parts(weight_cache(need_dgrad), spec.weight, need_dgrad)
        if w_parts is None:
            return None
    elif isinstance(weight, QuantizedTensor):
        w_parts = _gathered_parts(weight, spec.weight, need_dgrad)
        if w_parts is None:
            return None
    x_col = need_wgrad and not spec.save_original_input
    x_parts = _shared_input(x, cfg.input_q, spec.input, x_col)
    # (no gradient needed: rowwise forms only, nothing saved, as the general path's forward-only call)
    if _one_op(x, spec, w_parts):
        xi, w, g = spec.input, spec.weight, spec.grad_output
        return cuda_fp8_tensor.linear_op()(
            x, weight, bias, *(x_parts or _NO_PARTS), xi.dtype, xi.amax_epsilon, xi.power_2_scale, w.dtype,
            w.amax_epsilon, w.power_2_scale, g.dtype, g.amax_epsilon, g.power_2_scale, need_dgrad, need_wgrad,
            spec.save_original_input, native_gemm.FAST_ACCUM_FPROP,
            *(_NO_PARTS if w_parts is None else _op_weight_parts(w_parts)))
    if fast == FAST_PATH_BLOCK_GEMMS and _one_block_op(spec, w_parts, x_parts):
        xi, w, g = spec.input, spec.weight, spec.grad_output
        return cuda_fp8_block.linear_op()(
            x, weight, bias, *(x_parts or _NO_PARTS), xi.dtype, xi.amax_epsilon, xi.power_2_scale, w.dtype,
            w.block_dim, w.amax_epsilon, w.power_2_scale, g.dtype, g.amax_epsilon, g.power_2_scale, need_dgrad,
            need_wgrad, spec.save_original_input, *(_NO_PARTS if w_parts is None else _op_weight_parts(w_parts)))
    return _Float8GraphLinear.apply(x, weight, bias, spec, need_dgrad, need_wgrad, x_parts, w_parts, cfg.name)


_NO_PARTS = (None, None, None, None)


def _op_weight_parts(w_parts: tuple | None) -> tuple:
    """`hybridq::fp8_linear`'s (and `fp8_block_linear`'s) (w_row, w_row_scale_inv, w_col, w_col_scale_inv) of
    `_gathered_parts`' answer. The
    columnwise part's tensors are the unsharded weight's own tensors, which FSDP2's backward unshard refills in
    place (distributed/buffers.py: storage resize, `set_`, `copy_`; a part's tensors are never replaced), so the op's
    C++ node holds them by reference and reads them in backward, as the Python node reads the part it holds."""
    if w_parts is None:
        return _NO_PARTS
    wr, wrs, col = w_parts
    return (wr, wrs) + ((None, None) if col is None else (col.data, col.scale_inv))


def _one_op(x: torch.Tensor, spec: Float8GraphSpec, w_parts: tuple | None) -> bool:
    """Whether this fast-path call runs as the extension's one op `hybridq::fp8_linear` (csrc/linear_fp8.cpp: the
    same kernels and GEMMs as `_Float8GraphLinear`, its autograd node in C++, no Python in backward): per-tensor
    scaling on a CUDA device (where `takes` found the extension) and no TorchDispatchMode active (a mode --
    selective checkpointing's policy, an op counter -- sees this Function's quantize ops, which the C++ op calls
    directly). FSDP2's gathered weight (`w_parts`) too, outside inference mode: the op reads its parts, and only its
    autograd kernel keeps the op away from the weight's __torch_dispatch__ (which takes no such op); in inference
    mode no autograd kernel runs. (The is_first_microbatch cache's parts are `w_parts` too: in inference mode they
    take `_Float8GraphLinear`, bitwise the same.)"""
    return (spec.input.block_dim == PER_TENSOR and x.is_cuda and not torch._C._len_torch_dispatch_stack()
            and (w_parts is None or not torch.is_inference_mode_enabled()))


# An FP8 block call whose GEMMs all run as `hybridq::fp8_block_mm` as the extension's one op `hybridq::fp8_block_linear`
# (csrc/linear_fp8_block.cpp: `_Float8GraphLinear`'s quantize ops and GEMMs, its autograd node in C++) or as that
# Python node (bitwise equal). HYBRIDQ_BLOCK_LINEAR_OP=0 starts a process with the Python node (benchmarks compare).
_BLOCK_OP = Switch("HYBRIDQ_BLOCK_LINEAR_OP")


def _one_block_op(spec: Float8GraphSpec, w_parts: tuple | None, x_parts: tuple | None) -> bool:
    """Whether a fast-path call `_fast_call` answered FAST_PATH_BLOCK_GEMMS runs as `hybridq::fp8_block_linear`:
    the switch and native_gemm's block GEMM op on, no block GEMM failed before (native_gemm then emulates that one,
    with its warning: the Python node's dispatch decides per GEMM), no TorchDispatchMode active (as `_one_op`), and
    the parts handed over -- x's (shared, a norm's), FSDP2's gathered weight's (`w_parts`, outside inference mode, as
    `_one_op`) -- with contiguous fp32 scales of the shapes the block GEMM op takes (native_gemm.block_op_takes_scales;
    else the dispatch relays them in Python)."""
    if not (_BLOCK_OP.on and native_gemm.BLOCK_GEMM_OP.on and not torch._C._len_torch_dispatch_stack()):
        return False
    if native_gemm._failed and any(key[0] == "block" for key in native_gemm._failed):
        return False
    if x_parts is not None:
        xr, xrs, xc, xcs = x_parts
        m, k = xr.shape
        if not (xr.is_contiguous() and _block_scales_fit(xrs, (m, k // 128))
                and (xc is None or (xc.is_contiguous() and _block_scales_fit(xcs, (k, m // 128))))):
            return False
    if w_parts is None:
        return True
    if torch.is_inference_mode_enabled():
        return False
    wr, wrs, col = w_parts  # (`_gathered_parts` checked the data: the spec's parts, contiguous)
    n, k = wr.shape
    tiles = spec.weight.block_dim == 2
    col_scales = (-(-k // 128), n // 128) if tiles else (k, n // 128)
    return (_block_scales_fit(wrs, (-(-n // 128), k // 128) if tiles else (n, k // 128))
            and (col is None or _block_scales_fit(col.scale_inv, col_scales)))


def _block_scales_fit(s: torch.Tensor, shape: tuple) -> bool:
    """Whether the block scales `s` are what `hybridq::fp8_block_mm` reads: contiguous fp32 of `shape` (metadata
    only: a gathered weight's columnwise tensors may hold no storage until the backward unshard)."""
    return s.dtype == torch.float32 and s.is_contiguous() and tuple(s.shape) == shape


# ---- a compiled Linear's gathered weight (compiled_linear.py's gathered ops run these) ----------------------------

# `_fast_call`'s answers for the eager fast path and the compiled Linear's gathered ops, by what they depend on
# besides the switch and the dispatch tables (asked at every call): the spec and config (one per layer and backward
# override, or per compiled configuration: a recipe swap or an override from the environment makes a new config), the
# devices, dtypes and shapes, the gradients (requires_grad, grad mode) and whether native GEMMs are on (`takes` and
# the shape rules: ~25 us of host per call)
_FAST_CALLS: dict[tuple, int] = {}
_MAX_FAST_CALLS = 4096


def _cached_fast_call(x: torch.Tensor, weight: torch.Tensor, spec: Float8GraphSpec, cfg, need_dgrad: bool,
                      need_wgrad: bool) -> int:
    """`_fast_call`, the shape-dependent checks asked once per `_FAST_CALLS` key (the switch and the dispatch
    tables are read at every call: they can change between calls)."""
    if not _EAGER.on or not _dispatch_is_builtin((cfg.input_q, cfg.weight_q, cfg.grad_output_q), x.device.type,
                                                    _PART[spec.input.block_dim]):
        return NO_FAST_PATH
    key = (spec, cfg, x.device, x.dtype, x.shape, weight.device, weight.dtype, weight.shape, need_dgrad, need_wgrad,
           native_gemm.native_enabled())
    ok = _FAST_CALLS.get(key)
    if ok is None:
        if len(_FAST_CALLS) >= _MAX_FAST_CALLS:
            _FAST_CALLS.clear()
        ok = _FAST_CALLS[key] = _fast_call(x, weight, spec, cfg, need_dgrad, need_wgrad)
    return ok


# The gathered ops' phases on CUDA as one extension op each -- per-tensor scaling: `hybridq::fp8_linear_fprop` /
# `fp8_linear_grads` (csrc/linear_fp8.cpp); FP8 blocks: `hybridq::fp8_block_linear_fprop` / `fp8_block_linear_grads`
# (csrc/linear_fp8_block.cpp) -- `_fprop` / `_grads` in C++, the same kernels and GEMMs, or as `_fprop` / `_grads`
# themselves (bitwise equal). HYBRIDQ_LINEAR_CPP_OPS=0 starts a process with them off (benchmarks compare the two).
_CPP_OPS = Switch("HYBRIDQ_LINEAR_CPP_OPS")


def gathered_cpp_ops(enabled: bool) -> Turned:
    """Whether a compiled Linear's gathered FP8 fast path on CUDA runs each phase (forward, gradients) as one C++ op
    of the extension (default: on; the environment variable HYBRIDQ_LINEAR_CPP_OPS=0 starts a process with it off)
    or as this module's Python ops, the same kernels and GEMMs: results are bitwise equal either way. (FP8 blocks:
    where every GEMM of the call runs as the extension's block GEMM op, `_block_phase_op`.)
    `gathered_cpp_ops(False)` from then on; `with gathered_cpp_ops(False): ...` only inside the block."""
    return _CPP_OPS.turned(enabled)


def _cpp_phase(t: torch.Tensor) -> bool:
    """Whether a gathered op's phase on `t`'s device runs as the extension's one op: CUDA (where `takes` found the
    extension, whose build has the ops: `_ext` reports a build without them as out of date) and the switch on. (No
    TorchDispatchMode sees inside the gathered ops, unlike `_one_op`'s eager call: a mode sees the gathered op
    itself, whose body then runs with the mode off.)"""
    return t.is_cuda and _CPP_OPS.on


def _block_phase_op(t: torch.Tensor, fast: int) -> bool:
    """Whether a gathered op's FP8 block phase runs as the extension's one op (`fp8_block_linear_fprop` /
    `fp8_block_linear_grads`): `_cpp_phase`, and the call's GEMMs all ones native_gemm's dispatch runs as
    `hybridq::fp8_block_mm` -- by their shapes (`fast`: `_fast_call`'s FAST_PATH_BLOCK_GEMMS), the block GEMM op on
    and no block GEMM failed before (as `_one_block_op`: the dispatch then emulates that one, with its warning). The
    caller checks the weight part's scales (`_block_part_scales_fit`)."""
    return (fast == FAST_PATH_BLOCK_GEMMS and _cpp_phase(t) and native_gemm.BLOCK_GEMM_OP.on
            and not (native_gemm._failed and any(key[0] == "block" for key in native_gemm._failed)))


def _block_part_scales_fit(part, tiles: bool) -> bool:
    """Whether a gathered block weight part's scales are what `hybridq::fp8_block_mm` reads for its data `[r, c]`:
    `[ceil(r/128), c/128]` (128x128 tiles) or `[r, c/128]` (1x128 blocks), contiguous fp32 (metadata only)."""
    r, c = part.data.shape
    return _block_scales_fit(part.scale_inv, (-(-r // 128), c // 128) if tiles else (r, c // 128))


# [Note: gathered plans] A compiled graph calls the gathered ops of each Linear at every step with the same
# configuration, shapes and weight, and every forward call used to ask again whether and how it takes the fast path
# (the fast-path checks and their cache key, the weight part's fit, the phase: issue 33's host time). A forward
# call's decision is now a plan (`GatheredForwardPlan`: the phase it runs, with the answers it rests on), made by
# `forward_plan` -- the checks as they were -- and run by `run_forward`; `gathered_forward` is the two in one, and
# compiled_linear.py keeps each gathered forward call site's plan on its weight handle (`keep`), reusing it only where
# `holds` says nothing it rests on changed: the switches and GEMM state it read (`_switch_state`: the fast path, the
# C++ phases, native GEMMs, the block GEMM op, a failed GEMM), the dispatch tables' own kernels (read at every call,
# as before), the very weight object and part it checked (weak references: a new gathered weight or a replaced part
# is planned again), the part's contiguity as it was, and the device kind. What varies per call -- the weight's part
# itself (`part`: its gather on first use, the check of a direction pending the backward unshard), the op's tensors --
# is read per call. A plan and the call it replaces run the same code (`run_forward`): bitwise the same results. The
# backward's decision (`grads_phase`: the columnwise part's fit and the phase) is cheaper than checking a kept plan
# would be (measured: a per-tensor backward body 3.9 us deciding vs 4.4 us with a plan, CPU), and is made per call.

def _switch_state() -> tuple:
    """What the gathered decisions read of process-wide state that can change between calls: the fast path's and
    the C++ phases' switches, native GEMMs, the block GEMM op and how many GEMMs failed (`native_gemm._failed` only
    grows)."""
    return (_EAGER.on, _CPP_OPS.on, native_gemm.native_enabled(), native_gemm.BLOCK_GEMM_OP.on,
            len(native_gemm._failed))


# the phase a gathered call runs: the extension's per-tensor op, its block op, or this module's Python (`_fprop` /
# `_grads`)
_TENSOR_OP, _BLOCK_OP_PHASE, _PYTHON = "tensor op", "block op", "python"


class GatheredForwardPlan:
    """`forward_plan`'s decision for a gathered forward call (`rowwise`: the weight's part it read and checked),
    and, once `keep` made it reusable, what it rests on (see [Note: gathered plans])."""

    __slots__ = ("spec", "fast", "phase", "quantizers", "rowwise", "device_type", "cuda", "switches", "weight",
                 "part", "scales_contiguous")

    def __init__(self, spec: Float8GraphSpec, fast: int, phase: str, cfg, rowwise):
        self.spec, self.fast, self.phase = spec, fast, phase
        self.quantizers = (cfg.input_q, cfg.weight_q, cfg.grad_output_q)
        self.rowwise = rowwise

    def keep(self, x: torch.Tensor, weight) -> "GatheredForwardPlan":
        """This plan, made reusable (`holds`): what it rests on taken now, for the call it was made for (the weight
        and its part weakly: a kept plan keeps neither alive)."""
        part, self.rowwise = self.rowwise, None
        self.device_type, self.cuda = x.device.type, x.is_cuda
        self.switches = _switch_state()
        self.weight, self.part = weakref.ref(weight), weakref.ref(part)
        self.scales_contiguous = part.scale_inv.is_contiguous()
        return self

    def holds(self, x: torch.Tensor, part) -> bool:
        """Whether this call would be decided the same way: x of the plan's configuration, shape, dtype and device,
        on the plan's weight (the caller checks `weight() is` it before reading its rowwise part `part`)."""
        return (self.part() is part and x.is_cuda is self.cuda
                and self.switches == _switch_state() and part.data.is_contiguous()
                and part.scale_inv.is_contiguous() is self.scales_contiguous
                and _dispatch_is_builtin(self.quantizers, self.device_type, _PART[self.spec.input.block_dim]))


def forward_plan(x: torch.Tensor, weight: QuantizedTensor, spec: Float8GraphSpec | None, cfg, need_dgrad: bool,
                 need_wgrad: bool, parts_given: bool = False) -> GatheredForwardPlan | None:
    """The plan of a gathered forward call (`gathered_forward`'s checks; `parts_given`: x's parts handed over), or
    None where the general path must run."""
    if spec is None:
        return None
    fast = _cached_fast_call(x, weight, spec, cfg, need_dgrad, need_wgrad)
    if not fast:
        return None
    wr = weight.part(ROWWISE)
    if not _part_fits(wr, spec.weight):
        return None
    if parts_given:
        if not spec.per_tensor:
            raise ValueError("gathered_forward: x_parts are per-tensor FP8 parts (linear_input_quantize); this "
                             f"layer's input is quantized in {spec.input.block_dim}-d blocks")
        phase = _TENSOR_OP if _cpp_phase(x) else _PYTHON
    elif spec.per_tensor and _cpp_phase(x):
        phase = _TENSOR_OP
    elif (not spec.per_tensor and _block_phase_op(x, fast)
          and _block_part_scales_fit(wr, spec.weight.block_dim == 2)):
        phase = _BLOCK_OP_PHASE
    else:
        phase = _PYTHON
    return GatheredForwardPlan(spec, fast, phase, cfg, wr)


def run_forward(plan: GatheredForwardPlan, x: torch.Tensor, wr, bias: torch.Tensor | None, need_wgrad: bool,
                x_parts: tuple | None = None) -> tuple:
    """`gathered_forward`'s result of a call `plan` holds for, on the weight's rowwise part `wr`."""
    spec, phase = plan.spec, plan.phase
    xi = spec.input
    if x_parts is not None:
        xr, xrs, xp_col = x_parts
        if phase is _TENSOR_OP:
            y = cuda_fp8_tensor.linear_op("fp8_linear_fprop")(
                x, wr.data, wr.scale_inv, bias, xi.dtype, xi.amax_epsilon, xi.power_2_scale, False,
                spec.save_original_input, native_gemm.FAST_ACCUM_FPROP, xr, xrs)[0]
        else:
            y, _, _ = _fprop(x.reshape(-1, x.shape[-1]), (xr, xrs, None, None), wr.data, wr.scale_inv, bias, spec,
                             False)
            y = y.reshape(*x.shape[:-1], y.shape[-1]).contiguous()
        xc, xcs = xp_col, xrs  # (per-tensor: both directions share the one scale_inv)
    elif phase is _TENSOR_OP:
        y, xc, xcs = cuda_fp8_tensor.linear_op("fp8_linear_fprop")(
            x, wr.data, wr.scale_inv, bias, xi.dtype, xi.amax_epsilon, xi.power_2_scale, need_wgrad,
            spec.save_original_input, native_gemm.FAST_ACCUM_FPROP)
    elif phase is _BLOCK_OP_PHASE:
        y, xc, xcs = cuda_fp8_block.linear_op("fp8_block_linear_fprop")(
            x, wr.data, wr.scale_inv, bias, xi.dtype, xi.amax_epsilon, xi.power_2_scale, spec.weight.block_dim,
            need_wgrad, spec.save_original_input)
    else:
        y, xc, xcs = _fprop(x.reshape(-1, x.shape[-1]), None, wr.data, wr.scale_inv, bias, spec, need_wgrad)
        # (contiguous, as the op's outputs: the gathered op's fake has those strides)
        y = y.reshape(*x.shape[:-1], y.shape[-1]).contiguous()
        if xcs is not None:
            xc, xcs = xc.contiguous(), xcs.contiguous()
    if not need_wgrad:
        return y, None, None, plan.fast
    return (y, x, None, plan.fast) if spec.save_original_input else (y, xc, xcs, plan.fast)


def gathered_forward(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None, spec: Float8GraphSpec,
                     cfg, need_dgrad: bool, need_wgrad: bool, x_parts: tuple | None = None) -> tuple | None:
    """(y in x's shape with out_features last, x_saved, xcs, `_fast_call`'s answer) of an FP8 Linear (per-tensor or
    block scaling) on FSDP2's gathered weight, as this module's ops (the eager fast path's; on CUDA one op, see
    `gathered_cpp_ops`), or None where the general path must run (the checks of `eager_float8_linear`; x quantized
    here, never shared: an op's outputs are its own). What wgrad reads of x: its columnwise data and scale_inv
    (contiguous tensors of their own: the tensors of the input `linear_function.forward_and_saved` saves, in their
    flattened order: `saved_input` builds it), x itself and None (save_original_input: wgrad quantizes x's `[M, K]`
    view), or None, None (no wgrad). Only the weight's rowwise part is read: backward reads the columnwise one then
    (`gathered_grads`, handed the answer). `x_parts`: x as `linear_input_quantize` quantized it (rowwise data, its
    scale_inv, the columnwise data or None; per-tensor only): not quantized again, and what wgrad reads of it is
    those parts ([Note: one dense input quantization in the graph]). `forward_plan` then `run_forward` ([Note:
    gathered plans])."""
    plan = forward_plan(x, weight, spec, cfg, need_dgrad, need_wgrad, x_parts is not None)
    if plan is None:
        return None
    return run_forward(plan, x, plan.rowwise, bias, need_wgrad, x_parts)


def saved_input(spec: Float8GraphSpec, x_saved: torch.Tensor | None, xcs: torch.Tensor | None, shape,
                dtype: torch.dtype):
    """The input `linear_function.forward_and_saved` saves, of what `gathered_forward` gave (the general path's
    backward reads it)."""
    if xcs is None:
        return x_saved
    return QuantizedTensor(None, _part(spec.input, x_saved, xcs, True), shape=shape, dtype=dtype)


def grads_phase(spec: Float8GraphSpec, dy: torch.Tensor, w_col, need_dgrad: bool, fast: int = FAST_PATH) -> str | None:
    """The phase a gathered backward call runs (`gathered_grads`' checks), or None where the weight's part is not one
    this spec makes (the general path runs). Decided at every call: for a per-tensor call cheaper than checking a
    kept plan (the part's fit and two switches), see [Note: gathered plans]."""
    if need_dgrad and not _part_fits(w_col, spec.weight):
        return None
    if spec.per_tensor:
        return _TENSOR_OP if _cpp_phase(dy) else _PYTHON
    if _block_phase_op(dy, fast) and (not need_dgrad or _block_part_scales_fit(w_col, spec.weight.block_dim == 2)):
        return _BLOCK_OP_PHASE
    return _PYTHON


def run_grads(spec: Float8GraphSpec, phase: str, dy: torch.Tensor, x_saved: torch.Tensor | None,
              xcs: torch.Tensor | None, w_col, need_dgrad: bool, need_wgrad: bool, need_bgrad: bool, x_shape,
              w_dtype: torch.dtype, b_dtype: torch.dtype) -> list[torch.Tensor]:
    """`gathered_grads`' result of a call `grads_phase` answered `phase` for."""
    wc, wcs = (w_col.data, w_col.scale_inv) if need_dgrad else (None, None)
    xi, g = spec.input, spec.grad_output
    if phase is _TENSOR_OP:
        return list(cuda_fp8_tensor.linear_op("fp8_linear_grads")(
            dy, x_saved, xcs, wc, wcs, xi.dtype, xi.amax_epsilon, xi.power_2_scale, g.dtype, g.amax_epsilon,
            g.power_2_scale, spec.save_original_input, need_dgrad, need_wgrad, need_bgrad, x_shape, w_dtype, b_dtype))
    if phase is _BLOCK_OP_PHASE:
        return list(cuda_fp8_block.linear_op("fp8_block_linear_grads")(
            dy, x_saved, xcs, wc, wcs, xi.dtype, xi.amax_epsilon, xi.power_2_scale, g.dtype, g.amax_epsilon,
            g.power_2_scale, spec.weight.block_dim, spec.save_original_input, need_dgrad, need_wgrad, need_bgrad,
            x_shape, w_dtype, b_dtype))
    grads = _grads(spec, dy, x_saved, xcs, wc, wcs, need_dgrad, need_wgrad, need_bgrad, torch.Size(x_shape),
                   w_dtype, b_dtype)
    return [t if t is not None else dy.new_empty(0) for t in grads]


def gathered_grads(spec: Float8GraphSpec, dy: torch.Tensor, x_saved: torch.Tensor | None, xcs: torch.Tensor | None,
                   w_col, need_dgrad: bool, need_wgrad: bool, need_bgrad: bool, x_shape, w_dtype: torch.dtype,
                   b_dtype: torch.dtype, fast: int = FAST_PATH) -> list[torch.Tensor] | None:
    """`linear_function.linear_grads` of a call `gathered_forward` ran (x_saved: x's columnwise data with its
    scale_inv xcs, or x's `[M, K]` view under save_original_input; `w_col` the gathered weight's columnwise part
    where dgrad runs; `fast` the forward's `_fast_call` answer), as this module's ops (on CUDA one op, see
    `gathered_cpp_ops`): [dx in `x_shape`, dW, db], an empty tensor for a gradient not asked for (the gathered op's
    outputs), or None where the weight's part is not one this spec makes (the general path runs). `grads_phase` then
    `run_grads`."""
    phase = grads_phase(spec, dy, w_col, need_dgrad, fast)
    if phase is None:
        return None
    return run_grads(spec, phase, dy, x_saved, xcs, w_col, need_dgrad, need_wgrad, need_bgrad, x_shape, w_dtype,
                     b_dtype)
