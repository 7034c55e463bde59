"""The grouped quantize of GroupedLinear's packed block path on CUDA: the routed token rows quantized straight into
the expert slots (`triton_slot_quantize`), instead of packing them into a zero-padded buffer (`TokenLayout.pack`) and
quantizing that. Bitwise the same parts: it is taken only where the packed path would run the extension's CUDA
kernel of the same quantizer (`dispatch.lookup_quantize` on the slot-shaped input), whose numerics the Triton kernel
reproduces, for the formats it implements: FP8 1x128 blocks (`Float8BlockQuantizer(block_dim=1)`) and MXFP8 1x32
blocks (`MXFP8Quantizer(block_2d=False)`), alone or as either direction of a `HybridQuantizer` whose columnwise form
comes from the original values. Elsewhere (the CPU, no Triton, other formats, NVFP4 directions, torch.compile's
fake tensors, `HYBRIDQ_GROUPED_SLOT_QUANTIZE=0`, or after the kernel failed to compile or launch: one warning, then
off for the process) `quantize` returns None and the caller packs.
"""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..dispatch import lookup_quantize
from ..enums import ColumnwiseSource
from ..formats import Float8BlockPart, Float8BlockQuantizer, HybridQuantizer, MXFP8Part, MXFP8Quantizer
from ..formats._numerics import FP8_MAX
from ..formats.base import Quantizer
from ..tensor import QuantizedTensor
from .grouped_blocks import run_or_none

ENABLED = {"on": os.environ.get("HYBRIDQ_GROUPED_SLOT_QUANTIZE", "1") != "0"}
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CUDA_KERNELS = {Float8BlockQuantizer: "cuda-fp8-block", MXFP8Quantizer: "cuda-mxfp8"}


def _triton():
    """triton_slot_quantize when Triton imports, else None (imported on first use: Triton is optional)."""
    from . import triton_slot_quantize
    return triton_slot_quantize if triton_slot_quantize.available() else None


def _implemented(q: Quantizer) -> bool:
    return (type(q) is Float8BlockQuantizer and q.block_dim == 1) or (type(q) is MXFP8Quantizer and not q.block_2d)


def _direction_quantizers(q: Quantizer, rowwise: bool, columnwise: bool) -> list[tuple[Quantizer, bool]] | None:
    """(quantizer, columnwise) of each direction asked for, or None where one is not implemented here."""
    if isinstance(q, HybridQuantizer):
        if columnwise and q.columnwise_source != ColumnwiseSource.ORIGINAL:
            return None  # (its columnwise form comes from the dequantized rowwise one)
        out = ([(q.rowwise, False)] if rowwise else []) + ([(q.columnwise, True)] if columnwise else [])
    else:
        out = ([(q, False)] if rowwise else []) + ([(q, True)] if columnwise else [])
    return out if out and all(_implemented(d) for d, _ in out) else None


def supports(q: Quantizer, x: torch.Tensor, slot_rows: int, rowwise: bool, columnwise: bool) -> bool:
    """Whether `quantize` takes `x` (the routed tokens `[T, K]`) for a slot layout of `slot_rows` rows."""
    # (the kernel writes the columnwise bytes 4 slot rows to a word; the packed path's slots are 16-aligned)
    if not (ENABLED["on"] and x.is_cuda and not isinstance(x, FakeTensor) and x.dim() == 2 and x.shape[0] > 0
            and x.dtype in _IN_DTYPES and slot_rows > 0 and not (columnwise and slot_rows % 4)):
        return False
    dirs = _direction_quantizers(q, rowwise, columnwise)
    if dirs is None or _triton() is None:
        return False
    probe = x[:1].expand(slot_rows, x.shape[1])  # (the packed buffer's shape, for the CUDA kernel's checks)
    for d, col in dirs:  # only where the packed path would run the extension's kernel
        impl = lookup_quantize(d, probe, not col, col)
        if impl is None or impl.name != _CUDA_KERNELS[type(d)]:
            return False
    return True


def _part(q: Quantizer, data: torch.Tensor, scales: torch.Tensor, rows: int, cols: int, columnwise: bool):
    if type(q) is Float8BlockQuantizer:
        return Float8BlockPart(rows=rows, cols=cols, columnwise=columnwise, data=data, scale_inv=scales, block_dim=1)
    return MXFP8Part(rows=rows, cols=cols, columnwise=columnwise, data=data, scale=scales)


def quantize(q: Quantizer, x: torch.Tensor, source_rows: torch.Tensor, rowwise: bool, columnwise: bool
             ) -> QuantizedTensor | None:
    """The slot layout's quantized tensor `[S, K]` (`S = len(source_rows)`; slot row r is token row `source_rows[r]`
    of `x`, a zero row where it is < 0), bitwise `q.quantize_groups(packed buffer, slots)`; None where `supports`
    says no (the caller packs and quantizes)."""
    s, k = source_rows.shape[0], x.shape[1]
    if not supports(q, x, s, rowwise, columnwise):
        return None
    t = _triton()
    x = x if x.stride(1) == 1 else x.contiguous()

    def launch():
        parts = {False: None, True: None}
        for d, col in _direction_quantizers(q, rowwise, columnwise):
            mode = t.MODE_FP8_BLOCK if type(d) is Float8BlockQuantizer else t.MODE_MXFP8
            kw = dict(eps=d.amax_epsilon, pow2=d.power_2_scale) if mode == t.MODE_FP8_BLOCK else {}
            rq, rs, cq, cs = t.slot_quantize(x, source_rows, mode, d.dtype, not col, col, fp8_max=FP8_MAX[d.dtype],
                                             **kw)
            parts[col] = _part(d, cq, cs, k, s, True) if col else _part(d, rq, rs, s, k, False)
        return QuantizedTensor(parts[False], parts[True], shape=(s, k), dtype=x.dtype)
    # (a kernel that fails to compile or launch is turned off with a warning; the caller then packs)
    return run_or_none(ENABLED, "grouped slot quantize", launch,
                       instead="the packed path packs the tokens before quantizing them")
