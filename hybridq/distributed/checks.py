"""Sharding-dependent rules of a weight's formats, checked for every rank's shard as soon as the layout is known
(the layouts that cannot keep [Note: sharding invariance], formats/shardable.py).

Some formats can quantize a tensor but not every row shard of it (e.g. NVFP4 with the Hadamard transform
mixes 16 consecutive rows, so a columnwise shard must start and end on a multiple of 16 rows). Those rules are
the formats' own: they raise when asked to quantize such a shard. Here every direction any unshard of the
weight may gather (forward, the backward re-gather, a backward override, the rowwise form an activation
recompute reads in backward) is quantized and packed for every rank's shard on the meta device (no data, no
communication), so a violation surfaces at the first all-gather, on every rank alike, instead of at the first
backward.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats._sharding import dim0_chunks
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from .payload import HIGH_PRECISION, build_payload, quantize_shard, rows_of
from .plan import every_plan

__all__ = ["check_shard_layout", "gathered_directions"]

_PASSED: set = set()  # the layouts check_shard_layout accepted (see there)


def _configuration(q: Quantizer) -> str | None:
    """The quantizer's full configuration if it is one of hybridq's (its dataclass repr, nested quantizers
    included); None for any other (a user's subclass may hold state its repr does not show)."""
    parts = [q]
    while parts:
        p = parts.pop()
        if not (type(p).__module__.startswith("hybridq.") and dataclasses.is_dataclass(p)):
            return None
        parts += [v for f in dataclasses.fields(p) if isinstance(v := getattr(p, f.name), Quantizer)]
    return f"{type(q).__qualname__}:{q!r}"


def gathered_directions(q: Quantizer, shape, backward_override: str | None, derivable: bool) -> tuple[str, ...]:
    """Every direction some planned unshard of a weight may send, except those the format cannot take for the
    full shape (the unsharded weight has no such part)."""
    m, k = rows_of(shape), shape[-1]
    dirs = {d for plan in every_plan(backward_override, derivable) for d in plan.send}
    takes = {ROWWISE: q.shape_rule(m, k, True, False) is None, COLUMNWISE: q.shape_rule(m, k, False, True) is None,
             HIGH_PRECISION: True}
    return tuple(d for d in (ROWWISE, COLUMNWISE, HIGH_PRECISION) if d in dirs and takes[d])


def check_shard_layout(q: Quantizer, name: str, shape, world_size: int, dtype: torch.dtype,
                       backward_override: str | None, derivable: bool) -> None:
    """Raise ValueError naming the weight, the format, the direction, the rule and the shard boundary if some
    rank's shard of `name` (FSDP2's dim-0 chunking of `shape` over `world_size` ranks) cannot be quantized and
    packed in a direction an unshard may gather."""
    shape = tuple(shape)
    if world_size <= 1:
        return
    # a layout that passed once passes again (failures are not remembered): the check reads only these arguments
    # and the quantizer's configuration, which hybridq's own quantizers state in full in their dataclass repr
    config = _configuration(q)
    key = None if config is None else (config, shape, world_size, dtype, backward_override, derivable)
    if key is not None and key in _PASSED:
        return
    shards = dim0_chunks(shape, world_size)
    k = shape[-1]
    for d in gathered_directions(q, shape, backward_override, derivable):
        for rank, shard in enumerate(shards):
            x = torch.empty(shard.length, k, dtype=dtype, device="meta")
            try:
                stats = q.shard_stats(x, shard) if d != HIGH_PRECISION else None
                parts = quantize_shard(q, x, shard, (d,), stats)
                build_payload(q, parts, shard, shards, shape, x.device)
            except ValueError as e:
                bounds = ", ".join(str(c) for c in shard.cuts)
                raise ValueError(
                    f"apply_hybrid_fsdp: {name} {shape} cannot be sharded over {world_size} ranks in {q.describe()}: "
                    f"its {d} form is gathered, and rank {rank}'s shard (rows [{shard.offset}, {shard.end}) of "
                    f"{shard.rows}; shard boundaries at rows {bounds}) breaks the rule: {e}. Exclude this layer "
                    f"with module_filter_fn, or choose a world size or weight shape whose shard boundaries the "
                    f"format accepts") from e
    if key is not None:
        _PASSED.add(key)
