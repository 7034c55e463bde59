"""The one all-reduce for statistics (amaxes, amax histories): a NaN on any rank stays NaN.

A plain `all_reduce(op=MAX)` may return the finite value where one rank holds a NaN (gloo keeps whichever operand
its comparison happens to favour; NCCL's order is no contract either), and formats such as NVFP4 carry a NaN only in
their global amax, so the whole tensor would silently come out finite. Rule: the reduced statistics are those of
the whole tensor on one device, non-finite included (`torch.amax` propagates NaN).

How: every statistic hybridq reduces is an amax, max |x|. With the sign bit cleared, IEEE floats order like their
bit patterns read as integers, and every NaN lies above +inf; so `|v|` is reduced as integers (integer MAX is exact
and order-free on every backend): one collective of the same size, one extra launch (the in-place `abs`).

It lives with the formats (which may import only the package's leaves) because a format reduces its own state
too (delayed scaling's amax history); the distributed code reduces the formats' statistics through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["amax_all_reduce_"]

_AS_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def amax_all_reduce_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place, in one collective: the elementwise amax of `tensor` over the ranks of `group`, max |v| (as
    `torch.amax` of the ranks' values' magnitudes on one device): NaN where any rank holds a NaN (its payload kept),
    +inf where any holds +-inf and none a NaN; -0.0 counts as 0. For floating statistics (fp16 / bf16 through
    fp32, exact); returns `tensor`."""
    if not tensor.is_floating_point():
        raise TypeError(f"amax_all_reduce_ takes floating-point statistics, got {tensor.dtype}")
    own = tensor.dtype in _AS_INT and tensor.is_contiguous()  # else a contiguous fp32 / fp64 copy is reduced
    work = tensor if own else torch.empty(tensor.shape, dtype=tensor.dtype if tensor.dtype in _AS_INT
                                          else torch.float32, device=tensor.device).copy_(tensor)
    with torch.no_grad():
        torch.abs(work, out=work)  # sign bits clear: NaN (either sign) above +inf, -0.0 as 0
        dist.all_reduce(work.view(_AS_INT[work.dtype]), op=dist.ReduceOp.MAX, group=group)
        if not own:
            tensor.copy_(work)
    return tensor
