"""A tensor-parallel hybridq Linear inside torch.compile's graph: hybridq's ColwiseParallel / RowwiseParallel
layers (sequence parallelism included) as two opaque custom ops over the rank's local tensors.

DTensor stays outside the ops: dynamo traces the styles' hooks, `to_local` / `from_local` / `redistribute` and the
row-parallel output's reduction (DTensor's functional collectives). Inside, `hybridq::tp_linear_forward` /
`tp_linear_backward` take the rank's input, weight piece and bias piece plus two plain values naming the
parallelism -- `tp`, the layer's tensor-parallel configuration (registered when the style is applied: kind, group,
features) and `seq_dim`, the sharded sequence dim of the input (-1: none) -- and run the eager tensor-parallel
computation unchanged (linear_function's forward and gradients on a configuration carrying the same
`PieceQuantizer`s and `SequenceGather` as `TensorParallelLinear.forward`): every statistic is MAX-reduced over the
group as in eager, the sequence-parallel input is all-gathered quantized and its gradient reduce-scattered in high
precision, by torch.distributed collectives that really run when the op runs. The results are bitwise the eager
layer's.

What differs from eager: the layers that read one sequence-parallel input (wq/wk/wv, w1/w3) do not share its
gathered quantization (an op's outputs must be its own tensors): each op quantizes and gathers it (the same bits),
in forward and in backward.

Fakes (what compile traces with) run the same code on fake tensors: c10d's collectives have meta kernels (they
move nothing), so the saved tensors' shapes come out of the real code path; the one check that reads values (every
rank holding the same share of the sequence: sequence.py's `check_equal_pieces`) runs in the real op only.

A weight piece FSDP2 all-gathers quantized (apply_hybrid_fsdp, then the TP styles, then fully_shard over the dp
mesh dimension: torchtitan's 2-D order) enters the graph as its handle, as on one device (nn/weight_handle.py): the
ops called on it become `hybridq::tp_gathered_linear_forward` / `tp_gathered_linear_backward`, which read the
gathered piece when they run.

What stays a graph break (the eager path, same results): the is_first_microbatch cache, a quantized parameter
(quantized_model_init) under tensor parallelism, and inputs placed in a way the eager path refuses (its error is
raised there).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..enums import BackwardOverride, ParallelStyle
from ..nn.compiled_linear import (_LAYOUTS, _backward_fake, _config, _record_layout, general_forward,
                                  general_grads)
from ..nn.graph_keys import ConfigurationKeys
from ..nn.linear_function import _LinearConfig, gradients_needed
from ..nn.plain_ops import plain_op
from ..nn.weight_handle import handled_weight, redirect_to_handle, weight_of
from ..tensor import QuantizedTensor
from ..torch_private import local_tensor
from .sequence import SequenceGather, _WgradShare, gather_plan

__all__ = ["compiled_tp_linear", "local_input_grad_placements", "register", "runs_in_graph", "track", "tracked"]

# tensor-parallel configurations by key (graph_keys.py, [Note: configuration keys]): kind, group, features -> the
# TensorParallelLinear (mesh, kind, features), so that layers of one shape and kind share a compiled graph
_TP: ConfigurationKeys = ConfigurationKeys("tp-")
_CONFIGS: dict[tuple, _LinearConfig] = {}  # (configuration key, override, tp key) -> config with piece quantizers
_LAYERS: dict[int, weakref.ref] = {}  # tensor-parallel Linears by number (`track`)
_NEXT_LAYER = itertools.count()


def register(tp) -> str:
    """The key of `tp` (a TensorParallelLinear), registered when a style is applied (eagerly)."""
    content = (str(tp.kind), tp.group.group_name, tp.in_features, tp.out_features)
    # (a new key for the group of a new process group that reuses the name)
    return _TP.key(content, lambda: tp, keep=lambda known: known.group is tp.group)


def track(module) -> int:
    """A number naming `module` (a tensor-parallel Linear) for `_gathered_now`, kept while the module lives."""
    n = next(_NEXT_LAYER)
    _LAYERS[n] = weakref.ref(module, lambda _, n=n: _LAYERS.pop(n, None))
    return n


def tracked(layer: int):
    """The module numbered `layer` by `track`, or None (never tracked, or freed)."""
    ref = _LAYERS.get(layer)
    return None if ref is None else ref()


@torch.compiler.assume_constant_result
def _gathered_now(layer: int) -> bool:
    """Whether the weight of tensor-parallel Linear `layer` is, as compile traces its call, the piece FSDP2
    gathered quantized (a handled weight under the DTensor: fully_shard manages it, which never changes after;
    compiled code reads it as a constant)."""
    module = tracked(layer)  # (None: a layer copied without its module -- it stays eager)
    return module is not None and handled_weight(local_tensor(module._parameters.get("weight")))


def _tp_config(key: str, override: str | None, tp_key: str) -> _LinearConfig:
    cfg = _CONFIGS.get((key, override, tp_key))
    if cfg is None:
        base = _config(key, override)
        pieces = _TP[tp_key].piece_quantizers(base.input_q, base.weight_q, base.grad_output_q)
        cfg = _CONFIGS[(key, override, tp_key)] = base.replace(**pieces)
    return cfg


def _full_shape(x: torch.Tensor, seq_dim: int, world_size: int) -> tuple[int, ...]:
    """The whole input's shape from this rank's piece of it (DTensor's equal `Shard(seq_dim)` pieces)."""
    s = list(x.shape)
    s[seq_dim] *= world_size
    return tuple(s)


def _call_config(x: torch.Tensor, key: str, override: str | None, tp_key: str, seq_dim: int
                 ) -> tuple[_LinearConfig, SequenceGather | None]:
    """The configuration of one call: the layer's pieces, and with `seq_dim` >= 0 the input's sequence gather."""
    cfg = _tp_config(key, override, tp_key)
    if seq_dim < 0:
        return cfg, None
    tp = _TP[tp_key]
    gather = SequenceGather.create(x, _full_shape(x, seq_dim, tp.mesh.size()), seq_dim, tp.group,
                                   f"input of {cfg.name}")
    return cfg.replace(input_gather=gather), gather


def _layout_key(key, override, need_dgrad, need_wgrad, x, w_shape, tp_key, seq_dim) -> tuple:
    return ("tp", key, override, need_dgrad, need_wgrad, tuple(x.shape), tuple(w_shape), x.dtype, tp_key, seq_dim)


def _forward(x, weight, bias, key, override, need_dgrad, need_wgrad, tp_key, seq_dim, handled=False):
    cfg, gather = _call_config(x, key, override, tp_key, seq_dim)
    return general_forward(x, weight, bias, cfg, need_dgrad, need_wgrad, handled,
                           lead=None if gather is None else gather.full_shape[:-1])


@plain_op("hybridq::tp_linear_forward")
def tp_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: str,
                      override: str | None, need_dgrad: bool, need_wgrad: bool, tp: str,
                      seq_dim: int) -> list[torch.Tensor]:
    """[y, *saved tensors] of this rank's part of a tensor-parallel hybridq Linear call: `x` this rank's input
    (its sequence piece when `seq_dim` >= 0), `weight` / `bias` its pieces, `tp` the parallelism's key."""
    y, flat, layout = _forward(x, weight, bias, key, override, need_dgrad, need_wgrad, tp, seq_dim)
    _record_layout(_layout_key(key, override, need_dgrad, need_wgrad, x, weight.shape, tp, seq_dim), layout)
    return [y, *flat]


