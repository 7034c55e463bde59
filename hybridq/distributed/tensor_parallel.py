"""Tensor and sequence parallelism for hybridq Linear layers: drop-in replacements for torch's parallel styles.

`ColwiseParallel`, `RowwiseParallel` and `PrepareModuleInput` take torch's constructor arguments with torch's
meaning and go in the same plan dict as torch's own styles (`SequenceParallel` for norms). On a hybridq Linear
they keep every GEMM operand quantized as the single-device model quantizes it:

- column-parallel: the weight's rows (`Shard(0)`) are quantized with statistics reduced over the group
  (`pieces.PieceQuantizer`, rows); a sequence-sharded input is quantized on each rank and all-gathered in its
  quantized form, per phase where that fits in bf16's bytes (the rowwise form in forward, each rank's own form for
  wgrad in backward: `sequence.SequenceGather`, [Note: sequence phases]); grad_output's columns are quantized with
  the whole tensor's statistics; the input gradient is reduce-scattered in high precision.
- row-parallel: the input's and the weight's columns (`Shard(-1)` / `Shard(1)`) are quantized with the whole
  tensors' statistics; the partial outputs are reduced (all-reduce, or reduce-scatter for `Shard(1)` outputs)
  in high precision by DTensor.

On any other module (an nn.Linear not converted, an embedding) they behave exactly as torch's styles.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import style as _torch_style

from ..enums import Cut, ParallelStyle
from ..nn.linear import Linear
from ..nn.linear_function import apply_linear, cached_quantized_weight
from . import compiled_tp
from .compiled_tp import local_input_grad_placements
from .pieces import PieceQuantizer, check_column_cuts, reject_stateful
from .sequence import SequenceGather

__all__ = ["ColwiseParallel", "RowwiseParallel", "PrepareModuleInput", "TensorParallelLinear"]


def _is_sequence_shard(p) -> bool:
    return isinstance(p, Shard) and p.dim != -1


@dataclasses.dataclass(eq=False)
class TensorParallelLinear:
    """What a hybridq Linear needs to run its three GEMMs on this rank's pieces (set by the styles)."""

    kind: ParallelStyle
    mesh: object
    in_features: int
    out_features: int
    layer: int = -1  # the layer's number for the compiled path (compiled_tp.track)
    graph_key: str | None = None  # the plain value the compiled ops name this configuration by (compiled_tp.register)

    def __post_init__(self):
        self.kind = ParallelStyle.parse(self.kind, "TensorParallelLinear kind")

    def __deepcopy__(self, memo: dict) -> "TensorParallelLinear":
        # A copy made with its layer (copy.deepcopy of the model: the copied module is in `memo` before its
        # attributes are copied) gets a number of its own: the layer number names one module for the compiled
        # path, and a shared one would look at the original's weight (or at nothing once it is freed).
        new = copy.copy(self)
        memo[id(self)] = new
        for f in dataclasses.fields(self):
            if f.name != "layer":
                setattr(new, f.name, copy.deepcopy(getattr(self, f.name), memo))
        module = compiled_tp.tracked(self.layer)
        copied = memo.get(id(module)) if module is not None else None
        new.layer = compiled_tp.track(copied) if copied is not None else -1
        return new

    @property
    def group(self):
        return self.mesh.get_group()

    def pieces(self, module: Linear) -> dict:
        """The piece quantizers of the operands this rank holds a piece of (the others stay as they are)."""
        key = (module.input_quantizer, module.weight_quantizer, module.grad_output_quantizer)
        cached = module.__dict__.get("_tp_pieces")
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        out = self.piece_quantizers(*key)
        module.__dict__["_tp_pieces"] = (key, out)
        return out

    def piece_quantizers(self, input_q, weight_q, grad_output_q) -> dict:
        """{config field: PieceQuantizer} for the operands of these quantizers this rank holds a piece of."""
        g, ws, rank = self.group, self.mesh.size(), self.mesh.get_local_rank()
        n, k = self.out_features, self.in_features
        if self.kind == ParallelStyle.COLWISE:
            return {"weight_q": PieceQuantizer(weight_q, "rows", n, g, ws, rank),
                    "grad_output_q": PieceQuantizer(grad_output_q, "columns", n, g, ws, rank)}
        return {"input_q": PieceQuantizer(input_q, "columns", k, g, ws, rank),
                "weight_q": PieceQuantizer(weight_q, "columns", k, g, ws, rank)}

    # -- torch.compile (compiled_tp.py): the layer's GEMMs as custom ops inside the graph ---------------------
    def runs_in_graph(self, module: Linear, x: torch.Tensor, is_first_microbatch: bool | None) -> bool:
        return compiled_tp.runs_in_graph(module, self, x, is_first_microbatch)

    def compiled_forward(self, module: Linear, x: torch.Tensor, override: str | None) -> DTensor:
        return compiled_tp.compiled_tp_linear(module, self, x, override)

    def check(self, module: Linear) -> None:
        """The set-up checks: no delayed scaling, and the K / N splits keep every block of every operand this
        rank quantizes a column piece of whole (FormatShapeError naming the layer, the format and the rule)."""
        ws = self.mesh.size()
        override = module.recipe.backward_override
        for t, q in module.quantizers().items():
            reject_stateful(q, f"{t} of {module.name}")
        if self.kind == ParallelStyle.COLWISE:  # the weight's rows (its pieces are GEMM operands of their own)
            check_column_cuts(module.weight_quantizer, self.out_features, ws, True, override is None,
                              f"weight of {module.name}", axis=Cut.ROWS)
            if override is None:
                check_column_cuts(module.grad_output_quantizer, self.out_features, ws, True, True,
                                  f"grad_output of {module.name}")
        else:
            check_column_cuts(module.weight_quantizer, self.in_features, ws, True, override is None,
                              f"weight of {module.name}")
            check_column_cuts(module.input_quantizer, self.in_features, ws, True, False,
                              f"input of {module.name}")

    def forward(self, module: Linear, x: torch.Tensor, is_first_microbatch: bool | None) -> DTensor:
        override = module.recipe.backward_override
        if override is not None:
            module.check_override()
        cfg = module._config(override).replace(**self.pieces(module))
        if isinstance(x, DTensor):
            placement, full_shape = x.placements[0], tuple(x.shape)
            x_local = x.to_local(grad_placements=local_input_grad_placements(self.kind, placement))
        else:
            placement, full_shape, x_local = None, None, x
        if self.kind == ParallelStyle.COLWISE and _is_sequence_shard(placement):
            cfg = cfg.replace(input_gather=SequenceGather.create(x, full_shape, placement.dim, self.group,
                                                                 f"input of {module.name}"))
        elif self.kind == ParallelStyle.ROWWISE and isinstance(placement, Replicate):
            x_local = x.redistribute(placements=[Shard(-1)]).to_local()
        elif placement is not None and not (isinstance(placement, Replicate) or (
                self.kind == ParallelStyle.ROWWISE and isinstance(placement, Shard)
                and placement.dim in (-1, x.ndim - 1))):
            raise ValueError(f"{module.name}: a {self.kind}-parallel layer cannot take an input placed "
                             f"{placement}")
        weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        bias = module.bias
        local_bias = bias.to_local() if (self.kind == ParallelStyle.COLWISE and isinstance(bias, DTensor)) else None
        cache = None
        if is_first_microbatch is not None:
            cache = lambda need_columnwise: _cached_piece(module, weight, cfg.weight_q, is_first_microbatch,
                                                          need_columnwise)
        y = apply_linear(x_local, weight, local_bias, cfg, cache)
        if self.kind == ParallelStyle.COLWISE:
            return DTensor.from_local(y, self.mesh, [Shard(y.ndim - 1)], run_check=False)
        out = DTensor.from_local(y, self.mesh, [Partial()], run_check=False)
        return out if bias is None else out + bias  # DTensor reduces the partial sums before adding the bias


