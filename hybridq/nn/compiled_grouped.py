"""A GroupedLinear inside torch.compile's graph: per-tensor FP8 experts on the jagged layout as custom ops (block
formats: compiled_grouped_blocks.py).

Dynamo cannot trace hybridq's autograd functions, so a GroupedLinear in a compiled region was a graph break. Where the
layer takes the jagged FP8 path (per-tensor FP8 with current scaling for every expert, no bias, no backward override,
no weight cache, a plain weight: hybridq/nn/grouped_jagged.py) and `m_splits` is a 1-D integer tensor, its forward
is two custom ops over plain tensors and its backward one, as nn/compiled_linear.py does for Linear:
`hybridq::jagged_input_quantize` quantizes the input (rowwise, the columnwise form wgrad reads, the scales),
`hybridq::grouped_linear_forward` returns the output and the weight's forms backward reads, taking the quantized
input, and `hybridq::grouped_linear_backward` the input and weight gradients. Inside each op the eager code runs
unchanged (`grouped_jagged.jagged_forward` / `jagged_backward`): the results are bitwise the eager layer's with the
same m_splits. The input's quantization is an op of its own so that the projections of one input share it
([Note: one input quantization in the graph]). The token counts stay a tensor: a graph is compiled per shape, never
per routing, and on CUDA the ops read the counts on the device only (no host sync; their values are checked there,
asynchronously). The graph computes that check and the routing's group bounds, and the forward ops take them
(`_routing`, grouped_jagged's [Note: counts checked in the graph]; the input quantize op asserts the check). On the
CPU the ops read the counts (the reference kernels need host counts) and raise ValueError on counts that are negative
or do not sum to the input's tokens.

Fake implementations (what compile traces with) give the outputs' shapes from the shapes alone: the columnwise
buffers' widths come from the kernels (`JaggedFP8Kernels.columnwise_width`, computed without the counts' values, as
the real op computes them).

A weight FSDP2 all-gathered quantized (apply_hybrid_fsdp's `GroupedGatheredWeight`, per-tensor FP8 experts) enters the
graph as its handle, as a compiled Linear's does (nn/weight_handle.py): traced, the `grouped_linear_forward` call on
it becomes `hybridq::gathered_grouped_linear_forward`, which reads the experts' stacked rowwise buffers `[E, N, K]`
through the handle when it runs, and backward calls `hybridq::gathered_grouped_linear_backward`, which reads the
stacked columnwise buffers `[E, K, N]` the backward unshard derived -- the eager layer's `HeldFP8Experts` path, so
bitwise eager; the graph neither copies nor saves the gathered bytes.

Block formats without tensor-wide statistics (FP8 1x128 / 128x128 blocks, MXFP8, their hybrids: the `BLOCKS` packed
kind) compile into the graph too, as compiled_grouped_blocks.py's two ops over the device-count packed path
(nn/grouped_device_blocks.py), on the CPU and where that path runs on CUDA without a host count
(`grouped_device_blocks.device_path_runs`), with a plain weight or one FSDP2 gathered quantized (its handle, as above).

What stays a graph break (the eager path): `m_splits` as a list (its values would be constants of the graph: one
compile per routing), every other recipe (NVFP4, delayed scaling, ...) and option, weights held quantized
(quantized_model_init).
`runs_in_graph` says which; `experts_in_graph` whether an expert module's products all compile.
"""

from __future__ import annotations


import torch

from ..enums import COLUMNWISE, ROWWISE
from .. import dispatch
from ..gemm import JaggedFP8, JaggedFP8Kernels, jagged_fp8_kernels
from ..kernels import native_gemm
from ..weight_forms import GroupedGatheredForm
from .expert_layers import converted_experts
from .graph_keys import ConfigurationKeys
from .grouped_jagged import HeldFP8Experts, TokenGroups, counts_valid, group_bounds, jagged_backward, jagged_forward
from . import compiled_grouped_blocks
from .grouped_packed import BLOCKS, FP8_TENSOR, packed_quantizers
from .m_splits import check_split_values
from .plain_ops import plain_op
from .weight_handle import handled_weight, redirect_to_handle, weight_of

__all__ = ["experts_in_graph", "graph_key", "runs_in_graph", "grouped_in_graph"]

