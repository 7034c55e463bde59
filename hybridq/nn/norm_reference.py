"""The contracts of hybridq's RMSNorm and LayerNorm in PyTorch operations: the CPU path, the oracle of the CUDA
kernels, and what the compiled ops (compiled_norms.py) run on the CPU. A module of its own so that the modules and
the compiled ops both import it without a cycle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm_reference", "layer_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The contract, in PyTorch operations (torch's rms_norm decomposition)."""
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    """The contract: torch's layer_norm over the last dimension (fp32 computation, one rounding to x's dtype)."""
    if x.is_cuda and any(p is not None and p.dtype != x.dtype for p in (weight, bias)):
        # torch's CUDA layer_norm refuses parameters of another dtype than x (its CPU one computes in fp32): the
        # same contract, spelled out
        up = lambda t: None if t is None else t.float()  # noqa: E731
        return F.layer_norm(up(x), x.shape[-1:], up(weight), up(bias), eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