def _cached_piece(module: Linear, weight: torch.Tensor, q: PieceQuantizer, is_first_microbatch: bool,
                  need_columnwise: bool):
    module._weight_cache, module._cache_columnwise, wq = cached_quantized_weight(
        module._weight_cache, module._cache_columnwise, weight, q, is_first_microbatch, need_columnwise,
        module.name)
    return wq


def _distribute_weight(module: Linear, mesh, placement) -> None:
    """The weight as a DTensor piece on the TP mesh. A HybridWeight (apply_hybrid_fsdp, before fully_shard on
    the dp mesh dimension) stays one around the local piece, told that its per-tensor statistics also reduce over
    the TP group."""
    from .weights import HybridWeight

    w = module.weight
    if not isinstance(w, HybridWeight):
        return
    if placement == Shard(0):  # FSDP2 quantizes row shards of this piece: blocks must not span two pieces
        check_column_cuts(module.weight_quantizer, module.out_features, mesh.size(), True,
                          module.recipe.backward_override is None, f"weight of {module.name} (FSDP2 x TP)", axis=Cut.ROWS)
    full = distribute_tensor(w._data, mesh, [placement])
    w._hq.tp_group = mesh.get_group()
    w._hq.tp_cut = Cut.ROWS if placement == Shard(0) else Cut.COLUMNS
    local = HybridWeight(full.to_local(), w._hq)
    module.weight = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape,
                                                    stride=full.stride()), requires_grad=w.requires_grad)


