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
import functools
import math
from typing import Mapping

import torch

from ..enums import HIGH_PRECISION
from ..formats._sharding import RowShard, dim0_chunks
from ..formats.base import COLUMNWISE, ROWWISE, QuantizedPart, Quantizer
from ..formats.identity import IdentityQuantizer
from ..torch_private import storage_id

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

    @functools.cached_property  # (a weight's specs are reused at every unshard: `build_payload(memo=)`)
    def row_bytes(self) -> int:
        n = self.dtype.itemsize  # (no host tensor per call)
        for d in self.row_shape:
            n *= d
        return n

    @functools.cached_property
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


@dataclasses.dataclass(frozen=True)
class _PayloadLayout:
    """Where every buffer of a rank's parts lies in the payload, and how the receiver rebuilds the parts: a function
    of the quantizer, the shapes and the shards only (not of the values), so a weight's unshards reuse it
    (`build_payload(memo=)`) once the parts' buffers and metadata are checked to be the ones it was made for."""

    quantizer: Quantizer
    shards: tuple[RowShard, ...]
    expect: tuple  # ((direction, part class, part meta, ((buffer name, dtype, shape), ...)), ...)
    buffers: list[BufferSpec]
    parts: dict[str, PartSpec]
    nbytes: int

    def fits(self, q: Quantizer, shards, extracted) -> bool:
        if q is not self.quantizer or len(extracted) != len(self.expect) or not (
                shards is self.shards or tuple(shards) == self.shards):
            return False
        for (d, part, _, buffers, _), (ed, cls, meta, bufs) in zip(extracted, self.expect):
            if d != ed or type(part) is not cls or len(buffers) != len(bufs) or (meta and part.meta() != meta):
                return False
            for (name, t, _), (en, et, es) in zip(buffers, bufs):
                if name != en or t.dtype != et or t.shape != es:
                    return False
        return True


def _extract(q: Quantizer, parts: dict, shard: RowShard) -> list:
    """(direction, part, buffer hints, [(name, tensor, row block)], replicated) of each part, in DIRECTIONS order."""
    out = []
    for d in DIRECTIONS:
        if d not in parts:
            continue
        part = parts[d]
        hints = {} if d == HIGH_PRECISION else q.buffer_hints(d)
        buffers, rep = part.extract_buffers(shard, **hints)
        out.append((d, part, hints, buffers, rep))
    return out


def _lay_out(q: Quantizer, extracted, shard: RowShard, shards, shape) -> _PayloadLayout:
    m, k = shard.rows, (shape[-1] if len(shape) else 1)
    specs: list[BufferSpec] = []
    part_specs: dict[str, PartSpec] = {}
    expect = []
    offset = 0
    for d, part, hints, buffers, _ in extracted:
        rows, cols = (k, m) if d == COLUMNWISE else (m, k)
        meta = part.meta()
        part_specs[d] = PartSpec(type(part), rows, cols, d == COLUMNWISE, meta, hints)
        for name, t, g in buffers:
            counts = tuple(s.owned_count(g) for s in shards)
            if t.shape[0] != shard.owned_count(g):
                raise RuntimeError(f"{part!r}.extract_buffers gave {t.shape[0]} rows of {name!r}, expected "
                                   f"{shard.owned_count(g)} (row_block {g}, rows [{shard.offset}, {shard.end}))")
            spec = BufferSpec(d, name, t.dtype, tuple(t.shape[1:]), g, max(counts), counts, offset)
            specs.append(spec)
            offset += aligned(spec.nbytes)
        expect.append((d, type(part), meta, tuple((name, t.dtype, t.shape) for name, t, _ in buffers)))
    return _PayloadLayout(q, tuple(shards), tuple(expect), specs, part_specs, offset)


