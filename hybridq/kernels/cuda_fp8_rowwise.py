"""Rowwise FP8 (`Float8RowwiseQuantizer`, `Float8RowwisePart`) on the CUDA kernels of csrc/quantize_fp8_rowwise.cu:
one scale per row of x (rowwise part) and per column of x (columnwise part), both parts from one read of each tile
after one amax pre-pass; the amaxes of a piece of a larger tensor may be given (FSDP2 row shards: the columns'
reduced amaxes; tensor-parallel pieces: those along the cut dim). Dequantize: the reference (fp8 times a broadcast
fp32 scale_inv, elementwise torch ops on the device).

Ops (inputs 2-D, contiguous and non-empty; a direction not asked for returns an empty `[0]` tensor):
- fp8_rowwise_quantize(x, dtype, eps, pow2, rowwise, columnwise, row_amax?, col_amax?)
    -> (rowwise [M, K], scale_inv [M, 1] fp32, columnwise [K, M], scale_inv [K, 1] fp32)
"""

from __future__ import annotations

import torch

from ..dispatch import KernelImpl, register_quantize
from ..enums import Cut
from ..formats import Float8RowwisePart, Float8RowwiseQuantizer
from ..formats.float8_rowwise import CUTS
from .cuda import input_ok, ops, or_empty

OPS = ("fp8_rowwise_quantize",)

# The quantizer options the kernel implements (any other: the reference runs)
OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "power_2_scale", "amax_epsilon"})

_STATS_KW = frozenset({"shard", "stats", "global_stats", "cut"})  # the reference's keywords (reference_parts)


def _given_amaxes(kw: dict) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """(rows' amaxes, columns' amaxes) the call gives, as `reference_parts` reads them (a row shard's `stats`: the
    columns'; a piece's `global_stats`: along its `cut`), or None where the kernel does not take the call."""
    if not kw.keys() <= _STATS_KW:
        return None
    rows = cols = None
    stats, global_stats = kw.get("stats"), kw.get("global_stats")
    if stats is not None:
        cols = stats
    if global_stats is not None:
        cut = kw.get("cut")
        if cut not in CUTS:
            return None  # (the reference names the missing cut dim)
        if cut == Cut.COLUMNS:  # a column piece: its rows' amaxes span the cut
            rows = global_stats
        else:
            cols = global_stats
    if any(t is not None and t.dtype != torch.float32 for t in (rows, cols)):
        return None
    return rows, cols


def supports(q: Float8RowwiseQuantizer, x2d, rowwise, columnwise, **kw) -> bool:
    return _given_amaxes(kw) is not None and input_ok(q, x2d, rowwise, columnwise)


def run(q: Float8RowwiseQuantizer, x2d, rowwise, columnwise, **kw):
    x = x2d.contiguous()
    m, k = x.shape
    rows, cols = _given_amaxes(kw)
    row, rs, col, cs = ops().fp8_rowwise_quantize(x, q.dtype, q.amax_epsilon, q.power_2_scale, rowwise, columnwise,
                                                  rows, cols)
    r = Float8RowwisePart(rows=m, cols=k, columnwise=False, data=row, scale_inv=rs) if rowwise else None
    c = Float8RowwisePart(rows=k, cols=m, columnwise=True, data=col, scale_inv=cs) if columnwise else None
    return r, c


def register_fakes() -> None:
    from torch.library import register_fake

    @register_fake("hybridq::fp8_rowwise_quantize")
    def _quantize(x, dtype, eps, pow2, rowwise, columnwise, row_amax=None, col_amax=None):
        m, k = x.shape
        f32 = torch.float32
        return (or_empty(x, (m, k), dtype, rowwise), or_empty(x, (m, 1), f32, rowwise),
                or_empty(x, (k, m), dtype, columnwise), or_empty(x, (k, 1), f32, columnwise))


def register() -> None:
    register_quantize(Float8RowwiseQuantizer, KernelImpl("cuda-fp8-rowwise", "cuda", run, supports, OPTIONS))
