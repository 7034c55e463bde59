"""`precompute_scales`: every FSDP2-sharded weight's cross-shard statistics reduced in one fused all-reduce per
process group after the optimizer step, so that the next all-gathers reuse them instead of one all-reduce per
weight (each weight's state keeps them under a key of the shard values they came from: `transport.stats_key`)."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn

from .. import data_writes
from ..data_writes import CHECK, LEDGER, fingerprint, raise_stale
from ..formats._sharding import dim0_chunks
from ..formats._reduce import amax_all_reduce_
from ..nn.linear import Linear
from ..torch_private import local_tensor
from .grouped_blocks_payload import joins_blocks
from .layout import ExpertLayout
from .module_walk import modules_in_order as _modules
from .payload import HIGH_PRECISION
from .plan import every_plan
from .precomputed_payloads import PrecomputedPayloads, precompute_payloads
from .state import GroupedWeightState
from .stats import pack_stats
from .transport import stats_key
from .weights import GroupedHybridWeight, HybridWeight

__all__ = ["PrecomputedScales", "PrecomputedScalesAndPayloads", "precompute_scales"]


def _sharded(p, dim0_only: bool):
    """(process group of the shard mesh dim (None for one rank), device mesh, world size, rank) of a DTensor parameter
    sharded along one tensor dim (dim 0 only, if asked), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and (pl.dim == 0 or not dim0_only)]
    if len(dims) != 1:
        return None
    mesh, i = p.device_mesh, dims[0]
    hit = _MESH_DIMS.get((id(mesh), i))
    if hit is None or hit[0] is not mesh:
        if len(_MESH_DIMS) >= 64:
            _MESH_DIMS.clear()
        ws = mesh.size(i)
        # (the mesh is held: its id is not reused while cached)
        hit = _MESH_DIMS[(id(mesh), i)] = (mesh, mesh.get_group(i) if ws > 1 else None, ws, mesh.get_local_rank(i))
    return hit[1], mesh, hit[2], hit[3]


# (id(mesh), mesh dim) -> (mesh, process group | None, size, rank): a mesh's layout never changes. Asked once per
# mesh and dim: `DeviceMesh.size` / `get_local_rank` cost ~25 / ~70 us each on torch 2.11 (its layout algebra;
# H200 host, cProfile), and precompute_scales asks for every sharded weight after every optimizer step
_MESH_DIMS: dict = {}


def _device(mesh) -> torch.device:
    """Where the mesh's collectives run (CPU-offloaded shards are reduced there)."""
    return (torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda"
            else torch.device(mesh.device_type))


def _linear_item(mod: Linear, p, local: HybridWeight) -> tuple | None:
    """(process group, device, state, key, local statistics) of a hybridq Linear's FSDP2-sharded weight whose format
    reduces statistics; None for any other."""
    info = _sharded(p, dim0_only=True)
    if info is None:
        return None
    group, mesh, ws, rank = info
    st = local._hq
    if ws == 1 or st.tp_group is not None:  # (a TP piece's per-tensor statistics are reduced at its gather)
        return None
    dtype = st.param_dtype or local.dtype
    shape = tuple(p.shape)
    shard = dim0_chunks(shape, ws)[rank]
    data = local._data
    x2d = data.to(dtype).reshape(shard.length, shape[-1])
    s = mod.weight_quantizer.shard_stats(x2d, shard)
    if s is None:
        return None
    return group, _device(mesh), st, stats_key(p, dtype, shard), s.reshape(-1).float(), fingerprint(data)


def _grouped_item(mod: nn.Module, p, local: GroupedHybridWeight) -> tuple | None:
    """The same for a sharded grouped weight: all experts of one weight in one entry."""
    info = _sharded(p, dim0_only=False)
    if info is None:
        return None
    group, mesh, ws, rank = info
    if ws == 1:
        return None
    st: GroupedWeightState = local._hq
    try:
        layer = st.layer(mod)
    except TypeError:
        return None
    qs = tuple(q["weight"] for q in layer.expert_quantizers)
    dtype = st.param_dtype or local.dtype
    layout = ExpertLayout.infer(st.name, tuple(p.shape), tuple(local.shape), ws, rank, qs[0].describe())
    if _scales_travel_in_the_payload(st, layer, layout, dtype):
        return None
    data = local._data.to(dtype)
    flat = pack_stats([q.shard_stats(layout.local_piece(data, e), layout.stats_shard(e))
                       for e, q in enumerate(qs)])
    if flat is None:
        return None
    return group, _device(mesh), st, stats_key(p, dtype, layout), flat, fingerprint(local._data)


def _scales_travel_in_the_payload(st: GroupedWeightState, layer, layout: ExpertLayout, dtype) -> bool:
    """Whether no unshard of this grouped weight reads its cross-rank statistics: every plan an unshard may follow
    (`plan.every_plan`: either phase, any resharding, recompute's rowwise extra) sends the shard in high precision
    (quantized on every rank from the gathered weight) or takes the batched block payload, whose slots carry every
    expert's scales ([Note: stacked block payload]) -- decided by the pre-all-gather hook's own predicate
    (`joins_blocks`, with the switch's value now). The same answer on every rank (it reads nothing rank-local), so
    every rank leaves the same weights out of the fused all-reduce. Where the switch is turned off before the next
    unshard, the per-expert payload reduces the statistics itself: `GroupedStats.reduced_stats` reads precomputed
    values only under the key of these shard values, which this call then never set."""
    qs = layer.weight_quantizers()
    derivable = st.is_derivable(qs, (layout.rows, layout.cols), dtype)
    return all(joins_blocks(qs, send, layout) for send in _quantized_sends(layer.recipe.backward_override, derivable))


