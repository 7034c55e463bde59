"""Kernel dispatch: device implementations of a quantizer's `quantize_parts` and a part's `dequantize_2d`.

The format modules hold the pure-PyTorch references (the numerics contract). A device backend (the CUDA
extension) registers an implementation per quantizer / part type; it is used for tensors on its device
when its `supports` check accepts the call, and the reference runs otherwise. Either way the call
signature and the result (bit for bit) are the same.
"""

from .registry import (KernelImpl, lookup_dequantize, lookup_quantize, register_dequantize,
                       register_quantize)

__all__ = ["KernelImpl", "register_quantize", "register_dequantize", "lookup_quantize", "lookup_dequantize"]
