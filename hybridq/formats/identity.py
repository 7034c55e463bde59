"""Identity: a high-precision passthrough (optionally cast to a dtype). One buffer serves both directions."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import QuantizedPart, Quantizer, ScaleLayout
from .shardable import GatherablePart, ShardableQuantizer


class IdentityPart(GatherablePart, QuantizedPart):
    """data: the `[M, K]` tensor itself; a columnwise part stands for data^T without copying it."""

    format_name = "identity"
    tensor_fields = ("data",)
    scale_layout = ScaleLayout.NONE

    def element_values(self) -> torch.Tensor:
        return self.data

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        # fp32 at least; a wider input (fp64) keeps its dtype so the passthrough stays exact
        d = self.data if self.data.dtype == torch.float64 else self.data.float()
        return d.t() if self.columnwise else d

    # FSDP buffer protocol: the [M, K] data is already in dim-0 order for both directions.
    def extract_buffers(self, shard=None, *, tile_rows=None):
        return [("data", self.data, 1)], {}

    @classmethod
    def assign_gathered(cls, buffers, replicated, *, rows, cols, columnwise, meta, tile_rows=None):
        return cls(rows=rows, cols=cols, columnwise=columnwise, data=buffers["data"])


@dataclasses.dataclass
class IdentityQuantizer(ShardableQuantizer, Quantizer):
    dtype: torch.dtype | None = None

    format_name: ClassVar[str] = "identity"

    def describe(self) -> str:
        return "identity" if self.dtype is None else f"identity ({self.dtype})"

    @property
    def round_trip_bound(self) -> float:
        """Exact, or one rounding to `dtype` (its root-mean-square error is ulp / sqrt(12), under a quarter ulp:
        2^-(mantissa bits + 2) relative)."""
        if self.dtype is None or self.dtype in (torch.float32, torch.float64):
            return 0.0
        return torch.finfo(self.dtype).eps / 4  # (eps = 2^-mantissa bits)

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        return (rowwise + columnwise) * m * k * (self.dtype or dtype).itemsize

    def reference_parts(self, x2d, rowwise, columnwise, *, shard=None, stats=None):
        data = x2d if self.dtype is None else x2d.to(self.dtype)
        m, k = x2d.shape
        row = IdentityPart(rows=m, cols=k, columnwise=False, data=data) if rowwise else None
        col = IdentityPart(rows=k, cols=m, columnwise=True, data=data) if columnwise else None
        return row, col

    def derive_part(self, part, direction, dtype=None):
        """Both directions are the same [M, K] buffer."""
        if part.direction == direction:
            return None
        return IdentityPart(rows=part.cols, cols=part.rows, columnwise=not part.columnwise, data=part.data)

    def shard_is_plain(self, shard, rowwise, columnwise):
        return True


IdentityPart.quantizer_type = IdentityQuantizer