# Configurations by content (graph_keys.py, [Note: configuration keys]) -> (name of the first layer, the quantizers
# every expert shares)
_LAYERS: ConfigurationKeys[tuple[str, dict]] = ConfigurationKeys("grouped-config-")
_TENSORS = ("input", "weight", "grad_output")
# the jagged kernels of a call, by (key, device, in_features, out_features, the device type's registered kernels,
# native GEMMs on): `jagged_fp8_kernels`' answer depends on nothing else (each op call asked it anew: ~25 us of host)
_KERNELS: dict[tuple, JaggedFP8Kernels | None] = {}
# the gathered ops' stand-in weights by (shape, dtype): meta tensors, whose shape alone the ops read
_STAND_INS: dict[tuple, torch.Tensor] = {}


def graph_key(layer) -> str | None:
    """The key of the layer's configuration when its recipe can run in the graph (every expert the same per-tensor
    FP8 quantizers with current scaling), else None; set eagerly when the recipe is installed."""
    kind = packed_quantizers(layer.expert_quantizers)
    if kind is not None and kind.kind == BLOCKS:  # (block formats: compiled_grouped_blocks.py's ops)
        return compiled_grouped_blocks.graph_key(kind.quantizers, layer.name)
    if kind is None or kind.kind != FP8_TENSOR:
        return None
    content = "|".join(repr(kind.quantizers[t]) for t in _TENSORS)
    # messages name the first layer built with this configuration: the others share its compiled graph
    return _LAYERS.key(content, lambda: (f"{layer.name} (or a layer with its configuration, compiled)",
                                         dict(kind.quantizers)))


@torch._dynamo.assume_constant_result
def _kernels_run(key: str, device: str, in_features: int, out_features: int) -> bool:
    """Whether the jagged kernels take this configuration on this device (evaluated once per compile)."""
    return jagged_fp8_kernels(torch.device(device), in_features, out_features, _LAYERS[key][1]) is not None


def _kernels(key: str, device: torch.device, in_features: int, out_features: int) -> JaggedFP8Kernels | None:
    """`jagged_fp8_kernels` of configuration `key` (see `_KERNELS`)."""
    ck = (key, device, in_features, out_features, dispatch.jagged_fp8_kernels(device.type),
          native_gemm.native_enabled())
    if ck not in _KERNELS:
        _KERNELS[ck] = jagged_fp8_kernels(device, in_features, out_features, _LAYERS[key][1])
    return _KERNELS[ck]


def _configuration_in_graph(layer) -> bool:
    """The half of `runs_in_graph` that does not depend on the call: the layer's recipe and options (the jagged
    layout for per-tensor FP8; block formats take the device-count packed path)."""
    key = layer.__dict__.get("_graph_key")
    return (key is not None and layer.packed_path
            and (layer.jagged_path is not False or compiled_grouped_blocks.is_key(key))
            and layer.bias is None and not layer.save_original_input and layer.recipe.backward_override is None)


def _weight_in_graph(weight, key: str) -> bool:
    """A plain weight, or one FSDP2 gathered quantized (its handle enters the graph; block formats: only that, not a
    quantized parameter). Traced by dynamo."""
    return type(weight) in (torch.Tensor, torch.nn.Parameter) or (handled_weight(weight) and (
        not compiled_grouped_blocks.is_key(key) or isinstance(weight, GroupedGatheredForm)))


def _runs_here(layer, x: torch.Tensor) -> bool:
    """Whether the configuration's kernels take this call's device and shapes (once per compile)."""
    key = layer._graph_key
    if compiled_grouped_blocks.is_key(key):
        return compiled_grouped_blocks.runs_here(key, str(x.device), layer.num_experts, layer.in_features,
                                                 layer.out_features)
    return _kernels_run(key, str(x.device), layer.in_features, layer.out_features)


def runs_in_graph(layer, x: torch.Tensor, m_splits, is_first_microbatch) -> bool:
    """Whether this call of `layer` (a GroupedLinear) runs as the custom ops inside a compiled graph (see the module
    docstring). Traced by dynamo: the weight's type is looked at last."""
    plain = (torch.Tensor, torch.nn.Parameter)
    return (_configuration_in_graph(layer) and isinstance(m_splits, torch.Tensor) and is_first_microbatch is None
            and type(x) in plain and x.dim() == 2 and x.shape[-1] == layer.in_features
            and layer.in_features > 0 and layer.out_features > 0 and _weight_in_graph(layer.weight, layer._graph_key)
            and _runs_here(layer, x))


