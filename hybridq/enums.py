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


# [Note: direction]
# A quantized tensor serves up to two uses, each a direction with its own stored form (a part, see [Note: part],
# formats/base.py): rowwise, the `[M, K]` view with its scaling blocks along K (what the forward GEMM reads), and
# columnwise, stored transposed `[K, M]` with its blocks along M (what the transposed backward GEMMs read). Both are
# "rows by contracted dim", so every GEMM is `A @ B^T` over two stored forms: fprop x.rowwise @ W.rowwise^T, dgrad
# dy.rowwise @ W.columnwise^T, wgrad dy.columnwise @ x.columnwise^T. A hybrid quantizer gives the two directions two
# formats. Where a format derives one direction exactly from the other (a per-tensor FP8 byte transpose, 2-D tiles),
# the distributed code gathers one and derives the other. Beside the two, the gathers know one more form,
# HIGH_PRECISION: the tensor's values in the gather dtype (what backward_override="high_precision" reads).
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


class TensorType(_StrEnum):
    """Which tensor of a module a quantizer is for (a recipe's `Role`)."""

    INPUT = "input"
    WEIGHT = "weight"
    OUTPUT = "output"
    GRAD_OUTPUT = "grad_output"
    GRAD_INPUT = "grad_input"


class Phase(_StrEnum):
    """Which pass an FSDP2 unshard (or a piece of work) serves: forward, or backward (autograd running, or FSDP2's
    param group in its pre/post-backward state)."""

    FORWARD = "forward"
    BACKWARD = "backward"


class AmaxComputeAlgo(_StrEnum):
    """How delayed scaling reads its amax history: its maximum (max) or its newest entry (most_recent)."""

    MAX = "max"
    MOST_RECENT = "most_recent"


class ColumnwiseSource(_StrEnum):
    """What a hybrid quantizer's columnwise form is quantized from: the original tensor, or the dequantized rowwise
    form (double quantization)."""

    ORIGINAL = "original"
    ROWWISE_DEQUANTIZED = "rowwise_dequantized"


class OnIncompatible(_StrEnum):
    """What a conversion does with a layer its recipe's formats cannot take: keep it in its precision with a
    logged reason (skip), or raise (error)."""

    SKIP = "skip"
    ERROR = "error"


class ParallelStyle(_StrEnum):
    """How tensor parallelism cuts a Linear: its output features (colwise: weight rows) or its input features
    (rowwise: weight columns)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"


class SequenceSend(_StrEnum):
    """What a sequence-parallel all-gather sends: each rank's rows quantized, or in the input's dtype (when that
    is fewer bytes; the whole input is then quantized after the gather)."""

    QUANTIZED = "quantized"
    HIGH_PRECISION = "high_precision"


class FragmentKind(_StrEnum):
    """How quantize_master_weights makes one direction of a weight from fragments (distributed/master_weights.py):
    elementwise (no blocks), blocks (1-D blocks, 2-D tiles), high_precision (the fragments gathered in the model
    dtype, the whole weight quantized on every rank) or plain (a parameter held in high precision)."""

    ELEMENTWISE = "elementwise"
    BLOCKS = "blocks"
    HIGH_PRECISION = "high_precision"
    PLAIN = "plain"



class Cut(_StrEnum):
    """The dim a tensor-parallel piece of a `[M, K]` weight is cut along: M (a row piece, Shard(0)) or K (a column
    piece, Shard(1)); a per-axis format's statistics along the cut dim are the ones the pieces reduce."""

    ROWS = "M"
    COLUMNS = "K"

# the high-precision "direction" beside rowwise / columnwise: a tensor's values as they are, in the gather dtype
# (what backward_override="high_precision" reads)
HIGH_PRECISION = BackwardOverride.HIGH_PRECISION

ROWWISE = Direction.ROWWISE
COLUMNWISE = Direction.COLUMNWISE
DIRECTIONS = (ROWWISE, COLUMNWISE)
