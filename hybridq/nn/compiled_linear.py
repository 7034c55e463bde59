"""A hybridq Linear inside torch.compile's graph: the layer as two opaque custom ops.

(A layer whose quantizers are all FP8 with current scaling, per-tensor or in blocks, is traced as its own ops
instead: float8_graph.py. Everything else comes here.)

Dynamo cannot trace a QuantizedTensor or hybridq's autograd function, so a Linear in a compiled region was a graph
break (the region split in two around an eager call). Here the Linear's forward and backward are each one custom
op over plain tensors -- `hybridq::linear_forward` returns the output and the saved operands' tensors,
`hybridq::linear_backward` the three gradients -- with autograd registered on the forward op, so a compiled block
keeps every Linear in its graph and Inductor fuses around them. Inside each op the eager code runs unchanged
(`linear_function.forward_and_saved` / `linear_function.linear_grads`): the results are bitwise the eager layer's.

Fake implementations (what compile traces with): the forward runs the same code on fake tensors (every quantize
and GEMM op hybridq calls has one), which gives the saved tensors' shapes and dtypes; the backward's outputs have
the input's, weight's and bias's shapes.

A weight FSDP2 all-gathered quantized (apply_hybrid_fsdp's `GatheredWeight`) enters the graph as a handle: its
`__tensor_flatten__` gives dynamo one inner tensor, a small int64 tensor naming the weight's state
(nn/weight_handle.py, shared with the compiled GroupedLinear), so the graph neither copies nor saves the gathered
bytes, whose storage FSDP2 frees at reshard and refills at the backward unshard. Traced, the
`hybridq::linear_forward` / `linear_backward` call on it is turned into `hybridq::gathered_linear_forward` /
`gathered_linear_backward` (by the gathered weight's __torch_dispatch__, `weight_handle.handle_ops`),
which take the handle and read the unsharded weight's parts when they run, through the same eager code: forward
reads the rowwise form, backward the form dgrad reads (gathered by the backward unshard, or on first use). For an
FP8 configuration with current scaling that float8_graph describes (per-tensor, or fp8_block's 1x128 / 128x128
blocks) that code is the eager fast path's (float8_graph.py's `gathered_forward` / `gathered_grads`: on CUDA one C++
op per phase, `hybridq::fp8_linear_fprop` / `fp8_linear_grads` or `fp8_block_linear_fprop` / `fp8_block_linear_grads`;
not the general path's quantized tensors and dispatch), where it takes the call; it saves what the general path
saves (x's columnwise data and scale_inv, x itself under save_original_input, or nothing), so the fakes (the general
path on fake tensors) hold. For a per-tensor FP8 input (with gradients) the layer quantizes x in an op of its own,
`hybridq::linear_input_quantize`, and hands its outputs to the gathered forward op, so AOTAutograd's CSE merges the
casts of one tensor read by several Linears (q/k/v, w1/w3) and the one columnwise form is saved once
(float8_graph.py's [Note: one dense input quantization in the graph]).

A quantized parameter (`quantized_model_init` / `quantize_parameters`: nn/quantized_params.py's
`HeldQuantizedWeight`) enters the graph the same way, its handle naming the parameter: the gathered ops read its
parts when they run (forward the rowwise form, backward the columnwise one, derived from the rowwise one then where
the format derives it), so the bytes an optimizer writes into it in place between steps (ZeroAdamW,
quantize_master_weights) are what the next step reads, and the weight's gradient is the plain high-precision
tensor the eager layer gives. For either handled weight, forward makes nothing of the weight for backward: backward
reads what dgrad needs of it itself.

A tensor-parallel layer (hybridq's ColwiseParallel / RowwiseParallel: DTensor weights, sequence parallelism) runs
as its own pair of ops over its local pieces, built from the general path here: distributed/compiled_tp.py.

What stays a graph break (the eager path): the is_first_microbatch cache, and quantizers with state that changes
across calls (delayed scaling: its history would be mutated behind the graph's back). `runs_in_graph` says which.

Under CUDA graphs (mode="reduce-overhead") only the ops' kernels replay: nothing in them depends on host state but
the layouts recorded below (fixed per configuration and shape) and stochastic rounding's Philox offsets, which the
NVFP4 kernel reads from PyTorch's graph-safe state. A gathered weight's op reads buffers FSDP2 reallocates at every
unshard: its graph must not be replayed, and is not (Inductor does not CUDA-graph a graph with a CPU input, the
handle).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..enums import COLUMNWISE, ROWWISE, BackwardOverride
from ..tensor import QuantizedTensor, count_backward_pass, flatten_quantized, unflatten_quantized
from .graph_keys import ConfigurationKeys
from .float8_graph import (Float8GraphSpec, forward_plan, grads_phase, graph_spec, run_forward, run_grads,
                           saved_input)
from .linear_function import (_LinearConfig, _only, forward_and_saved, gradients_needed, linear_grads,
                              shared_input_quantization)
from ..switches import Switch, Turned
from .plain_ops import plain_op
from .weight_handle import handled_weight, redirect, redirect_to_handle, weight_handle, weight_of

__all__ = ["compiled_linear", "configuration_key", "gathered_plans", "runs_in_graph", "weight_handle"]

# Configurations by key (graph_keys.py, [Note: configuration keys]): its three quantizers and save_original_input
# -> (name of the first layer, quantizers, save_original_input)
_LAYERS: ConfigurationKeys[tuple] = ConfigurationKeys("linear-config-")
_CONFIGS: dict[tuple, _LinearConfig] = {}  # (key, backward override) -> the config the ops run with
# key -> the float8_graph spec of a configuration its fast path runs on a gathered weight (FP8 with current scaling,
# per-tensor or in blocks: float8_graph.graph_spec; no backward override), else None
_FAST_SPECS: dict[str, Float8GraphSpec | None] = {}
# how the saved tensors of a forward call rebuild into quantized operands, by (config, grads needed, shapes,
# dtype): a pure function of those, recorded by the forward op for the backward op; with it, whether the forward
# ran float8_graph's fast path (its `_fast_call` answer, falsy where it did not: then backward tries it too, handed
# the answer; either path reads the same saved tensors)
_LAYOUTS: "OrderedDict[tuple, tuple[list, int]]" = OrderedDict()
_MAX_LAYOUTS = 4096
# layout entries of a saved operand that is not a quantized tensor: absent, or the op's own input or weight (an
# op cannot return its inputs; the backward op takes them)
_NONE, _INPUT, _WEIGHT = "none", "input", "weight"
# the layout entry of a weight read through its handle (a gathered weight or a quantized parameter): the backward
# op reads it again
_HANDLE = "handle"
# the layout entry of the input's columnwise data and scale_inv as float8_graph's fast path saves them (two tensors)
_FAST_X = "fast input"
_NONE_ENTRY, _INPUT_ENTRY, _HANDLE_ENTRY, _FAST_X_ENTRY = (_NONE,), (_INPUT,), (_HANDLE,), (_FAST_X,)


class _Layer:
    """What a _LinearConfig reads from its module."""

    def __init__(self, name: str, quantizers: dict, save_original_input: bool):
        self.name = name
        self.input_quantizer = quantizers["input"]
        self.weight_quantizer = quantizers["weight"]
        self.grad_output_quantizer = quantizers["grad_output"]
        self.save_original_input = save_original_input


def configuration_key(name: str, quantizers: dict, save_original_input: bool) -> str:
    """The key of a layer's configuration (registered on first use; called eagerly, when a layer's recipe or
    save_original_input is set, never while compile traces)."""
    content = "|".join([repr(quantizers[t]) for t in ("input", "weight", "grad_output")]
                       + [f"save_original_input={save_original_input}"])
    return _LAYERS.key(content, lambda: (name, dict(quantizers), save_original_input))


def _config(key: str, override: str | None) -> _LinearConfig:
    cfg = _CONFIGS.get((key, override))
    if cfg is None:
        name, quantizers, save_original_input = _LAYERS[key]
        # messages name the first layer built with this configuration: the others share its compiled graph
        label = f"{name} (or a layer with its configuration, compiled)"
        cfg = _CONFIGS[(key, override)] = _LinearConfig(_Layer(label, quantizers, save_original_input), override)
    return cfg


def runs_in_graph(module, x: torch.Tensor, is_first_microbatch: bool | None) -> bool:
    """Whether this call of `module` (a Linear) runs as the custom ops inside a compiled graph, rather than as a
    graph break: a plain weight, one FSDP2 all-gathered quantized or a quantized parameter (both enter the graph as
    their handle: weight_handle.HandledWeight), no tensor parallelism (compiled_tp.runs_in_graph decides that), no
    quantizer with state, no weight cache.
    Traced by dynamo: the weight is looked at only after the flags that say what it may be (a weight quantized
    elsewhere that is not a HandledWeight, e.g. a QuantizedTensor assigned by hand, stays a graph break)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    if (is_first_microbatch is not None or module._quantizers_stateful
            or module.__dict__.get("_tensor_parallel") is not None or type(x) not in plain):
        return False
    if module._weight_quantized_elsewhere:
        return handled_weight(module.weight)
    return type(module.weight) in plain


