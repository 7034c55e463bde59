"""MXFP8 (`MXFP8Quantizer`, `MXFP8Part`) on the CUDA kernels of csrc/quantize_mxfp8.cu: 1x32 / 32x1 blocks or 32x32
tiles with E8M0 scales (compact, or GEMM-swizzled through `mxfp8_quantize`), and the dequantize.

Ops (inputs 2-D and contiguous; a direction not asked for returns an empty `[0]` tensor):
- mxfp8_quantize(x, dtype, block_2d, rowwise, columnwise, swizzle, src_rows=None) -> (rowwise, E8M0 scales,
  columnwise, scales); src_rows (int32 [S]): the [S, K] of x's rows through that map is quantized (zero rows where < 0)
- mxfp8_dequantize(data, scale [rows, cols/32] uint8, out_dtype) -> [rows, cols] of out_dtype (float32 or bfloat16)
"""

from __future__ import annotations

import torch

from ..dispatch import KernelImpl, register_dequantize, register_quantize
from ..formats import MXFP8Part, MXFP8Quantizer
from .cuda import FP8_DTYPES, input_ok, ops, or_empty, part_ok, plain_kw

OPS = ("mxfp8_quantize", "mxfp8_dequantize")

# The quantizer options the kernel implements (any other: the reference runs)
OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "block_2d"})


def supports(q: MXFP8Quantizer, x2d, rowwise, columnwise, **kw) -> bool:
    return plain_kw(kw) and input_ok(q, x2d, rowwise, columnwise)


def run(q: MXFP8Quantizer, x2d, rowwise, columnwise, src_rows=None, **_):
    """The parts of x2d, or (`src_rows`, 1x32 blocks) of the `[S, K]` whose row r is x2d's row src_rows[r] (a zero
    row where < 0)."""
    x = x2d.contiguous()
    m, k = x.shape[0] if src_rows is None else src_rows.shape[0], x.shape[1]
    row, rs, col, cs = ops().mxfp8_quantize(x, q.dtype, q.block_2d, rowwise, columnwise, False, src_rows)
    r = MXFP8Part(rows=m, cols=k, columnwise=False, data=row, scale=rs) if rowwise else None
    c = MXFP8Part(rows=k, cols=m, columnwise=True, data=col, scale=cs) if columnwise else None
    return r, c


def mxfp8_quantize(x2d: torch.Tensor, fp8=torch.float8_e4m3fn, *, block_2d=False, rowwise=True, columnwise=False,
                   swizzle=False):
    """Direct access to the MXFP8 kernel: (rowwise, scales, columnwise, scales) with the scales compact or, with
    swizzle=True, in the GEMM-ready layout of `swizzle_mx_scales` (flat uint8)."""
    return ops().mxfp8_quantize(x2d.contiguous(), fp8, block_2d, rowwise, columnwise, swizzle)


def part_supports(part: MXFP8Part, undo_transform) -> bool:
    return (part.data.dtype in FP8_DTYPES and part.data.dim() == 2 and part.scale.dtype == torch.uint8
            and tuple(part.scale.shape) == (part.rows, part.cols // 32) and part_ok(part, ("data", "scale")))


def dequantize(part: MXFP8Part, undo_transform=True):
    return ops().mxfp8_dequantize(part.data, part.scale, torch.float32)


def register_fakes() -> None:
    from torch.library import register_fake

    @register_fake("hybridq::mxfp8_quantize")
    def _quantize(x, dtype, block_2d, rowwise, columnwise, swizzle, src_rows=None):
        m, k = x.shape if src_rows is None else (src_rows.shape[0], x.shape[1])
        if swizzle:
            rs = (-(-m // 128) * 128 * -(-(k // 32) // 4) * 4,)
            cs = (-(-k // 128) * 128 * -(-(m // 32) // 4) * 4,)
        else:
            rs, cs = (m, k // 32), (k, m // 32)
        return (or_empty(x, (m, k), dtype, rowwise), or_empty(x, rs, torch.uint8, rowwise),
                or_empty(x, (k, m), dtype, columnwise), or_empty(x, cs, torch.uint8, columnwise))

    @register_fake("hybridq::mxfp8_dequantize")
    def _dequantize(data, scale, out_dtype):
        return data.new_empty(data.shape, dtype=out_dtype)


def register() -> None:
    register_quantize(MXFP8Quantizer, KernelImpl("cuda-mxfp8", "cuda", run, supports, OPTIONS))
    register_dequantize(MXFP8Part, KernelImpl("cuda-mxfp8", "cuda", dequantize, part_supports))
