"""Quantization formats: one module per format (its quantizer and its per-direction part)."""

from ..enums import COLUMNWISE, DIRECTIONS, ROWWISE
from .base import OperandKind, QuantizedPart, Quantizer, ScaleLayout
from .float8 import Float8Quantizer, Float8TensorPart
from .float8_block import Float8BlockPart, Float8BlockQuantizer
from .float8_rowwise import Float8RowwisePart, Float8RowwiseQuantizer
from .hybrid import HybridQuantizer
from .identity import IdentityPart, IdentityQuantizer
from .mxfp8 import MXFP8Part, MXFP8Quantizer, swizzle_mx_scales
from .nvfp4 import NVFP4Part, NVFP4Quantizer
from .shardable import GatherablePart, ShardableQuantizer

__all__ = [
    "ROWWISE", "COLUMNWISE", "DIRECTIONS", "Quantizer", "QuantizedPart", "ScaleLayout", "OperandKind",
    "Float8Quantizer", "Float8TensorPart", "Float8BlockQuantizer", "Float8BlockPart", "Float8RowwiseQuantizer",
    "Float8RowwisePart",
    "MXFP8Quantizer", "MXFP8Part", "swizzle_mx_scales", "NVFP4Quantizer", "NVFP4Part",
    "IdentityQuantizer", "IdentityPart", "HybridQuantizer", "GatherablePart", "ShardableQuantizer",
]
