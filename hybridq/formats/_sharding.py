"""Row shards of a 2-D tensor and the block bookkeeping the formats need to quantize one shard so that the
result is bitwise what quantizing the whole tensor gives for those rows (see [Note: sharding invariance],
shardable.py).

FSDP2 shards a weight along dim 0, i.e. along the rows M of its `[M, K]` view. Blocks that run along K
(rowwise 1x32 / 1x128 / 1x16 blocks) never straddle a shard boundary; blocks that run along M (columnwise
32x1 / 128x1 / 16x1 blocks of a weight) and 2-D tiles (16x16 / 32x32 / 128x128) do whenever a boundary is not
a multiple of the block. Two kinds of statistics therefore have to be reduced across shards:

- global amaxes (per-tensor FP8, NVFP4's global amax per direction);
- the amaxes of the *cut* block rows: block rows (of `g` tensor rows) that a shard boundary splits.

A quantizer's `shard_stats(x_shard, shard)` returns both as one fp32 vector whose length depends only on the
full shape and the shard layout (never on the data or the rank), with zeros where the shard holds nothing.
An elementwise MAX over all shards (one all-reduce) gives the statistics of the full tensor, and
`reference_parts(x_shard, ..., shard=shard, stats=reduced)` then quantizes the shard exactly as the full tensor
would be quantized. Block grids stay aligned to the *global* row index, so a shard's scale tensors cover the
block rows it touches, the first one possibly partial ("shard parts"); `extract_buffers(shard)` keeps only the
block rows a shard *owns* (those whose first row lies in the shard), so the gathered buffers partition the
full tensor's block rows without duplicates.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class RowShard:
    """Rows `[offset, offset + length)` of a tensor whose 2-D view has `rows` rows.

    `cuts` are the global row indices (0 < cut < rows) where one shard ends and the next begins; they are the
    same on every rank, so statistics laid out by them line up across ranks.
    """

    rows: int
    offset: int
    length: int
    cuts: tuple[int, ...] = ()

    def __post_init__(self):
        if not (0 <= self.offset and 0 <= self.length and self.offset + self.length <= self.rows):
            raise ValueError(f"RowShard: rows [{self.offset}, {self.offset + self.length}) outside [0, {self.rows})")

    @classmethod
    def whole(cls, rows: int) -> "RowShard":
        return cls(rows, 0, rows, ())

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def is_whole(self) -> bool:
        return self.offset == 0 and self.length == self.rows

    def aligned(self, g: int) -> bool:
        """Starts on a block row of g rows and ends on one (or at the end of the tensor)."""
        return self.offset % g == 0 and (self.length % g == 0 or self.end == self.rows)

    # -- block rows (of g tensor rows each, aligned to global row 0) ---------------------------------
    def touched(self, g: int) -> tuple[int, int]:
        """[first, end) block rows that hold at least one row of this shard."""
        if self.length == 0:
            return self.offset // g, self.offset // g
        return self.offset // g, cdiv(self.end, g)

    def owned(self, g: int) -> tuple[int, int]:
        """[first, end) block rows whose first row lies in this shard (each block row has exactly one owner)."""
        return cdiv(self.offset, g), cdiv(self.end, g)

    def owned_count(self, g: int) -> int:
        a, b = self.owned(g)
        return max(b - a, 0)

    def cut_blocks(self, g: int) -> tuple[int, ...]:
        """Global block rows split by a shard boundary (identical on every rank)."""
        return tuple(sorted({c // g for c in self.cuts if c % g}))


def dim0_chunks(shape, world_size: int) -> tuple[RowShard, ...]:
    """Every rank's RowShard under FSDP2's dim-0 chunking of a tensor of `shape` (rows = prod(shape[:-1]))."""
    return _dim0_chunks(tuple(shape), world_size)


@functools.lru_cache(maxsize=4096)  # asked for on every all-gather of every weight
def _dim0_chunks(shape: tuple, world_size: int) -> tuple[RowShard, ...]:
    d0 = shape[0] if shape else 1
    k = shape[-1] if shape else 1
    unit = 1  # rows of the 2-D view per dim-0 index
    for d in shape[1:-1]:
        unit *= d
    if len(shape) < 2:  # a vector is one row of K: FSDP would split K, which row shards cannot follow
        raise ValueError(f"row sharding needs a tensor of at least 2 dims, got shape {shape} (K={k})")
    rows = d0 * unit
    chunk = cdiv(d0, world_size) if d0 else 0
    bounds = [min(r * chunk, d0) * unit for r in range(world_size + 1)]
    cuts = tuple(sorted({b for b in bounds if 0 < b < rows}))
    return tuple(RowShard(rows, bounds[r], bounds[r + 1] - bounds[r], cuts) for r in range(world_size))


# ---- per-shard block statistics --------------------------------------------------------------------

def aligned(x2d: torch.Tensor, shard: RowShard, g: int) -> torch.Tensor:
    """The shard's rows padded with zero rows so that row 0 starts a global block row and the row count is a
    multiple of g: shape [n_touched * g, K] (zero rows never raise an amax)."""
    if shard.length == 0:
        return x2d[:0]
    first, end = shard.touched(g)
    top = shard.offset - first * g
    bottom = (end - first) * g - top - shard.length
    if top == 0 and bottom == 0:
        return x2d
    return torch.nn.functional.pad(x2d, (0, 0, top, bottom))


def col_block_amax(x2d: torch.Tensor, shard: RowShard, g: int) -> torch.Tensor:
    """max|x| over g x 1 blocks along M (columnwise blocks), globally aligned: [n_touched, K]."""
    a = aligned(x2d.float().abs(), shard, g)
    return a.view(-1, g, a.shape[1]).amax(dim=1) if a.numel() else a.new_zeros(a.shape[0] // g, a.shape[1])


def tile_amax_rows(x2d: torch.Tensor, shard: RowShard, g: int) -> torch.Tensor:
    """max|x| over g x g tiles (partial edge tiles along K), globally aligned rows: [n_touched, ceil(K/g)]."""
    a = aligned(x2d.float().abs(), shard, g)
    k = a.shape[1]
    kb = cdiv(k, g)
    a = torch.nn.functional.pad(a, (0, kb * g - k))
    if a.shape[0] == 0:
        return a.new_zeros(0, kb)
    return a.view(-1, g, kb, g).amax(dim=(1, 3))


def cut_stats(local: torch.Tensor, shard: RowShard, g: int) -> torch.Tensor:
    """[n_cut, W]: this shard's partial amax of every cut block row it touches, 0 for the others."""
    cuts = shard.cut_blocks(g)
    out = local.new_zeros(len(cuts), local.shape[1])
    first, end = shard.touched(g)
    for i, b in enumerate(cuts):
        if first <= b < end:
            out[i] = local[b - first]
    return out


