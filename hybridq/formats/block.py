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

from ._sharding import RowShard, owned_rows
from .base import QuantizedPart, Quantizer, transposed_copy
from .shardable import GatherablePart, ShardableQuantizer


def tile_scale_columnwise(tile_scale: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-row scales of the columnwise (transposed) form from the `[M/tile, K/tile]` tile-scale grid."""
    return tile_scale.t().repeat_interleave(tile, dim=0).contiguous()


class BlockScaledPart(GatherablePart, QuantizedPart):
    """A part with per-block scales in the field `scale_field` (`[rows, cols/block]`, compact)."""

    block: ClassVar[int]
    scale_field: ClassVar[str] = "scale"

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
        return {"tile_rows": self.block} if (self.tiled and direction == "rowwise") else {}

    def split_granularity(self, rowwise, columnwise):
        b = self.block
        return (b if (columnwise or self.tiled) else 1), (b if (rowwise or self.tiled) else 1)
