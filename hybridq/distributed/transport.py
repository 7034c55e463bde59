"""Building the bytes one rank all-gathers, and all-gathering them outside FSDP2.

`prepare_payload` casts a rank's shard to the gather dtype, reduces the cross-shard statistics and packs the
quantized shard (`payload.py`); `transport_view` gives FSDP2 the all-gather input it accepts; `gather_now` runs
the same gather as a plain collective (a direction nobody planned for, materialized on first use).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref

import torch
import torch.distributed as dist

from ..formats._sharding import dim0_chunks
from ..formats.base import Quantizer
from .payload import HIGH_PRECISION, PayloadMeta, assemble_parts, build_payload, quantize_shard

__all__ = ["GatherContext", "gather_now", "payload_key", "prepare_payload", "stats_key", "transport_view"]

# payload element types for an unevenly sharded weight (FSDP2 then wants every all-gather input to have the
# padded shard's shape); gloo has no int16 all-gather, float16 views are only copied, never computed on
_ITEM_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass
class GatherContext:
    """What the last FSDP2 unshard of a weight knew, kept to gather a direction later on the same ranks."""

    local: weakref.ref  # the sharded HybridWeight
    module: weakref.ref  # its hybridq Linear
    shape: tuple[int, ...]
    dtype: torch.dtype  # the gather dtype (FSDP's param_dtype)
    world_size: int
    rank: int
    group: object  # the process group, None for one rank
    device: torch.device
    param: weakref.ref | None  # FSDP2's sharded DTensor parameter, when found


def transport_view(payload: torch.Tensor, shape, ws: int) -> torch.Tensor:
    """The all-gather input: the flat payload, or (uneven dim-0 sharding) a view with the padded shard's shape,
    which FSDP2 requires of every input then."""
    if shape[0] % ws == 0:
        return payload
    chunk = -(-shape[0] // ws)
    n = chunk * math.prod(shape[1:])
    for size, dt in _ITEM_DTYPES.items():
        if size * n >= payload.numel():
            buf = payload
            if size * n > payload.numel():
                buf = torch.cat([payload, payload.new_zeros(size * n - payload.numel())])
            return buf.view(dt).view((chunk,) + tuple(shape[1:]))
    raise RuntimeError(f"hybridq FSDP: quantized payload ({payload.numel()} bytes) exceeds 8 bytes per element "
                       f"of the padded shard {chunk}x{tuple(shape[1:])}")


def stats_key(param, dtype, shard):
    """Identifies the values the statistics were computed from. In-place updates (optimizer, load_state_dict)
    bump the version counter of the tensor they are called on: the DTensor parameter (FSDP2), or its local
    tensor; never the wrapped plain tensor (it is updated below the autograd / version-counter keys). Without
    the parameter the statistics are not cached."""
    if param is None:
        return None
    local = param._local_tensor
    return (id(param), param._version, id(local), local._version, local._data.data_ptr(), dtype, shard)


def payload_key(param, dtype, shape, ws: int, rank: int, send) -> tuple | None:
    """Identifies a payload: the shard's values (see `stats_key`) and the directions sent; None: not reusable."""
    key = stats_key(param, dtype, dim0_chunks(shape, ws)[rank])
    return None if key is None else (key, tuple(shape), ws, tuple(send))


def prepare_payload(local, param, q: Quantizer, send, shape, ws: int, rank: int, dtype, group
                    ) -> tuple[torch.Tensor, PayloadMeta]:
    """This rank's payload for the directions `send` of the sharded weight `local` (a HybridWeight)."""
    shards = dim0_chunks(shape, ws)
    shard = shards[rank]
    data = local._data
    x2d = data.to(dtype).reshape(shard.length, shape[-1])
    stats = None
    tp = local._hq.tp_group is not None  # a tensor-parallel piece: its statistics also reduce over the TP group
    if (ws > 1 or tp) and any(d != HIGH_PRECISION for d in send):
        # every rank takes part in the reduction (a whole shard beside empty ones included)
        key = stats_key(param, dtype, shard)
        stats = local._hq.reduced_stats(q, x2d, shard, key, group)
    if tp and shard.is_whole:  # (reduced_stats gave the whole weight's per-tensor statistics)
        parts = quantize_shard(q, x2d, shard, send, global_stats=stats)
    else:
        parts = quantize_shard(q, x2d, shard, send, stats)
    return build_payload(q, parts, shard, shards, shape, x2d.device)


def gather_now(local, q: Quantizer, send, ctx: GatherContext) -> dict:
    """An all-gather outside FSDP2 (lazy materialization): every rank must take the same path."""
    ws = ctx.world_size
    param = ctx.param() if ctx.param is not None else None
    payload, meta = prepare_payload(local, param, q, send, ctx.shape, ws, ctx.rank, ctx.dtype, ctx.group)
    if ws == 1:
        gathered = payload.view(1, -1)
    else:
        gathered = payload.new_empty(ws * payload.numel())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(gathered, payload, group=ctx.group)
        gathered = gathered.view(ws, -1)
    return assemble_parts(meta, gathered)