def merge_cut(local: torch.Tensor, shard: RowShard, g: int, reduced: torch.Tensor) -> torch.Tensor:
    """`local` [n_touched, W] with every touched cut block row replaced by its reduced (full-tensor) amax."""
    cuts = shard.cut_blocks(g)
    if not cuts:
        return local
    out = local.clone()
    first, end = shard.touched(g)
    reduced = reduced.reshape(len(cuts), local.shape[1]).to(local.device)
    for i, b in enumerate(cuts):
        if first <= b < end:
            out[b - first] = reduced[i]
    return out


def expand_rows(values: torch.Tensor, shard: RowShard, g: int) -> torch.Tensor:
    """Per-block-row values [n_touched, W] repeated onto the shard's rows: [length, W]."""
    top = shard.offset - shard.touched(g)[0] * g
    return values.repeat_interleave(g, dim=0)[top:top + shard.length]


def owned_rows(t: torch.Tensor, shard: RowShard, g: int) -> torch.Tensor:
    """Rows of a per-touched-block-row tensor [n_touched, ...] that this shard owns."""
    first = shard.touched(g)[0]
    a, b = shard.owned(g)
    return t[a - first:max(b, a) - first]


class StatsLayout:
    """Packs named fp32 pieces into the flat, MAX-reducible vector `shard_stats` returns, and unpacks it."""

    def __init__(self, *pieces: tuple[str, tuple[int, ...]]):
        self.pieces = [(n, tuple(s)) for n, s in pieces if _numel(s) > 0]

    @property
    def numel(self) -> int:
        return sum(_numel(s) for _, s in self.pieces)

    def pack(self, values: dict[str, torch.Tensor], device) -> torch.Tensor | None:
        if not self.pieces:
            return None
        return torch.cat([values[n].float().reshape(-1) for n, _ in self.pieces]).to(device)

    def unpack(self, flat: torch.Tensor | None) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        if flat is None:
            if self.pieces:
                raise ValueError("shard quantization needs the reduced statistics (stats=) of shard_stats")
            return out
        flat = flat.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"stats has {flat.numel()} values, expected {self.numel}")
        for n, s in self.pieces:
            m = _numel(s)
            out[n] = flat[i:i + m].reshape(s)
            i += m
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def full_col_block_amax(x2d: torch.Tensor, shard: RowShard, g: int, stats: dict) -> torch.Tensor:
    """Amaxes of the g x 1 column blocks this shard touches, completed across shards: the local amaxes, with
    the block rows a boundary cuts replaced by their reduced values (`stats["cut"]`, when there are any)."""
    amax = col_block_amax(x2d, shard, g)
    return merge_cut(amax, shard, g, stats["cut"]) if "cut" in stats else amax
