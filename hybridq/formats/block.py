"""What the block-scaled formats (FP8 1x128 / 128x128, MXFP8, NVFP4) have in common.

A block-scaled part stores its values `[rows, cols]` with one scale per `block` consecutive elements along the
contracted dim (a 2-D tile's scale repeated on each of the tile's rows). Under FSDP2 the values travel in the
original row order, and the scales as the block rows each shard owns (docs/numerics.md "Terms"); 2-D tiles send
one scale row per tile row (`tile_rows`). The formats differ in how their values are packed (fp8 bytes, E2M1
nibble pairs) and in what every shard holds identically (a global amax): `data_in_row_order`,
`data_from_row_order` and `replicated` say that.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..enums import ROWWISE
from ._sharding import RowShard, owned_rows
from .base import QuantizedPart, Quantizer, ScaleLayout, transposed_copy
from .shardable import GatherablePart, ShardableQuantizer


def tile_scale_columnwise(tile_scale: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-row scales of the columnwise (transposed) form from the `[M/tile, K/tile]` tile-scale grid."""
    return tile_scale.t().repeat_interleave(tile, dim=0).contiguous()


class BlockScaledPart(GatherablePart, QuantizedPart):
    """A part with per-block scales in the field `scale_field` (`[rows, cols/block]`, compact)."""

    block: ClassVar[int]
    scale_layout = ScaleLayout.BLOCK
    scale_field: ClassVar[str] = "scale"
    partial_blocks: ClassVar[bool] = False  # an edge block may hold fewer than `block` elements (FP8 blocks)
    values_per_byte: ClassVar[int] = 1  # values packed in one byte of `data` (NVFP4: two E2M1 codes)

    def element_values(self) -> torch.Tensor:
        return self.data.view(torch.uint8)  # (fp8 bytes; NVFP4 unpacks its nibbles)

    @property
    def block_shape(self) -> tuple[int, int]:
        return 1, self.block  # (a 2-D tile's scale is stored on each of its rows)

    @property
    def scales(self) -> torch.Tensor:
        return getattr(self, self.scale_field)

    def row_slice(self, start: int, stop: int, group: int | None = None) -> "BlockScaledPart":
        """Rows `[start, stop)` of the `[M, K]` tensor this part quantizes, as a part of its own: stored rows of a
        rowwise part (views of its tensors), stored columns of a columnwise part (a contiguous copy, which the
        GEMMs need: a memcpy, not a quantization). Tensors every row shares (a global amax) are kept; a part of
        row groups that holds such a statistic per group (`Quantizer.quantize_groups`, NVFP4) gives group
        `group`'s (see `group_tensors`).

        Where blocks run along M (a columnwise part; 2-D tiles) `start` must be a block boundary, and so must
        `stop` unless it ends the tensor or the format has partial edge blocks. The slice is then what quantizing
        those rows alone gives (for formats whose scales depend on their own block only, see
        `Quantizer.local_scaling`), provided a partial last block's remaining rows up to the boundary are zero."""
        per_group = self.group_tensors(group)
        if self.columnwise:
            self._check_row_slice(start, stop, self.block)
            s = getattr(self, self.scale_field)[:, start // self.block:-(-stop // self.block)].contiguous()
            v = self.values_per_byte
            data = self.data[:, start // v:-(-stop // v)].contiguous()
            return self._sliced(self.rows, stop - start, data, s, per_group)
        self._check_row_slice(start, stop, 1)
        return self._sliced(stop - start, self.cols, self.data[start:stop],
                            getattr(self, self.scale_field)[start:stop], per_group)

    def group_tensors(self, group: int | None) -> dict[str, torch.Tensor]:
        """The tensors of row group `group` that replace the part's own in a row slice: none for formats whose
        statistics are all per block (NVFP4 overrides it: a part of row groups holds one global amax per group)."""
        return {}

    def _check_row_slice(self, start: int, stop: int, block: int) -> None:
        m = self.cols if self.columnwise else self.rows
        if not 0 <= start <= stop <= m:
            raise ValueError(f"{self!r}: row slice [{start}, {stop}) is outside its {m} rows")
        if start % block or (stop % block and stop != m and not self.partial_blocks):
            raise ValueError(f"{self!r}: row slice [{start}, {stop}) would cut a {self.direction} scaling block of "
                             f"{block} rows (start{'' if self.partial_blocks else ' and stop'} must be a multiple "
                             f"of {block})")

    def _sliced(self, rows: int, cols: int, data: torch.Tensor, scale: torch.Tensor,
                per_group: dict[str, torch.Tensor]) -> "BlockScaledPart":
        fields = {**self.tensors(), "data": data, self.scale_field: scale, **per_group}
        return type(self)(rows=rows, cols=cols, columnwise=self.columnwise, **fields, **self.meta())

    def data_in_row_order(self) -> torch.Tensor:
        """The values as the `[M, K]` (rowwise-ordered) buffer that concatenates over row shards."""
        return transposed_copy(self.data) if self.columnwise else self.data

    @classmethod
    def data_from_row_order(cls, data: torch.Tensor, columnwise: bool) -> torch.Tensor:
        """Inverse of `data_in_row_order` for the gathered full tensor."""
        return transposed_copy(data) if columnwise else data

    def replicated(self) -> dict[str, torch.Tensor]:
        """Tensors every shard holds identically (not gathered)."""
        return {}

    # The buffer protocol: rowwise scales are per row (or, with `tile_rows`, one row per tile row); columnwise
    # scales per `block`-row block, sent by the shard owning the block's first row.
    def extract_buffers(self, shard=None, *, tile_rows=None):
        shard = shard if shard is not None else RowShard.whole(self.cols if self.columnwise else self.rows)
        scale = getattr(self, self.scale_field)
        if self.columnwise:
            scale, row_block = owned_rows(scale.t(), shard, self.block).contiguous(), self.block
        elif tile_rows:
            first = shard.owned(tile_rows)[0] * tile_rows - shard.offset
            scale, row_block = scale[first::tile_rows][:shard.owned_count(tile_rows)].contiguous(), tile_rows
        else:
            row_block = 1
        return [("data", self.data_in_row_order(), 1), (self.scale_field, scale, row_block)], self.replicated()

    @classmethod
    def assign_gathered(cls, buffers, replicated, *, rows, cols, columnwise, meta, tile_rows=None):
        scale = buffers[cls.scale_field]
        if columnwise:
            scale = transposed_copy(scale)
        elif tile_rows:
            scale = scale.repeat_interleave(tile_rows, dim=0)[:rows]
        return cls(rows=rows, cols=cols, columnwise=columnwise,
                   data=cls.data_from_row_order(buffers["data"], columnwise),
                   **{cls.scale_field: scale}, **replicated, **meta)


class BlockScaledQuantizer(ShardableQuantizer, Quantizer):
    """A quantizer of `block`-element blocks along the scaled dim (K rowwise, M columnwise), optionally 2-D
    `block x block` tiles (`block_2d`). With `whole_blocks`, a tensor must be made of whole blocks in every
    direction it is quantized in (MXFP8, NVFP4); otherwise edge blocks are partial (FP8 blocks)."""

    block: ClassVar[int]
    whole_blocks: ClassVar[bool] = True
    global_statistic: ClassVar[bool] = False  # a statistic of the whole tensor (NVFP4's global amax) sets scales

    @property
    def local_scaling(self) -> bool:
        return not self.global_statistic and self.is_deterministic

    @property
    def tiled(self) -> bool:
        """True for 2-D tiles (one scale per `block x block` tile, shared by both directions)."""
        return bool(getattr(self, "block_2d", False))

    def shape_rule(self, m, k, rowwise, columnwise):
        if not self.whole_blocks:
            return None
        b = self.block
        if (rowwise or self.tiled) and k % b:
            return f"needs K % {b} == 0, got K={k}"
        if (columnwise or self.tiled) and m % b:
            return f"needs M % {b} == 0 (M = prod(shape[:-1])), got M={m}"
        return None

    def buffer_hints(self, direction):
        return {"tile_rows": self.block} if (self.tiled and direction == ROWWISE) else {}

    def split_granularity(self, rowwise, columnwise):
        b = self.block
        return (b if (columnwise or self.tiled) else 1), (b if (rowwise or self.tiled) else 1)
