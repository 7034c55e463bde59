"""A block-format GroupedLinear inside torch.compile's graph: the device-count packed block path
(nn/grouped_device_blocks.py: FP8 1x128 / 128x128 blocks, MXFP8 and their hybrids, `BLOCKS`) as custom ops, as
compiled_grouped.py does for per-tensor FP8: `hybridq::grouped_blocks_input_quantize` quantizes the input into its
expert slots (rowwise, and the columnwise form wgrad reads), `hybridq::grouped_blocks_forward` takes those forms and
returns the output and the tensors of the weight's columnwise form (what dgrad reads),
`hybridq::grouped_blocks_backward` the input and weight gradients, with autograd registered on the forward op. The input's quantization is an op of its
own so that the projections of one input share it ([Note: one input quantization of block experts in the graph]).
Inside the ops the eager code runs (`grouped_device_blocks`' quantize, weight forms, grouped GEMMs and `backward`):
bitwise the eager layer with the same counts.

The counts stay a tensor: a graph is compiled per shape, never per routing. Every buffer is sized by a bound that
depends on the shapes only (`grouped_packed.bound_rows`), so the fakes give the outputs' shapes from the shapes alone:
the fake input quantize runs the same quantization on fake tensors, the fake forward the weight's (the GEMMs it skips).
On CUDA the ops read the counts on the device only (checked there, asynchronously, by the input quantize op's slot
layout; the GEMM op reuses that layout: `SlotLayout.build`'s routings); on the CPU (the reference) they read them and
raise ValueError on counts that are negative or do not sum to the input's tokens.

Taken (`runs_in_graph`) where the eager layer would take the device-count path without a host sync (CUDA:
`grouped_device_blocks.device_path_runs`), and on the CPU; the weight a plain tensor or one FSDP2 gathered quantized
(quantized parameters stay a graph break). A gathered weight enters the graph as its handle (nn/weight_handle.py), as
compiled_grouped.py's per-tensor FP8 experts do: traced, the forward op on it becomes
`hybridq::gathered_grouped_blocks_forward`, which reads the experts' rowwise parts through the handle when it runs,
and backward calls `hybridq::gathered_grouped_blocks_backward`, whose dgrad reads their columnwise parts (the backward
unshard's) through it -- the eager layer's `GatheredExpertWeights`, so bitwise eager; the graph neither copies nor
saves the gathered bytes.
"""

from __future__ import annotations


from typing import NamedTuple

import torch

from ..enums import COLUMNWISE, ROWWISE
from ..formats.base import QuantizedPart, Quantizer
from ..tensor import QuantizedTensor
from ..weight_forms import GroupedGatheredForm
from . import grouped_device_blocks as device_blocks
from .graph_keys import ConfigurationKeys
from .grouped_packed import SlotLayout
from .grouped_packed_blocks import ExpertWeights, GatheredExpertWeights
from .plain_ops import plain_op
from .weight_handle import handled_weight, redirect_to_handle, weight_of

# configurations by content (graph_keys.py) -> (name of the first layer, the quantizers every expert shares)
_LAYERS: ConfigurationKeys[tuple[str, dict]] = ConfigurationKeys("grouped-blocks-config-")
_TENSORS = ("input", "weight", "grad_output")
# ([Note: block op forms]) (key, need_dgrad, need_wgrad, x shape, x dtype) -> (the input's rowwise `_Form`, its
# columnwise `_Form` or None): kept by the input quantize op, read by the forward op
_INPUTS: dict[tuple, tuple["_Form", "_Form | None"]] = {}
# (key, need_dgrad, need_wgrad, x shape, weight shape, dtypes, gathered) -> (the input's columnwise `_Form` or None,
# the weight's columnwise `_Form`s, weight packed): kept by the forward op, read by backward
_SAVED: dict[tuple, tuple["_Form | None", tuple["_Form", ...], bool]] = {}
# (key, need_dgrad, need_wgrad) -> the slot multiple of the input quantize op's layout
_MULTIPLES: dict[tuple, int] = {}


def is_key(key: str | None) -> bool:
    return _LAYERS.owns(key)


