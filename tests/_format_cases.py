"""Shared format cases for the format tests (not a test module); the comparison helpers live in _compare.

Each case is a factory, so every test gets a fresh quantizer (delayed scaling and stochastic rounding
carry state).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import hybridq
from hybridq.formats import (Float8BlockQuantizer, Float8Quantizer, Float8RowwiseQuantizer, HybridQuantizer,
                             IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from hybridq.formats._numerics import expand_tiles

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
    "fp8rw_e4m3": lambda: Float8RowwiseQuantizer(),
    "fp8rw_e5m2_nopow2": lambda: Float8RowwiseQuantizer(fp8="e5m2", power_2_scale=False),
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

@dataclasses.dataclass(frozen=True)
class FormatCase:
    """What the tests need to know about a case, read off a fresh quantizer (each format states it, docs/numerics.md):
    a new format is covered by the existing tests once its factory is in FORMATS."""

    name: str
    make: Callable[[], Quantizer]

    @property
    def bound(self) -> float:
        """The stated bound on the relative round-trip error for x ~ N(0, 1)."""
        return self.make().round_trip_bound

    @property
    def stateless(self) -> bool:
        """The output does not depend on earlier calls."""
        return not self.make().is_stateful

    @property
    def transposed(self) -> bool:
        """The columnwise form is, by the format's definition, the exact transpose of the rowwise form."""
        return self.make().columnwise_is_transpose


CASES = {name: FormatCase(name, make) for name, make in FORMATS.items()}
STATELESS = [k for k, c in CASES.items() if c.stateless]
TRANSPOSED_2D = [k for k, c in CASES.items() if c.transposed]

# per-tensor FP8 with current scaling whose three roles' casts all differ (dtype, epsilon, power-of-2 scales): a
# role's cast read in another's place changes the bits
MIXED_PER_TENSOR = {"input": lambda: Float8Quantizer(power_2_scale=True),
                    "weight": lambda: Float8Quantizer(amax_epsilon=4.0),
                    "grad_output": lambda: Float8Quantizer(fp8="e5m2")}


def case_recipe(case: str) -> hybridq.CustomRecipe:
    """The recipe of a layer case: "mixed" (MIXED_PER_TENSOR), a FORMATS name in every role, or a preset's name."""
    if case == "mixed":
        return hybridq.CustomRecipe(lambda role: MIXED_PER_TENSOR[role.tensor_type](), name="mixed-per-tensor")
    if case in FORMATS:
        return hybridq.CustomRecipe(lambda role: FORMATS[case](), name=f"all-{case}")
    return hybridq.recipe(case)


def hybrid(rowwise: str, columnwise: str, **kw):
    """A factory of the hybrid of two FORMATS cases (by name)."""
    return lambda: HybridQuantizer(rowwise=FORMATS[rowwise](), columnwise=FORMATS[columnwise](), **kw)


def element_values(part) -> torch.Tensor:
    """The stored element values (before scaling) of a part as a 2-D tensor in stored orientation."""
    return part.element_values()


def element_scales(part) -> torch.Tensor:
    """Per-element decode scale of a part (fp32, stored orientation) - what multiplies the element value."""
    return part.element_scales()


__all__ = ["FLT_MAX", "FORMATS", "CASES", "FormatCase", "hybrid", "STATELESS", "TRANSPOSED_2D", "DIRECTIONS", "raw_bytes", "assert_bitwise",
           "assert_parts_bitwise", "element_values", "element_scales", "expand_tiles"]
