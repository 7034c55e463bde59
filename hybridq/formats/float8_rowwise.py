"""Rowwise FP8: one fp32 scale per row along the contracted dim (docs/numerics.md "Rowwise FP8"), and the
`fp8_rowwise` preset (torchao's Float8LinearRecipeName.ROWWISE: E4M3 for input, weight and grad_output, scales
rounded down to powers of two).

Both parts are stored in GEMM orientation, so each holds one scale per stored row: the rowwise part `[M, K]` one
per row (max|x| over K), the columnwise part `[K, M]` one per column of x (max|x| over M). That is the layout of
`torch._scaled_mm`'s rowwise GEMM (scale_a `[M, 1]`, scale_b `[1, N]`), which the native GEMM table selects by
`scale_layout`.

Statistics per axis (docs/architecture.md "Statistics"): a row's amax spans the row's columns and a column's amax
the column's rows. Under FSDP2 (row shards) the rowwise scales are local to a shard and only the columns' amaxes
are reduced (`shard_stats`, one `[K]` vector); a tensor-parallel piece reduces the amaxes along its cut dim only
(`piece_stats`): the rows' amaxes for a column piece, the columns' for a row piece.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..enums import Cut
from ._numerics import FP8_MAX, FP8_NAMES, fp8_dtype, rcp, satfinite_fp8, scale_from_amax
from ._presets import declare_preset
from .base import QuantizedPart, Quantizer, ScaleLayout, transposed_copy
from .float8 import ScaledFP8Values
from .shardable import GatherablePart, ShardableQuantizer

CUTS = tuple(Cut)  # a tensor-parallel piece is cut along M (a row piece) or along K (a column piece)


class Float8RowwisePart(ScaledFP8Values, GatherablePart, QuantizedPart):
    """data: fp8 `[rows, cols]`; scale_inv: fp32 `[rows, 1]`, one per stored row (dequantize = data * scale_inv)."""

    format_name = "FP8-rowwise"
    tensor_fields = ("data", "scale_inv")
    scale_layout = ScaleLayout.ROW

    # FSDP buffer protocol: a rowwise part's scales are per row of the shard (gathered with the data); a columnwise
    # part's are per column of the whole tensor, from the reduced column amaxes, so every shard holds them all.
    def extract_buffers(self, shard=None, *, tile_rows=None):
        if self.columnwise:
            return [("data", transposed_copy(self.data), 1)], {"scale_inv": self.scale_inv}
        return [("data", self.data, 1), ("scale_inv", self.scale_inv, 1)], {}

    @classmethod
    def assign_gathered(cls, buffers, replicated, *, rows, cols, columnwise, meta, tile_rows=None):
        if columnwise:
            return cls(rows=rows, cols=cols, columnwise=True, data=transposed_copy(buffers["data"]),
                       scale_inv=replicated["scale_inv"])
        return cls(rows=rows, cols=cols, columnwise=False, data=buffers["data"], scale_inv=buffers["scale_inv"])


def row_amax(x2d: torch.Tensor) -> torch.Tensor:
    """max|x| of every row, fp32 `[M]` (0 for rows without elements; NaN propagates)."""
    if x2d.shape[1] == 0:
        return torch.zeros(x2d.shape[0], dtype=torch.float32, device=x2d.device)
    return x2d.float().abs().amax(dim=1)


@dataclasses.dataclass
class Float8RowwiseQuantizer(ShardableQuantizer, Quantizer):
    """FP8 with one scale per row of each part (per row of x rowwise, per column of x columnwise), current scaling.
    `Float8RowwiseQuantizer()` is E4M3 with power-of-two scales (torchao's rowwise recipe)."""

    fp8: str | torch.dtype = "e4m3"
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    format_name: ClassVar[str] = "FP8-rowwise"

    def __post_init__(self):
        self.dtype = fp8_dtype(self.fp8)

    def describe(self) -> str:
        return f"FP8-rowwise {FP8_NAMES[self.dtype]}"

    # -- what the tests and tables read off a quantizer (docs/numerics.md "Rowwise FP8") -------------
    @property
    def round_trip_bound(self) -> float:
        return 0.030 if self.dtype == torch.float8_e4m3fn else 0.060

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        return rowwise * (m * k + 4 * m) + columnwise * (m * k + 4 * k)

    # -- quantization ----------------------------------------------------------------------------
    def _cast(self, x2d: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x2d `[R, C]` scaled by the rows' amaxes `[R]`: (fp8 `[R, C]`, scale_inv `[R, 1]`)."""
        scale = scale_from_amax(amax.to(x2d.device).reshape(-1, 1), FP8_MAX[self.dtype], self.amax_epsilon,
                                self.power_2_scale)
        return satfinite_fp8(x2d.float() * scale, self.dtype), rcp(scale)

    def reference_parts(self, x2d, rowwise, columnwise, *, shard=None, stats=None, global_stats=None, cut=None):
        """`shard` / `stats`: `x2d` is a row shard and `stats` the MAX-reduced `shard_stats` (the columns' amaxes
        over all shards). `global_stats` / `cut`: `x2d` is a tensor-parallel piece cut along `cut` and
        `global_stats` its MAX-reduced `piece_stats` (the amaxes along the cut dim)."""
        m, k = x2d.shape
        rows = cols = None
        if stats is not None:
            cols = stats.reshape(-1)
        if global_stats is not None:
            if cut not in CUTS:
                raise ValueError(f"{self.describe()}: statistics of a piece need the dim it is cut along "
                                 f"(cut='M' or 'K', see piece_stats), got cut={cut!r}")
            if cut == Cut.COLUMNS:
                rows = global_stats.reshape(-1)
            else:
                cols = global_stats.reshape(-1)
        row = col = None
        if rowwise:
            data, s_inv = self._cast(x2d, row_amax(x2d) if rows is None else rows)
            row = Float8RowwisePart(rows=m, cols=k, columnwise=False, data=data, scale_inv=s_inv)
        if columnwise:
            xt = x2d.t()
            data, s_inv = self._cast(xt, row_amax(xt) if cols is None else cols)
            col = Float8RowwisePart(rows=k, cols=m, columnwise=True, data=data.contiguous(), scale_inv=s_inv)
        return row, col

    # -- statistics per axis (FSDP2 row shards, tensor-parallel pieces) -------------------------
    def shard_stats(self, x2d, shard):
        """The shard's amax of every column `[K]` (the columnwise scales span all rows; the rowwise ones are the
        shard's own)."""
        return row_amax(x2d.t())

    def shard_is_plain(self, shard, rowwise, columnwise):
        return not columnwise or shard.is_whole

    def piece_stats(self, x2d, rowwise, columnwise, cut):
        """A column piece (cut along K) shares its rows' amaxes `[M]` (rowwise scales); a row piece (cut along M)
        its columns' amaxes `[K]` (columnwise scales); the other axis is the piece's own."""
        if cut == Cut.COLUMNS:
            return row_amax(x2d) if rowwise else None
        return row_amax(x2d.t()) if columnwise else None

    def quantize_piece(self, x2d, rowwise, columnwise, stats, cut):
        kw = {} if stats is None else {"global_stats": stats, "cut": cut}
        return self.quantize_parts(x2d, rowwise, columnwise, **kw)

    stats_per_axis = True

    def fragment_block(self, m, k, rowwise, columnwise):
        """A rowwise scale covers its whole row (1 x K), a columnwise one its whole column (M x 1)."""
        return (1 if rowwise and not columnwise else max(m, 1)), (1 if columnwise and not rowwise else max(k, 1))

    def quantize_axes(self, x2d, rowwise, columnwise, row_stats, col_stats):
        return self.reference_parts(x2d, rowwise, columnwise, stats=col_stats, global_stats=row_stats,
                                    cut=None if row_stats is None else Cut.COLUMNS)

    def global_stats(self, x2d, rowwise, columnwise):
        # No per-tensor statistic: what spans pieces are per-axis amaxes, which a caller that does not say the cut
        # dim (piece_stats) would combine across different rows or columns: refuse rather than quantize wrongly.
        raise NotImplementedError(
            f"{self.describe()}: its statistics are per row and per column, not per tensor; this path combines "
            f"per-tensor statistics only (piece_stats takes the cut dim)")


@declare_preset("fp8_rowwise", "FP8 E4M3, one power-of-two scale per row along K for input, weight and gradients "
                               "(torchao's rowwise recipe)")
def fp8_rowwise(role) -> Quantizer:
    """torchao's Float8LinearRecipeName.ROWWISE: axiswise E4M3 casts of input, weight and grad_output (each operand
    scaled along the GEMM's contracted dim), scales rounded down to powers of two."""
    return Float8RowwiseQuantizer()


Float8RowwisePart.quantizer_type = Float8RowwiseQuantizer