def graph_key(quantizers: dict[str, Quantizer], layer_name: str) -> str:
    """The key of a BLOCKS configuration (its quantizers' content: layers differing in name share a graph)."""
    content = "|".join(repr(quantizers[t]) for t in _TENSORS)
    return _LAYERS.key(content, lambda: (f"{layer_name} (or a layer with its configuration, compiled)",
                                         dict(quantizers)))


@torch._dynamo.assume_constant_result
def runs_here(key: str, device: str, experts: int, in_features: int, out_features: int) -> bool:
    """Whether configuration `key` runs in the graph on `device` (evaluated once per compile): the CPU reference, or
    CUDA where the device-count path needs no host count."""
    dev = torch.device(device)
    return dev.type == "cpu" or device_blocks.device_path_runs(_LAYERS[key][1], dev, experts, out_features,
                                                               in_features)


def _input_key(key, need_dgrad, need_wgrad, x_shape, x_dtype) -> tuple:
    return (key, need_dgrad, need_wgrad, tuple(x_shape), x_dtype)


def _saved_key(key, need_dgrad, need_wgrad, x_shape, w_shape, x_dtype, w_dtype, gathered: bool) -> tuple:
    return (key, need_dgrad, need_wgrad, tuple(x_shape), tuple(w_shape), x_dtype, w_dtype, gathered)


# [Note: block op forms] The ops pass quantized forms as plain tensors (a custom op's inputs and outputs), and what
# rebuilds a form from them -- its part's type, rows, cols, direction and metadata, the names of its tensors, the
# QuantizedTensor's shape and dtype -- depends on the configuration and shapes alone. It is kept as a `_Form` per
# call signature (`_INPUTS`, `_SAVED`) instead of walking the forms generically at every call (tensor.py's
# `flatten_quantized` / `unflatten_quantized`, with a QuantizedTensor -- a wrapper subclass, the costly part -- made
# around each part just to be flattened, and one around the input's rowwise part just to read it); a kept form is
# reused only for a part it `fits` (same type, rows, cols, direction, tensors present and metadata), else made anew,
# so it is never stale. The forward op rebuilds the input's rowwise part alone (its GEMM reads nothing else); backward
# the QuantizedTensors `grouped_device_blocks.backward` takes.
class _Form(NamedTuple):
    """One direction of a QuantizedTensor as an op's plain tensors (see [Note: block op forms])."""

    cls: type
    rows: int
    cols: int
    columnwise: bool
    meta: dict
    names: tuple[str, ...]  # (its tensors present, in `tensor_fields` order)
    absent: dict  # (its tensor fields that are None)
    shape: tuple
    dtype: torch.dtype

    @classmethod
    def of(cls, part: QuantizedPart, shape, dtype: torch.dtype) -> "_Form":
        names = tuple(n for n in part.tensor_fields if getattr(part, n) is not None)
        return cls(type(part), part.rows, part.cols, part.columnwise, part.meta(), names,
                   {n: None for n in part.tensor_fields if n not in names}, tuple(shape), dtype)

    def fits(self, part: QuantizedPart) -> bool:
        return (type(part) is self.cls and part.rows == self.rows and part.cols == self.cols
                and part.columnwise == self.columnwise and all(getattr(part, n) is not None for n in self.names)
                and all(getattr(part, n) is None for n in self.absent) and part.meta() == self.meta)

    def tensors(self, part: QuantizedPart) -> list[torch.Tensor]:
        return [getattr(part, n) for n in self.names]

    def part(self, tensors) -> QuantizedPart:
        """The part of `tensors` (this form's, in order)."""
        return self.cls(rows=self.rows, cols=self.cols, columnwise=self.columnwise, **dict(zip(self.names, tensors)),
                        **self.absent, **self.meta)

    def quantized(self, tensors) -> QuantizedTensor:
        p = self.part(tensors)
        return QuantizedTensor(None if self.columnwise else p, p if self.columnwise else None, shape=self.shape,
                               dtype=self.dtype)