def _layout_key(key: str, override: str | None, need_dgrad: bool, need_wgrad: bool, x_shape, w_shape,
                dtype: torch.dtype, handled: bool = False) -> tuple:
    # (whether x's parts were handed over is not in the key: compiled_linear hands them to every call of one key
    # and flags or to none; the layouts differ only where the fast path declines, `_planned_forward`)
    return (key, override, need_dgrad, need_wgrad, tuple(x_shape), tuple(w_shape), dtype, handled)


def _fast_spec(key: str, override: str | None) -> Float8GraphSpec | None:
    """The spec float8_graph's fast path runs a gathered weight's ops with (see `_FAST_SPECS`)."""
    if override is not None:
        return None
    if key not in _FAST_SPECS:
        _, quantizers, save_original_input = _LAYERS[key]
        _FAST_SPECS[key] = graph_spec(quantizers, save_original_input)
    return _FAST_SPECS[key]


def _record_layout(lkey: tuple, layout: tuple[list, int]) -> None:
    _LAYOUTS[lkey] = layout
    _LAYOUTS.move_to_end(lkey)
    if len(_LAYOUTS) > _MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)


# the fast path's layouts, one object per value: a gathered call site's plan records its layout only where the entry
# is not that very object ([Note: a gathered call site's plans]), also when layers of one key and shape alternate
_FAST_LAYOUTS: dict[tuple, tuple[list, int]] = {}


