"""The package's named choices (a leaf module: imports no other hybridq module).

Each enum's members are also plain strings (`Direction.ROWWISE == "rowwise"`), so the string spellings users
already write keep working at the API boundary; `parse` turns a user's value into a member or raises an error
that lists the valid spellings.
"""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    # str(), format() and repr() give the value on every Python version, so messages read as the strings users
    # write (3.10 formats a str mix-in by its member name)
    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def parse(cls, value, what: str):
        """`value` (a member or its string, any case) as a member; ValueError naming `what` otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}")


class Direction(_StrEnum):
    """Which use of a tensor a quantized part serves (docs/numerics.md "Terms"): rowwise (blocks along the last
    dim; what the forward GEMM reads) or columnwise (blocks along dim 0; what the transposed backward GEMMs
    read)."""

    ROWWISE = "rowwise"
    COLUMNWISE = "columnwise"


class Scaling(_StrEnum):
    """How a per-tensor FP8 scale is chosen: from this tensor's amax (current) or from an amax history
    (delayed)."""

    CURRENT = "current"
    DELAYED = "delayed"


class BackwardOverride(_StrEnum):
    """How a layer's backward GEMMs read their operands when not the default (None: the quantized operands):
    in the activation dtype from the original tensors (high_precision), or from the dequantized rowwise forms
    the forward saved (dequantized)."""

    HIGH_PRECISION = "high_precision"
    DEQUANTIZED = "dequantized"


ROWWISE = Direction.ROWWISE
COLUMNWISE = Direction.COLUMNWISE
DIRECTIONS = (ROWWISE, COLUMNWISE)
