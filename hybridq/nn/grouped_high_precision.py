"""The high-precision product of an expert module that was not converted (`hybridq.nn.grouped_mm` before
`convert_experts`): what a bf16 MoE baseline runs. On CUDA (sm_90+) with a bf16 input this is one
`torch._grouped_mm` on the jagged token layout (torchtitan's experts: one launch for all experts, the group ends on the
device, no host sync with device counts); elsewhere one matmul per expert on its slice (the CPU reference)."""

from __future__ import annotations

from typing import Sequence

import torch

from .m_splits import checked_m_splits, host_m_splits

__all__ = ["grouped_mm_high_precision", "uses_grouped_mm"]

_CAPS: dict[int, tuple[int, int]] = {}


def uses_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes this call: a CUDA sm_90+ device, bf16 input, 2-D x 3-D, rows of both
    operands 16-byte aligned (in / out features multiples of 8)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and weight.dim() == 3
            and hasattr(torch, "_grouped_mm")):
        return False
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if _CAPS.setdefault(idx, torch.cuda.get_device_capability(idx)) < (9, 0):
        return False
    return weight.shape[1] % 8 == 0 and weight.shape[2] % 8 == 0


def grouped_mm_high_precision(x: torch.Tensor, weight: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                              name: str) -> torch.Tensor:
    """`y[rows of expert e] = x[rows of e] @ weight[e]^T` in x's dtype (the m_splits rules of GroupedLinear)."""
    if uses_grouped_mm(x, weight):
        from .grouped_jagged import TokenGroups  # (list: one pinned copy; device tensor: checked on the device)
        splits = checked_m_splits(m_splits, weight.shape[0], x.shape[0], name)
        ends = TokenGroups.build(splits, x.shape[0], x.device, name).ends
        return torch._grouped_mm(x, weight.to(x.dtype).transpose(-2, -1), offs=ends)
    parts = x.split(host_m_splits(m_splits, weight.shape[0], x.shape[0], name), 0)
    return torch.cat([p @ w.t().to(x.dtype) for p, w in zip(parts, weight.unbind(0))], 0)
