"""max|y| of tensors whose producing kernel computed it in passing (hybridq.nn.RMSNorm), so that the per-tensor
scaled cast of y by the Linear layers that read it skips its own max|y| pass (one read of y fewer). The value is
exactly what that pass would compute, so results are bitwise the same with or without it."""

from __future__ import annotations

import torch

from .side_table import TensorSideTable

_AMAX = TensorSideTable(slots=4)


def remember_amax(y: torch.Tensor, amax: torch.Tensor) -> None:
    """Record max|y| (`[1]` or scalar fp32, NaN if y holds one) for the tensor object `y` at its current version."""
    _AMAX.put(y, None, amax)


def known_amax(x: torch.Tensor) -> torch.Tensor | None:
    """max|x| if x's producer recorded it and x has not changed since, else None."""
    return _AMAX.find(x)
