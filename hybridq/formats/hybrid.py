"""Hybrid: the rowwise part from one quantizer and the columnwise part from another (docs/numerics.md "Hybrid")."""

from __future__ import annotations

from typing import Sequence

import torch

from ..enums import COLUMNWISE, ROWWISE, ColumnwiseSource, Cut
from ..tensor import QuantizedTensor
from .base import Quantizer
from .shardable import ShardableQuantizer

class HybridQuantizer(ShardableQuantizer, Quantizer):
    """`HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer())`.

    Here `rowwise` / `columnwise` name the two quantizers; the usage flags are `rowwise_usage` /
    `columnwise_usage` (a new hybrid produces the rowwise form only, like every quantizer).
    columnwise_source="rowwise_dequantized" quantizes the columnwise form from the dequantized rowwise
    result ("double quantization") instead of from the original input.
    """

    format_name = "hybrid"

    def __init__(self, rowwise: Quantizer, columnwise: Quantizer,
                 columnwise_source: ColumnwiseSource | str = ColumnwiseSource.ORIGINAL, *,
                 rowwise_usage: bool = True, columnwise_usage: bool = False):
        for d, q in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
            if not isinstance(q, Quantizer) or isinstance(q, HybridQuantizer):
                raise TypeError(f"HybridQuantizer {d}= must be a plain hybridq quantizer, got {q!r}")
        if rowwise is columnwise and rowwise.is_stateful:
            raise ValueError("HybridQuantizer: one delayed-scaling quantizer cannot serve both directions (its "
                             "scale would update between the two casts); pass two instances")
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.columnwise_source = ColumnwiseSource.parse(columnwise_source, "HybridQuantizer columnwise_source")
        self._usage = (rowwise_usage, columnwise_usage)

    @property
    def usage(self) -> tuple[bool, bool]:
        return self._usage

    def __repr__(self) -> str:
        return (f"HybridQuantizer(rowwise={self.rowwise!r}, columnwise={self.columnwise!r}, "
                f"columnwise_source={self.columnwise_source!r})")

    def __eq__(self, other) -> bool:
        return (isinstance(other, HybridQuantizer) and self.rowwise == other.rowwise
                and self.columnwise == other.columnwise and self.columnwise_source == other.columnwise_source)

    def describe(self) -> str:
        return f"hybrid[{self.rowwise.describe()} / {self.columnwise.describe()}]"

    @property
    def round_trip_bound(self) -> float:
        return max(self.rowwise.round_trip_bound, self.columnwise.round_trip_bound)

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        return (self.rowwise.storage_bytes(m, k, rowwise, False, dtype)
                + self.columnwise.storage_bytes(m, k, False, columnwise, dtype))

    @property
    def is_stateful(self) -> bool:
        return self.rowwise.is_stateful or self.columnwise.is_stateful

    @property
    def is_deterministic(self) -> bool:
        return self.rowwise.is_deterministic and self.columnwise.is_deterministic

    def quantizers(self) -> tuple[Quantizer, ...]:
        return (self.rowwise, self.columnwise)

    @property
    def local_scaling(self) -> bool:
        # (double quantization too: the rowwise form dequantizes element by element, so its columnwise form's
        # blocks see only their own rows)
        return self.rowwise.local_scaling and self.columnwise.local_scaling

    @property
    def packs_row_groups(self) -> bool:
        # each direction's groups from its own quantizer; a columnwise form quantized from the dequantized rowwise
        # one needs that rowwise form to dequantize element by element (local scaling: no per-group statistic in
        # the way); and only one of the two may draw random numbers, since the packed call draws all of one
        # direction's groups before the other's while a per-group call draws rowwise then columnwise
        return (self.rowwise.packs_row_groups and self.columnwise.packs_row_groups
                and (not self._double or self.rowwise.local_scaling)
                and (self.rowwise.is_deterministic or self.columnwise.is_deterministic))

    def quantize_groups(self, x2d: torch.Tensor, sizes: Sequence[int], *, rowwise: bool = True,
                        columnwise: bool = False, name: str = "tensor",
                        draw_order: Sequence[int] | None = None) -> QuantizedTensor:
        """Row groups (see `Quantizer.quantize_groups`): the rowwise part from the rowwise quantizer's row groups,
        the columnwise part from the columnwise quantizer's."""
        if self.local_scaling or not self.packs_row_groups:  # one plain quantize (or the error naming the tensor)
            return super().quantize_groups(x2d, sizes, rowwise=rowwise, columnwise=columnwise, name=name,
                                           draw_order=draw_order)
        double = columnwise and self._double
        row = col = None
        if rowwise or double:
            row = self.rowwise.quantize_groups(x2d, sizes, rowwise=True, columnwise=False, name=name,
                                               draw_order=draw_order).part(ROWWISE)
        if columnwise:
            src = row.dequantize_2d().to(x2d.dtype) if double else x2d
            col = self.columnwise.quantize_groups(src, sizes, rowwise=False, columnwise=True, name=name,
                                                  draw_order=draw_order).part(COLUMNWISE)
        return QuantizedTensor(row if rowwise else None, col, shape=x2d.shape, dtype=x2d.dtype)

    def shape_rule(self, m, k, rowwise, columnwise):
        need_row = rowwise or (columnwise and self.columnwise_source == ColumnwiseSource.ROWWISE_DEQUANTIZED)
        return ((self.rowwise.shape_rule(m, k, True, False) if need_row else None)
                or (self.columnwise.shape_rule(m, k, False, True) if columnwise else None))

    def quantize_parts(self, x2d, rowwise, columnwise, *, shard=None, stats=None, global_stats=None):
        """`shard` / `stats`: quantize the row shard `x2d` with the MAX-reduced `shard_stats` (see _sharding).
        `global_stats`: `x2d` is a piece of a tensor and this the MAX-reduced `global_stats`."""
        if shard is not None and not shard.is_whole:
            return self._shard_parts(x2d, rowwise, columnwise, shard, stats)
        kw_r, kw_c = self._split_global_stats(global_stats, rowwise, columnwise, x2d)
        double = columnwise and self.columnwise_source == ColumnwiseSource.ROWWISE_DEQUANTIZED
        row = self.rowwise.quantize_parts(x2d, True, False, **kw_r)[0] if (rowwise or double) else None
        col = None
        if columnwise:
            src = row.dequantize_2d().to(x2d.dtype) if double else x2d
            col = self.columnwise.quantize_parts(src, False, True, **kw_c)[1]
        return (row if rowwise else None), col

    # -- pieces cut along both dims (tensor parallelism) ------------------------------------------------
    def split_granularity(self, rowwise, columnwise):
        import math

        gs = []
        if rowwise or (columnwise and self._double):
            gs.append(self.rowwise.split_granularity(True, False))
        if columnwise:
            gs.append(self.columnwise.split_granularity(False, True))
        return (math.lcm(*(g[0] for g in gs)), math.lcm(*(g[1] for g in gs))) if gs else (1, 1)

    def global_stats(self, x2d, rowwise, columnwise):
        """The rowwise quantizer's (when rowwise is asked), then the columnwise quantizer's."""
        self._refuse_double_piece(columnwise)
        a = self.rowwise.global_stats(x2d, True, False) if rowwise else None
        b = self.columnwise.global_stats(x2d, False, True) if columnwise else None
        pieces = [t.reshape(-1).float() for t in (a, b) if t is not None]
        return torch.cat(pieces) if pieces else None

    def _refuse_double_piece(self, columnwise: bool) -> None:
        if columnwise and self._double:
            # the columnwise statistics are those of the dequantized rowwise form, known only after a first round
            raise NotImplementedError(
                f"{self.describe()}: the double-quantized columnwise form of a piece depends on the whole "
                f"tensor's rowwise form; it cannot be quantized piece by piece")

    @property
    def stats_per_axis(self) -> bool:
        return self.rowwise.stats_per_axis or self.columnwise.stats_per_axis

    def piece_stats(self, x2d, rowwise, columnwise, cut):
        """The rowwise quantizer's statistics of the piece (when rowwise is asked), then the columnwise one's, each
        for its own direction and the cut (a side with per-axis statistics shares only the cut axis's)."""
        if not self.stats_per_axis:
            return self.global_stats(x2d, rowwise, columnwise)
        self._refuse_double_piece(columnwise)
        a = self.rowwise.piece_stats(x2d, True, False, cut) if rowwise else None
        b = self.columnwise.piece_stats(x2d, False, True, cut) if columnwise else None
        pieces = [t.reshape(-1).float() for t in (a, b) if t is not None]
        return torch.cat(pieces) if pieces else None

    def quantize_piece(self, x2d, rowwise, columnwise, stats, cut):
        if not self.stats_per_axis:
            return super().quantize_piece(x2d, rowwise, columnwise, stats, cut)
        probe = torch.empty(x2d.shape, device="meta")  # sizes only, no data
        a = self.rowwise.piece_stats(probe, True, False, cut) if rowwise else None
        na = 0 if a is None else a.numel()
        stats = None if stats is None else stats.reshape(-1)
        sa = stats[:na] if (stats is not None and na) else None
        sb = stats[na:] if (stats is not None and stats.numel() > na) else None
        row = self.rowwise.quantize_piece(x2d, True, False, sa, cut)[0] if rowwise else None
        col = self.columnwise.quantize_piece(x2d, False, True, sb, cut)[1] if columnwise else None
        return row, col

    def quantize_axes(self, x2d, rowwise, columnwise, row_stats, col_stats):
        """Each side's `quantize_axes` with its share of the statistics (`row_stats` / `col_stats`: this hybrid's
        `piece_stats(x2d, True, True, cut)` for cut "K" / "M", reduced)."""
        if not (self.rowwise.stats_per_axis and self.columnwise.stats_per_axis):
            raise NotImplementedError(
                f"{self.describe()}: per-axis statistics (a row's or a column's amax) on one side only; a piece cut "
                f"along both dims is quantized only with per-axis statistics on both sides (quantize_axes)")
        self._refuse_double_piece(columnwise)
        probe = torch.empty(x2d.shape, device="meta")  # sizes only, no data

        def split(stats, cut):
            if stats is None:
                return None, None
            a = self.rowwise.piece_stats(probe, True, False, cut)
            na, stats = (0 if a is None else a.numel()), stats.reshape(-1)
            return (stats[:na] if na else None), (stats[na:] if stats.numel() > na else None)

        (r_rows, c_rows), (r_cols, c_cols) = split(row_stats, Cut.COLUMNS), split(col_stats, Cut.ROWS)
        row = self.rowwise.quantize_axes(x2d, True, False, r_rows, r_cols)[0] if rowwise else None
        col = self.columnwise.quantize_axes(x2d, False, True, c_rows, c_cols)[1] if columnwise else None
        return row, col

    def stats_from_amax(self, amax, rowwise, columnwise):
        """The two sub-quantizers' statistics side by side (as `global_stats`), when each that has statistics can
        take them from the amax."""
        if columnwise and self._double:
            return None  # (the columnwise statistics are those of the dequantized rowwise form)
        probe = torch.empty(0, 1, device="meta")  # sizes only: does a sub-quantizer have statistics at all?
        pieces = []
        for q, use, r, c in ((self.rowwise, rowwise, True, False), (self.columnwise, columnwise, False, True)):
            if not use or q.global_stats(probe, r, c) is None:
                continue
            s = q.stats_from_amax(amax, r, c)
            if s is None:
                return None
            pieces.append(s.reshape(-1).float())
        return torch.cat(pieces) if pieces else None

    def _split_global_stats(self, stats, rowwise, columnwise, x2d) -> tuple[dict, dict]:
        """The keyword arguments passing each sub-quantizer its share of the hybrid's `global_stats`."""
        if stats is None:
            return {}, {}
        probe = torch.empty(0, x2d.shape[1], device="meta")  # sizes only, no data
        a = self.rowwise.global_stats(probe, True, False) if rowwise else None
        na = 0 if a is None else a.numel()
        stats = stats.reshape(-1)
        kw_r = {"global_stats": stats[:na]} if na else {}
        kw_c = {"global_stats": stats[na:]} if (columnwise and stats.numel() > na) else {}
        return kw_r, kw_c

    # -- sharded quantization (FSDP): the two sub-quantizers' statistics, side by side ------------------
    @property
    def _double(self) -> bool:
        return self.columnwise_source == ColumnwiseSource.ROWWISE_DEQUANTIZED

    @staticmethod
    def _stats_numel(q: Quantizer, shard, k: int) -> int:
        probe = q.shard_stats(torch.empty(shard.length, k, device="meta"), shard)  # sizes only, no data
        return 0 if probe is None else probe.numel()

    def shard_stats(self, x2d, shard):
        """The rowwise quantizer's statistics, then the columnwise quantizer's (none for double quantization:
        its columnwise form is re-quantized from the gathered rowwise form, see derive_part)."""
        a = self.rowwise.shard_stats(x2d, shard)
        b = None if self._double else self.columnwise.shard_stats(x2d, shard)
        pieces = [t.reshape(-1).float() for t in (a, b) if t is not None]
        return torch.cat(pieces) if pieces else None

    def with_global_stats(self, stats, shard, k, global_stats):
        if stats is None or global_stats is None:
            return stats
        na = self._stats_numel(self.rowwise, shard, k)
        probe = torch.empty(0, k, device="meta")
        ga = self.rowwise.global_stats(probe, True, False)
        nga = 0 if ga is None else ga.numel()
        stats, global_stats = stats.reshape(-1), global_stats.reshape(-1)
        a = self.rowwise.with_global_stats(stats[:na] if na else None, shard, k, global_stats[:nga] if nga else None)
        b = None
        if not self._double:
            rest = stats[na:] if stats.numel() > na else None
            b = self.columnwise.with_global_stats(rest, shard, k, global_stats[nga:] if global_stats.numel() > nga
                                                  else None)
        pieces = [t.reshape(-1).float() for t in (a, b) if t is not None]
        return torch.cat(pieces) if pieces else None

    def _shard_parts(self, x2d, rowwise, columnwise, shard, stats):
        na = self._stats_numel(self.rowwise, shard, x2d.shape[1])
        sa = sb = None
        if stats is not None:
            stats = stats.reshape(-1)
            sa = stats[:na] if na else None
            sb = stats[na:] if stats.numel() > na else None
        if columnwise and self._double:
            raise NotImplementedError(
                f"{self.describe()}: the double-quantized columnwise form of a shard depends on other shards' "
                f"rows; gather the rowwise form and derive the columnwise one (derive_part)")
        row = col = None
        if rowwise:
            kw = {} if self.rowwise.shard_is_plain(shard, True, False) else {"shard": shard, "stats": sa}
            row = self.rowwise.quantize_parts(x2d, True, False, **kw)[0]
        if columnwise:
            kw = {} if self.columnwise.shard_is_plain(shard, False, True) else {"shard": shard, "stats": sb}
            col = self.columnwise.quantize_parts(x2d, False, True, **kw)[1]
        return row, col

    def derive_part(self, part, direction, dtype=None):
        """Double quantization: the columnwise form is a function of the rowwise one. Two equal quantizers:
        whatever that quantizer can derive."""
        if part.direction == direction:
            return None
        if self._double:
            if direction != COLUMNWISE:
                return None
            src = part.dequantize_2d().to(dtype or torch.float32)
            return self.columnwise.quantize_parts(src, False, True)[1]
        if self.rowwise == self.columnwise:
            return self.rowwise.derive_part(part, direction, dtype)
        return None

    def derive_part_into(self, part, into, dtype=None):
        """Two equal quantizers: whatever that quantizer derives in place (a double quantization never is)."""
        if self._double or part.direction == into.direction or self.rowwise != self.columnwise:
            return False
        return self.rowwise.derive_part_into(part, into, dtype)

    def derive_experts_into(self, rows, cols, dtype=None):
        """Two equal quantizers: whatever that quantizer derives of the experts at once (as `derive_part_into`)."""
        if self._double or self.rowwise != self.columnwise:
            return False
        return self.rowwise.derive_experts_into(rows, cols, dtype)

    def buffer_hints(self, direction):
        q = self.rowwise if direction == ROWWISE else self.columnwise
        return q.buffer_hints(direction)

    def shard_is_plain(self, shard, rowwise, columnwise):
        return ((not rowwise or self.rowwise.shard_is_plain(shard, True, False))
                and (not columnwise or (not self._double and self.columnwise.shard_is_plain(shard, False, True))))