def _fast_layout(layout: list, fast: int) -> tuple[list, int]:
    """The one (layout, fast) object of this value (the backward op reads it; nothing mutates it)."""
    return _FAST_LAYOUTS.setdefault((tuple(layout), fast), (layout, fast))


def _parts_entry(cfg: _LinearConfig, need_wgrad: bool) -> tuple:
    """The layout entry of x in a call handed x's parts (`linear_input_quantize`'s): what the layer's autograd saves
    of them -- the columnwise data and scale_inv, x itself (save_original_input: the general path's entry), or
    nothing."""
    if not need_wgrad:
        return _NONE_ENTRY
    return _INPUT_ENTRY if cfg.save_original_input else _FAST_X_ENTRY


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str, override: str | None,
             need_dgrad: bool, need_wgrad: bool, handled: bool = False, x_parts: tuple | None = None
             ) -> tuple[torch.Tensor, list[torch.Tensor], tuple[list, int]]:
    """(y, the saved tensors, (their layout, whether the fast path ran: float8_graph's `_fast_call` answer, 0 where
    not)). `handled`: the weight is read through its handle, by backward too. A gathered (quantized) weight of an FP8
    configuration float8_graph describes runs its fast path where it takes the call: the same kernels and GEMMs as
    the general path, which the fake runs (on a stand-in weight), and the same saved tensors. `x_parts`: x as
    `linear_input_quantize` quantized it (x_row, x_scale_inv, x_col or None): the layer's autograd saves what wgrad
    reads of them, so this call saves nothing of x ([Note: one dense input quantization in the graph])."""
    return _planned_forward(x, weight, bias, key, override, need_dgrad, need_wgrad, handled, x_parts)[:3]