@tp_linear_forward.register_fake
def _(x, weight, bias, key, override, need_dgrad, need_wgrad, tp, seq_dim):
    y, flat, _ = _forward(x, weight, bias, key, override, need_dgrad, need_wgrad, tp, seq_dim)
    return [y, *flat]


@plain_op("hybridq::tp_linear_backward")
def tp_linear_backward(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                       saved: list[torch.Tensor], key: str, override: str | None, need_dgrad: bool,
                       need_wgrad: bool, need_bgrad: bool, x_shape: list[int], w_shape: list[int],
                       x_dtype: torch.dtype, w_dtype: torch.dtype, b_dtype: torch.dtype, tp: str,
                       seq_dim: int) -> list[torch.Tensor]:
    """[dx, dw, db] (an empty tensor for a gradient not asked for) of the call `tp_linear_forward` saved `saved`
    for; dx is this rank's piece (under sequence parallelism reduce-scattered over the group)."""
    return _grads(dy, x, weight, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape,
                  x_dtype, w_dtype, b_dtype, tp, seq_dim)


def _grads(dy, x, weight, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, x_dtype,
           w_dtype, b_dtype, tp, seq_dim) -> list[torch.Tensor]:
    x_meta = torch.empty(x_shape, dtype=x_dtype, device="meta")
    layout, _ = _LAYOUTS[_layout_key(key, override, need_dgrad, need_wgrad, x_meta, w_shape, tp, seq_dim)]
    cfg, gather = _call_config(x_meta, key, override, tp, seq_dim)
    if gather is not None:  # what forward's gather planned; wgrad's input gathered again from what this rank kept
        reads = (need_wgrad and cfg.backward_override is None and not cfg.save_original_input)
        rows = x_meta.reshape(-1, x_shape[-1]).shape[0]
        gather.plan = gather_plan(cfg.input_q, gather, rows, x_shape[-1], x_dtype, reads)
        gather.quantizer = cfg.input_q
        if reads and gather.plan.per_phase:
            gather.share = _WgradShare(readers=1)
    return general_grads(cfg, layout, dy, x, weight, saved, need_dgrad, need_wgrad, need_bgrad, x_shape, x_dtype,
                         w_dtype, b_dtype)