def experts_in_graph(module) -> bool:
    """Whether every grouped product of `module` -- a GroupedLinear, or an expert module converted by
    `convert_experts` -- runs inside torch.compile's graph (no graph break) when called with `m_splits` as a tensor
    on inputs the kernels take: every layer per-tensor FP8 with current scaling on the jagged path, its weight plain
    or gathered quantized by FSDP2, or block formats (FP8 blocks, MXFP8, their hybrids) likewise. False for a module
    that was not converted. May be traced by dynamo (e.g. to run
    an expert module's forward under `torch.compiler.disable` where it would break the graph)."""
    if "_graph_key" in module.__dict__:
        layers = {"weight": module}
    else:
        layers = converted_experts(module)
    # (len, not bool(dict): torch 2.11's dynamo cannot trace bool of a dict -- a graph break per expert module)
    return len(layers) > 0 and all(_configuration_in_graph(layer)
                                   and _weight_in_graph(getattr(module, name), layer._graph_key)
                                   for name, layer in layers.items())


def _check_split_tensor(m_splits: torch.Tensor, num_experts: int, name: str) -> None:
    """The rules on a tensor m_splits that need no values (traced: raised at compile time, before anything runs)."""
    if (m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex
            or m_splits.dtype is torch.bool):
        raise ValueError(f"{name}: m_splits must be a 1-D integer tensor or a list of ints, got a "
                         f"{m_splits.dim()}-D {m_splits.dtype} tensor")
    if m_splits.shape[0] != num_experts:
        raise ValueError(f"{name}: m_splits must have one count per expert ({num_experts}), got {m_splits.shape[0]}")


def _device_counts(device: torch.device) -> bool:
    """Whether counts on `device` stay there, checked and bounded by the graph ([Note: counts checked in the
    graph]): a GPU's; on the CPU the op reads them."""
    return device.type != "cpu"


def _groups(m_splits: torch.Tensor, tokens: int, device: torch.device, name: str, fake: bool,
            valid: torch.Tensor | None = None, bounds=()) -> TokenGroups:
    """The token groups the ops run on. On CUDA the counts stay on the device (no host sync): the host knows only
    what the fake knows, so both size the columnwise buffers alike; `valid` / `bounds`: the graph's `counts_valid` /
    `group_bounds` of them ([Note: counts checked in the graph]). On the CPU the real op reads and checks them."""
    if fake or _device_counts(device):
        if fake:
            return TokenGroups(m_splits.to(device=device, dtype=torch.int64), tokens, None)
        if bounds:  # (the graph's: this call's own groups, the check asserted where given)
            return TokenGroups.with_bounds(m_splits, tokens, device, bounds, valid, name)
        # (values checked on the device, asynchronously; the routing's groups built once)
        return TokenGroups.build(m_splits, tokens, device, name, valid)
    counts = m_splits.to(device=device, dtype=torch.int64)
    sizes = check_split_values([int(v) for v in counts.tolist()], counts.shape[0], tokens, name)
    groups = TokenGroups(counts, tokens, sizes)
    if bounds:
        groups.take_bounds(bounds)
    return groups