@functools.lru_cache(maxsize=64)  # (a handful of arguments; asked for every grouped weight after every step)
def _quantized_sends(backward_override: str | None, derivable: bool) -> tuple[tuple[str, ...], ...]:
    """The distinct directions sent by the plans an unshard may follow that send a quantized direction (a plan that
    sends the shard in high precision quantizes on every rank from the gathered weight: no reduced statistics)."""
    return tuple(sorted({plan.send for plan in every_plan(backward_override, derivable)
                         if plan.send != (HIGH_PRECISION,)}))


def _items(model: nn.Module) -> tuple[list, list]:
    """The items of every FSDP2-sharded Linear weight, then of every sharded grouped weight, of `model`: one walk
    of its modules, each parameter's local tensor type asked before its placements (this runs after every
    optimizer step: the 1B job's 20 layers at d_model 256 on a CPU, world 1, 1.5 ms per call when it walked the
    modules twice and asked every parameter's placements, 0.6 ms now); and (process group, state) of every sharded
    weight with queued data-write checks, in the same order ([Note: data-write check])."""
    linear, grouped, checks = [], [], []
    for mod in _modules(model):
        params = mod._parameters
        if not params:
            continue
        weight = params.get("weight") if isinstance(mod, Linear) else None
        for p in params.values():
            local = local_tensor(p)
            if not isinstance(local, HybridWeight):  # (not a DTensor, or not a hybridq weight: nothing to reduce)
                continue
            if p is weight:
                item = _linear_item(mod, p, local)
                if item is not None:
                    linear.append(item)
            if isinstance(local, GroupedHybridWeight):
                item = _grouped_item(mod, p, local)
                if item is not None:
                    grouped.append(item)
            if local._hq.data_checks:
                info = _sharded(p, dim0_only=False)
                if info is not None and info[0] is not None:
                    checks.append((info[0], local._hq))
    return linear + grouped, checks


@dataclasses.dataclass(frozen=True)
class PrecomputedScales:
    """What `precompute_scales` reduced."""

    weights: int  # sharded weights whose statistics were reduced (a grouped weight counts once)
    values: int  # fp32 values reduced
    all_reduces: int  # collectives issued (one per process group)


@dataclasses.dataclass(frozen=True)
class PrecomputedScalesAndPayloads(PrecomputedScales):
    """What `precompute_scales(model, payloads=True)` reduced and prepared."""

    payloads: PrecomputedPayloads  # the next forward's payloads prepared


@torch.no_grad()
def precompute_scales(model: nn.Module, payloads: bool = False, *, per_unit: bool = True) -> PrecomputedScales:
    """Reduce the cross-shard statistics of every converted FSDP2-sharded weight of `model` in one fused
    all-reduce per process group; call it after `optimizer.step()` on every rank (it is a collective). The
    next all-gathers use them instead of one all-reduce per weight. A harmless no-op on a model that is not
    sharded (all counts 0).

    `payloads=True` then also prepares the next forward unshard's all-gather payloads of the Linear weights the unit
    cast takes, one cast + quantize per FSDP2 unit and kind (`per_unit=False`: per kind for the whole model), so the
    forward's hooks quantize nothing (`precomputed_payloads.precompute_payloads`, [Note: precomputed payloads]); they
    are held until that unshard, about one byte per local weight element. A weight changed before it (another
    optimizer step, an in-place edit) is quantized anew. `HYBRIDQ_PRECOMPUTED_PAYLOADS=0` turns that part off. Returns
    a `PrecomputedScalesAndPayloads` then (`.payloads`: what was prepared)."""
    due = LEDGER.begin_report() if CHECK.on else []  # (earlier data-write checks: [Note: data-write check])
    items, checks = _items(model)
    per_group: dict = {}
    for group, device, st, key, s, fp in items:
        per_group.setdefault(id(group), (group, [], device, []))[1].append((st, key, s, fp))
    for group, st in checks:  # (a group with checks and no statistics to reduce: an all-reduce of its flags alone)
        per_group.setdefault(id(group), (group, [], None, []))[3].append(st)
    values, all_reduces, stale = 0, 0, []
    for group, items, device, checked in per_group.values():
        # the queued data-write checks' flags, sent with the statistics: one per check, the same on every rank
        names = [st.name for st in checked]
        chunks = [s for _, _, s, _ in items]
        if checked:
            chunks.append(data_writes.flags([st.data_checks for st in checked]))
        if device is None:
            device = chunks[-1].device
        flat = torch.cat(chunks).to(device)  # CPU-offloaded shards: reduce on the PG's device
        amax_all_reduce_(flat, group)
        all_reduces += 1
        i = 0
        for st, key, s, fp in items:
            st.stats_key, st.stats = key, flat[i:i + s.numel()]  # views of one fresh vector: no copy per weight
            st.stats_fp = fp
            i += s.numel()
        values += i
        if checked:
            stale += LEDGER.reduced_flags(names, flat[i:])
    reduced = dict(weights=sum(len(v[1]) for v in per_group.values()), values=values, all_reduces=all_reduces)
    out = PrecomputedScalesAndPayloads(**reduced, payloads=precompute_payloads(model, per_unit=per_unit)) \
        if payloads else PrecomputedScales(**reduced)
    raise_stale(stale + LEDGER.end_report(due))  # (after the new statistics and payloads are in place)
    return out
