"""What the one-call casts of many tensors (fp8_tensors.py, fp8_block_tensors.py) share: each tensor's region and
device check, whether the extension's kernel takes the inputs, and the per-tensor FP8 options the kernel is passed.
The format rules (which quantizers, which shapes) stay in each caller.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["check_region_and_device", "fp32_contiguous_on_cuda", "fp8_options"]

# the gather dtypes the kernels cast to in registers
PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_region_and_device(op: str, i: int, x: torch.Tensor, region: int, device: torch.device) -> None:
    """Raise naming `op` and tensor `i` unless its `region` of bytes is a multiple of 16 holding its elements and it
    is on `device` (tensor 0's)."""
    if region < x.numel() or region % 16:
        raise ValueError(f"{op}: region {i} of {region} bytes must be a multiple of 16 and hold the {x.numel()} "
                         f"elements of its tensor")
    if x.device != device:
        raise ValueError(f"{op}: tensor {i} is on {x.device}, tensor 0 on {device}")


def fp32_contiguous_on_cuda(xs: Sequence[torch.Tensor], param_dtype: torch.dtype) -> bool:
    """Whether every tensor is a contiguous fp32 CUDA tensor and `param_dtype` one the kernels cast to (the inputs
    the kernels read; whether the extension is built is the caller's check)."""
    if not (xs[0].is_cuda and param_dtype in PARAM_DTYPES):
        return False
    return all(x.dtype == torch.float32 and x.is_contiguous() for x in xs)


def fp8_options(quantizers) -> tuple[list[int], list[float], list[int]]:
    """(is E5M2, amax epsilon, power-of-two scale) of each quantizer: the kernels' per-tensor FP8 arguments."""
    return ([int(q.dtype == torch.float8_e5m2) for q in quantizers], [float(q.amax_epsilon) for q in quantizers],
            [int(q.power_2_scale) for q in quantizers])
