"""Float8 block scaling (docs/numerics.md "Float8 block scaling"): 1x128 blocks for activations and gradients,
128x128 tiles for weights, power-of-two scales by default. Edge blocks are partial."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ._numerics import (FP8_MAX, FP8_NAMES, block_amax, expand_blocks, expand_tiles, fp8_dtype, rcp,
                        satfinite_fp8, scale_from_amax, tile_amax)
from ._sharding import StatsLayout, col_block_amax, cut_stats, expand_rows, full_col_block_amax, tile_amax_rows
from .base import transposed_copies_into, transposed_copy, transposed_copy_into
from .float8_groups import transpose_groups
from .block import BlockScaledPart, BlockScaledQuantizer

BLOCK = 128


class Float8BlockPart(BlockScaledPart):
    """data: fp8 `[rows, cols]`. scale_inv: fp32 `[rows, ceil(cols/128)]` for 1-D blocks, or
    `[ceil(rows/128), ceil(cols/128)]` for 128x128 tiles (block_dim == 2)."""

    format_name = "FP8-block"
    tensor_fields = ("data", "scale_inv")
    meta_fields = ("block_dim",)
    block = BLOCK
    scale_field = "scale_inv"
    scale_dtype = torch.float32
    partial_blocks = True

    @property
    def block_shape(self) -> tuple[int, int]:
        return (BLOCK, BLOCK) if self.block_dim == 2 else (1, BLOCK)

    def row_slice(self, start: int, stop: int, group: int | None = None) -> "Float8BlockPart":
        """As `BlockScaledPart.row_slice`; 128x128 tiles keep the rows of the tile grid the slice covers (`start`
        on a tile boundary in both directions). Every statistic is per block: `group` changes nothing."""
        if self.block_dim != 2:
            return super().row_slice(start, stop, group)
        self._check_row_slice(start, stop, BLOCK)
        tiles = slice(start // BLOCK, -(-stop // BLOCK))
        if self.columnwise:
            return self._sliced(self.rows, stop - start, self.data[:, start:stop].contiguous(),
                                self.scale_inv[:, tiles].contiguous(), {})
        return self._sliced(stop - start, self.cols, self.data[start:stop], self.scale_inv[tiles], {})

    def scale_inv_per_element(self) -> torch.Tensor:
        if self.block_dim == 2:
            return expand_tiles(self.scale_inv, BLOCK, self.rows, self.cols)
        return expand_blocks(self.scale_inv, BLOCK, self.cols)

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        return self.data.float() * self.scale_inv_per_element()

    def element_scales(self) -> torch.Tensor:
        return self.scale_inv_per_element()

    # FSDP buffer protocol: 128x128 tiles replicate their tile scales (sharded quantization all-reduces the
    # whole tile-amax grid, so every shard holds every tile scale) and send only the data; 1-D blocks send
    # their scales as every block-scaled part does.
    def extract_buffers(self, shard=None, *, tile_rows=None):
        if self.block_dim == 2:
            return [("data", self.data_in_row_order(), 1)], {"scale_inv": self.scale_inv}
        return super().extract_buffers(shard, tile_rows=tile_rows)

    @classmethod
    def assign_gathered(cls, buffers, replicated, *, rows, cols, columnwise, meta, tile_rows=None):
        if meta["block_dim"] == 2:  # the replicated tile scales are already in this direction's orientation
            return cls(rows=rows, cols=cols, columnwise=columnwise,
                       data=cls.data_from_row_order(buffers["data"], columnwise),
                       scale_inv=replicated["scale_inv"], **meta)
        return super().assign_gathered(buffers, replicated, rows=rows, cols=cols, columnwise=columnwise, meta=meta,
                                       tile_rows=tile_rows)


def float8_block_current(x2d: torch.Tensor, dtype: torch.dtype, block_dim: int, amax_epsilon: float,
                         power_2_scale: bool, rowwise: bool, columnwise: bool
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """FP8 block scaling of a whole tensor on plain tensors, the reference: (rowwise data, its scale_inv, columnwise
    data, its scale_inv), None for a direction not asked for. 1x128 blocks (block_dim 1: the columnwise form has its
    own 128x1 blocks) or 128x128 tiles shared by both directions (block_dim 2)."""
    def scale_of(amax):
        return scale_from_amax(amax, FP8_MAX[dtype], amax_epsilon, power_2_scale)

    if block_dim == 1:
        def blocks(t):
            scale = scale_of(block_amax(t, BLOCK))
            return satfinite_fp8(t.float() * expand_blocks(scale, BLOCK, t.shape[1]), dtype), rcp(scale)

        row, rs = blocks(x2d) if rowwise else (None, None)
        # (the transposed operand made contiguous: a part is contiguous wherever it is made, base.QuantizedPart)
        col, cs = blocks(x2d.t().contiguous()) if columnwise else (None, None)
        return row, rs, col, cs
    m, k = x2d.shape
    scale = scale_of(tile_amax(x2d, BLOCK))
    q = satfinite_fp8(x2d.float() * expand_tiles(scale, BLOCK, m, k), dtype)
    s_inv = rcp(scale)
    col, cs = (q.t().contiguous(), s_inv.t().contiguous()) if columnwise else (None, None)
    return (q, s_inv, col, cs) if rowwise else (None, None, col, cs)


@dataclasses.dataclass
class Float8BlockQuantizer(BlockScaledQuantizer):
    """block_dim=1: 1x128 rowwise / 128x1 columnwise (activations, gradients);
    block_dim=2: 128x128 tiles shared by both directions (weights; columnwise = transpose of rowwise)."""

    fp8: str | torch.dtype = "e4m3"
    block_dim: int = 1
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    format_name: ClassVar[str] = "FP8-block"
    block: ClassVar[int] = BLOCK
    whole_blocks: ClassVar[bool] = False  # edge blocks are partial

    def split_granularity(self, rowwise, columnwise):
        if self.block_dim == 2:  # 128x128 tiles (the partial edge tiles lie at the tensor's end)
            return BLOCK, BLOCK
        return super().split_granularity(rowwise, columnwise)

    def __post_init__(self):
        self.dtype = fp8_dtype(self.fp8)
        if self.block_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer block_dim must be 1 (1x128) or 2 (128x128), "
                             f"got {self.block_dim}")

    def describe(self) -> str:
        shape = "128x128" if self.block_dim == 2 else "1x128"
        return f"FP8-block {FP8_NAMES[self.dtype]} {shape}"

    @property
    def round_trip_bound(self) -> float:
        return 0.030 if self.dtype == torch.float8_e4m3fn else 0.060

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        def one(r, c):  # fp8 values + fp32 scales: one per 1x128 block, or one per 128x128 tile
            return r * c + 4 * (-(-r // BLOCK) if self.block_dim == 2 else r) * -(-c // BLOCK)
        return rowwise * one(m, k) + columnwise * one(k, m)

    @property
    def columnwise_is_transpose(self) -> bool:
        return self.block_dim == 2

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(amax, FP8_MAX[self.dtype], self.amax_epsilon, self.power_2_scale)

    def _quantize_1d(self, x2d: torch.Tensor, columnwise: bool) -> Float8BlockPart:
        m, k = x2d.shape
        q, s_inv, _, _ = float8_block_current(x2d, self.dtype, 1, self.amax_epsilon, self.power_2_scale, True, False)
        return Float8BlockPart(rows=m, cols=k, columnwise=columnwise, data=q, scale_inv=s_inv, block_dim=1)

    def reference_parts(self, x2d, rowwise, columnwise, *, shard=None, stats=None):
        """`shard` / `stats`: quantize the row shard `x2d` with the MAX-reduced `shard_stats` (see _sharding)."""
        if shard is not None and not shard.is_whole:
            return self._shard_parts(x2d, rowwise, columnwise, shard, stats)
        m, k = x2d.shape
        row, rs, col, cs = float8_block_current(x2d, self.dtype, self.block_dim, self.amax_epsilon,
                                                self.power_2_scale, rowwise, columnwise)
        bd = self.block_dim
        return (Float8BlockPart(rows=m, cols=k, columnwise=False, data=row, scale_inv=rs, block_dim=bd)
                if rowwise else None,
                Float8BlockPart(rows=k, cols=m, columnwise=True, data=col, scale_inv=cs, block_dim=bd)
                if columnwise else None)

    # -- sharded quantization (FSDP) -------------------------------------------------------------
    def _stats_layout(self, shard, k: int) -> StatsLayout:
        if self.block_dim == 2:  # the whole tile-amax grid (small: one value per 16384 elements)
            return StatsLayout(("tiles", (-(-shard.rows // BLOCK), -(-k // BLOCK))))
        return StatsLayout(("cut", (len(shard.cut_blocks(BLOCK)), k)))

    def shard_stats(self, x2d, shard):
        """128x128 tiles: this shard's partial amax of every tile it touches, 0 elsewhere (the reduced grid
        gives every shard every tile scale, so tile scales need not be gathered). 1-D: partial amaxes of the
        128x1 columnwise blocks that shard boundaries split (rowwise 1x128 blocks never straddle)."""
        layout = self._stats_layout(shard, x2d.shape[1])
        if not layout.pieces:
            return None
        if self.block_dim == 2:
            grid = x2d.new_zeros(layout.pieces[0][1], dtype=torch.float32)
            first, end = shard.touched(BLOCK)
            grid[first:end] = tile_amax_rows(x2d, shard, BLOCK)
            return layout.pack({"tiles": grid}, x2d.device)
        return layout.pack({"cut": cut_stats(col_block_amax(x2d, shard, BLOCK), shard, BLOCK)}, x2d.device)

    def tiles_inside(self, shard) -> bool:
        """128x128 tiles and no tile split by the shard's boundaries: each tile's amax is then the shard's own, so
        plainly quantizing the shard's rows gives their data; only the part's scale grid (every tile's, see
        `shard_scale_inv`) comes from the reduced statistics. What a device kernel can take."""
        return self.block_dim == 2 and not shard.cut_blocks(BLOCK)

    def shard_scale_inv(self, shard, k: int, stats) -> torch.Tensor:
        """128x128 tiles: the whole grid of tile scale_inv from the MAX-reduced `stats` (the scale_inv a shard part
        carries)."""
        return self.tile_scale_inv(self._stats_layout(shard, k).unpack(stats)["tiles"])

    def tile_scale_inv(self, tile_amax: torch.Tensor) -> torch.Tensor:
        """The scale_inv of tiles whose max|x| is `tile_amax` (any shape; elementwise: the grids of several weights
        concatenated give each weight's, bitwise -- the FSDP2 unit cast computes a unit's grids at once)."""
        return rcp(self._scale(tile_amax))

    def _shard_parts(self, x2d, rowwise, columnwise, shard, stats):
        st = self._stats_layout(shard, x2d.shape[1]).unpack(stats)
        l, k = x2d.shape
        if self.block_dim == 1:
            row = self._quantize_1d(x2d, False) if rowwise else None
            col = None
            if columnwise:
                amax = full_col_block_amax(x2d, shard, BLOCK, st)
                scale = self._scale(amax)  # [n_touched, K]
                q = satfinite_fp8(x2d.float() * expand_rows(scale, shard, BLOCK), self.dtype)
                col = Float8BlockPart(rows=k, cols=l, columnwise=True, data=q.t().contiguous(),
                                      scale_inv=rcp(scale).t().contiguous(), block_dim=1)
            return row, col
        scale = self._scale(st["tiles"].to(x2d.device))  # [ceil(M/128), ceil(K/128)], the whole grid
        first, end = shard.touched(BLOCK)
        q = satfinite_fp8(x2d.float() * expand_blocks(expand_rows(scale[first:end], shard, BLOCK), BLOCK, k),
                          self.dtype)
        s_inv = rcp(scale)  # a shard part of 128x128 tiles carries every tile's scale
        row = Float8BlockPart(rows=l, cols=k, columnwise=False, data=q, scale_inv=s_inv, block_dim=2)
        col = Float8BlockPart(rows=k, cols=l, columnwise=True, data=q.t().contiguous(),
                              scale_inv=s_inv.t().contiguous(), block_dim=2) if columnwise else None
        return (row if rowwise else None), col

    def derive_part(self, part, direction, dtype=None):
        """128x128 tiles are shared by both directions: each is the exact transpose of the other."""
        if self.block_dim != 2 or part.direction == direction:
            return None
        return Float8BlockPart(rows=part.cols, cols=part.rows, columnwise=not part.columnwise,
                               data=transposed_copy(part.data), scale_inv=part.scale_inv.t().contiguous(),
                               block_dim=2)

    def derive_part_into(self, part, into, dtype=None):
        """`derive_part` into `into`'s own buffers: the data's byte transpose and the tile-scale grid's transpose."""
        if self.block_dim != 2 or part.direction == into.direction or into.block_dim != 2:
            return False
        want = tuple(reversed(part.scale_inv.shape))
        if tuple(into.scale_inv.shape) != want:
            raise ValueError(f"{self.describe()}: the {into.direction} part's tile scales "
                             f"{tuple(into.scale_inv.shape)} are not the transpose {want} of the {part.direction} one's")
        transposed_copy_into(part.data, into.data)
        into.scale_inv.copy_(part.scale_inv.t())
        return True

    def derive_parts_into(self, items, dtype=None) -> bool:
        """`derive_part_into(part, into)` for every `(q, part, into)` of `items` (each `q` a 128x128-tile quantizer of
        this type: several weights' parts, [Note: unit fill], distributed/unit_fill.py), every item checked before any
        is written: the byte transposes in one call of the device's list transpose, the tile-scale grids' transposes
        in one `_foreach_copy_`. False, nothing written, where an item is not so derived (its own `derive_part_into`
        then declines it or raises)."""
        for q, part, into in items:
            if type(q) is not type(self) or q.block_dim != 2 or part.direction == into.direction \
                    or into.block_dim != 2 or tuple(into.scale_inv.shape) != tuple(reversed(part.scale_inv.shape)):
                return False
        transposed_copies_into([(part.data, into.data) for _, part, into in items])
        torch._foreach_copy_([into.scale_inv for _, _, into in items], [part.scale_inv.t() for _, part, _ in items])
        return True

    def derive_experts_into(self, rows, cols, dtype=None):
        """`derive_part_into` of every expert at once: the experts' data byte-transposed in one launch of the
        device's tiled transpose (`float8_groups.transpose_groups`; a strided copy on the CPU) and their tile-scale
        grids transposed in one copy."""
        if self.block_dim != 2 or set(rows) != {"data", "scale_inv"} or set(cols) != {"data", "scale_inv"}:
            return False
        for name, want in (("data", rows["data"]), ("scale_inv", rows["scale_inv"])):
            got = cols[name]
            if want.dim() != 3 or tuple(got.shape) != (want.shape[0], want.shape[2], want.shape[1]) \
                    or got.dtype != want.dtype:
                raise ValueError(f"{self.describe()}: the experts' columnwise {name} {tuple(got.shape)} {got.dtype} "
                                 f"is not the per-expert transpose of the rowwise one's {tuple(want.shape)} "
                                 f"{want.dtype}")
        if rows["data"].element_size() != 1:
            raise ValueError(f"{self.describe()}: the experts' rowwise data is {rows['data'].dtype}, not 1-byte FP8")
        transpose_groups(rows["data"], cols["data"])
        cols["scale_inv"].copy_(rows["scale_inv"].transpose(1, 2))
        return True

    def shard_is_plain(self, shard, rowwise, columnwise):
        if self.block_dim == 2:
            return shard.is_whole  # the tile-scale grid is shared by every shard
        return not columnwise or shard.aligned(BLOCK)


Float8BlockPart.quantizer_type = Float8BlockQuantizer
