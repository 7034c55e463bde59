"""A GroupedLinear inside torch.compile's graph: per-tensor FP8 experts on the jagged layout as two custom ops.

Dynamo cannot trace hybridq's autograd functions, so a GroupedLinear in a compiled region was a graph break. Where the
layer takes the jagged FP8 path (per-tensor FP8 with current scaling for every expert, no bias, no backward override,
no weight cache, a plain weight: hybridq/nn/grouped_jagged.py) and `m_splits` is a 1-D integer tensor, its forward
and backward are each one custom op over plain tensors, as nn/compiled_linear.py does for Linear:
`hybridq::grouped_linear_forward` returns the output and what backward reads (the columnwise forms and scales),
`hybridq::grouped_linear_backward` the input and weight gradients. Inside each op the eager code runs unchanged
(`grouped_jagged.jagged_forward` / `jagged_backward`): the results are bitwise the eager layer's with the same
m_splits. The token counts stay a tensor: a graph is compiled per shape, never per routing, and on CUDA the ops read
the counts on the device only (no host sync; their values are checked there, asynchronously). On the CPU the ops read
them (the reference kernels need host counts) and raise ValueError on counts that are negative or do not sum to the
input's tokens.

Fake implementations (what compile traces with) give the outputs' shapes from the shapes alone: the columnwise
buffers' widths come from the kernels (`JaggedFP8Kernels.columnwise_width`, computed without the counts' values, as
the real op computes them).

What stays a graph break (the eager path): `m_splits` as a list (its values would be constants of the graph: one
compile per routing), every other recipe and option, FSDP2-gathered or quantized weights. `runs_in_graph` says which.
"""

from __future__ import annotations

import uuid

import torch

from ..gemm import jagged_fp8_kernels
from .grouped_jagged import TokenGroups, jagged_backward, jagged_forward
from .grouped_packed import FP8_TENSOR, packed_quantizers
from .m_splits import check_split_values

__all__ = ["graph_key", "runs_in_graph", "grouped_in_graph"]

# Configurations by content (see compiled_linear.py: blocks whose layers differ in name only share one compiled
# graph; the process id keeps another process's cached graphs from naming this process's configurations)
_CONTENT: dict[str, str] = {}  # content -> key
_LAYERS: dict[str, tuple[str, dict]] = {}  # key -> (name of the first layer, the quantizers every expert shares)
_PROCESS = uuid.uuid4().hex[:12]
_TENSORS = ("input", "weight", "grad_output")


def graph_key(layer) -> str | None:
    """The key of the layer's configuration when its recipe can run in the graph (every expert the same per-tensor
    FP8 quantizers with current scaling), else None; set eagerly when the recipe is installed."""
    kind = packed_quantizers(layer.expert_quantizers)
    if kind is None or kind.kind != FP8_TENSOR:
        return None
    content = "|".join(repr(kind.quantizers[t]) for t in _TENSORS)
    key = _CONTENT.get(content)
    if key is None:
        key = _CONTENT[content] = f"grouped-config-{len(_CONTENT)}@{_PROCESS}"
        # messages name the first layer built with this configuration: the others share its compiled graph
        _LAYERS[key] = (f"{layer.name} (or a layer with its configuration, compiled)", dict(kind.quantizers))
    return key


@torch._dynamo.assume_constant_result
def _kernels_run(key: str, device: str, in_features: int, out_features: int) -> bool:
    """Whether the jagged kernels take this configuration on this device (evaluated once per compile)."""
    return jagged_fp8_kernels(torch.device(device), in_features, out_features, _LAYERS[key][1]) is not None


def runs_in_graph(layer, x: torch.Tensor, m_splits, is_first_microbatch) -> bool:
    """Whether this call of `layer` (a GroupedLinear) runs as the custom ops inside a compiled graph (see the module
    docstring). Traced by dynamo: the weight's type is looked at last."""
    plain = (torch.Tensor, torch.nn.Parameter)
    key = layer.__dict__.get("_graph_key")
    return (key is not None and isinstance(m_splits, torch.Tensor) and is_first_microbatch is None
            and layer.packed_path and layer.jagged_path is not False and layer.bias is None
            and not layer.save_original_input and layer.recipe.backward_override is None
            and type(x) in plain and x.dim() == 2 and x.shape[-1] == layer.in_features
            and type(layer.weight) in plain and layer.in_features > 0 and layer.out_features > 0
            and _kernels_run(key, str(x.device), layer.in_features, layer.out_features))


def _check_split_tensor(m_splits: torch.Tensor, num_experts: int, name: str) -> None:
    """The rules on a tensor m_splits that need no values (traced: raised at compile time, before anything runs)."""
    if (m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex
            or m_splits.dtype is torch.bool):
        raise ValueError(f"{name}: m_splits must be a 1-D integer tensor or a list of ints, got a "
                         f"{m_splits.dim()}-D {m_splits.dtype} tensor")
    if m_splits.shape[0] != num_experts:
        raise ValueError(f"{name}: m_splits must have one count per expert ({num_experts}), got {m_splits.shape[0]}")


def _groups(m_splits: torch.Tensor, tokens: int, device: torch.device, name: str, fake: bool) -> TokenGroups:
    """The token groups the ops run on. On CUDA the counts stay on the device (no host sync): the host knows only
    what the fake knows, so both size the columnwise buffers alike. On the CPU the real op reads and checks them."""
    counts = m_splits.to(device=device, dtype=torch.int64)
    if fake or device.type != "cpu":
        if not fake:  # (values checked on the device, asynchronously)
            return TokenGroups.build(counts, tokens, device, name)
        return TokenGroups(counts, tokens, None)
    sizes = check_split_values([int(v) for v in counts.tolist()], counts.shape[0], tokens, name)
    return TokenGroups(counts, tokens, sizes)


