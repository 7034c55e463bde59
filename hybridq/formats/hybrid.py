"""Hybrid: the rowwise part from one quantizer and the columnwise part from another (FORMATS.md "Hybrid")."""

from __future__ import annotations

import torch

from .base import Quantizer

_SOURCES = ("original", "rowwise_dequantized")


class HybridQuantizer(Quantizer):
    """`HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer())`.

    Here `rowwise` / `columnwise` name the two quantizers; the usage flags are `rowwise_usage` /
    `columnwise_usage` (a new hybrid produces the rowwise form only, like every quantizer).
    columnwise_source="rowwise_dequantized" quantizes the columnwise form from the dequantized rowwise
    result ("double quantization") instead of from the original input.
    """

    format_name = "hybrid"

    def __init__(self, rowwise: Quantizer, columnwise: Quantizer, columnwise_source: str = "original", *,
                 rowwise_usage: bool = True, columnwise_usage: bool = False):
        for d, q in (("rowwise", rowwise), ("columnwise", columnwise)):
            if not isinstance(q, Quantizer) or isinstance(q, HybridQuantizer):
                raise TypeError(f"HybridQuantizer {d}= must be a plain hybridq quantizer, got {q!r}")
        if columnwise_source not in _SOURCES:
            raise ValueError(f"HybridQuantizer columnwise_source must be one of {_SOURCES}, "
                             f"got {columnwise_source!r}")
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.columnwise_source = columnwise_source
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
    def is_stateful(self) -> bool:
        return self.rowwise.is_stateful or self.columnwise.is_stateful

    def quantizers(self) -> tuple[Quantizer, ...]:
        return (self.rowwise, self.columnwise)

    def shape_rule(self, m, k, rowwise, columnwise):
        need_row = rowwise or (columnwise and self.columnwise_source == "rowwise_dequantized")
        return ((self.rowwise.shape_rule(m, k, True, False) if need_row else None)
                or (self.columnwise.shape_rule(m, k, False, True) if columnwise else None))

    def quantize_parts(self, x2d, rowwise, columnwise):
        double = columnwise and self.columnwise_source == "rowwise_dequantized"
        row = self.rowwise.quantize_parts(x2d, True, False)[0] if (rowwise or double) else None
        col = None
        if columnwise:
            src = row.dequantize_2d().to(x2d.dtype) if double else x2d
            col = self.columnwise.quantize_parts(src, False, True)[1]
        return (row if rowwise else None), col
