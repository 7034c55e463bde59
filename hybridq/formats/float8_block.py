"""Float8 block scaling (FORMATS.md "Float8 block scaling"): 1x128 blocks for activations and gradients,
128x128 tiles for weights, power-of-two scales by default. Edge blocks are partial."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ._numerics import (FP8_MAX, FP8_NAMES, block_amax, expand_blocks, expand_tiles, fp8_dtype, rcp,
                        satfinite_fp8, scale_from_amax, tile_amax)
from .base import QuantizedPart, Quantizer

BLOCK = 128


class Float8BlockPart(QuantizedPart):
    """data: fp8 `[rows, cols]`. scale_inv: fp32 `[rows, ceil(cols/128)]` for 1-D blocks, or
    `[ceil(rows/128), ceil(cols/128)]` for 128x128 tiles (block_dim == 2)."""

    format_name = "FP8-block"
    tensor_fields = ("data", "scale_inv")
    meta_fields = ("block_dim",)

    def scale_inv_per_element(self) -> torch.Tensor:
        if self.block_dim == 2:
            return expand_tiles(self.scale_inv, BLOCK, self.rows, self.cols)
        return expand_blocks(self.scale_inv, BLOCK, self.cols)

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        return self.data.float() * self.scale_inv_per_element()


@dataclasses.dataclass
class Float8BlockQuantizer(Quantizer):
    """block_dim=1: 1x128 rowwise / 128x1 columnwise (activations, gradients);
    block_dim=2: 128x128 tiles shared by both directions (weights; columnwise = transpose of rowwise)."""

    fp8: str | torch.dtype = "e4m3"
    block_dim: int = 1
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    format_name: ClassVar[str] = "FP8-block"

    def __post_init__(self):
        self.dtype = fp8_dtype(self.fp8)
        if self.block_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer block_dim must be 1 (1x128) or 2 (128x128), "
                             f"got {self.block_dim}")

    def describe(self) -> str:
        shape = "128x128" if self.block_dim == 2 else "1x128"
        return f"FP8-block {FP8_NAMES[self.dtype]} {shape}"

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(amax, FP8_MAX[self.dtype], self.amax_epsilon, self.power_2_scale)

    def _quantize_1d(self, x2d: torch.Tensor, columnwise: bool) -> Float8BlockPart:
        m, k = x2d.shape
        scale = self._scale(block_amax(x2d, BLOCK))
        q = satfinite_fp8(x2d.float() * expand_blocks(scale, BLOCK, k), self.dtype)
        return Float8BlockPart(rows=m, cols=k, columnwise=columnwise, data=q, scale_inv=rcp(scale), block_dim=1)

    def reference_parts(self, x2d, rowwise, columnwise):
        if self.block_dim == 1:
            row = self._quantize_1d(x2d, False) if rowwise else None
            col = self._quantize_1d(x2d.t(), True) if columnwise else None
            return row, col
        m, k = x2d.shape
        scale = self._scale(tile_amax(x2d, BLOCK))
        q = satfinite_fp8(x2d.float() * expand_tiles(scale, BLOCK, m, k), self.dtype)
        s_inv = rcp(scale)
        row = Float8BlockPart(rows=m, cols=k, columnwise=False, data=q, scale_inv=s_inv, block_dim=2)
        col = Float8BlockPart(rows=k, cols=m, columnwise=True, data=q.t().contiguous(),
                              scale_inv=s_inv.t().contiguous(), block_dim=2) if columnwise else None
        return (row if rowwise else None), col