def build_payload(q: Quantizer, parts: dict, shard: RowShard, shards: list[RowShard], shape, device, *,
                  pack: bool = True, memo: dict | None = None) -> tuple[torch.Tensor | None, PayloadMeta]:
    """Lay this rank's parts out in a flat uint8 payload (same layout on every rank). pack=False: only the
    metadata (the payload is None), for a receiver that holds none of the rows but must assemble them. `memo`: a
    dict the caller keeps across calls (a weight's state) where the layout is remembered per quantizer, shard, shape
    and directions, and reused when the parts' buffers are the ones it was made for (their `BufferSpec`s are then the same
    objects at every call)."""
    extracted = _extract(q, parts, shard)
    layout = None
    if memo is not None:
        key = (id(q), shard, tuple(shape), tuple(parts))  # (forward and backward may send other directions)
        layout = memo.get(key)
        if layout is not None and not layout.fits(q, shards, extracted):
            layout = None
    if layout is None:
        layout = _lay_out(q, extracted, shard, shards, shape)
        if memo is not None:
            if len(memo) >= 16:
                memo.clear()
            memo[key] = layout
    replicated = {d: rep for d, _, _, _, rep in extracted}
    meta = PayloadMeta(tuple(shape), len(shards), layout.nbytes, layout.buffers, layout.parts, replicated)
    if not pack:
        return None, meta
    chunks: list[torch.Tensor] = []
    specs = iter(layout.buffers)
    for _, _, _, buffers, _ in extracted:
        for name, t, _ in buffers:
            spec = next(specs)
            cap = spec.capacity
            if t.shape[0] < cap:
                t = torch.cat([t, t.new_zeros((cap - t.shape[0],) + tuple(t.shape[1:]))])
            b = (t if t.is_contiguous() else t.contiguous()).view(torch.uint8).reshape(-1) if t.numel() else \
                torch.empty(0, dtype=torch.uint8, device=t.device)
            nbytes = spec.nbytes
            if b.numel() != nbytes:
                raise RuntimeError(f"payload size mismatch for {name!r}: {b.numel()} != {nbytes}")
            chunks.append(b)
            pad = aligned(nbytes) - nbytes
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8, device=b.device))
    payload = torch.cat(chunks) if len(chunks) > 1 else (
        chunks[0] if chunks else torch.empty(0, dtype=torch.uint8, device=device))
    return payload, meta


def _gathered_buffers(meta: PayloadMeta, gathered: torch.Tensor) -> tuple[dict, bool]:
    """({direction: {buffer name: full buffer}}, whether every buffer is a view of `gathered`)."""
    ws = meta.world_size
    full: dict[str, dict[str, torch.Tensor]] = {d: {} for d in meta.parts}
    views = True
    storage = storage_id(gathered)
    for spec in meta.buffers:
        if spec.nbytes == 0:
            rows = torch.empty((0,) + spec.row_shape, dtype=spec.dtype, device=gathered.device)
            views = False
        else:
            raw = gathered[:, spec.offset:spec.offset + spec.nbytes]
            per_rank = raw.view(spec.dtype).view((ws, spec.capacity) + spec.row_shape)
            if all(c == spec.capacity for c in spec.counts[:-1]):
                # every rank but the last is full: the concatenation is a prefix of the ranks' rows in order
                # (a view when this buffer is the whole payload)
                rows = per_rank.reshape((ws * spec.capacity,) + spec.row_shape)[:sum(spec.counts)]
            else:
                pieces = [per_rank[r, :spec.counts[r]] for r in range(ws) if spec.counts[r]]
                rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            views = views and storage_id(rows) == storage  # (not a copy: the reshape of ranks' rows)
        full[spec.direction][spec.name] = rows
    return full, views


def _rebuild(meta: PayloadMeta, full: dict) -> dict:
    out = {}
    for d, ps in meta.parts.items():
        out[d] = ps.cls.assign_gathered(full[d], meta.replicated[d], rows=ps.rows, cols=ps.cols,
                                        columnwise=ps.columnwise, meta=ps.meta, **ps.hints)
    return out


