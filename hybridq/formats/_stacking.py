"""One view over many equally spaced tensors of one storage, so that one op (a copy) serves them all: the experts'
buffers of a grouped weight held in one allocation, or their slices of one all-gather output."""

from __future__ import annotations

import torch

__all__ = ["stacked_view"]


def stacked_view(tensors) -> torch.Tensor | None:
    """`[G, *shape]` whose `[g]` is `tensors[g]`, when all are views of one storage with the same shape, strides,
    dtype and device, and start equally spaced (a positive spacing: the view never overlaps itself); else None."""
    tensors = list(tensors)
    if not tensors:
        return None
    t0 = tensors[0]
    if type(t0) is not torch.Tensor:
        return None
    if len(tensors) == 1:
        return t0.unsqueeze(0)
    ptr, shape, stride, off = t0.untyped_storage().data_ptr(), t0.shape, t0.stride(), t0.storage_offset()
    delta = tensors[1].storage_offset() - off
    if delta <= 0 or ptr == 0:
        return None
    for g, t in enumerate(tensors):
        if (type(t) is not torch.Tensor or t.untyped_storage().data_ptr() != ptr or t.shape != shape
                or t.stride() != stride or t.dtype != t0.dtype or t.device != t0.device
                or t.storage_offset() != off + g * delta):
            return None
    if t0.numel() and delta < sum((n - 1) * s for n, s in zip(shape, stride)) + 1:
        return None  # (consecutive tensors would overlap)
    return t0.as_strided((len(tensors),) + tuple(shape), (delta,) + tuple(stride), off)