def _form_of(part: QuantizedPart, kept: "_Form | None", shape, dtype: torch.dtype) -> "_Form":
    """`kept` where it fits `part`, else the part's form."""
    return kept if kept is not None and kept.fits(part) else _Form.of(part, shape, dtype)


def _fresh(flat: list[torch.Tensor], inputs: tuple[torch.Tensor, ...], fake: bool) -> list[torch.Tensor]:
    """`flat` as an op's outputs: aliasing neither the inputs nor one another, with the fake's (contiguous) strides.
    Storages are told apart by address (two live storages never share a nonzero one; an empty storage's 0 only costs
    the copy of an empty tensor); a fake tensor has none: the fake's outputs are copies (compile's tracing only)."""
    if fake:
        return [t.clone(memory_format=torch.contiguous_format) for t in flat]
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    out = []
    for t in flat:
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone(memory_format=torch.contiguous_format) if ptr in seen else t.contiguous())
        seen.add(ptr)
    return out


def _no_host_gemm(m: int) -> int:
    raise RuntimeError("hybridq compiled block GroupedLinear: the input quantize op's slot layout runs no GEMM (its "
                       "padded counts are the forward op's)")


# [Note: one input quantization of block experts in the graph] As for per-tensor FP8 experts ([Note: one input
# quantization in the graph], compiled_grouped.py): an MoE layer's w1 and w3 read one input, and the compiled layer
# quantizes it in an op of its own, `grouped_blocks_input_quantize`, whose outputs -- the tensors of the input's
# rowwise form in its expert slots, then of its columnwise form (wgrad's) -- the forward op takes. It is a pure
# function of its arguments: the input, the counts, the configuration key (the content of the three quantizers) and
# the gradients asked for, which fix the slot multiple (`grouped_device_blocks.slot_multiple`: whole scaling blocks of
# the input and grad_output casts along the tokens) and whether the columnwise form is made. Block formats have no
# tensor-wide statistics: each block's scale comes from its own values, and the slots hold the same rows whoever asks,
# so two calls with equal arguments give the same bytes. AOTAutograd's min-cut partitioner (Inductor's and
# aot_eager's) merges call_function nodes of one target with equal arguments (its CSE, custom ops included): w1's and
# w3's quantize calls become one, and the input's columnwise form is saved once for both wgrads. Calls that differ --
# another configuration (an input format, or another weight / grad_output format: the key is the three quantizers'),
# a frozen projection (no columnwise form, and maybe another slot multiple) -- stay two; a graph without backward
# (no_grad) is not partitioned, so there each projection quantizes its input. The counts are read (CPU) or checked on
# the device (CUDA) by this op's slot layout, which the forward op's layout of the same routing follows (on CUDA the
# same device tensors, `SlotLayout.build`'s routings). Cost: one more op call per projection, against one input
# quantization (a slot quantize launch and its host work) fewer per MoE layer and step.
def _run_input_quantize(x, m_splits, key, need_dgrad, need_wgrad, fake: bool) -> list[torch.Tensor]:
    """[the input's rowwise form's tensors, then its columnwise form's (`need_wgrad`)] in the slot layout of the
    counts (`grouped_device_blocks.forward`'s input quantization)."""
    name, quantizers = _LAYERS[key]
    mk = (key, need_dgrad, need_wgrad)
    multiple = _MULTIPLES.get(mk)
    if multiple is None:
        multiple = _MULTIPLES[mk] = device_blocks.slot_multiple(quantizers, need_dgrad, need_wgrad)
    layout = SlotLayout.build(m_splits, x.shape[0], x.device, multiple, _no_host_gemm, name, fake)
    xq = device_blocks._quantize(quantizers["input"], x, layout, True, need_wgrad, f"input of {name}")
    ik = _input_key(key, need_dgrad, need_wgrad, x.shape, x.dtype)
    kept_row, kept_col = _INPUTS.get(ik, (None, None))
    row = xq.part(ROWWISE)
    row_form = _form_of(row, kept_row, xq.shape, xq.dtype)
    flat = row_form.tensors(row)
    col_form = None
    if need_wgrad:
        col = xq.part(COLUMNWISE)
        col_form = _form_of(col, kept_col, xq.shape, xq.dtype)
        flat += col_form.tensors(col)
    if row_form is not kept_row or col_form is not kept_col:
        _INPUTS[ik] = (row_form, col_form)
    return _fresh(flat, (x,), fake)


