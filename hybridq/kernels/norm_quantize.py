"""The formats a norm's CUDA kernel can write the rowwise part of, in the same pass as the norm
(`torch.ops.hybridq.norm_quantize_forward`, csrc/rms_norm.cu): block formats with 1-D blocks along K, each row's
blocks being in the kernel already -- FP8 block 1x128 and MXFP8 1x32. Per-tensor formats need the tensor-wide
max|y| first and NVFP4's block scales its tensor-wide amax: for those the norm hands over max|y| instead
(hybridq.nn.known_amax). The part the kernel writes is bitwise the one that format's own quantize makes of y."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..enums import ColumnwiseSource
from ..formats import Float8BlockPart, Float8BlockQuantizer, HybridQuantizer, MXFP8Part, MXFP8Quantizer
from ..formats.base import QuantizedPart, Quantizer, option_names
from . import cuda_fp8_block, cuda_mxfp8


class RowBlocks(NamedTuple):
    """What the fused kernel needs of a row quantizer: its block along K, fp8 dtype, amax epsilon and power-of-two
    rule (the last two: FP8 block only)."""

    block: int
    dtype: torch.dtype
    amax_eps: float
    pow2: bool


def _options_ok(q: Quantizer, options: frozenset) -> bool:
    return option_names(type(q)) <= options


def row_blocks(q: Quantizer) -> RowBlocks | None:
    """The kernel arguments of a plain quantizer whose rowwise part the fused kernel writes, or None."""
    if type(q) is Float8BlockQuantizer and q.block_dim == 1 and _options_ok(q, cuda_fp8_block.OPTIONS):
        return RowBlocks(128, q.dtype, float(q.amax_epsilon), bool(q.power_2_scale))
    if type(q) is MXFP8Quantizer and not q.block_2d and _options_ok(q, cuda_mxfp8.OPTIONS):
        return RowBlocks(32, q.dtype, 0.0, False)
    return None


def fusable_row_quantizer(q: Quantizer) -> Quantizer | None:
    """The plain quantizer that makes `q`'s rowwise part when a norm can write that part (`row_blocks`) and `q`'s
    columnwise part does not depend on it (a hybrid quantizing its columnwise form from the dequantized rowwise one
    does); None otherwise."""
    if isinstance(q, HybridQuantizer):
        if q.columnwise_source != ColumnwiseSource.ORIGINAL:
            return None
        q = q.rowwise
    return q if row_blocks(q) is not None and q.is_deterministic else None


def kernel_takes(x2d: torch.Tensor, q: Quantizer) -> bool:
    """Whether the fused kernel writes `q`'s rowwise part of the norm of the CUDA tensor `x2d` (`[M, K]`, contiguous,
    16-byte aligned, K a whole number of blocks); else the norm runs alone and the Linear quantizes y itself."""
    rb = row_blocks(q)
    return (rb is not None and x2d.shape[0] > 0 and x2d.shape[1] % rb.block == 0 and x2d.data_ptr() % 16 == 0
            and q.shape_rule(x2d.shape[0], x2d.shape[1], True, False) is None)


def row_part(q: Quantizer, data: torch.Tensor, scale: torch.Tensor) -> QuantizedPart:
    """The rowwise part of `q` from the fused kernel's outputs (data `[M, K]` fp8, scales `[M, K / block]`)."""
    m, k = data.shape
    if isinstance(q, Float8BlockQuantizer):
        return Float8BlockPart(rows=m, cols=k, columnwise=False, data=data, scale_inv=scale, block_dim=1)
    return MXFP8Part(rows=m, cols=k, columnwise=False, data=data, scale=scale)