def _routing(m_splits: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(counts_ok, bounds) of the forward op, computed in the graph ([Note: counts checked in the graph]): the
    counts' device check for counts on a GPU (on the CPU the op reads them: a host check with its ValueError), and
    the groups' bounds for int32 / int64 counts on the input's device. Traced by dynamo."""
    tokens = x.shape[0]
    valid = counts_valid(m_splits, tokens) if _device_counts(x.device) else None
    takes = m_splits.dtype in (torch.int32, torch.int64) and m_splits.device == x.device
    return valid, group_bounds(m_splits, tokens) if takes else []


def _buffer(col: torch.Tensor) -> torch.Tensor:
    """The whole buffer behind a columnwise form (the CUDA cast's plain transpose is a `[K, T]` view of rows
    `ceil16(T)` apart): an op's outputs must have the strides of the fake's, contiguous ones."""
    if col.is_contiguous():
        return col
    return col.as_strided((col.shape[0], col.stride(0)), (col.stride(0), 1))


# [Note: one input quantization in the graph] An MoE layer's gate and up projections (w1, w3) read one input tensor;
# eager quantizes it once for both ([Note: shared jagged input], grouped_jagged.py). A custom op cannot hand its
# outputs to another op call, so the compiled layer quantizes its input in an op of its own, `jagged_input_quantize`,
# a pure function of its arguments -- the input, the counts, the graph's check and bounds of them, the configuration
# key (the content of the layer's three quantizers: `graph_key`), the weight's rows (which, with the input's width,
# pick the kernels: `_kernels`) and whether the columnwise form is made -- whose outputs are tensors of its own; the
# GEMM op `grouped_linear_forward` takes them. Per-tensor FP8 with current scaling is deterministic: each expert's
# scale comes from the amax of its rows of the input alone, so two calls with equal arguments give the same bytes.
# AOTAutograd's min-cut partitioner (Inductor's and aot_eager's) runs common-subexpression elimination
# (torch._functorch.compile_utils.fx_graph_cse, torch 2.11 and 2.13 alike) over the joint training graph: it merges
# call_function nodes of one target with equal arguments, custom ops included (only random aten ops, `empty` and
# nodes aliasing outputs are exempt), after merging the projections' equal count checks and bounds, so w1's and w3's
# quantize calls become one, and the one columnwise form and scales are saved for both wgrads. Calls that differ in
# any argument -- another input quantizer (format, scale rule), another weight quantizer or width (the key or the
# kernels could differ), a frozen projection (no columnwise form) -- stay two. A graph without backward (no_grad) is
# not partitioned, so there each projection quantizes its input. The count check is asserted in this op, which every
# GEMM op of the routing follows (it reads its outputs): the GEMM op's groups issue no op. Cost: one more op call per
# projection (the split), against one input quantization (its kernels and host work) fewer per MoE layer and step.
def _run_input_quantize(x, m_splits, valid, bounds, key, out_features, columnwise, fake: bool):
    """[x rowwise `[T, K]`, x columnwise buffer (empty without `columnwise`), x scale_inv `[E]`]: `kernels.quantize`
    of the input, each expert's rows with its own amax and scale (the kernels the layer's GEMMs run: `_kernels` of
    the configuration at this input's width and `out_features`)."""
    name, quantizers = _LAYERS[key]
    q, k = quantizers["input"], x.shape[1]
    # (the fake asks anew: its shapes may be symbolic)
    kernels = (jagged_fp8_kernels(x.device, k, out_features, quantizers) if fake
               else _kernels(key, x.device, k, out_features))
    groups = _groups(m_splits, x.shape[0], x.device, name, fake, valid, bounds)
    if fake:  # (an output not asked for is an empty tensor of its own: outputs may not alias)
        col = x.new_empty(k, kernels.columnwise_width(groups), dtype=q.dtype) if columnwise else x.new_empty(0)
        return [x.new_empty(x.shape, dtype=q.dtype), col, x.new_empty(groups.n, dtype=torch.float32)]
    xq = kernels.quantize(q, x, groups, columnwise, f"input of {name}")
    return [xq.row.contiguous(), _buffer(xq.col) if xq.col is not None else x.new_empty(0), xq.scale_inv]


def _run_forward(x, x_row, x_scale, weight, m_splits, bounds, key, need_dgrad, fake: bool, handle=None):
    """[y, W columnwise, W scale_inv] from the input `jagged_input_quantize` made (`x_row`, `x_scale`). With `handle`
    (the weight FSDP2 gathered, `weight` a stand-in of its shape) W's forms are read through the handle: forward its
    rowwise form, backward its columnwise form, so neither is an output (empty tensors)."""
    name, quantizers = _LAYERS[key]
    e, n, k = weight.shape
    handled = handle is not None
    if fake:  # (an output a gradient does not need is an empty tensor of its own: outputs may not alias)
        w_col = (x.new_empty(k, e * n, dtype=quantizers["weight"].dtype) if need_dgrad and not handled
                 else x.new_empty(0))
        return [x.new_empty(x.shape[0], n), w_col,
                x.new_empty(0) if handled else x.new_empty(e, dtype=torch.float32)]
    kernels = _kernels(key, x.device, k, n)
    # (no check: the counts were checked by the input's quantize, which this op follows)
    groups = _groups(m_splits, x.shape[0], x.device, name, fake, bounds=bounds)
    held = None
    if handled:
        row, scale_inv = _held(handle, ROWWISE, name)
        held = JaggedFP8(row, None, scale_inv)
    y, (_, _, w_col, w_scale) = jagged_forward(x, weight, groups, quantizers, name, need_dgrad, False, kernels, held,
                                               xq=JaggedFP8(x_row, None, x_scale))
    if handled:  # (two tensors: outputs may not alias one another)
        w_col, w_scale = x.new_empty(0), x.new_empty(0)
    return [y.contiguous(), w_col.contiguous() if w_col is not None else x.new_empty(0), w_scale]


def _held(handle: torch.Tensor, direction: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data `[E, rows, cols]`, scale_inv `[E]`): the experts' per-tensor FP8 form of `direction` of the gathered
    weight `handle` names (views of its stacked buffers, scales included: no copy), as the eager layer's
    `HeldFP8Experts` reads it. Only the op's GEMM reads them (never an output of the op: outputs may not alias)."""
    weight = weight_of(handle)
    # (`form` makes the direction available first -- a lazy gather is a collective: every rank asks, whatever its
    # counts)
    form = HeldFP8Experts(weight, lambda: weight.unbind(0)).form(direction, in_place=True)
    if form is None:
        raise RuntimeError(f"hybridq compiled GroupedLinear {name}: the gathered experts have no per-tensor FP8 "
                           f"{direction} form (their recipe is per-tensor FP8: apply_hybrid_fsdp gathered another "
                           f"format)")
    return form


@plain_op("hybridq::jagged_input_quantize")
def jagged_input_quantize(x: torch.Tensor, m_splits: torch.Tensor, counts_ok: torch.Tensor | None,
                          bounds: list[torch.Tensor], key: str, out_features: int,
                          columnwise: bool) -> list[torch.Tensor]:
    """[x rowwise, x columnwise buffer, x scale_inv] of the input of a jagged FP8 GroupedLinear call (configuration
    `key`, `out_features` its weight's rows; the columnwise form where `columnwise`, else an empty tensor), for
    `grouped_linear_forward`. A pure function of its arguments: the projections of one input with one configuration
    share one call ([Note: one input quantization in the graph]). `counts_ok` / `bounds`: the graph's `counts_valid`
    / `group_bounds` of `m_splits` (`_routing`), or None / [] (made here); the check is asserted here."""
    return _run_input_quantize(x, m_splits, counts_ok, bounds, key, out_features, columnwise, fake=False)


@jagged_input_quantize.register_fake
def _(x, m_splits, counts_ok, bounds, key, out_features, columnwise):
    return _run_input_quantize(x, m_splits, counts_ok, bounds, key, out_features, columnwise, fake=True)


@plain_op("hybridq::grouped_linear_forward")
def grouped_linear_forward(x: torch.Tensor, x_row: torch.Tensor, x_col: torch.Tensor, x_scale: torch.Tensor,
                           weight: torch.Tensor, m_splits: torch.Tensor, bounds: list[torch.Tensor], key: str,
                           need_dgrad: bool, need_wgrad: bool) -> list[torch.Tensor]:
    """[y, W columnwise, W scale_inv] of a jagged FP8 GroupedLinear call (configuration `key`) on its input `x` as
    `jagged_input_quantize` quantized it (`x_row`, `x_col`, `x_scale`: `x_col` is only saved for wgrad, `x` only
    routes its gradient); W's columnwise form is an empty tensor where backward will not read it. `bounds`: the
    graph's `group_bounds` of `m_splits`, or [] (made here)."""
    return _run_forward(x, x_row, x_scale, weight, m_splits, bounds, key, need_dgrad, fake=False)


@grouped_linear_forward.register_fake
def _(x, x_row, x_col, x_scale, weight, m_splits, bounds, key, need_dgrad, need_wgrad):
    return _run_forward(x, x_row, x_scale, weight, m_splits, bounds, key, need_dgrad, fake=True)


def _run_backward(dy, m_splits, bounds, x_col, x_scale, w_col, w_scale, key, need_dgrad, need_wgrad, w_shape,
                  w_dtype) -> list[torch.Tensor]:
    name, quantizers = _LAYERS[key]
    e, n, k = w_shape
    kernels = _kernels(key, dy.device, k, n)
    groups = _groups(m_splits, dy.shape[0], dy.device, name, fake=False, bounds=bounds)  # (bounds: forward's)
    saved = (kernels.columnwise_form(x_col, groups) if need_wgrad else None, x_scale,
             w_col if need_dgrad else None, w_scale)
    dx, dw = jagged_backward(dy, saved, groups, quantizers, name, kernels, (e, n, k), w_dtype, need_dgrad,
                             need_wgrad)
    return [dx.contiguous() if dx is not None else dy.new_empty(0),
            dw.contiguous() if dw is not None else dy.new_empty(0)]


def _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype) -> list[torch.Tensor]:
    return [dy.new_empty(dy.shape[0], w_shape[2]) if need_dgrad else dy.new_empty(0),
            dy.new_empty(w_shape, dtype=w_dtype) if need_wgrad else dy.new_empty(0)]