@plain_op("hybridq::grouped_blocks_input_quantize")
def grouped_blocks_input_quantize(x: torch.Tensor, m_splits: torch.Tensor, key: str, need_dgrad: bool,
                                  need_wgrad: bool) -> list[torch.Tensor]:
    """The tensors of the input of a block-format GroupedLinear call (configuration `key`) quantized into its expert
    slots: its rowwise form's, then (`need_wgrad`) its columnwise form's, for `grouped_blocks_forward`. A pure
    function of its arguments: the projections of one input with one configuration share one call ([Note: one
    input quantization of block experts in the graph])."""
    return _run_input_quantize(x, m_splits, key, need_dgrad, need_wgrad, fake=False)


@grouped_blocks_input_quantize.register_fake
def _(x, m_splits, key, need_dgrad, need_wgrad):
    return _run_input_quantize(x, m_splits, key, need_dgrad, need_wgrad, fake=True)


def _input_forms(key, need_dgrad, need_wgrad, x) -> tuple[_Form, _Form | None]:
    return _INPUTS[_input_key(key, need_dgrad, need_wgrad, x.shape, x.dtype)]


def _run_forward(x, x_parts, weight, m_splits, key, need_dgrad, need_wgrad, fake: bool,
                 handle=None) -> list[torch.Tensor]:
    """[y, *the weight's columnwise form's tensors] from the input forms `grouped_blocks_input_quantize` made
    (`grouped_device_blocks.forward` past its input quantization). With `handle` (a weight FSDP2 gathered; `weight`
    then a stand-in of its shape, the fake's on x's device) the weight's parts are read through the handle, none
    saved: backward reads them."""
    name, quantizers = _LAYERS[key]
    gathered = handle is not None
    if gathered and not fake:
        weight = weight_of(handle)  # (the GroupedGatheredForm as it is now: read as gathered)
    e, n, k = weight.shape
    row_form, col_form = _input_forms(key, need_dgrad, need_wgrad, x)
    # FSDP2's gathered experts: read as gathered, their columnwise form in backward
    as_gathered = isinstance(weight, GroupedGatheredForm)
    wq = (GatheredExpertWeights(weight, quantizers["weight"], ROWWISE) if as_gathered else
          ExpertWeights.quantize(quantizers["weight"], weight.detach(), need_dgrad, f"weight of {name}"))
    if fake:
        y = x.new_empty(x.shape[0], n)
    else:
        x_row = row_form.part(x_parts[:len(row_form.names)])
        layout = device_blocks.slot_layout(m_splits, x, k, n, quantizers, need_dgrad, need_wgrad, name)
        y = device_blocks._mm(x_row, wq, e, ROWWISE, layout, x.dtype, f"fprop of {name}")
    # backward reads the weight's columnwise form (dgrad): the fake quantized its stand-in (the shapes), the real one
    # of a gathered weight saves none (backward reads the gathered parts)
    w_cols = ([t.part(COLUMNWISE) for t in wq.tensors] if need_dgrad and not as_gathered and not gathered else [])
    sk = _saved_key(key, need_dgrad, need_wgrad, x.shape, weight.shape, x.dtype, weight.dtype, gathered)
    kept = _SAVED.get(sk)
    if (kept is None or kept[0] is not col_form or kept[2] != wq.packed or len(kept[1]) != len(w_cols)
            or not all(f.fits(p) for f, p in zip(kept[1], w_cols))):
        kept = _SAVED[sk] = (col_form, tuple(_Form.of(p, t.shape, t.dtype) for p, t in zip(w_cols, wq.tensors)),
                             wq.packed)
    flat = [t for f, p in zip(kept[1], w_cols) for t in f.tensors(p)]
    return [y.contiguous(), *_fresh(flat, (x,) if gathered else (x, weight), fake)]