def _check_fsdp_pieces(module: Linear) -> None:
    """A weight prepared for FSDP2 (apply_hybrid_fsdp) becomes a TP piece that FSDP2 cuts into row shards: refuse,
    before anything changes, a format that cannot quantize a piece cut along both dims."""
    from .weights import HybridWeight

    q = module.weight_quantizer
    if not (isinstance(module.weight, HybridWeight) and q.stats_per_axis):
        return
    probe = torch.empty(2, 2, device="meta")  # (sizes only: does the format quantize such a piece at all?)
    try:
        q.quantize_axes(probe, True, True, q.piece_stats(probe, True, True, "K"), q.piece_stats(probe, True, True, "M"))
    except NotImplementedError as e:
        raise NotImplementedError(
            f"{module.name}: FSDP2 over tensor-parallel pieces cuts its weight along both dims, which its format "
            f"cannot quantize: {e}. Use one format with per-axis statistics for both directions, or keep this "
            f"layer out of apply_hybrid_fsdp (module_filter_fn)") from e


def _attach(module: Linear, kind: ParallelStyle, mesh) -> None:
    _check_fsdp_pieces(module)
    if mesh.ndim != 1:
        raise ValueError(f"{module.name}: tensor-parallel styles take the 1-D tensor-parallel mesh (e.g. "
                         f"mesh['tp']), got a {mesh.ndim}-D mesh")
    tp = TensorParallelLinear(kind, mesh, module.in_features, module.out_features)
    tp.check(module)
    # (registered when attached to a layer over a real mesh: the pre-flight checks layouts with a stand-in mesh)
    tp.layer, tp.graph_key = compiled_tp.track(module), compiled_tp.register(tp)
    module.__dict__.pop("_tp_pieces", None)
    module._weight_cache = None
    module._tensor_parallel = tp


class ColwiseParallel(_torch_style.ColwiseParallel):
    """torch's ColwiseParallel (same arguments) that keeps a hybridq Linear's operands quantized: a
    sequence-sharded input (`input_layouts=Shard(1)`, or a `Shard(1)` DTensor from `SequenceParallel` /
    `PrepareModuleInput`) is all-gathered quantized; the output is `Shard(-1)` unless `output_layouts` says
    otherwise."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, Linear):
            return super()._apply(module, device_mesh)
        _attach(module, ParallelStyle.COLWISE, device_mesh)
        _distribute_weight(module, device_mesh, Shard(0))
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 lambda mod, inputs, mesh: self._hybrid_input(inputs, mesh),
                                 lambda mod, outputs, mesh: self._prepare_output_fn(
                                     self.output_layouts, self.use_local_output, mod, outputs, mesh))

    def _hybrid_input(self, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        p = x.placements[0]
        if not (isinstance(p, Replicate) or _is_sequence_shard(p)):  # e.g. Partial: reduce it (high precision)
            x = x.redistribute(placements=self.desired_input_layouts)
        return (x, *inputs[1:])


class RowwiseParallel(_torch_style.RowwiseParallel):
    """torch's RowwiseParallel (same arguments) that keeps a hybridq Linear's operands quantized: the input's
    and the weight's K columns are quantized with the whole tensors' statistics; the partial outputs are reduced
    to `output_layouts` (Replicate: all-reduce; Shard(1): reduce-scatter, sequence parallelism) in high
    precision."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, Linear):
            return super()._apply(module, device_mesh)
        _attach(module, ParallelStyle.ROWWISE, device_mesh)
        _distribute_weight(module, device_mesh, Shard(1))
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 lambda mod, inputs, mesh: self._prepare_input_fn(
                                     self.input_layouts, self.desired_input_layouts, mod, inputs, mesh),
                                 lambda mod, outputs, mesh: self._prepare_output_fn(
                                     self.output_layouts, self.use_local_output, mod, outputs, mesh))


class PrepareModuleInput(_torch_style.PrepareModuleInput):
    """torch's PrepareModuleInput (same arguments). An input going from a sequence shard (`Shard(d)`) to
    `Replicate()` is handed on as the `Shard(d)` DTensor, unconverted, when `use_local_output=False` (the
    default): hybridq column-parallel layers reading it all-gather it in its quantized form, once for all the
    layers that read the same tensor; anything else that reads it sees a correct DTensor (torch's styles
    redistribute it themselves)."""

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if (input_layout is not None and desired_layout is not None and not self.use_local_output
                and _is_sequence_shard(input_layout) and isinstance(desired_layout, Replicate)):
            if isinstance(input, DTensor):
                return input
            return DTensor.from_local(input, mesh, (input_layout,), run_check=False)
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
