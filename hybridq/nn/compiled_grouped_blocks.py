"""A block-format GroupedLinear inside torch.compile's graph: the device-count packed block path
(nn/grouped_device_blocks.py: FP8 1x128 / 128x128 blocks, MXFP8 and their hybrids, `BLOCKS`) as two custom ops, as
compiled_grouped.py does for per-tensor FP8: `hybridq::grouped_blocks_forward` returns the output and the tensors of
what backward reads (the input's and the weight's columnwise forms), `hybridq::grouped_blocks_backward` the input and
weight gradients, with autograd registered on the forward op. Inside each op the eager code runs unchanged
(`grouped_device_blocks.forward` / `backward`): bitwise the eager layer with the same counts.

The counts stay a tensor: a graph is compiled per shape, never per routing. Every buffer is sized by a bound that
depends on the shapes only (`grouped_packed.bound_rows`), so the fakes give the outputs' shapes from the shapes alone:
the fake forward runs the same quantization on fake tensors (the GEMMs it skips). On CUDA the ops read the counts on
the device only (checked there, asynchronously); on the CPU (the reference) they read them and raise ValueError on
counts that are negative or do not sum to the input's tokens.

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


import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..formats.base import Quantizer
from ..tensor import flatten_quantized, unflatten_quantized
from . import grouped_device_blocks as device_blocks
from .graph_keys import ConfigurationKeys
from .plain_ops import plain_op
from .weight_handle import handled_weight, redirect_to_handle, weight_of

# configurations by content (graph_keys.py) -> (name of the first layer, the quantizers every expert shares)
_LAYERS: ConfigurationKeys[tuple[str, dict]] = ConfigurationKeys("grouped-blocks-config-")
_TENSORS = ("input", "weight", "grad_output")
# (key, need_dgrad, need_wgrad, x shape, weight shape, dtypes) -> (flattened layout of the saved forms, weight packed):
# recorded by forward, read by backward (a function of the configuration and shapes alone)
_SAVED: dict[tuple, tuple[list, bool]] = {}


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


def _saved_key(key, need_dgrad, need_wgrad, x, weight, gathered: bool) -> tuple:
    return (key, need_dgrad, need_wgrad, tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype, gathered)


def _run_forward(x, weight, m_splits, key, need_dgrad, need_wgrad, fake: bool, handle=None) -> list[torch.Tensor]:
    """[y, *the saved forms' tensors]. With `handle` (a weight FSDP2 gathered; `weight` then a stand-in of its shape,
    the fake's on x's device) the weight's parts are read through the handle, none saved: backward reads them."""
    name, quantizers = _LAYERS[key]
    gathered = handle is not None
    if gathered and not fake:
        weight = weight_of(handle)  # (the GroupedGatheredWeight as it is now: device_blocks reads it as gathered)
    e, n, k = weight.shape
    layout = device_blocks.slot_layout(m_splits, x, k, n, quantizers, need_dgrad, need_wgrad, name, fake=fake)
    y, x_col, w_saved, packed = device_blocks.forward(x, weight, layout, quantizers, name, need_dgrad, need_wgrad,
                                                      fake=fake)
    if gathered:  # (the fake quantized its stand-in: the shapes; the real read the gathered parts and saved none)
        w_saved = []
    flat, entries = flatten_quantized(([x_col] if x_col is not None else []) + w_saved)
    _SAVED[_saved_key(key, need_dgrad, need_wgrad, x, weight, gathered)] = (entries, packed)
    # outputs may alias neither the inputs nor one another, and have the fake's (contiguous) strides
    seen = {StorageWeakRef(t.untyped_storage()) for t in ((x,) if gathered else (x, weight))}
    out = []
    for t in flat:
        ref = StorageWeakRef(t.untyped_storage())
        out.append(t.clone(memory_format=torch.contiguous_format) if ref in seen else t.contiguous())
        seen.add(ref)
    return [y.contiguous(), *out]


@plain_op("hybridq::grouped_blocks_forward")
def grouped_blocks_forward(x: torch.Tensor, weight: torch.Tensor, m_splits: torch.Tensor, key: str,
                           need_dgrad: bool, need_wgrad: bool) -> list[torch.Tensor]:
    """[y, *the tensors of the input's (wgrad) and weight's (dgrad) columnwise forms] of a block-format
    GroupedLinear call (configuration `key`)."""
    return _run_forward(x, weight, m_splits, key, need_dgrad, need_wgrad, fake=False)