@plain_op("hybridq::grouped_linear_backward")
def grouped_linear_backward(dy: torch.Tensor, m_splits: torch.Tensor, bounds: list[torch.Tensor], x_col: torch.Tensor,
                            x_scale: torch.Tensor, w_col: torch.Tensor, w_scale: torch.Tensor, key: str,
                            need_dgrad: bool, need_wgrad: bool, w_shape: list[int],
                            w_dtype: torch.dtype) -> list[torch.Tensor]:
    """[dx, dW] (an empty tensor for a gradient not asked for) of the call `grouped_linear_forward` saved for
    (`bounds`: the forward's)."""
    return _run_backward(dy, m_splits, bounds, x_col, x_scale, w_col, w_scale, key, need_dgrad, need_wgrad, w_shape,
                         w_dtype)


@grouped_linear_backward.register_fake
def _(dy, m_splits, bounds, x_col, x_scale, w_col, w_scale, key, need_dgrad, need_wgrad, w_shape, w_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, x_row, x_col, x_scale, weight, m_splits, bounds, key, need_dgrad, need_wgrad = inputs
    # a gathered weight is kept for dgrad as its handle (not its bytes): backward reads its columnwise form then
    # (the graph's bounds saved too: backward takes them as the forward did -- kept alive for it). The input's forms
    # are the quantize op's outputs: projections sharing that call save the same tensors.
    ctx.save_for_backward(m_splits, x_col, x_scale, *output[1:],
                          weight if need_dgrad and handled_weight(weight) else None, *bounds)
    ctx.args = (key, need_dgrad, need_wgrad, list(weight.shape), weight.dtype)
    ctx.bounds = len(bounds)  # (the gradient of a tensor list is a list of its length)


def _backward(ctx, grads):
    m_splits, x_col, x_scale, w_col, w_scale, handled, *bounds = ctx.saved_tensors
    key, need_dgrad, need_wgrad, w_shape, w_dtype = ctx.args
    need_dgrad = need_dgrad and ctx.needs_input_grad[0]
    need_wgrad = need_wgrad and ctx.needs_input_grad[4]
    if handled is not None and need_dgrad:
        dx, dw = torch.ops.hybridq.gathered_grouped_linear_backward(grads[0], m_splits, bounds, x_col, x_scale,
                                                                    handled._handle, key, need_dgrad, need_wgrad,
                                                                    w_shape, w_dtype)
    else:
        dx, dw = torch.ops.hybridq.grouped_linear_backward(grads[0], m_splits, bounds, x_col, x_scale, w_col,
                                                           w_scale, key, need_dgrad, need_wgrad, w_shape, w_dtype)
    # (x_row, x_col, x_scale: the quantized input carries no gradient -- x's flows through this op)
    return (dx if need_dgrad else None, None, None, None, dw if need_wgrad else None, None, [None] * ctx.bounds,
            None, None, None)


grouped_linear_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- a weight read through its handle (FSDP2's gathered experts) -----------------------------------------------

@plain_op("hybridq::gathered_grouped_linear_forward")
def gathered_grouped_linear_forward(x: torch.Tensor, x_row: torch.Tensor, x_col: torch.Tensor, x_scale: torch.Tensor,
                                    handle: torch.Tensor, m_splits: torch.Tensor, bounds: list[torch.Tensor],
                                    key: str, need_dgrad: bool, need_wgrad: bool, w_shape: list[int],
                                    w_dtype: torch.dtype) -> list[torch.Tensor]:
    """`grouped_linear_forward` of the gathered weight `handle` names (its rowwise form read now); W's columnwise
    outputs are empty: backward reads them through the handle."""
    return _run_forward(x, x_row, x_scale, _stand_in(w_shape, w_dtype), m_splits, bounds, key, need_dgrad,
                        fake=False, handle=handle)


@gathered_grouped_linear_forward.register_fake
def _(x, x_row, x_col, x_scale, handle, m_splits, bounds, key, need_dgrad, need_wgrad, w_shape, w_dtype):
    # (a stand-in of its own: one made under the fake mode is a fake tensor, never to be kept)
    return _run_forward(x, x_row, x_scale, torch.empty(w_shape, dtype=w_dtype, device="meta"), m_splits, bounds, key,
                        need_dgrad, fake=True, handle=handle)


def _stand_in(w_shape: list[int], w_dtype: torch.dtype) -> torch.Tensor:
    """A weight of the gathered weight's shape (no storage): the ops read only its shape (the real op's: kept per
    shape and dtype)."""
    sk = (tuple(w_shape), w_dtype)
    if sk not in _STAND_INS:
        _STAND_INS[sk] = torch.empty(w_shape, dtype=w_dtype, device="meta")
    return _STAND_INS[sk]


@plain_op("hybridq::gathered_grouped_linear_backward")
def gathered_grouped_linear_backward(dy: torch.Tensor, m_splits: torch.Tensor, bounds: list[torch.Tensor],
                                     x_col: torch.Tensor, x_scale: torch.Tensor, handle: torch.Tensor, key: str,
                                     need_dgrad: bool, need_wgrad: bool, w_shape: list[int],
                                     w_dtype: torch.dtype) -> list[torch.Tensor]:
    """`grouped_linear_backward` of a `gathered_grouped_linear_forward` call: dgrad reads the experts' columnwise
    form through `handle` now (the backward unshard derived it, or it is gathered now)."""
    w_col, w_scale = _held(handle, COLUMNWISE, _LAYERS[key][0]) if need_dgrad else (None, None)
    return _run_backward(dy, m_splits, bounds, x_col, x_scale, w_col, w_scale, key, need_dgrad, need_wgrad, w_shape,
                         w_dtype)


@gathered_grouped_linear_backward.register_fake
def _(dy, m_splits, bounds, x_col, x_scale, handle, key, need_dgrad, need_wgrad, w_shape, w_dtype):
    return _backward_fake(dy, need_dgrad, need_wgrad, w_shape, w_dtype)


# `grouped_linear_forward` called on a gathered weight (its __torch_dispatch__ sends it to weight_handle.handle_ops
# while compile traces): the handle in the weight's place
redirect_to_handle(grouped_linear_forward, torch.ops.hybridq.gathered_grouped_linear_forward, 4, with_shape=True)


def grouped_in_graph(layer, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """`y[rows of e] = x[rows of e] W[e]^T` of a GroupedLinear as the custom ops; traced by dynamo."""
    _check_split_tensor(m_splits, layer.num_experts, layer.name)
    if compiled_grouped_blocks.is_key(layer._graph_key):
        return compiled_grouped_blocks.grouped_in_graph(layer, x, m_splits)
    grad = torch.is_grad_enabled()
    need_dgrad, need_wgrad = grad and x.requires_grad, grad and layer.weight.requires_grad
    counts_ok, bounds = _routing(m_splits, x)  # ([Note: counts checked in the graph])
    # ([Note: one input quantization in the graph]; the quantized bytes carry no gradient: x's flows through the GEMM
    # op)
    x_row, x_col, x_scale = torch.ops.hybridq.jagged_input_quantize(x.detach(), m_splits, counts_ok, bounds,
                                                                    layer._graph_key, layer.out_features, need_wgrad)
    return torch.ops.hybridq.grouped_linear_forward(x, x_row, x_col, x_scale, layer.weight, m_splits, bounds,
                                                    layer._graph_key, need_dgrad, need_wgrad)[0]
