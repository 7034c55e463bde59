"""Per-tensor FP8 (current scaling) of many tensors in one call: each a high-precision tensor cast to a gather dtype
and quantized as its own tensor (its own max|x|, or a given amax) into its region of one byte buffer -- the weights
of one FSDP2 unit (hybridq/distributed/unit_cast.py).

`quantize_fp8_tensors` runs the extension's `hybridq::fp8_tensors_quantize` (csrc/fp8_tensors.cu: one amax launch and
one cast launch per 16 tensors, the cast to the gather dtype done in registers) where every tensor is a contiguous
fp32 CUDA tensor and the extension is built; elsewhere the reference: per tensor, exactly what the per-weight path
does (`x.to(param_dtype)`, then `float8_current_scaling`, the Float8Quantizer reference). Bitwise the same bytes and
scales either way (tests/test_fp8_tensors.py on the GPU).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..enums import Scaling
from ..formats import Float8Quantizer, Float8TensorPart
from ..formats.float8 import float8_current_scaling
from . import _ext
from ._many_tensors import check_region_and_device, fp32_contiguous_on_cuda, fp8_options

__all__ = ["quantize_fp8_tensors", "reference", "rowwise_part", "takes"]


def takes(q) -> bool:
    """Whether `q` quantizes a tensor as `quantize_fp8_tensors` does: per-tensor FP8 with current scaling (a
    subclass may change the rules: not taken)."""
    return type(q) is Float8Quantizer and q.scaling == Scaling.CURRENT


def _check(xs, quantizers, amaxes, regions) -> None:
    n = len(xs)
    if not (len(quantizers) == len(amaxes) == len(regions) == n) or n == 0:
        raise ValueError(f"quantize_fp8_tensors: xs, quantizers, amaxes and regions need one entry per tensor, got "
                         f"lengths {n}, {len(quantizers)}, {len(amaxes)}, {len(regions)}")
    for i, (x, q, r) in enumerate(zip(xs, quantizers, regions)):
        if not takes(q):
            raise ValueError(f"quantize_fp8_tensors: tensor {i} has quantizer {q!r}; only per-tensor FP8 with current "
                             f"scaling (Float8Quantizer, scaling='current') is cast here")
        check_region_and_device("quantize_fp8_tensors", i, x, r, xs[0].device)


def _cuda_takes(xs, param_dtype, amaxes) -> bool:
    if not fp32_contiguous_on_cuda(xs, param_dtype):
        return False
    for a in amaxes:
        if a is not None and not (a.is_cuda and a.dtype == torch.float32 and a.numel() == 1):
            return False
    return _ext.available_for(xs[0].device) and hasattr(torch.ops.hybridq, "fp8_tensors_quantize")


def reference(xs: Sequence[torch.Tensor], param_dtype: torch.dtype, quantizers, amaxes, regions
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-weight path looped: tensor i is `xs[i].to(param_dtype)` quantized by the Float8Quantizer reference
    with its own amax or `amaxes[i]` (a `[1]` statistic, e.g. MAX-reduced across shards)."""
    device = xs[0].device
    out = torch.zeros(sum(regions), dtype=torch.uint8, device=device)
    scale_inv = torch.zeros(len(xs), 4, dtype=torch.float32, device=device)
    offset = 0
    for i, (x, q, a, r) in enumerate(zip(xs, quantizers, amaxes, regions)):
        data, s = float8_current_scaling(x.to(param_dtype), q.dtype, q.amax_epsilon, q.power_2_scale,
                                         None if a is None else a.reshape(-1)[0])
        out[offset:offset + x.numel()].copy_(data.view(torch.uint8).reshape(-1))
        scale_inv[i, 0] = s.reshape(-1)[0]
        offset += r
    return out, scale_inv


def quantize_fp8_tensors(xs: Sequence[torch.Tensor], param_dtype: torch.dtype, quantizers, amaxes,
                         regions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes, scale_inv): tensor i's FP8 bytes (of `quantizers[i].dtype`) at `[sum(regions[:i]), + numel)` of the
    uint8 buffer `bytes`, zeros up to its region's end; its scale_inv at `scale_inv[i, 0]` (`[N, 4]` fp32: each row
    16-byte aligned, the other columns 0). `xs[i]` is cast to `param_dtype` first; `amaxes[i]`: the `[1]` amax it is
    scaled from, or None for its own max|x|. Regions: multiples of 16 bytes, each at least its tensor's elements."""
    _check(xs, quantizers, amaxes, regions)
    if _cuda_takes(xs, param_dtype, amaxes):
        out, scale_inv, _ = torch.ops.hybridq.fp8_tensors_quantize(
            list(xs), param_dtype, list(amaxes), *fp8_options(quantizers), list(regions))
        return out, scale_inv
    return reference(xs, param_dtype, quantizers, amaxes, regions)


def rowwise_part(q: Float8Quantizer, data: torch.Tensor, scale_inv: torch.Tensor, rows: int, cols: int):
    """The rowwise part of a tensor `quantize_fp8_tensors` wrote: `data` its bytes (uint8 `[rows * cols]`, a view of the
    buffer), `scale_inv` its `[1]` row of the scales (a 16-byte aligned view)."""
    return Float8TensorPart(rows=rows, cols=cols, columnwise=False, data=data.view(q.dtype).view(rows, cols),
                            scale_inv=scale_inv)