@grouped_blocks_forward.register_fake
def _(x, weight, m_splits, key, need_dgrad, need_wgrad):
    return _run_forward(x, weight, m_splits, key, need_dgrad, need_wgrad, fake=True)


def _run_backward(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape,
                  x_dtype, w_dtype, handle=None) -> list[torch.Tensor]:
    name, quantizers = _LAYERS[key]
    e, n, k = w_shape
    x_meta = torch.empty(x_shape, dtype=x_dtype, device="meta")
    entries, packed = _SAVED[_saved_key(key, fwd_dgrad, fwd_wgrad, x_meta,
                                        torch.empty(w_shape, dtype=w_dtype, device="meta"), handle is not None)]
    forms = list(unflatten_quantized(saved, entries))
    x_col = forms.pop(0) if fwd_wgrad else None
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
    for (`fwd_dgrad` / `fwd_wgrad`: its flags, which laid out the slots and the saved forms)."""
    return _run_backward(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape,
                         x_dtype, w_dtype)


def _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype) -> list[torch.Tensor]:
    return [dy.new_empty(dy.shape[0], w_shape[2]) if need_dgrad else dy.new_empty(0),
            dy.new_empty(w_shape, dtype=w_dtype) if need_wgrad else dy.new_empty(0)]


@grouped_blocks_backward.register_fake
def _(dy, m_splits, saved, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, m_splits, key, need_dgrad, need_wgrad = inputs
    # a gathered weight is kept as its handle (not its bytes): backward reads its columnwise parts through it
    ctx.save_for_backward(m_splits, weight if handled_weight(weight) else None, *output[1:])
    ctx.args = (key, need_dgrad, need_wgrad, list(x.shape), list(weight.shape), x.dtype, weight.dtype)


def _backward(ctx, grads):
    m_splits, handled, *saved = ctx.saved_tensors
    key, fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype = ctx.args
    need_dgrad = fwd_dgrad and ctx.needs_input_grad[0]
    need_wgrad = fwd_wgrad and ctx.needs_input_grad[1]
    if handled is not None:
        dx, dw = torch.ops.hybridq.gathered_grouped_blocks_backward(
            grads[0], m_splits, saved, handled._handle, key, need_dgrad, need_wgrad, fwd_dgrad, fwd_wgrad, x_shape,
            w_shape, x_dtype, w_dtype)
    else:
        dx, dw = torch.ops.hybridq.grouped_blocks_backward(grads[0], m_splits, saved, key, need_dgrad, need_wgrad,
                                                           fwd_dgrad, fwd_wgrad, x_shape, w_shape, x_dtype, w_dtype)
    return dx if need_dgrad else None, dw if need_wgrad else None, None, None, None, None


grouped_blocks_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- a weight read through its handle (FSDP2's gathered experts) -----------------------------------------------

@plain_op("hybridq::gathered_grouped_blocks_forward")
def gathered_grouped_blocks_forward(x: torch.Tensor, handle: torch.Tensor, m_splits: torch.Tensor, key: str,
                                    need_dgrad: bool, need_wgrad: bool, w_shape: list[int],
                                    w_dtype: torch.dtype) -> list[torch.Tensor]:
    """`grouped_blocks_forward` of the gathered weight `handle` names (its rowwise parts read now); no weight form
    among the outputs: backward reads the columnwise parts through the handle."""
    return _run_forward(x, None, m_splits, key, need_dgrad, need_wgrad, fake=False, handle=handle)


@gathered_grouped_blocks_forward.register_fake
def _(x, handle, m_splits, key, need_dgrad, need_wgrad, w_shape, w_dtype):
    return _run_forward(x, x.new_empty(w_shape, dtype=w_dtype), m_splits, key, need_dgrad, need_wgrad, fake=True,
                        handle=handle)


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
redirect_to_handle(grouped_blocks_forward, torch.ops.hybridq.gathered_grouped_blocks_forward, 1, with_shape=True)


def grouped_in_graph(layer, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """`y[rows of e] = x[rows of e] W[e]^T` of a block-format GroupedLinear as the custom ops; traced by dynamo."""
    grad = torch.is_grad_enabled()
    need_dgrad, need_wgrad = grad and x.requires_grad, grad and layer.weight.requires_grad
    return torch.ops.hybridq.grouped_blocks_forward(x, layer.weight, m_splits, layer._graph_key, need_dgrad,
                                                    need_wgrad)[0]
