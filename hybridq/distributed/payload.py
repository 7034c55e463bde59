"""Format-agnostic packing of quantized shards into one gatherable byte payload, and unpacking after the gather.

A shard is quantized with the reduced cross-shard statistics (`Quantizer.shard_stats` /
`reference_parts(shard=, stats=)`), each of its parts is turned into dim-0-gatherable buffers through the
part's buffer protocol (`extract_buffers` / `assign_gathered`), and the buffers are laid out in one uint8
payload whose layout is identical on every rank: each buffer is padded to the largest number of block rows any
rank owns. After an all-gather of the payloads (`[world_size, nbytes]`), every buffer is reassembled by
concatenating each rank's owned block rows along dim 0, and the part class rebuilds the full part.

Nothing here knows a format: the only inputs are quantizers, parts and `RowShard`s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch

from ..enums import HIGH_PRECISION
from ..formats._sharding import RowShard, dim0_chunks
from ..formats.base import COLUMNWISE, ROWWISE, QuantizedPart, Quantizer
from ..formats.identity import IdentityQuantizer

# [Note: payload]
# A payload is the bytes one rank contributes to one all-gather: the parts it quantized of its piece (see
# [Note: part], formats/base.py, and [Note: piece], pieces.py), each split by the part's buffer protocol into dim-0
# buffers (data and compact scales in row order, padding stripped, transposed forms turned back to dim-0 order),
# laid out in one uint8 tensor whose layout is the same on every rank (each buffer padded to the most block rows
# any rank owns, 16-byte aligned). Bytes, because one payload mixes dtypes, gloo cannot gather float8 and FSDP2
# gathers one tensor per parameter. The receiver concatenates each buffer's owned rows of all ranks and the part
# class rebuilds the whole part (`assign_gathered`); `PayloadMeta` says where each buffer lies. FSDP2's weight
# gathers, the sequence-parallel activation gathers and the grouped weights (one slot per expert, layout.py) all
# send payloads.

# what an unshard may send (see [Note: direction]): HIGH_PRECISION is the shard itself in the gather dtype (FSDP's
# param_dtype), sent as an identity part (backward_override="high_precision": dgrad reads the high-precision weight)
DIRECTIONS = (ROWWISE, COLUMNWISE, HIGH_PRECISION)
_IDENTITY = IdentityQuantizer()

ALIGN = 16  # byte alignment of every buffer inside the payload (any dtype can be viewed at its offset)


def rows_of(shape) -> int:
    """Rows of the 2-D view `[rows, K]` of a tensor of `shape`."""
    return math.prod(shape[:-1]) if len(shape) > 1 else 1


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    direction: str
    name: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    row_block: int  # rows of the full tensor per buffer row
    capacity: int  # buffer rows every rank sends (the most any rank owns)
    counts: tuple[int, ...]  # buffer rows each rank owns
    offset: int  # byte offset inside the payload

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize  # (no host tensor per call)
        for d in self.row_shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_bytes


PartMeta = Mapping[str, object]  # a part's constructor fields besides its tensors (`QuantizedPart.meta()`)
BufferHints = Mapping[str, object]  # keyword arguments of its extract_buffers / assign_gathered (`buffer_hints`)


@dataclasses.dataclass(frozen=True)
class PartSpec:
    """How the receiver rebuilds one part from its gathered buffers (`assign_gathered`)."""

    cls: type[QuantizedPart]
    rows: int
    cols: int
    columnwise: bool
    meta: PartMeta
    hints: BufferHints


@dataclasses.dataclass
class PayloadMeta:
    """What the receiving side needs besides the gathered bytes (identical on every rank except for the
    replicated tensors, which are equal in value)."""

    shape: tuple[int, ...]
    world_size: int
    nbytes: int  # payload bytes per rank, before transport padding
    buffers: list[BufferSpec]
    parts: dict[str, PartSpec]
    replicated: dict[str, dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class AxisStats:
    """Reduced statistics of a per-axis format's piece cut along both dims, an FSDP2 row shard of a tensor-parallel
    piece (`ShardableQuantizer.quantize_axes`): its rows' (None: the rows are whole) and its columns'."""

    rows: torch.Tensor | None
    cols: torch.Tensor | None


def quantize_shard(q: Quantizer, x2d: torch.Tensor, shard: RowShard, directions, stats=None, global_stats=None):
    """Parts {direction: part} of the row shard `x2d` for the requested directions (HIGH_PRECISION: `x2d` itself,
    as an identity part). `global_stats`: a whole shard that is a tensor-parallel piece, quantized with the whole
    weight's per-tensor statistics."""
    want_r, want_c = ROWWISE in directions, COLUMNWISE in directions
    out = {}
    if HIGH_PRECISION in directions:
        out[HIGH_PRECISION] = _IDENTITY.quantize_parts(x2d, True, False)[0]
    if not (want_r or want_c):
        return out
    if isinstance(stats, AxisStats):
        r, c = q.quantize_axes(x2d, want_r, want_c, stats.rows, stats.cols)
    elif shard.is_whole:  # plain quantization (device kernels apply)
        r, c = q.quantize_parts(x2d, want_r, want_c, **({} if global_stats is None else {"global_stats": global_stats}))
    elif q.shard_is_plain(shard, want_r, want_c):
        r, c = q.quantize_parts(x2d, want_r, want_c)
    else:
        r, c = q.quantize_parts(x2d, want_r, want_c, shard=shard, stats=stats)
    if want_r:
        out[ROWWISE] = r
    if want_c:
        out[COLUMNWISE] = c
    return out


