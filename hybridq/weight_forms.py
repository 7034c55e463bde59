"""A marker for quantized weights that can also give their high-precision form on demand.

`backward_override="high_precision"` needs the weight in high precision in backward. A weight that implements
`HighPrecisionSource` (FSDP2's gathered weight, whose backward unshard gathers it in param_dtype) is saved as a
handle and asked for `high_precision()` in backward; any other quantized weight is dequantized in forward.
Kept in a leaf module so the layers can recognise such weights without importing the distributed code.
"""

from __future__ import annotations

import torch

__all__ = ["HighPrecisionSource"]


class HighPrecisionSource:
    """Mixin for a QuantizedTensor that can return the weight in high precision (its gather dtype)."""

    def high_precision(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement high_precision()")
