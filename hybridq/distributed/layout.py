"""Where a weight's rows live on the ranks, and the all-gather input FSDP2 accepts for them.

A Linear weight `[out, in]` is sharded by FSDP2 along dim 0 (`dim0_chunks`); its payload goes to FSDP2 as it is,
or, when dim 0 does not divide evenly, as a view with the padded shard's shape (`transport_view`), which FSDP2
requires of every all-gather input then.

A grouped (mixture-of-experts) weight `[E, out, in]` is sharded in one of two ways, and each expert's local piece
is a `RowShard` of that expert's `[out, in]` matrix either way (`ExpertLayout`):

- `Shard(0)` (the default): whole experts per rank (`ceil(E / world)` per rank, the last ranks fewer or none).
  An expert is whole on its owner and empty elsewhere.
- `Shard(1)` (`fully_shard(..., shard_placement_fn=lambda p: Shard(1))`, what torchtitan uses when there are
  more ranks than experts): every rank holds the same rows of every expert, FSDP2's chunking of `out`.

With `Shard(0)`, FSDP2 concatenates the ranks' payloads (rank-major). With `Shard(1)`, FSDP2 views each rank's
all-gather input as its padded shard `[E, out / world, in]` and concatenates the ranks along dim 1 ("chunk-cat",
torch 2.11 and 2.13 alike), so the payload is laid out as E equal slots that this view keeps whole: after the
gather, expert e's slots of all ranks are contiguous (expert-major).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch

from ..formats._sharding import RowShard, cdiv, dim0_chunks
from .payload import ALIGN, PayloadMeta, aligned

__all__ = ["ExpertLayout", "transport_view"]

# payload element types for a view with a shard's shape (an unevenly sharded weight, a Shard(1) expert slot);
# gloo and NCCL have no int16 all-gather; a 2-byte item is float16, taken only where FSDP2 copies it as bytes
# ([Note: 16-bit items], `halves`)
ITEM_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}

# [Note: 16-bit items]
# FSDP2 copies a param group's all-gather inputs into its all-gather buffer with one `torch._foreach_copy_` (copy-in,
# world > 1). Where every input of the group has one dtype it copies them in that dtype, and CUDA's foreach copy of
# float16 / bfloat16 goes through fp32 registers (opmath): every bit pattern that is a 16-bit NaN comes out as the
# canonical NaN. Quantized bytes read as float16 hold such patterns all the time (an E4M3 448, 0x7E, or an E8M0 scale
# 2^0, 0x7F, at an odd byte; an fp32 scale's low half), so they would reach the other ranks rewritten. Where the
# inputs' dtypes differ FSDP2 views every one of them as uint8 and copies bytes. So a weight sends float16 items only
# in a group FSDP2 gathers as bytes (`fsdp_adapter.gathers_as_bytes`: a parameter without all-gather hooks whose
# all-gather dtype is not float16 is in it, e.g. a norm's bf16 weight); elsewhere a payload that needs 2 bytes per
# element of the padded shard goes as int32 items (2 bytes more per element on the wire). uint8, int32 and int64
# items are integers: copied bit for bit.


def _item_size(nbytes: int, elements: int, halves: bool = True) -> int | None:
    """The smallest item size whose `elements` items hold `nbytes` bytes (None: more than 8 bytes each); 2 only with
    `halves` ([Note: 16-bit items])."""
    return next((size for size in ITEM_DTYPES if size * elements >= nbytes and (halves or size != 2)), None)


def transport_view(payload: torch.Tensor, shape, ws: int, halves: bool = True) -> torch.Tensor:
    """The all-gather input: the flat payload, or (uneven dim-0 sharding) a view with the padded shard's shape,
    which FSDP2 requires of every input then, in float16 items only with `halves` ([Note: 16-bit items])."""
    if shape[0] % ws == 0:
        return payload
    chunk = -(-shape[0] // ws)
    n = chunk * math.prod(shape[1:])
    size = _item_size(payload.numel(), n, halves)
    if size is None:
        raise RuntimeError(f"hybridq FSDP: quantized payload ({payload.numel()} bytes) exceeds 8 bytes per element "
                           f"of the padded shard {chunk}x{tuple(shape[1:])}")
    buf = payload
    if size * n > payload.numel():
        buf = torch.cat([payload, payload.new_zeros(size * n - payload.numel())])
    return buf.view(ITEM_DTYPES[size]).view((chunk,) + tuple(shape[1:]))


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where each expert's rows of a grouped weight `[E, out, in]` live on `world_size` ranks: FSDP2's `Shard(dim)`
    chunking along dim 0 (whole experts) or dim 1 (rows of every expert)."""

    dim: int
    experts: int
    rows: int  # out
    cols: int  # in
    world_size: int
    rank: int
    # float16 items may carry the payload ([Note: 16-bit items]); the transport's choice only, not where rows live:
    # left out of comparisons (statistics keyed by the layout stay those precompute_scales reduced)
    halves: bool = dataclasses.field(default=True, compare=False)

    @classmethod
    def infer(cls, name: str, shape, local_shape, world_size: int, rank: int,
              describe: str | Callable[[], str], halves: bool = True) -> "ExpertLayout":
        """The layout FSDP2 chose, told by the local shard's shape (public information, same in torch 2.11 and
        2.13). Sharding along `in` (dim 2) is refused: the rowwise blocks run along it. `describe`: the weight
        format, for the error (a callable is called only then: the hooks infer the layout at every unshard).
        `halves`: float16 items may carry the payload ([Note: 16-bit items])."""
        e, n, k = shape
        if world_size == 1 or tuple(local_shape[1:]) == (n, k):
            return cls(0, e, n, k, world_size, rank, halves)
        if local_shape[0] == e and local_shape[2] == k:
            return cls(1, e, n, k, world_size, rank, halves)
        fmt = describe if isinstance(describe, str) else describe()
        raise ValueError(
            f"apply_hybrid_fsdp: {name} {tuple(shape)} is sharded along dim 2 (in_features; local shard "
            f"{tuple(local_shape)}) in {fmt}: hybridq gathers a grouped weight quantized only when FSDP2 shards "
            f"it along dim 0 (whole experts, the default) or dim 1 (rows of every expert, shard_placement_fn="
            f"lambda p: Shard(1)); the rowwise scaling blocks run along in_features and cannot be split by rank")

    @functools.cached_property  # (a weight's layout is kept across unshards: weights._grouped_layout)
    def chunk(self) -> int:
        """Experts per rank (dim 0) or rows of every expert per rank (dim 1), as FSDP2 chunks them."""
        return cdiv(self.experts, self.world_size) if self.dim == 0 else cdiv(self.rows, self.world_size)

    def owner(self, e: int) -> int:
        return e // self.chunk if self.dim == 0 else self.rank

    def held(self, e: int) -> bool:
        return self.dim == 1 or self.owner(e) == self.rank

    def stats_shard(self, e: int) -> RowShard:
        """This rank's piece of expert e, for its statistics (the layout every rank agrees on)."""
        if self.dim == 1:
            return dim0_chunks((self.rows, self.cols), self.world_size)[self.rank]
        return RowShard.whole(self.rows) if self.held(e) else RowShard(self.rows, self.rows, 0)

    def payload_shards(self, e: int) -> tuple[RowShard, tuple[RowShard, ...]]:
        """(this rank's piece of expert e, the pieces of expert e that are all-gathered): with dim 0 only the
        owner sends it, whole."""
        if self.dim == 1:
            shards = dim0_chunks((self.rows, self.cols), self.world_size)
            return shards[self.rank], shards
        return self.stats_shard(e), (RowShard.whole(self.rows),)

    def local_piece(self, data: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's rows held here, `[rows, in]` (empty when not held)."""
        if self.dim == 1:
            return data[e]
        if not self.held(e):
            return data.new_empty(0, self.cols)
        return data[e - self.rank * self.chunk]

    def slots(self) -> list[int | None]:
        """The experts of this rank's payload slots, in order (None: an empty slot of the last ranks, dim 0)."""
        if self.dim == 1:
            return list(range(self.experts))
        first = self.rank * self.chunk
        return [e if e < self.experts else None for e in range(first, first + self.chunk)]

    @functools.cached_property
    def slots_held(self) -> int:
        """Experts in this rank's payload slots (`slots()` less the empty ones)."""
        return sum(e is not None for e in self.slots())

    def slot_bytes(self, metas: list[PayloadMeta]) -> int:
        """Bytes of one payload slot (same on every rank). With dim 1 a slot is one expert's share of the padded
        shard `[chunk, in]` in an item type of 1-8 bytes, so that FSDP2's chunk-cat keeps slots whole."""
        need = aligned(max((m.nbytes for m in metas), default=0))
        if self.dim == 0:
            return need
        size = _item_size(need, self.chunk * self.cols, self.halves)
        if size is None:
            raise ValueError(f"hybridq FSDP: an expert's quantized payload ({need} bytes) exceeds 8 bytes per element "
                             f"of its shard [{self.chunk}, {self.cols}]")
        return size * self.chunk * self.cols

    def transport(self, payload: torch.Tensor, slot: int) -> torch.Tensor:
        """The all-gather input FSDP2 accepts for this layout."""
        if self.dim == 0:
            return transport_view(payload, (self.experts, self.rows, self.cols), self.world_size, self.halves)
        dt = ITEM_DTYPES[slot // (self.chunk * self.cols)] if slot else torch.uint8
        return payload.view(dt).view(self.experts, self.chunk, self.cols) if slot else payload

    def expert_bytes(self, gathered: torch.Tensor, slot: int, e: int, meta: PayloadMeta,
                     expert_major: bool) -> torch.Tensor:
        """Expert e's gathered payloads `[pieces, nbytes]` (uint8) out of the gathered bytes of all ranks.
        expert_major: FSDP2's chunk-cat output (dim 1); else the ranks' payloads one after another."""
        flat = gathered.reshape(-1).view(torch.uint8)
        ws = self.world_size
        if self.dim == 1:
            g = flat.view(self.experts, ws, -1)[e] if expert_major else flat.view(ws, self.experts, -1)[:, e]
            g = g[:, :meta.nbytes]
        else:
            per_rank = flat.view(ws, -1)
            j = e - self.owner(e) * self.chunk
            g = per_rank[self.owner(e), j * slot:j * slot + meta.nbytes].unsqueeze(0)
        if g.storage_offset() % ALIGN or (g.shape[0] > 1 and g.stride(0) % ALIGN):
            g = g.contiguous()  # each buffer is read in its own dtype at 16-byte aligned offsets
        return g