@tp_linear_backward.register_fake
def _(dy, x, weight, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, x_dtype, w_dtype,
      b_dtype, tp, seq_dim):
    return _backward_fake(dy, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, w_dtype, b_dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, key, override, need_dgrad, need_wgrad, tp, seq_dim = inputs
    cfg = _config(key, override)
    hp = cfg.backward_override == BackwardOverride.HIGH_PRECISION
    # the input (this rank's rows) and the weight piece are kept only where backward reads them as they are; a
    # gathered weight piece is kept whatever backward reads (its handle: backward reads the weight then)
    keep_x = need_wgrad and (hp or (override is None and cfg.save_original_input))
    keep_w = (need_dgrad and hp) or isinstance(weight, QuantizedTensor)
    ctx.save_for_backward(x if keep_x else None, weight if keep_w else None, *output[1:])
    ctx.args = (key, override, need_dgrad, need_wgrad, list(x.shape), list(weight.shape), x.dtype, weight.dtype,
                weight.dtype if bias is None else bias.dtype, tp, seq_dim)
    ctx.has_bias = bias is not None


def _backward(ctx, grads):
    x, weight, *saved = ctx.saved_tensors
    key, override, need_dgrad, need_wgrad, x_shape, w_shape, x_dtype, w_dtype, b_dtype, tp, seq_dim = ctx.args
    need_bgrad = ctx.has_bias and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.hybridq.tp_linear_backward(grads[0], x, weight, saved, key, override, need_dgrad,
                                                      need_wgrad, need_bgrad, x_shape, w_shape, x_dtype, w_dtype,
                                                      b_dtype, tp, seq_dim)
    return (dx if need_dgrad else None, dw if need_wgrad else None, db if need_bgrad else None, None, None, None,
            None, None, None)


tp_linear_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- a weight piece FSDP2 all-gathered quantized (apply_hybrid_fsdp over the TP piece: its handle) -------------

@plain_op("hybridq::tp_gathered_linear_forward")
def tp_gathered_linear_forward(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, key: str,
                               override: str | None, need_dgrad: bool, need_wgrad: bool, tp: str, seq_dim: int,
                               w_shape: list[int], w_dtype: torch.dtype) -> list[torch.Tensor]:
    """`tp_linear_forward` of the gathered weight piece `handle` names (read when the op runs; nothing of it
    saved: backward reads it again)."""
    y, flat, layout = _forward(x, weight_of(handle), bias, key, override, need_dgrad, need_wgrad, tp, seq_dim,
                               handled=True)
    _record_layout(_layout_key(key, override, need_dgrad, need_wgrad, x, w_shape, tp, seq_dim), layout)
    return [y, *flat]


@tp_gathered_linear_forward.register_fake
def _(x, handle, bias, key, override, need_dgrad, need_wgrad, tp, seq_dim, w_shape, w_dtype):
    # (a stand-in weight of its shape: the outputs' shapes do not depend on its values, and it is not saved)
    y, flat, _ = _forward(x, x.new_empty(w_shape, dtype=w_dtype), bias, key, override, need_dgrad, need_wgrad, tp,
                          seq_dim, handled=True)
    return [y, *flat]


@plain_op("hybridq::tp_gathered_linear_backward")
def tp_gathered_linear_backward(dy: torch.Tensor, x: torch.Tensor | None, handle: torch.Tensor,
                                saved: list[torch.Tensor], key: str, override: str | None, need_dgrad: bool,
                                need_wgrad: bool, need_bgrad: bool, x_shape: list[int], w_shape: list[int],
                                x_dtype: torch.dtype, w_dtype: torch.dtype, b_dtype: torch.dtype, tp: str,
                                seq_dim: int) -> list[torch.Tensor]:
    """`tp_linear_backward` of a `tp_gathered_linear_forward` call: the weight piece read through `handle` now."""
    return _grads(dy, x, handle, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape,
                  x_dtype, w_dtype, b_dtype, tp, seq_dim)


@tp_gathered_linear_backward.register_fake
def _(dy, x, handle, saved, key, override, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, x_dtype, w_dtype,
      b_dtype, tp, seq_dim):
    return _backward_fake(dy, need_dgrad, need_wgrad, need_bgrad, x_shape, w_shape, w_dtype, b_dtype)


# the ops called on the gathered weight piece while compile traces (its __torch_dispatch__): their `gathered` twins
redirect_to_handle(tp_linear_forward, torch.ops.hybridq.tp_gathered_linear_forward, 1, with_shape=True)
redirect_to_handle(tp_linear_backward, torch.ops.hybridq.tp_gathered_linear_backward, 2, with_shape=False)


# ---- traced by dynamo ---------------------------------------------------------------------------------------

def local_input_grad_placements(kind: ParallelStyle, placement) -> tuple | None:
    """How the gradient of a layer's local input lies on the group (`to_local`'s grad_placements): a
    column-parallel layer reading a replicated input computes, on each rank, the part of the input gradient that
    flows through its output columns -- a partial sum, which DTensor then all-reduces (in high precision) into the
    replicated input's gradient. Anything else: as the input lies (None)."""
    return (Partial(),) if kind == ParallelStyle.COLWISE and isinstance(placement, Replicate) else None


def _is_sequence_shard(p, ndim: int) -> bool:
    return isinstance(p, Shard) and p.dim % ndim != ndim - 1


def runs_in_graph(module, tp, x: torch.Tensor, is_first_microbatch: bool | None) -> bool:
    """Whether this call of a tensor-parallel `module` runs as the custom ops inside the compiled graph: a DTensor
    weight over the TP mesh holding a plain local piece or one FSDP2 gathered quantized (its handle), no weight
    cache, no quantizer with state, and an input placed as the eager path takes it (else the eager path raises)."""
    if is_first_microbatch is not None or module._quantizers_stateful:
        return False
    # (a weight quantized elsewhere is looked at only once FSDP2 has swapped its gathered piece in: dynamo cannot
    # wrap the sharded one, apply_hybrid_fsdp's without fully_shard)
    if module._weight_quantized_elsewhere and not (module._weight_gathered and _gathered_now(tp.layer)):
        return False
    if not isinstance(module.weight, DTensor):
        return False
    if not isinstance(x, DTensor):
        return type(x) in (torch.Tensor, torch.nn.Parameter)
    p = x.placements[0]
    if isinstance(p, Replicate):
        return True
    if tp.kind == ParallelStyle.COLWISE:
        return _is_sequence_shard(p, x.ndim)
    return isinstance(p, Shard) and p.dim % x.ndim == x.ndim - 1


def compiled_tp_linear(module, tp, x: torch.Tensor, override: str | None) -> DTensor:
    """This rank's `x W^T + b` of a tensor-parallel hybridq Linear as the custom ops (see the module docstring),
    returned as the DTensor the eager path returns; traced by dynamo."""
    seq_dim = -1
    if isinstance(x, DTensor):
        p = x.placements[0]
        if tp.kind == ParallelStyle.ROWWISE and isinstance(p, Replicate):
            x = x.redistribute(placements=[Shard(-1)])
        elif tp.kind == ParallelStyle.COLWISE and _is_sequence_shard(p, x.ndim):
            seq_dim = p.dim % x.ndim
        x = x.to_local(grad_placements=local_input_grad_placements(tp.kind, x.placements[0]))
    weight = module.weight.to_local()
    bias = module.bias
    local_bias = bias.to_local() if tp.kind == ParallelStyle.COLWISE and isinstance(bias, DTensor) else None
    need_dgrad, need_wgrad = gradients_needed(x, weight)
    y = torch.ops.hybridq.tp_linear_forward(x, weight, local_bias, module._configuration_key,
                                            None if override is None else str(override), need_dgrad, need_wgrad,
                                            tp.graph_key, seq_dim)[0]
    if tp.kind == ParallelStyle.COLWISE:
        return DTensor.from_local(y, tp.mesh, [Shard(y.ndim - 1)], run_check=False)
    out = DTensor.from_local(y, tp.mesh, [Partial()], run_check=False)
    return out if bias is None else out + bias  # DTensor reduces the partial sums before adding the bias