@plain_op("hybridq::grouped_blocks_forward")
def grouped_blocks_forward(x: torch.Tensor, x_parts: list[torch.Tensor], weight: torch.Tensor,
                           m_splits: torch.Tensor, key: str, need_dgrad: bool, need_wgrad: bool) -> list[torch.Tensor]:
    """[y, *the tensors of the weight's columnwise form (dgrad)] of a block-format GroupedLinear call (configuration
    `key`) on its input `x` as `grouped_blocks_input_quantize` quantized it (`x_parts`: its columnwise form is only
    saved for wgrad, `x` only routes its gradient)."""
    return _run_forward(x, x_parts, weight, m_splits, key, need_dgrad, need_wgrad, fake=False)


@grouped_blocks_forward.register_fake
def _(x, x_parts, weight, m_splits, key, need_dgrad, need_wgrad):
    return _run_forward(x, x_parts, weight, m_splits, key, need_dgrad, need_wgrad, fake=True)


def _run_backward(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape,
                  x_dtype, w_dtype, handle=None) -> list[torch.Tensor]:
    name, quantizers = _LAYERS[key]
    e, n, k = w_shape
    col_form, w_forms, packed = _SAVED[_saved_key(key, fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype,
                                                  handle is not None)]
    tensors = iter(saved)
    x_col = col_form.quantized(tensors) if col_form is not None else None
    forms = [f.quantized(tensors) for f in w_forms]
    # (the gathered weight as it is now: dgrad reads its columnwise parts, made available on every rank first)
    gathered = weight_of(handle) if handle is not None and need_dgrad else None
    layout = device_blocks.slot_layout(m_splits, dy, k, n, quantizers, fwd_dgrad, fwd_wgrad, name)
    dx, dw = device_blocks.backward(dy, layout, quantizers, name, x_col, forms, packed, (e, n, k), w_dtype,
                                    need_dgrad, need_wgrad, gathered)
    if need_dgrad and dx is None:
        dx = dy.new_zeros(dy.shape[0], k)
    if need_wgrad and dw is None:
        dw = dy.new_zeros(e, n, k, dtype=w_dtype)
    return [dx.contiguous() if need_dgrad else dy.new_empty(0), dw.contiguous() if need_wgrad else dy.new_empty(0)]


@plain_op("hybridq::grouped_blocks_backward")
def grouped_blocks_backward(dy: torch.Tensor, m_splits: torch.Tensor, saved: list[torch.Tensor], key: str,
                            need_dgrad: bool, need_wgrad: bool, fwd_dgrad: bool, fwd_wgrad: bool,
                            x_shape: list[int], w_shape: list[int], x_dtype: torch.dtype,
                            w_dtype: torch.dtype) -> list[torch.Tensor]:
    """[dx, dW] (an empty tensor for a gradient not asked for) of the call `grouped_blocks_forward` saved `saved`
    for (the input's columnwise form, then the weight's; `fwd_dgrad` / `fwd_wgrad`: its flags, which laid out the
    slots and the saved forms)."""
    return _run_backward(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape,
                         x_dtype, w_dtype)


def _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype) -> list[torch.Tensor]:
    return [dy.new_empty(dy.shape[0], w_shape[2]) if need_dgrad else dy.new_empty(0),
            dy.new_empty(w_shape, dtype=w_dtype) if need_wgrad else dy.new_empty(0)]


