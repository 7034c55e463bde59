"""FP8 128x128-tile block scaling of many tensors in one call: each a 2-D high-precision tensor cast to a gather dtype
and quantized as its own tensor (every 128x128 tile its own scale) into its region of one byte buffer, its tile-scale
grid into its slot of one fp32 buffer -- the block-format weights of one FSDP2 unit (hybridq/distributed/
unit_cast.py).

`quantize_fp8_block_tensors` runs the extension's `hybridq::fp8_block_tensors_quantize` (csrc/fp8_block_tensors.cu:
one launch per 16 tensors, one CTA per tile, the cast to the gather dtype done in registers) where every tensor is a
contiguous 2-D fp32 CUDA tensor and the extension is built; elsewhere `reference`: per tensor, exactly what the
per-weight path does with a whole tensor (`x.to(param_dtype)`, then the quantizer's rowwise part: on the CPU the
Float8BlockQuantizer reference, on a GPU its device kernel where it takes the tensor). Bitwise the same bytes and
scales either way (tests/test_fp8_block_tensors.py on the GPU).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..formats import Float8BlockPart, Float8BlockQuantizer
from . import _ext
from ._many_tensors import check_region_and_device, fp32_contiguous_on_cuda, fp8_options

__all__ = ["quantize_fp8_block_tensors", "reference", "rowwise_part", "scale_slots", "takes"]

TILE = 128
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def takes(q) -> bool:
    """Whether `q` quantizes a tensor as `quantize_fp8_block_tensors` does: FP8 128x128 tiles
    (`Float8BlockQuantizer(block_dim=2)`, E4M3 or E5M2, its power-of-two and epsilon options; a subclass may change
    the rules: not taken)."""
    return type(q) is Float8BlockQuantizer and q.block_dim == 2 and q.dtype in _FP8


def tiles_of(rows: int, cols: int) -> tuple[int, int]:
    """The tile-scale grid `[ceil(rows/128), ceil(cols/128)]` of a `[rows, cols]` tensor."""
    return -(-rows // TILE), -(-cols // TILE)


def scale_slots(shapes: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """(each tensor's float offset of its tile-scale grid in the scales buffer, the buffer's floats): the grids one
    after another, each starting 16-byte aligned."""
    offsets, n = [], 0
    for rows, cols in shapes:
        tm, tk = tiles_of(rows, cols)
        offsets.append(n)
        n += -(-(tm * tk) // 4) * 4
    return offsets, n


def _check(xs, quantizers, regions) -> None:
    n = len(xs)
    if not (len(quantizers) == len(regions) == n) or n == 0:
        raise ValueError(f"quantize_fp8_block_tensors: xs, quantizers and regions need one entry per tensor, got "
                         f"lengths {n}, {len(quantizers)}, {len(regions)}")
    for i, (x, q, r) in enumerate(zip(xs, quantizers, regions)):
        if not takes(q):
            raise ValueError(f"quantize_fp8_block_tensors: tensor {i} has quantizer {q!r}; only FP8 128x128 tiles "
                             f"(Float8BlockQuantizer, block_dim=2) are cast here")
        if x.dim() != 2:
            raise ValueError(f"quantize_fp8_block_tensors: tensor {i} has shape {tuple(x.shape)}; a 2-D [rows, cols] "
                             f"tensor is quantized in 128x128 tiles")
        check_region_and_device("quantize_fp8_block_tensors", i, x, r, xs[0].device)


def _cuda_takes(xs, param_dtype) -> bool:
    return (fp32_contiguous_on_cuda(xs, param_dtype) and _ext.available_for(xs[0].device)
            and hasattr(torch.ops.hybridq, "fp8_block_tensors_quantize"))


def reference(xs: Sequence[torch.Tensor], param_dtype: torch.dtype, quantizers, regions
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-weight path looped: tensor i is `xs[i].to(param_dtype)` quantized whole as the per-weight path
    quantizes it (`quantize_parts`, its rowwise part: bytes in row order, its tile scale_inv grid; on the CPU the
    Float8BlockQuantizer reference)."""
    device = xs[0].device
    offsets, n = scale_slots([tuple(x.shape) for x in xs])
    out = torch.zeros(sum(regions), dtype=torch.uint8, device=device)
    scales = torch.zeros(n, dtype=torch.float32, device=device)
    offset = 0
    for x, q, r, s in zip(xs, quantizers, regions, offsets):
        if x.numel():
            part = q.quantize_parts(x.to(param_dtype), True, False)[0]
            out[offset:offset + x.numel()].copy_(part.data.view(torch.uint8).reshape(-1))
            scales[s:s + part.scale_inv.numel()].copy_(part.scale_inv.reshape(-1))
        offset += r
    return out, scales


def quantize_fp8_block_tensors(xs: Sequence[torch.Tensor], param_dtype: torch.dtype, quantizers,
                               regions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes, scales): tensor i's FP8 bytes (of `quantizers[i].dtype`, `[rows_i, cols_i]` in row order) at
    `[sum(regions[:i]), + numel)` of the uint8 buffer `bytes`, zeros up to its region's end; its tile scale_inv grid
    `[ceil(rows_i/128), ceil(cols_i/128)]` (row-major) at `scale_slots`' offset i of the fp32 buffer `scales`.
    `xs[i]` (2-D) is cast to `param_dtype` first. Regions: multiples of 16 bytes, each at least its tensor's
    elements."""
    _check(xs, quantizers, regions)
    if _cuda_takes(xs, param_dtype):
        return torch.ops.hybridq.fp8_block_tensors_quantize(
            list(xs), param_dtype, *fp8_options(quantizers), list(regions))
    return reference(xs, param_dtype, quantizers, regions)


def rowwise_part(q: Float8BlockQuantizer, data: torch.Tensor, scale_inv: torch.Tensor, rows: int, cols: int
                 ) -> Float8BlockPart:
    """The rowwise part of a tensor `quantize_fp8_block_tensors` wrote: `data` its bytes (uint8 `[rows * cols]`, a view
    of the buffer), `scale_inv` its tile-scale grid (`[ceil(rows/128), ceil(cols/128)]`, a view)."""
    return Float8BlockPart(rows=rows, cols=cols, columnwise=False, data=data.view(q.dtype).view(rows, cols),
                           scale_inv=scale_inv, block_dim=2)
