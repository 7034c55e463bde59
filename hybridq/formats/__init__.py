"""Quantization formats: one module per format (its quantizer and its per-direction part)."""

from ..enums import COLUMNWISE, DIRECTIONS, ROWWISE
from .base import QuantizedPart, Quantizer
from .float8 import Float8Quantizer, Float8TensorPart
from .float8_block import Float8BlockPart, Float8BlockQuantizer
from .hybrid import HybridQuantizer
from .identity import IdentityPart, IdentityQuantizer
from .mxfp8 import MXFP8Part, MXFP8Quantizer, swizzle_mx_scales
from .nvfp4 import NVFP4Part, NVFP4Quantizer
from .shardable import GatherablePart, ShardableQuantizer

__all__ = [
    "ROWWISE", "COLUMNWISE", "DIRECTIONS", "Quantizer", "QuantizedPart",
    "Float8Quantizer", "Float8TensorPart", "Float8BlockQuantizer", "Float8BlockPart",
    "MXFP8Quantizer", "MXFP8Part", "swizzle_mx_scales", "NVFP4Quantizer", "NVFP4Part",
    "IdentityQuantizer", "IdentityPart", "HybridQuantizer", "GatherablePart", "ShardableQuantizer",
]
