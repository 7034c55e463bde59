"""Building the bytes one rank all-gathers (see [Note: payload], payload.py), and all-gathering them outside FSDP2.

`prepare_payload` casts a rank's shard to the gather dtype, reduces the cross-shard statistics and packs the
quantized shard (`payload.py`); `prepare_grouped` does the same for every expert of a grouped weight, one slot per
expert (`layout.ExpertLayout`); `gather_now` / `gather_grouped_now` run the same gather as a plain collective (a
direction nobody planned for, materialized on first use).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch
import torch.distributed as dist

from ..formats._sharding import dim0_chunks
from ..formats.base import Quantizer
from ..torch_private import local_tensor
from .layout import ExpertLayout
from .payload import HIGH_PRECISION, AxisStats, PayloadMeta, assemble_parts, build_payload, quantize_shard

__all__ = ["GatherContext", "gather_grouped_now", "gather_now", "payload_key", "prepare_grouped", "prepare_payload",
           "stats_key"]


@dataclasses.dataclass
class GatherContext:
    """What the last FSDP2 unshard of a weight knew, kept to gather a direction later on the same ranks."""

    local: weakref.ref  # the sharded HybridWeight (or GroupedHybridWeight)
    module: weakref.ref  # its hybridq Linear (or the module FSDP2 registers the grouped weight on)
    shape: tuple[int, ...]
    dtype: torch.dtype  # the gather dtype (FSDP's param_dtype)
    world_size: int
    rank: int
    group: object  # the process group, None for one rank
    device: torch.device
    param: weakref.ref | None  # FSDP2's sharded DTensor parameter, when found
    layout: ExpertLayout | None = None  # a grouped weight's: where each expert's rows live


def stats_key(param, dtype, shard, local=None):
    """Identifies the values the statistics were computed from. In-place updates (optimizer, load_state_dict)
    bump the version counter of the tensor they are called on: the DTensor parameter (FSDP2), or its local
    tensor; never the wrapped plain tensor (it is updated below the autograd / version-counter keys). Without
    the parameter the statistics are not cached. `local`: the parameter's local tensor, where the caller has it."""
    if param is None:
        return None
    if local is None:
        local = local_tensor(param)
    return (id(param), param._version, id(local), local._version, local._data.data_ptr(), dtype, shard)


def payload_key(param, dtype, shape, ws: int, shard, send, local=None) -> tuple | None:
    """Identifies a payload: the shard's values (see `stats_key`; `shard`: this rank's rows) and the directions sent;
    None: not reusable."""
    key = stats_key(param, dtype, shard, local)
    return None if key is None else (key, tuple(shape), ws, tuple(send))


def prepare_payload(local, param, q: Quantizer, send, shape, ws: int, rank: int, dtype, group
                    ) -> tuple[torch.Tensor, PayloadMeta]:
    """This rank's payload for the directions `send` of the sharded weight `local` (a HybridWeight)."""
    shards = dim0_chunks(shape, ws)
    shard = shards[rank]
    data = local._data
    x2d = data.to(dtype)
    rows_k = (shard.length, shape[-1])
    if x2d.shape != rows_k:  # (a Linear's shard is that already: no view op per unshard)
        x2d = x2d.reshape(rows_k)
    stats = None
    tp = local._hq.tp_group is not None  # a tensor-parallel piece: its statistics also reduce over the TP group
    if (ws > 1 or tp) and any(d != HIGH_PRECISION for d in send):
        # every rank takes part in the reduction (a whole shard beside empty ones included)
        key = stats_key(param, dtype, shard)
        stats = local._hq.reduced_stats(q, x2d, shard, key, group, data)
    if tp and shard.is_whole and not isinstance(stats, AxisStats):  # (the whole weight's per-tensor statistics)
        parts = quantize_shard(q, x2d, shard, send, global_stats=stats)
    else:
        parts = quantize_shard(q, x2d, shard, send, stats)
    return build_payload(q, parts, shard, shards, shape, x2d.device, memo=local._hq.payload_layouts)


def all_gather_bytes(payload: torch.Tensor, ws: int, group) -> torch.Tensor:
    """Every rank's payload one after another (flat): a plain all-gather outside FSDP2; every rank must call it."""
    if ws == 1:
        return payload
    gathered = payload.new_empty(ws * payload.numel())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(gathered, payload, group=group)
    return gathered


def gather_now(local, q: Quantizer, send, ctx: GatherContext) -> dict:
    """An all-gather outside FSDP2 (lazy materialization): every rank must take the same path."""
    ws = ctx.world_size
    param = ctx.param() if ctx.param is not None else None
    payload, meta = prepare_payload(local, param, q, send, ctx.shape, ws, ctx.rank, ctx.dtype, ctx.group)
    return assemble_parts(meta, all_gather_bytes(payload, ws, ctx.group).view(ws, -1))


def prepare_grouped(local, param, qs, send, layout: ExpertLayout, dtype, group
                    ) -> tuple[torch.Tensor, list[PayloadMeta], int]:
    """This rank's payload of a grouped weight (one slot per expert it sends), every expert's metadata and the
    slot size."""
    data = local._data.to(dtype)
    pieces = [layout.local_piece(data, e) for e in range(layout.experts)]
    stats: list = [None] * layout.experts
    if layout.world_size > 1 and any(d != HIGH_PRECISION for d in send):
        key = stats_key(param, dtype, layout)
        stats = local._hq.reduced_stats(qs, pieces, layout, key, group, local._data)
    payloads, metas = [], []
    shape = (layout.rows, layout.cols)
    for e, (q, x) in enumerate(zip(qs, pieces)):
        shard, shards = layout.payload_shards(e)
        parts = quantize_shard(q, x, shard, send, stats[e])
        payload, meta = build_payload(q, parts, shard, shards, shape, data.device, pack=layout.held(e))
        payloads.append(payload)
        metas.append(meta)
    slot = layout.slot_bytes(metas)
    chunks = []
    for e in layout.slots():
        p = payloads[e] if e is not None else data.new_empty(0, dtype=torch.uint8)
        chunks.append(p)
        if slot > p.numel():
            chunks.append(torch.zeros(slot - p.numel(), dtype=torch.uint8, device=data.device))
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=data.device)
    return payload, metas, slot


def gather_grouped_now(local, param, qs, send, ctx: GatherContext) -> tuple[torch.Tensor, list[PayloadMeta], int]:
    """A grouped weight's all-gather outside FSDP2 (lazy materialization; rank-major): the gathered bytes, every
    expert's metadata and the slot size."""
    layout = ctx.layout
    payload, metas, slot = prepare_grouped(local, param, qs, send, layout, ctx.dtype, ctx.group)
    return all_gather_bytes(payload, layout.world_size, ctx.group), metas, slot