def assemble_parts(meta: PayloadMeta, gathered: torch.Tensor) -> dict:
    """Full parts {direction: part} from the gathered payloads `gathered` ([world_size, >= meta.nbytes] uint8)."""
    return _rebuild(meta, _gathered_buffers(meta, gathered)[0])


def assemble_joined(metas, per_expert: torch.Tensor, replicated: dict | None = None) -> dict | None:
    """The parts of all experts' gathered payloads joined as the parts of one `[E*rows, cols]` tensor (rowwise rows
    one expert after another, columnwise columns likewise), read as `E` row shards of it: `per_expert` `[E, >=
    nbytes]` holds each expert's whole payload (one piece each, the same buffers). Where no scaling block along the
    rows spans two experts (the caller's rule) this is the quantization of the experts stacked, bitwise, as the
    gathered shards of one weight are ([Note: sharding invariance]). None where the payloads are not so laid out.
    `replicated`: the joined parts' replicated tensors, where the metas hold none (they travel in the payloads:
    grouped_blocks_payload.StackedBlocks)."""
    m0, e = metas[0], len(metas)
    if m0.world_size != 1 or any(m.world_size != 1 or m.buffers != m0.buffers or m.parts != m0.parts
                                 for m in metas[1:]):
        return None
    if any(ps.hints for ps in m0.parts.values()) or per_expert.shape[0] != e:
        return None
    buffers = [dataclasses.replace(b, counts=b.counts * e) for b in m0.buffers]
    parts = {d: dataclasses.replace(ps, rows=ps.rows if ps.columnwise else e * ps.rows,
                                    cols=e * ps.cols if ps.columnwise else ps.cols) for d, ps in m0.parts.items()}
    given, replicated = replicated or {}, {}
    for d, rep in m0.replicated.items():
        if d in given:
            replicated[d] = {**dict.fromkeys(rep), **given[d]}
            continue
        dim = 1 if m0.parts[d].columnwise else 0
        replicated[d] = {n: None if t is None else torch.cat([m.replicated[d][n] for m in metas], dim)
                         for n, t in rep.items()}
    joined = PayloadMeta((e * m0.shape[0],) + tuple(m0.shape[1:]), e, m0.nbytes, buffers, parts, replicated)
    return _rebuild(joined, _gathered_buffers(joined, per_expert)[0])


class GatheredViews:
    """Views of one all-gather output kept across unshards by a weight's state: FSDP2 hands the post-all-gather hook
    the same output storage at every unshard (it frees and re-allocates its bytes; views of it stay valid), so the
    received buffers are sliced once per storage and layout (`assemble_output`, grouped_batched.fill_stacked). The
    key is the output's storage, offset, shape and dtype; the tag says what the views were made for (compared by
    `==`). Only views of the output may be kept, never a copy of its bytes."""

    __slots__ = ("tag", "key", "value")

    def __init__(self):
        self.tag = self.key = self.value = None

    @staticmethod
    def key_of(output: torch.Tensor) -> tuple:
        return storage_id(output), output.storage_offset(), output.shape, output.dtype

    def get(self, tag, key):
        return self.value if self.key == key and self.tag == tag else None

    def put(self, tag, key, value) -> None:
        self.tag, self.key, self.value = tag, key, value


def assemble_output(meta: PayloadMeta, output: torch.Tensor, memo: GatheredViews | None = None) -> dict:
    """`assemble_parts` of FSDP2's all-gather output `output` (the ranks' payloads one after another, any dtype). With
    `memo`: the buffers' views are those of the last call when `output` is a view of the same storage at the same
    place and the payload's layout is the same; buffers that are not views (concatenated rows of uneven shards) are
    never kept."""
    if memo is not None:
        key = memo.key_of(output)
        full = memo.get(meta.buffers, key)
        if full is not None:
            return _rebuild(meta, full)
    full, views = _gathered_buffers(meta, output.reshape(-1).view(torch.uint8).view(meta.world_size, -1))
    if memo is not None:
        memo.put(meta.buffers, key, full if views else None)
    return _rebuild(meta, full)


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