@grouped_blocks_backward.register_fake
def _(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, x_parts, weight, m_splits, key, need_dgrad, need_wgrad = inputs
    n_row = len(_input_forms(key, need_dgrad, need_wgrad, x)[0].names)
    # a gathered weight is kept as its handle (not its bytes): backward reads its columnwise parts through it. The
    # input's columnwise form is the quantize op's outputs: projections sharing that call save the same tensors.
    ctx.save_for_backward(m_splits, weight if handled_weight(weight) else None, *x_parts[n_row:], *output[1:])
    ctx.args = (key, need_dgrad, need_wgrad, list(x.shape), list(weight.shape), x.dtype, weight.dtype)
    ctx.parts = len(x_parts)  # (the gradient of a tensor list is a list of its length)


def _backward(ctx, grads):
    m_splits, handled, *saved = ctx.saved_tensors
    key, fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype = ctx.args
    need_dgrad = fwd_dgrad and ctx.needs_input_grad[0]
    need_wgrad = fwd_wgrad and ctx.needs_input_grad[2]
    if handled is not None:
        dx, dw = torch.ops.hybridq.gathered_grouped_blocks_backward(
            grads[0], m_splits, saved, handled._handle, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape,
            w_shape, x_dtype, w_dtype)
    else:
        dx, dw = torch.ops.hybridq.grouped_blocks_backward(grads[0], m_splits, saved, key, need_dgrad, need_wgrad,
                                                           fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype)
    # (x_parts: the quantized input carries no gradient -- x's flows through this op)
    return (dx if need_dgrad else None, [None] * ctx.parts, dw if need_wgrad else None, None, None, None, None)


grouped_blocks_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- a weight read through its handle (FSDP2's gathered experts) -----------------------------------------------

@plain_op("hybridq::gathered_grouped_blocks_forward")
def gathered_grouped_blocks_forward(x: torch.Tensor, x_parts: list[torch.Tensor], handle: torch.Tensor,
                                    m_splits: torch.Tensor, key: str, need_dgrad: bool, need_wgrad: bool,
                                    w_shape: list[int], w_dtype: torch.dtype) -> list[torch.Tensor]:
    """`grouped_blocks_forward` of the gathered weight `handle` names (its rowwise parts read now); no weight form
    among the outputs: backward reads the columnwise parts through the handle."""
    return _run_forward(x, x_parts, None, m_splits, key, need_dgrad, need_wgrad, fake=False, handle=handle)


@gathered_grouped_blocks_forward.register_fake
def _(x, x_parts, handle, m_splits, key, need_dgrad, need_wgrad, w_shape, w_dtype):
    return _run_forward(x, x_parts, x.new_empty(w_shape, dtype=w_dtype), m_splits, key, need_dgrad, need_wgrad,
                        fake=True, handle=handle)


@plain_op("hybridq::gathered_grouped_blocks_backward")
def gathered_grouped_blocks_backward(dy: torch.Tensor, m_splits: torch.Tensor, saved: list[torch.Tensor],
                                     handle: torch.Tensor, key: str, need_dgrad: bool, need_wgrad: bool,
                                     fwd_dgrad: bool, fwd_wgrad: bool, x_shape: list[int], w_shape: list[int],
                                     x_dtype: torch.dtype, w_dtype: torch.dtype) -> list[torch.Tensor]:
    """`grouped_blocks_backward` of a `gathered_grouped_blocks_forward` call: dgrad reads the experts' columnwise
    parts through `handle` now (the backward unshard's, or gathered now: every rank calls it)."""
    return _run_backward(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape,
                         x_dtype, w_dtype, handle)


@gathered_grouped_blocks_backward.register_fake
def _(dy, m_splits, saved, handle, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype,
      w_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype)


# `grouped_blocks_forward` called on a gathered weight (its __torch_dispatch__ sends it to weight_handle.handle_ops
# while compile traces): the handle in the weight's place
redirect_to_handle(grouped_blocks_forward, torch.ops.hybridq.gathered_grouped_blocks_forward, 2, with_shape=True)


def grouped_in_graph(layer, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """`y[rows of e] = x[rows of e] W[e]^T` of a block-format GroupedLinear as the custom ops; traced by dynamo."""
    grad = torch.is_grad_enabled()
    need_dgrad, need_wgrad = grad and x.requires_grad, grad and layer.weight.requires_grad
    key = layer._graph_key
    # ([Note: one input quantization of block experts in the graph]; the quantized bytes carry no gradient: x's
    # flows through the forward op)
    x_parts = torch.ops.hybridq.grouped_blocks_input_quantize(x.detach(), m_splits, key, need_dgrad, need_wgrad)
    return torch.ops.hybridq.grouped_blocks_forward(x, x_parts, layer.weight, m_splits, key, need_dgrad,
                                                    need_wgrad)[0]