def _planned_forward(x, weight, bias, key, override, need_dgrad, need_wgrad, handled, x_parts) -> tuple:
    """`_forward`'s (y, saved tensors, (layout, fast)) and the float8_graph plan its fast path ran (None where the
    general path ran)."""
    cfg = _config(key, override)
    if handled and isinstance(weight, QuantizedTensor):
        plan = forward_plan(x, weight, _fast_spec(key, override), cfg, need_dgrad, need_wgrad, x_parts is not None)
        if plan is not None:
            # (the part the plan read and checked: `part` once per call)
            y, x_saved, xcs, fast = run_forward(plan, x, plan.rowwise, bias, need_wgrad, x_parts)
            w_entry = _HANDLE_ENTRY if need_dgrad else _NONE_ENTRY
            if x_parts is not None:
                return y, [], _fast_layout([_parts_entry(cfg, need_wgrad), w_entry], fast), plan
            # the saved input's tensors as they are: the cast's fresh outputs (x's columnwise data and scale_inv)
            # or none (x itself, which backward takes); no quantized tensor built, flattened and rebuilt. (y and
            # they are contiguous: the fake's strides, as below)
            x_entry = _NONE_ENTRY if x_saved is None else _INPUT_ENTRY if xcs is None else _FAST_X_ENTRY
            return y, [] if xcs is None else [x_saved, xcs], _fast_layout([x_entry, w_entry], fast), plan
    if x_parts is not None:
        # the general path on a call handed x's parts (the fast path declines: another weight part, a shape the
        # native GEMM does not take; or the fake's stand-in weight), which quantizes x itself: its rowwise cast is
        # the parts' (one cast rule, per-tensor scale from max|x|), and its saved x -- the same bytes as the parts'
        # -- is left (the parts are saved)
        if not handled:  # (a plain weight's backward reads what forward saved of it: the parts path saves nothing)
            raise ValueError(f"hybridq::linear_forward ({key}): x's parts are handed over only with a weight read "
                             "through its handle (FSDP2's gathered weight, a quantized parameter)")
        y, _, _ = general_forward(x, weight, bias, cfg, need_dgrad, False, handled)
        return y, [], ([_parts_entry(cfg, need_wgrad), _HANDLE_ENTRY if need_dgrad else _NONE_ENTRY], 0), None
    return (*general_forward(x, weight, bias, cfg, need_dgrad, need_wgrad, handled), None)


def general_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: _LinearConfig,
                    need_dgrad: bool, need_wgrad: bool, handled: bool = False, lead: tuple | None = None
                    ) -> tuple[torch.Tensor, list[torch.Tensor], tuple[list, int]]:
    """`_forward`'s general path on `cfg` (also the tensor-parallel ops': distributed/compiled_tp.py): (y in the
    leading shape `lead`, default x's, the saved tensors flattened, (their layout, 0))."""
    # no input sharing across layers: an op's outputs must be its own tensors, not another op's. A weight read
    # through its handle: backward takes what dgrad reads of it then, so forward makes none (the saved weight is
    # the only thing need_dgrad changes here, the weight being quantized already)
    with shared_input_quantization(False):
        y, saved_x, saved_w = forward_and_saved(x, weight, bias, None, cfg, need_dgrad and not handled, need_wgrad)
    flat, layout = [], []
    for t, mark in ((saved_x, _INPUT), (saved_w, _WEIGHT)):
        if mark == _WEIGHT and handled:
            layout.append(_HANDLE_ENTRY if need_dgrad else _NONE_ENTRY)
        elif t is None:
            layout.append((_NONE,))
        elif not isinstance(t, QuantizedTensor):  # the input's [M, K] view or the weight: backward takes those
            layout.append((mark,))
        else:
            tensors, entry = flatten_quantized([t])
            flat += tensors
            layout += entry
    # an op's outputs may alias neither its inputs (an identity quantizer's part is its input) nor one another
    # (a derived direction can be a view of the other's bytes): those are copied. Every output is made
    # contiguous, so the real outputs' strides match the fake run's whatever path (kernel or reference) made them:
    # Inductor checks them
    seen = {StorageWeakRef(t.untyped_storage()) for t in (x, None if handled else weight, bias) if t is not None}
    out = []
    for t in flat:
        ref = StorageWeakRef(t.untyped_storage())
        out.append(t.clone(memory_format=torch.contiguous_format) if ref in seen else t.contiguous())
        seen.add(ref)
    lead = tuple(x.shape[:-1]) if lead is None else tuple(lead)
    return y.reshape(*lead, y.shape[-1]).contiguous(), out, (layout, 0)


def _parts(x_row: torch.Tensor | None, x_scale_inv: torch.Tensor | None, x_col: torch.Tensor | None) -> tuple | None:
    """x's parts as the ops take them (`linear_input_quantize`'s outputs; an empty x_col: no columnwise form), or
    None where none was handed over."""
    if x_row is None:
        return None
    if x_scale_inv is None or x_col is None:
        raise ValueError("hybridq::linear_forward: x's parts are x_row, x_scale_inv and x_col together "
                         "(linear_input_quantize's outputs)")
    return x_row, x_scale_inv, x_col if x_col.numel() else None


