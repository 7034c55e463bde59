"""The one MAX all-reduce for statistics (amaxes, amax histories): a NaN on any rank stays NaN.

A plain `all_reduce(op=MAX)` may return the finite value where one rank holds a NaN (gloo keeps whichever operand
its comparison happens to favour; NCCL's order is no contract either), and formats such as NVFP4 carry a NaN only in
their global amax, so the whole tensor would silently come out finite. Rule: the reduced statistics are those of
the whole tensor on one device, non-finite included (`torch.amax` propagates NaN).

How: each float is mapped to an integer key whose order is the float order with every NaN above +inf (the sign
bit cleared on NaNs, then the magnitude bits of negative values flipped), the keys are MAX-reduced (integer MAX
is exact and order-free on every backend), and mapped back. One collective of the same size; -inf, -0.0 < +0.0,
subnormals and a NaN's payload come through exactly.

It lives with the formats (which may import only the package's leaves) because a format reduces its own state
too (delayed scaling's amax history); the distributed code reduces the formats' statistics through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["max_all_reduce_"]

# float dtype -> (integer dtype of the same width, mask of its magnitude bits)
_KEYS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def _to_key(x: torch.Tensor) -> torch.Tensor:
    idt, mask = _KEYS[x.dtype]
    bits = torch.where(torch.isnan(x), x.abs(), x).view(idt)  # every NaN positive (payload kept): above +inf
    return torch.where(bits < 0, bits ^ mask, bits)  # negative floats: larger magnitude, smaller key


def _from_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = _KEYS[dtype][1]
    return torch.where(key < 0, key ^ mask, key).view(dtype)  # (the map is its own inverse)


def max_all_reduce_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Elementwise MAX of `tensor` over the ranks of `group`, in place, in one collective, where a NaN on any rank
    gives NaN (as `torch.amax` over the ranks' values on one device would). Integer tensors are reduced as they
    are; fp16 / bf16 through fp32 (exact). Returns `tensor`."""
    if not tensor.is_floating_point():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor
    work = tensor.dtype if tensor.dtype in _KEYS else torch.float32  # (gloo has no 16-bit integer MAX)
    key = _to_key(tensor.detach().to(work).contiguous())
    dist.all_reduce(key, op=dist.ReduceOp.MAX, group=group)
    with torch.no_grad():
        tensor.copy_(_from_key(key, work))
    return tensor
