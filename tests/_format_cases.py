"""Shared format cases for the format tests (not a test module); the comparison helpers live in _compare.

Each case is a factory, so every test gets a fresh quantizer (delayed scaling and stochastic rounding
carry state).
"""

from __future__ import annotations

import torch

from hybridq.formats import (Float8BlockQuantizer, Float8Quantizer, HybridQuantizer, IdentityQuantizer,
                             MXFP8Quantizer, NVFP4Quantizer)
from hybridq.formats._numerics import expand_blocks, expand_tiles, unpack_nibbles

from _compare import assert_bitwise, assert_parts_bitwise, raw_bytes

FLT_MAX = torch.finfo(torch.float32).max
DIRECTIONS = ("rowwise", "columnwise")


def _sr(seed: int = 1234) -> NVFP4Quantizer:
    return NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(seed))


# id -> factory; every plain format and the options that change its numerics
FORMATS = {
    "fp8_e4m3": lambda: Float8Quantizer(),
    "fp8_e5m2": lambda: Float8Quantizer(fp8="e5m2"),
    "fp8_e4m3_pow2": lambda: Float8Quantizer(power_2_scale=True),
    "fp8_e5m2_pow2": lambda: Float8Quantizer(fp8="e5m2", power_2_scale=True),
    "fp8_e4m3_delayed": lambda: Float8Quantizer(scaling="delayed", amax_history_len=4),
    "fp8blk_1x128_e4m3": lambda: Float8BlockQuantizer(),
    "fp8blk_1x128_e5m2": lambda: Float8BlockQuantizer(fp8="e5m2"),
    "fp8blk_1x128_e4m3_nopow2": lambda: Float8BlockQuantizer(power_2_scale=False),
    "fp8blk_128x128_e4m3": lambda: Float8BlockQuantizer(block_dim=2),
    "mxfp8_e4m3": lambda: MXFP8Quantizer(),
    "mxfp8_e5m2": lambda: MXFP8Quantizer(fp8="e5m2"),
    "mxfp8_32x32_e4m3": lambda: MXFP8Quantizer(block_2d=True),
    "mxfp8_32x32_e5m2": lambda: MXFP8Quantizer(fp8="e5m2", block_2d=True),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_16x16": lambda: NVFP4Quantizer(block_2d=True),
    "nvfp4_rht": lambda: NVFP4Quantizer(rht=True),
    "nvfp4_sr": _sr,
    "identity": lambda: IdentityQuantizer(),
    "identity_bf16": lambda: IdentityQuantizer(dtype=torch.bfloat16),
}
# formats whose output does not depend on earlier calls
STATELESS = [k for k in FORMATS if k != "fp8_e4m3_delayed"]
# formats whose columnwise form is, by the contract, the exact transpose of the rowwise form
TRANSPOSED_2D = ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_pow2", "fp8_e5m2_pow2", "fp8_e4m3_delayed", "fp8blk_128x128_e4m3",
                 "mxfp8_32x32_e4m3", "mxfp8_32x32_e5m2", "nvfp4_16x16"]


def hybrid(rowwise: str, columnwise: str, **kw):
    """A factory of the hybrid of two FORMATS cases (by name)."""
    return lambda: HybridQuantizer(rowwise=FORMATS[rowwise](), columnwise=FORMATS[columnwise](), **kw)


def element_values(part) -> torch.Tensor:
    """The stored element values (before scaling) of a part as a 2-D tensor in stored orientation:
    fp8 data as bytes, NVFP4 as unpacked 4-bit codes, identity as the data."""
    name = type(part).__name__
    if name == "NVFP4Part":
        return unpack_nibbles(part.data)
    if name == "IdentityPart":
        return part.data
    return part.data.view(torch.uint8)


def element_scales(part) -> torch.Tensor:
    """Per-element decode scale of a part (fp32, stored orientation) - what multiplies the element value."""
    name = type(part).__name__
    if name == "Float8TensorPart":
        return part.scale_inv.expand(part.rows, part.cols)
    if name == "Float8BlockPart":
        return part.scale_inv_per_element()
    if name == "MXFP8Part":
        from hybridq.formats._numerics import e8m0_to_pow2
        return expand_blocks(e8m0_to_pow2(part.scale), 32, part.cols)
    if name == "NVFP4Part":
        return expand_blocks(part.scale.float(), 16, part.cols) * part.amax
    raise TypeError(name)


__all__ = ["FLT_MAX", "FORMATS", "hybrid", "STATELESS", "TRANSPOSED_2D", "DIRECTIONS", "raw_bytes", "assert_bitwise",
           "assert_parts_bitwise", "element_values", "element_scales", "expand_tiles"]
