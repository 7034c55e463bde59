"""Quantizing the piece of a tensor one rank holds under tensor parallelism, bitwise as the corresponding piece of
the whole tensor's quantization.

Two kinds of pieces occur (docs/architecture.md "Tensor parallelism"):
- a *row piece* (rows of the `[M, K]` view; a column-parallel weight, `Shard(0)`);
- a *column piece* (columns of the view; a row-parallel weight, `Shard(1)`, a row-parallel input or a
  column-parallel grad_output, `Shard(-1)`).
The GEMM uses a piece as a tensor of its own, so every boundary must be a multiple of the format's
`split_granularity` along the cut dim (checked when the layout is known, `check_column_cuts`); the per-tensor
statistics (`global_stats`) are then reduced with one MAX all-reduce and the piece is quantized plainly with them.
(A sequence-parallel input, which is gathered before use, may cut blocks: see `sequence`.)

`PieceQuantizer` wraps a format's quantizer so that a hybridq Linear quantizes its local operand through it
unchanged; nothing here knows a format.
"""

from __future__ import annotations

import dataclasses

import torch

from ..enums import Cut
from ..errors import FormatShapeError, RecipeError
from ..formats.base import Quantizer, as_2d
from ..formats._reduce import amax_all_reduce_
from ..tensor import QuantizedTensor

__all__ = ["PieceQuantizer", "chunk_bounds", "check_column_cuts", "reject_stateful"]


def chunk_bounds(size: int, world_size: int) -> list[int]:
    """Boundaries of DTensor's `Shard` chunks (torch.chunk: ceil-sized, the last ones possibly short or empty)."""
    chunk = -(-size // world_size) if size else 0
    return [min(r * chunk, size) for r in range(world_size + 1)]


def check_column_cuts(q: Quantizer, k: int, world_size: int, rowwise: bool, columnwise: bool, name: str, *,
                      axis: Cut = Cut.COLUMNS) -> None:
    """Raise FormatShapeError unless cutting the `k` columns (axis "K"; rows with axis "M") into `world_size`
    DTensor chunks keeps every block of the requested directions whole."""
    g = q.split_granularity(rowwise, columnwise)[1 if axis == Cut.COLUMNS else 0]
    bad = [c for c in chunk_bounds(k, world_size)[1:-1] if 0 < c < k and c % g]
    if bad:
        what = "column" if axis == Cut.COLUMNS else "row"
        raise FormatShapeError(
            f"{q.describe()} cannot split {name} along {axis} across {world_size} tensor-parallel ranks: its blocks "
            f"span {g} {what}s, so every rank's first {what} must be a multiple of {g}; {axis}={k} splits at "
            f"{bad[0]} (choose {axis} a multiple of {g * world_size})")


def reject_stateful(q: Quantizer, name: str) -> None:
    if q.is_stateful:  # (a rule of the recipe, whatever the shapes: RecipeError, a ValueError)
        raise RecipeError(
            f"{q.describe()}: {name} uses delayed scaling; under tensor parallelism every rank quantizes its piece "
            f"with the whole tensor's statistics, which a scale carried over from earlier steps does not give. "
            f"Use current scaling (e.g. the 'fp8_tensorwise' preset)")


@dataclasses.dataclass(eq=False)
# [Note: piece]
# A piece is a rank's share of a tensor that is quantized as part of the whole: an FSDP2 row shard of a weight, a
# tensor-parallel weight's rows or columns, a sequence-parallel activation's rows, a ZeRO optimizer's flat fragment.
# It is quantized with the statistics it shares with the other pieces, MAX-reduced over the group first, so that it
# is bitwise its share of the whole tensor's quantization (see [Note: sharding invariance], formats/shardable.py).
# Where a cut may fall (`split_granularity`: whole scaling blocks) is the format's rule, checked on every rank alike
# before anything is quantized.
class PieceQuantizer:
    """Quantizes this rank's piece of a tensor split across `group` along `dim` ("rows" or "columns") as the
    piece of the whole tensor's quantization. Quacks like the Quantizer it wraps where a Linear calls it."""

    inner: Quantizer
    dim: str  # "rows" | "columns"
    total: int  # rows (dim "rows") or columns of the whole tensor
    group: object
    world_size: int
    rank: int

    @property
    def is_deterministic(self) -> bool:
        return self.inner.is_deterministic

    @property
    def is_stateful(self) -> bool:
        return self.inner.is_stateful

    def describe(self) -> str:
        return self.inner.describe()

    def quantizers(self) -> tuple[Quantizer, ...]:
        return self.inner.quantizers()

    def __eq__(self, other) -> bool:
        return (isinstance(other, PieceQuantizer) and other.dim == self.dim and other.group is self.group
                and other.inner == self.inner)

    __hash__ = None

    def quantize(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False,
                 name: str = "tensor") -> QuantizedTensor:
        if self.world_size == 1:
            return self.inner.quantize(x, rowwise=rowwise, columnwise=columnwise, name=name)
        q = self.inner
        reject_stateful(q, name)
        x2d = as_2d(x.detach() if x.requires_grad else x)
        if self.dim == "rows":
            parts = self._row_piece(q, x2d, rowwise, columnwise, name)
        else:
            parts = self._column_piece(q, x2d, rowwise, columnwise, name)
        return QuantizedTensor(*parts, shape=x.shape, dtype=x.dtype)

    def _row_piece(self, q, x2d, rowwise, columnwise, name):
        """Rows `[offset, offset + local)` of the whole `[M, K]`. The GEMM uses the piece as a tensor of its own,
        so no block may straddle two ranks (a shard part, which FSDP2 completes by gathering, would pair the
        piece's rows with another block's scale): the boundaries must be multiples of the format's row
        granularity, checked here on every rank alike before any collective; the piece is then quantized as a
        column piece is, with the whole tensor's per-tensor statistics."""
        m_local, k = x2d.shape
        bounds, rows = chunk_bounds(self.total, self.world_size), self.total
        if bounds[self.rank + 1] - bounds[self.rank] != m_local:
            raise ValueError(f"{name}: rank {self.rank} holds {m_local} rows, DTensor's chunks of {rows} rows over "
                             f"{self.world_size} ranks give it {bounds[self.rank + 1] - bounds[self.rank]}")
        q.validate((rows, k), name, rowwise=rowwise, columnwise=columnwise)
        check_column_cuts(q, rows, self.world_size, rowwise, columnwise, name, axis=Cut.ROWS)
        return self._with_global_stats(q, x2d, rowwise, columnwise, Cut.ROWS)

    def _column_piece(self, q, x2d, rowwise, columnwise, name):
        """Columns of the whole `[M, K]` whose boundaries keep blocks whole: plain quantization with the whole
        tensor's per-tensor statistics."""
        m, k_local = x2d.shape
        check_column_cuts(q, self.total, self.world_size, rowwise, columnwise, name)  # (alike on every rank)
        q.validate((m, k_local), name, rowwise=rowwise, columnwise=columnwise)
        return self._with_global_stats(q, x2d, rowwise, columnwise, Cut.COLUMNS)

    def _with_global_stats(self, q, x2d, rowwise, columnwise, cut):
        """A piece cut along `cut` at the format's split granularity: quantized with the statistics it shares with
        the other pieces (`piece_stats`: per-tensor ones, or those of the axis it is cut along; MAX-reduced over the
        group), bitwise that piece of the whole tensor's quantization."""
        stats = q.piece_stats(x2d, rowwise, columnwise, cut)
        if stats is not None:
            stats = stats.contiguous()
            amax_all_reduce_(stats, self.group)
        return q.quantize_piece(x2d, rowwise, columnwise, stats, cut)