def build_payload(q: Quantizer, parts: dict, shard: RowShard, shards: list[RowShard], shape, device, *,
                  pack: bool = True) -> tuple[torch.Tensor | None, PayloadMeta]:
    """Lay this rank's parts out in a flat uint8 payload (same layout on every rank). pack=False: only the
    metadata (the payload is None), for a receiver that holds none of the rows but must assemble them."""
    m, k = shard.rows, (shape[-1] if len(shape) else 1)
    chunks: list[torch.Tensor] = []
    specs: list[BufferSpec] = []
    part_specs: dict[str, PartSpec] = {}
    replicated: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for d in DIRECTIONS:
        if d not in parts:
            continue
        part = parts[d]
        hints = {} if d == HIGH_PRECISION else q.buffer_hints(d)
        buffers, rep = part.extract_buffers(shard, **hints)
        rows, cols = (k, m) if d == COLUMNWISE else (m, k)
        part_specs[d] = PartSpec(type(part), rows, cols, d == COLUMNWISE, part.meta(), hints)
        replicated[d] = rep
        for name, t, g in buffers:
            counts = tuple(s.owned_count(g) for s in shards)
            cap = max(counts)
            if t.shape[0] != shard.owned_count(g):
                raise RuntimeError(f"{part!r}.extract_buffers gave {t.shape[0]} rows of {name!r}, expected "
                                   f"{shard.owned_count(g)} (row_block {g}, rows [{shard.offset}, {shard.end}))")
            spec = BufferSpec(d, name, t.dtype, tuple(t.shape[1:]), g, cap, counts, offset)
            pad = aligned(spec.nbytes) - spec.nbytes
            specs.append(spec)
            offset += spec.nbytes + pad
            if not pack:
                continue
            if t.shape[0] < cap:
                t = torch.cat([t, t.new_zeros((cap - t.shape[0],) + tuple(t.shape[1:]))])
            b = (t if t.is_contiguous() else t.contiguous()).view(torch.uint8).reshape(-1) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                                          device=t.device)
            if b.numel() != spec.nbytes:
                raise RuntimeError(f"payload size mismatch for {name!r}: {b.numel()} != {spec.nbytes}")
            chunks.append(b)
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8, device=b.device))
    meta = PayloadMeta(tuple(shape), len(shards), offset, specs, part_specs, replicated)
    if not pack:
        return None, meta
    payload = torch.cat(chunks) if len(chunks) > 1 else (
        chunks[0] if chunks else torch.empty(0, dtype=torch.uint8, device=device))
    return payload, meta


def assemble_parts(meta: PayloadMeta, gathered: torch.Tensor) -> dict:
    """Full parts {direction: part} from the gathered payloads `gathered` ([world_size, >= meta.nbytes] uint8)."""
    ws = meta.world_size
    full: dict[str, dict[str, torch.Tensor]] = {d: {} for d in meta.parts}
    for spec in meta.buffers:
        raw = gathered[:, spec.offset:spec.offset + spec.nbytes]
        if spec.nbytes == 0:
            rows = torch.empty((0,) + spec.row_shape, dtype=spec.dtype, device=gathered.device)
        else:
            per_rank = raw.view(spec.dtype).view((ws, spec.capacity) + spec.row_shape)
            if all(c == spec.capacity for c in spec.counts[:-1]):
                # every rank but the last is full: the concatenation is a prefix of the ranks' rows in order
                # (a view when this buffer is the whole payload)
                rows = per_rank.reshape((ws * spec.capacity,) + spec.row_shape)[:sum(spec.counts)]
            else:
                pieces = [per_rank[r, :spec.counts[r]] for r in range(ws) if spec.counts[r]]
                rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        full[spec.direction][spec.name] = rows
    out = {}
    for d, ps in meta.parts.items():
        out[d] = ps.cls.assign_gathered(full[d], meta.replicated[d], rows=ps.rows, cols=ps.cols,
                                        columnwise=ps.columnwise, meta=ps.meta, **ps.hints)
    return out


def gather_bytes_for(q: Quantizer, shape, world_size: int, directions, dtype=torch.bfloat16) -> int:
    """Payload bytes each rank sends to gather `directions` of a tensor of `shape` (computed on the meta device:
    no data, no communication)."""
    if not directions:
        return 0
    shards = dim0_chunks(shape, world_size)
    shard = shards[0]
    k = shape[-1]
    x = torch.empty(shard.length, k, dtype=dtype, device="meta")
    stats = None if world_size == 1 else q.shard_stats(x, shard)
    parts = quantize_shard(q, x, shard, directions, stats)
    _, meta = build_payload(q, parts, shard, shards, shape, x.device)
    return meta.nbytes
