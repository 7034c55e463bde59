"""MXFP8 (docs/numerics.md "MXFP8"): blocks of 32 with one E8M0 scale byte each; optional 32x32 weight tiles."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ._numerics import (FP8_MAX, FP8_NAMES, block_amax, e8m0_round_up, e8m0_to_pow2, expand_blocks, fp8_dtype,
                        rcp, satfinite_fp8, tile_amax)
from ._sharding import (StatsLayout, col_block_amax, cut_stats, expand_rows, full_col_block_amax, merge_cut,
                        tile_amax_rows)
from .block import BlockScaledPart, BlockScaledQuantizer, tile_scale_columnwise

BLOCK = 32


def swizzle_mx_scales(scale: torch.Tensor) -> torch.Tensor:
    """GEMM-ready layout of compact `[rows, cols]` block scales: pad to 128 x 4 tiles, then within each tile
    scale (r, c) goes to offset (r % 32) * 16 + (r // 32) * 4 + c; tiles laid out tile-row-major.
    Padding bytes are 0. Returns a flat uint8 tensor of rows_padded * cols_padded bytes."""
    rows, cols = scale.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    s = torch.nn.functional.pad(scale.view(torch.uint8), (0, cp - cols, 0, rp - rows))
    # [tile_r, 4 (r // 32), 32 (r % 32), tile_c, 4 (c)] -> [tile_r, tile_c, r % 32, r // 32, c]
    s = s.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return s.contiguous().view(-1)


class MXFP8Part(BlockScaledPart):
    """data: fp8 `[rows, cols]`; scale: E8M0 bytes (uint8) `[rows, cols/32]` (a 32x32 tile's scale is repeated
    on each of its rows)."""

    format_name = "MXFP8"
    tensor_fields = ("data", "scale")
    block = BLOCK
    scale_dtype = torch.float8_e8m0fnu  # (stored as uint8 bytes)

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        return self.data.float() * expand_blocks(e8m0_to_pow2(self.scale), BLOCK, self.cols)

    def element_scales(self) -> torch.Tensor:
        return expand_blocks(e8m0_to_pow2(self.scale), BLOCK, self.cols)

    def swizzled_scale(self) -> torch.Tensor:
        return swizzle_mx_scales(self.scale)


@dataclasses.dataclass
class MXFP8Quantizer(BlockScaledQuantizer):
    """`MXFP8Quantizer()` is E4M3 with 1-D blocks (1x32 rowwise, 32x1 columnwise, both from the input);
    block_2d=True uses 32x32 tiles (weights), whose columnwise form is the transpose of the rowwise one."""

    fp8: str | torch.dtype = "e4m3"
    block_2d: bool = False

    format_name: ClassVar[str] = "MXFP8"
    block: ClassVar[int] = BLOCK

    def __post_init__(self):
        self.dtype = fp8_dtype(self.fp8)

    def describe(self) -> str:
        return f"MXFP8 {FP8_NAMES[self.dtype]}" + (" 32x32" if self.block_2d else "")

    @property
    def round_trip_bound(self) -> float:
        return 0.030 if self.dtype == torch.float8_e4m3fn else 0.060

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        return (rowwise + columnwise) * (m * k + m * k // BLOCK)  # fp8 values + one E8M0 byte per 32 (tiles: per row)

    @property
    def columnwise_is_transpose(self) -> bool:
        return self.block_2d

    def _exponent(self, amax: torch.Tensor) -> torch.Tensor:
        # a multiply by the rounded reciprocal of fp8_max, not a division (it matters at powers of two)
        return e8m0_round_up(amax * rcp(torch.tensor(FP8_MAX[self.dtype], device=amax.device)))

    def _encode(self, x2d: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        mult = expand_blocks(e8m0_to_pow2(e, negate=True), BLOCK, x2d.shape[1])
        return satfinite_fp8(x2d.float() * mult, self.dtype)

    def _part(self, x2d: torch.Tensor, columnwise: bool) -> MXFP8Part:
        e = self._exponent(block_amax(x2d, BLOCK))
        m, k = x2d.shape
        return MXFP8Part(rows=m, cols=k, columnwise=columnwise, data=self._encode(x2d, e), scale=e)

    def reference_parts(self, x2d, rowwise, columnwise, *, shard=None, stats=None):
        """`shard` / `stats`: quantize the row shard `x2d` with the MAX-reduced `shard_stats` (see _sharding)."""
        if shard is not None and not shard.is_whole:
            return self._shard_parts(x2d, rowwise, columnwise, shard, stats)
        if not self.block_2d:
            return (self._part(x2d, False) if rowwise else None,
                    self._part(x2d.t().contiguous(), True) if columnwise else None)  # parts are contiguous
        m, k = x2d.shape
        e_tile = self._exponent(tile_amax(x2d, BLOCK))  # [M/32, K/32]
        e_row = e_tile.repeat_interleave(BLOCK, dim=0)
        q = self._encode(x2d, e_row)
        row = MXFP8Part(rows=m, cols=k, columnwise=False, data=q, scale=e_row) if rowwise else None
        col = MXFP8Part(rows=k, cols=m, columnwise=True, data=q.t().contiguous(),
                        scale=tile_scale_columnwise(e_tile, BLOCK)) if columnwise else None
        return row, col

    # -- sharded quantization (FSDP) -------------------------------------------------------------
    def _stats_layout(self, shard, k: int) -> StatsLayout:
        width = k // BLOCK if self.block_2d else k
        return StatsLayout(("cut", (len(shard.cut_blocks(BLOCK)), width)))

    def shard_stats(self, x2d, shard):
        """Partial amaxes of the 32x32 tiles / 32x1 columnwise blocks that shard boundaries split."""
        layout = self._stats_layout(shard, x2d.shape[1])
        if not layout.pieces:
            return None
        local = (tile_amax_rows(x2d, shard, BLOCK) if self.block_2d else col_block_amax(x2d, shard, BLOCK))
        return layout.pack({"cut": cut_stats(local, shard, BLOCK)}, x2d.device)

    def _shard_parts(self, x2d, rowwise, columnwise, shard, stats):
        st = self._stats_layout(shard, x2d.shape[1]).unpack(stats)
        l, k = x2d.shape
        if not self.block_2d:
            row = self._part(x2d, False) if rowwise else None  # 1x32 blocks lie within a row
            col = None
            if columnwise:
                amax = full_col_block_amax(x2d, shard, BLOCK, st)
                e = self._exponent(amax)  # [n_touched, K]
                mult = e8m0_to_pow2(expand_rows(e, shard, BLOCK), negate=True)
                q = satfinite_fp8(x2d.float() * mult, self.dtype)
                col = MXFP8Part(rows=k, cols=l, columnwise=True, data=q.t().contiguous(), scale=e.t().contiguous())
            return row, col
        amax = tile_amax_rows(x2d, shard, BLOCK)
        if "cut" in st:
            amax = merge_cut(amax, shard, BLOCK, st["cut"])
        e_tile = self._exponent(amax)  # [n_touched, K/32]
        e_row = expand_rows(e_tile, shard, BLOCK)
        q = self._encode(x2d, e_row)
        row = MXFP8Part(rows=l, cols=k, columnwise=False, data=q, scale=e_row) if rowwise else None
        col = MXFP8Part(rows=k, cols=l, columnwise=True, data=q.t().contiguous(),
                        scale=tile_scale_columnwise(e_tile, BLOCK)) if columnwise else None
        return row, col

    def derive_part(self, part, direction, dtype=None):
        """32x32 tiles: the columnwise form is the exact transpose of the rowwise one (and back)."""
        if not self.block_2d or part.direction == direction:
            return None
        e_tile = part.scale[::BLOCK]  # one row per tile row of the stored orientation
        return MXFP8Part(rows=part.cols, cols=part.rows, columnwise=not part.columnwise,
                         data=part.data.t().contiguous(),
                         scale=tile_scale_columnwise(e_tile, BLOCK))

    def shard_is_plain(self, shard, rowwise, columnwise):
        return shard.aligned(BLOCK) if (self.block_2d or columnwise) else True


MXFP8Part.quantizer_type = MXFP8Quantizer