@plain_op("hybridq::linear_forward")
def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str,
                   override: str | None, need_dgrad: bool, need_wgrad: bool, x_row: torch.Tensor | None = None,
                   x_scale_inv: torch.Tensor | None = None, x_col: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[y, *saved tensors] of a hybridq Linear call (configuration `key`) that gradients flow through. x_row,
    x_scale_inv, x_col: x as `linear_input_quantize` quantized it (a weight read through its handle only: the op
    then saves nothing of x, the layer's autograd saves those)."""
    y, flat, layout = _forward(x, weight, bias, key, override, need_dgrad, need_wgrad,
                               x_parts=_parts(x_row, x_scale_inv, x_col))
    _record_layout(_layout_key(key, override, need_dgrad, need_wgrad, x.shape, weight.shape, x.dtype), layout)
    return [y, *flat]


@linear_forward.register_fake
def _(x, weight, bias, key, override, need_dgrad, need_wgrad, x_row=None, x_scale_inv=None, x_col=None):
    y, flat, _ = _forward(x, weight, bias, key, override, need_dgrad, need_wgrad,
                          x_parts=_parts(x_row, x_scale_inv, x_col))
    return [y, *flat]


@plain_op("hybridq::linear_backward")
def linear_backward(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                    saved: list[torch.Tensor], key: str, override: str | None, need_dgrad: bool, need_wgrad: bool,
                    need_bgrad: bool,
                    x_shape: list[int], w_shape: list[int], x_dtype: torch.dtype, w_dtype: torch.dtype,
                    b_dtype: torch.dtype) -> list[torch.Tensor]:
    """[dx, dw, db] (an empty tensor for a gradient not asked for) of the call `linear_forward` saved `saved` for."""
    return _backward_grads(dy, x, weight, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape,
                           w_shape, x_dtype, w_dtype, b_dtype)


def _backward_grads(dy, x, weight, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape,
                    x_dtype, w_dtype, b_dtype, handled: bool = False) -> list[torch.Tensor]:
    layout, fast = _LAYOUTS[_layout_key(key, override, need_dgrad, need_wgrad, x_shape, w_shape, x_dtype,
                                        handled)]
    if fast:  # (float8_graph's ops on the saved tensors and the gathered weight's columnwise part, read now)
        w_col = weight_of(weight).part(COLUMNWISE) if need_dgrad else None
        spec = _FAST_SPECS[key]
        phase = grads_phase(spec, dy, w_col, need_dgrad, fast)
        if phase is not None:
            entry = layout[0]
            x_saved, xcs = ((saved[0], saved[1]) if entry == _FAST_X_ENTRY else
                            (None, None) if entry == _NONE_ENTRY else (x.reshape(-1, x.shape[-1]), None))
            return run_grads(spec, phase, dy, x_saved, xcs, w_col, need_dgrad, need_wgrad, need_bgrad, x_shape,
                             w_dtype, b_dtype)
    # (the general path's casts count backward passes: delayed scaling's replays; the fast path has no state)
    count_backward_pass()
    # (x saved as the fast spec's parts where the fast path ran, or where x's parts were handed over)
    fast_x = fast or layout[0] == _FAST_X_ENTRY
    return general_grads(_config(key, override), layout, dy, x, weight, saved, need_dgrad, need_wgrad, need_bgrad,
                         x_shape, x_dtype, w_dtype, b_dtype, _fast_spec(key, override) if fast_x else None)


def general_grads(cfg: _LinearConfig, layout: list, dy: torch.Tensor, x: torch.Tensor | None,
                  weight: torch.Tensor | None, saved: list[torch.Tensor], need_dgrad: bool, need_wgrad: bool,
                  need_bgrad: bool, x_shape: list[int], x_dtype: torch.dtype, w_dtype: torch.dtype,
                  b_dtype: torch.dtype, fast_spec: Float8GraphSpec | None = None) -> list[torch.Tensor]:
    """[dx, dw, db] on `cfg` from the saved tensors laid out as `layout` (also the tensor-parallel ops')."""
    flat = iter(saved)
    operands = []
    for entry in layout:
        if entry[0] == _NONE:
            operands.append(None)
        elif entry[0] == _INPUT:
            operands.append(x.reshape(-1, x.shape[-1]))
        elif entry[0] == _WEIGHT:
            operands.append(weight)
        elif entry[0] == _HANDLE:
            operands.append(_saved_weight(weight_of(weight), cfg.backward_override))
        elif entry[0] == _FAST_X:
            operands.append(saved_input(fast_spec, next(flat), next(flat),
                                        torch.Size([math.prod(x_shape[:-1]), x_shape[-1]]), x_dtype))
        else:
            operands += unflatten_quantized(flat, [entry])
    saved_x, saved_w = operands
    grads = linear_grads(cfg, dy, saved_x, saved_w, need_dgrad, need_wgrad, need_bgrad, torch.Size(x_shape),
                         w_dtype, b_dtype)
    return [g if g is not None else dy.new_empty(0) for g in grads]


def _saved_weight(weight: QuantizedTensor, override: BackwardOverride | None):
    """What dgrad reads of a quantized weight (as forward_and_saved saves it), taken when backward runs: the
    gathered weight's form its backward unshard filled, or gathered now; a quantized parameter's stored or derived
    form (its high_precision(): dequantized)."""
    if override == BackwardOverride.HIGH_PRECISION:
        return weight  # (its high_precision(): gathered in param_dtype)
    return _only(weight, ROWWISE if override == BackwardOverride.DEQUANTIZED else COLUMNWISE)


@linear_backward.register_fake
def _(dy, x, weight, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, x_dtype, w_dtype, b_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, w_dtype, b_dtype)


def _backward_fake(dy, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, w_dtype, b_dtype) -> list:
    empty = dy.new_empty(0)
    return [dy.new_empty(x_shape) if need_dgrad else empty,
            dy.new_empty(w_shape, dtype=w_dtype) if need_wgrad else empty,
            dy.new_empty(w_shape[:1], dtype=b_dtype) if need_bgrad else empty]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, key, override, need_dgrad, need_wgrad, x_row, x_scale_inv, x_col = inputs
    # (the dispatcher drops trailing arguments equal to their defaults -- the parts, None -- from the autograd
    # function's inputs: backward returns a gradient for each input it kept)
    ctx.n_inputs = 7 if x_row is None else 10
    cfg = _config(key, override)
    # x's handed parts: what wgrad reads of them is saved here, once for every layer reading them (the forward op
    # saves nothing of x: [Note: one dense input quantization in the graph])
    parts = [x_col, x_scale_inv] if x_row is not None and need_wgrad and not cfg.save_original_input else []
    hp = cfg.backward_override == BackwardOverride.HIGH_PRECISION
    # the input and weight are kept only where backward reads them as they are
    keep_x = need_wgrad and (hp or (cfg.backward_override is None and cfg.save_original_input))
    # a weight read through its handle is kept whatever backward reads: its handle (not its bytes) goes to the
    # backward op, which takes the weight as it is then
    keep_w = (need_dgrad and hp) or isinstance(weight, QuantizedTensor)
    ctx.save_for_backward(x if keep_x else None, weight if keep_w else None, *parts, *output[1:])
    ctx.args = (key, override, need_dgrad, need_wgrad, list(x.shape), list(weight.shape), x.dtype, weight.dtype,
                weight.dtype if bias is None else bias.dtype)
    ctx.has_bias = bias is not None


def _backward(ctx, grads):
    x, weight, *saved = ctx.saved_tensors
    key, override, need_dgrad, need_wgrad, x_shape, w_shape, x_dtype, w_dtype, b_dtype = ctx.args
    need_bgrad = ctx.has_bias and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.hybridq.linear_backward(grads[0], x, weight, saved, key, override, need_dgrad,
                                                   need_wgrad, need_bgrad, x_shape, w_shape, x_dtype, w_dtype,
                                                   b_dtype)
    return (dx if need_dgrad else None, dw if need_wgrad else None, db if need_bgrad else None,
            *(None,) * (ctx.n_inputs - 3))


linear_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- a weight read through its handle (FSDP2's gathered weight, a quantized parameter) ------------------------

# [Note: a gathered call site's plans] A compiled graph calls `gathered_linear_forward` on each layer's handle at
# every step with the same arguments but the tensors. Where a call took float8_graph's fast path, the op keeps what
# it decided on the handle (the handle's `_hq_sites`: one handle per weight, so a plan's weight is the handle's), by
# (configuration key, override, gradients needed, x's shape, dtype and device, whether x's parts were handed over):
# the float8_graph plan, the weight shape it was traced with, its layout key and the layout it recorded. A later
# call with that key runs the plan where it still holds (float8_graph's [Note: gathered plans]: the same weight and
# part, switches, dispatch tables) and otherwise plans again, as the first call did: the same checks, the same
# refusals, and the same code runs either way. The layout is recorded only where its entry is not already the
# plan's (one object per value, `_fast_layout`), which the backward op reads as before. (The backward op decides
# per call: float8_graph's `grads_phase`, cheaper than checking a plan.)
_MAX_SITES = 64  # plans per handle (shapes, flags): beyond, the handle's plans start over
# The plans kept and reused, or every call decided anew (bitwise equal: tests and benchmarks compare the two).
# HYBRIDQ_GATHERED_PLANS=0 starts a process with them off.
_PLANS = Switch("HYBRIDQ_GATHERED_PLANS")


def gathered_plans(enabled: bool) -> Turned:
    """Whether the compiled Linear's gathered ops keep and reuse each call site's plan (default: on; the
    environment variable HYBRIDQ_GATHERED_PLANS=0 starts a process with it off) or decide every call anew; results
    are bitwise equal either way. `gathered_plans(False)` from then on; `with gathered_plans(False): ...` only
    inside the block."""
    return _PLANS.turned(enabled)


class _ForwardSite:
    """What a gathered forward call site keeps: the float8_graph plan, the traced weight shape, its layout key and
    layout."""

    __slots__ = ("plan", "w_shape", "lkey", "layout")

    def __init__(self, plan, w_shape: list, lkey: tuple, layout: tuple):
        self.plan, self.w_shape, self.lkey, self.layout = plan, w_shape, lkey, layout


def _sites(handle: torch.Tensor) -> dict:
    """The handle's forward call sites ([Note: a gathered call site's plans])."""
    sites = handle.__dict__.get("_hq_sites")
    if sites is None:
        sites = handle._hq_sites = {}
    return sites


def _keep(sites: dict, key: tuple, site) -> None:
    if len(sites) >= _MAX_SITES:
        sites.clear()
    sites[key] = site


@plain_op("hybridq::gathered_linear_forward")
def gathered_linear_forward(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, key: str,
                            override: str | None, need_dgrad: bool, need_wgrad: bool, w_shape: list[int],
                            w_dtype: torch.dtype, x_row: torch.Tensor | None = None,
                            x_scale_inv: torch.Tensor | None = None,
                            x_col: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`linear_forward` of the weight `handle` names: [y, *saved tensors of the input] ([y] alone where x's parts
    are handed over)."""
    return _gathered_forward(x, handle, bias, key, override, need_dgrad, need_wgrad, w_shape,
                             _parts(x_row, x_scale_inv, x_col))


def _gathered_forward(x, handle, bias, key, override, need_dgrad, need_wgrad, w_shape, x_parts) -> list:
    """`gathered_linear_forward`'s body (benchmarks/host_split.py times it)."""
    weight = weight_of(handle)
    sites = skey = None
    if _PLANS.on:
        sites = _sites(handle)
        skey = (key, override, need_dgrad, need_wgrad, x.shape, x.dtype, x.device, x_parts is None)
        site = sites.get(skey)
        if site is not None and site.w_shape == w_shape and site.plan.weight() is weight:
            wr = weight.part(ROWWISE)  # (read per call: a gather on first use, the check of a pending direction)
            if site.plan.holds(x, wr):  # ([Note: a gathered call site's plans])
                y, x_saved, xcs, _ = run_forward(site.plan, x, wr, bias, need_wgrad, x_parts)
                if _LAYOUTS.get(site.lkey) is not site.layout:
                    _record_layout(site.lkey, site.layout)
                return [y] if x_parts is not None or xcs is None else [y, x_saved, xcs]
    y, flat, layout, plan = _planned_forward(x, weight, bias, key, override, need_dgrad, need_wgrad, True, x_parts)
    lkey = _layout_key(key, override, need_dgrad, need_wgrad, x.shape, w_shape, x.dtype, True)
    _record_layout(lkey, layout)
    if plan is not None and sites is not None:
        _keep(sites, skey, _ForwardSite(plan.keep(x, weight), list(w_shape), lkey, layout))
    return [y, *flat]


@gathered_linear_forward.register_fake
def _(x, handle, bias, key, override, need_dgrad, need_wgrad, w_shape, w_dtype, x_row=None, x_scale_inv=None,
      x_col=None):
    # (a stand-in weight of its shape: the outputs' shapes do not depend on its values, and it is not saved)
    y, flat, _ = _forward(x, x.new_empty(w_shape, dtype=w_dtype), bias, key, override, need_dgrad, need_wgrad,
                          handled=True, x_parts=_parts(x_row, x_scale_inv, x_col))
    return [y, *flat]


@plain_op("hybridq::gathered_linear_backward")
def gathered_linear_backward(dy: torch.Tensor, x: torch.Tensor | None, handle: torch.Tensor,
                             saved: list[torch.Tensor], key: str, override: str | None, need_dgrad: bool,
                             need_wgrad: bool, need_bgrad: bool, x_shape: list[int], w_shape: list[int],
                             x_dtype: torch.dtype, w_dtype: torch.dtype, b_dtype: torch.dtype) -> list[torch.Tensor]:
    """`linear_backward` of a `gathered_linear_forward` call: the weight read through `handle` now."""
    return _backward_grads(dy, x, handle, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape,
                           w_shape, x_dtype, w_dtype, b_dtype, handled=True)


@gathered_linear_backward.register_fake
def _(dy, x, handle, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, x_dtype, w_dtype,
      b_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, w_dtype, b_dtype)


# `linear_forward` / `linear_backward` called on a weight read through its handle (the gathered weight's
# __torch_dispatch__ sends them to weight_handle.handle_ops while compile traces): the same call as the `gathered_`
# op, the handle in the weight's place
def _forward_on_handle(args, kwargs):
    # (redirect_to_handle's call, x's parts passed by name: they follow the weight's shape and dtype in the twin)
    schema = linear_forward._opoverload._schema.arguments
    bound = list(args) + [kwargs[a.name] if a.name in kwargs else a.default_value for a in schema[len(args):]]
    weight = bound[1]
    x_parts = dict(zip(("x_row", "x_scale_inv", "x_col"), bound[7:10]))
    return torch.ops.hybridq.gathered_linear_forward(*bound[:1], weight._handle, *bound[2:7], list(weight.shape),
                                                     weight.dtype, **x_parts)


redirect(linear_forward._opoverload, _forward_on_handle)
redirect_to_handle(linear_backward, torch.ops.hybridq.gathered_linear_backward, 2, with_shape=False)


def compiled_linear(module, x: torch.Tensor, override: str | None) -> torch.Tensor:
    """`x W^T + b` of a hybridq Linear as the custom ops (see the module docstring); traced by dynamo."""
    weight, bias = module.weight, module.bias
    need_dgrad, need_wgrad = gradients_needed(x, weight)  # neither: rowwise forms only, nothing saved
    key = module._configuration_key
    if override is None and module._weight_quantized_elsewhere and (need_dgrad or need_wgrad):
        cast = _shared_input_cast(key)
        if cast is not None:  # x quantized by an op of its own ([Note: one dense input quantization in the graph])
            dtype, amax_epsilon, power_2_scale, save_original_input = cast
            # (x detached: the parts take no gradient, x's flows through linear_forward)
            parts = torch.ops.hybridq.linear_input_quantize(x.detach(), dtype, amax_epsilon, power_2_scale,
                                                            need_wgrad and not save_original_input)
            return torch.ops.hybridq.linear_forward(x, weight, bias, key, None, need_dgrad, need_wgrad, *parts)[0]
    return torch.ops.hybridq.linear_forward(x, weight, bias, key, None if override is None else str(override),
                                            need_dgrad, need_wgrad)[0]


@torch.compiler.assume_constant_result
def _shared_input_cast(key: str) -> tuple | None:
    """(dtype, amax_epsilon, power_2_scale, save_original_input) of configuration `key`'s input cast where its
    gathered fast path quantizes per-tensor FP8 (`_fast_spec`; compiled code reads it as a constant), else None."""
    spec = _fast_spec(key, None)
    if spec is None or not spec.per_tensor:
        return None
    return spec.input.dtype, spec.input.amax_epsilon, spec.input.power_2_scale, spec.save_original_input