def _buffer(col: torch.Tensor) -> torch.Tensor:
    """The whole buffer behind a columnwise form (the CUDA cast's plain transpose is a `[K, T]` view of rows
    `ceil16(T)` apart): an op's outputs must have the strides of the fake's, contiguous ones."""
    if col.is_contiguous():
        return col
    return col.as_strided((col.shape[0], col.stride(0)), (col.stride(0), 1))


def _run_forward(x, weight, m_splits, key, need_dgrad, need_wgrad, fake: bool):
    name, quantizers = _LAYERS[key]
    e, n, k = weight.shape
    kernels = jagged_fp8_kernels(x.device, k, n, quantizers)
    groups = _groups(m_splits, x.shape[0], x.device, name, fake)
    if fake:  # (an output a gradient does not need is an empty tensor of its own: outputs may not alias)
        x_col = (x.new_empty(k, kernels.columnwise_width(groups), dtype=quantizers["input"].dtype) if need_wgrad
                 else x.new_empty(0))
        w_col = x.new_empty(k, e * n, dtype=quantizers["weight"].dtype) if need_dgrad else x.new_empty(0)
        scale = x.new_empty(e, dtype=torch.float32)
        return [x.new_empty(x.shape[0], n), x_col, scale, w_col, scale.clone()]
    y, (x_col, x_scale, w_col, w_scale) = jagged_forward(x, weight, groups, quantizers, name, need_dgrad, need_wgrad,
                                                         kernels)
    return [y.contiguous(), _buffer(x_col) if x_col is not None else x.new_empty(0), x_scale,
            w_col.contiguous() if w_col is not None else x.new_empty(0), w_scale]


@torch.library.custom_op("hybridq::grouped_linear_forward", mutates_args=())
def grouped_linear_forward(x: torch.Tensor, weight: torch.Tensor, m_splits: torch.Tensor, key: str,
                           need_dgrad: bool, need_wgrad: bool) -> list[torch.Tensor]:
    """[y, x columnwise buffer, x scale_inv, W columnwise, W scale_inv] of a jagged FP8 GroupedLinear call
    (configuration `key`); a columnwise form backward will not read is an empty tensor."""
    return _run_forward(x, weight, m_splits, key, need_dgrad, need_wgrad, fake=False)


@grouped_linear_forward.register_fake
def _(x, weight, m_splits, key, need_dgrad, need_wgrad):
    return _run_forward(x, weight, m_splits, key, need_dgrad, need_wgrad, fake=True)


@torch.library.custom_op("hybridq::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(dy: torch.Tensor, m_splits: torch.Tensor, x_col: torch.Tensor, x_scale: torch.Tensor,
                            w_col: torch.Tensor, w_scale: torch.Tensor, key: str, need_dgrad: bool,
                            need_wgrad: bool, w_shape: list[int], w_dtype: torch.dtype) -> list[torch.Tensor]:
    """[dx, dW] (an empty tensor for a gradient not asked for) of the call `grouped_linear_forward` saved for."""
    name, quantizers = _LAYERS[key]
    e, n, k = w_shape
    kernels = jagged_fp8_kernels(dy.device, k, n, quantizers)
    groups = _groups(m_splits, dy.shape[0], dy.device, name, fake=False)
    saved = (kernels.columnwise_form(x_col, groups) if need_wgrad else None, x_scale,
             w_col if need_dgrad else None, w_scale)
    dx, dw = jagged_backward(dy, saved, groups, quantizers, name, kernels, (e, n, k), w_dtype, need_dgrad,
                             need_wgrad)
    return [dx.contiguous() if dx is not None else dy.new_empty(0),
            dw.contiguous() if dw is not None else dy.new_empty(0)]


@grouped_linear_backward.register_fake
def _(dy, m_splits, x_col, x_scale, w_col, w_scale, key, need_dgrad, need_wgrad, w_shape, w_dtype):
    return [dy.new_empty(dy.shape[0], w_shape[2]) if need_dgrad else dy.new_empty(0),
            dy.new_empty(w_shape, dtype=w_dtype) if need_wgrad else dy.new_empty(0)]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, m_splits, key, need_dgrad, need_wgrad = inputs
    ctx.save_for_backward(m_splits, *output[1:])
    ctx.args = (key, need_dgrad, need_wgrad, list(weight.shape), weight.dtype)


def _backward(ctx, grads):
    m_splits, x_col, x_scale, w_col, w_scale = ctx.saved_tensors
    key, need_dgrad, need_wgrad, w_shape, w_dtype = ctx.args
    need_dgrad = need_dgrad and ctx.needs_input_grad[0]
    need_wgrad = need_wgrad and ctx.needs_input_grad[1]
    dx, dw = torch.ops.hybridq.grouped_linear_backward(grads[0], m_splits, x_col, x_scale, w_col, w_scale, key,
                                                       need_dgrad, need_wgrad, w_shape, w_dtype)
    return dx if need_dgrad else None, dw if need_wgrad else None, None, None, None, None


grouped_linear_forward.register_autograd(_backward, setup_context=_setup_context)


def grouped_in_graph(layer, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """`y[rows of e] = x[rows of e] W[e]^T` of a GroupedLinear as the custom ops; traced by dynamo."""
    _check_split_tensor(m_splits, layer.num_experts, layer.name)
    grad = torch.is_grad_enabled()
    need_dgrad, need_wgrad = grad and x.requires_grad, grad and layer.weight.requires_grad
    return torch.ops.hybridq.grouped_linear_forward(x, layer.weight, m_splits, layer._graph_key, need_dgrad,
                                                    need_wgrad)[0]
