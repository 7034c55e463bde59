"""NVFP4 (`NVFP4Quantizer`, `NVFP4Part`) on the CUDA kernels of csrc/quantize_nvfp4.cu (and quantize_nvfp4_2d.cu):
1x16 / 16x1 blocks (the columnwise input optionally through the 16-point RHT) or 16x16 tiles, round to nearest or
stochastic rounding, the row-group variant of grouped linears, and the dequantize.

Ops (inputs 2-D and contiguous; a direction not asked for returns an empty `[0]` tensor):
- nvfp4_quantize(x, block_2d, rht, stochastic_rounding, generator?, rowwise, columnwise, amax?, amax_col?)
    (amax / amax_col: given global amaxes, e.g. of the whole tensor when x is a row shard of it)
    -> (row data [M, K/2], row scales [M, K/16] e4m3, row amax [1], col data [K, M/2], col scales, col amax)
- nvfp4_quantize_grouped(x, block_2d, rht, stochastic_rounding, generator?, rowwise, columnwise, sizes, draw_rank,
  n_draws): row group g (the next sizes[g] rows) quantized as nvfp4_quantize quantizes it alone, its draws those of
  the draw_rank[g]-th of n_draws launches -> as nvfp4_quantize with amaxes [G]
- nvfp4_dequantize(data, scale, amax, rht_inverse, apply_global, out_dtype): codes times scales, times amax / 2688
  if apply_global, then the inverse RHT of each block if rht_inverse -> [rows, 2 * data.size(1)] of out_dtype
"""

from __future__ import annotations

import torch

from ..dispatch import KernelImpl, register_dequantize, register_quantize, register_row_groups
from ..formats import NVFP4Part, NVFP4Quantizer
from ..formats.base import option_names
from .cuda import input_ok, ops, or_empty, part_ok, plain_kw

OPS = ("nvfp4_quantize", "nvfp4_quantize_grouped", "nvfp4_dequantize")

# The quantizer options the kernel implements (any other: the reference runs)
OPTIONS = frozenset({"rowwise", "columnwise", "block_2d", "rht", "stochastic_rounding", "generator"})


def supports(q: NVFP4Quantizer, x2d, rowwise, columnwise, **kw) -> bool:
    shard = kw.get("shard")
    if shard is not None and not shard.is_whole:
        # a row shard (FSDP) whose blocks all lie inside it: plain quantization with the global amaxes of `stats`
        if q.stochastic_rounding or q.plain_shard_amaxes(shard, x2d.shape[1], kw.get("stats")) is None:
            return False
        kw = {n: v for n, v in kw.items() if n not in ("shard", "stats")}
    if not plain_kw(kw, ("global_stats",)):
        return False
    g = q.generator
    if q.stochastic_rounding and g is not None:
        if g.device.type != "cuda" or (g.device.index is not None and g.device.index != x2d.device.index):
            return False
    return input_ok(q, x2d, rowwise, columnwise)


def _parts(m, k, rht, row, rs, ra, col, cs, ca, rowwise, columnwise):
    r = NVFP4Part(rows=m, cols=k, columnwise=False, data=row, scale=rs, amax=ra, rht=False) if rowwise else None
    c = NVFP4Part(rows=k, cols=m, columnwise=True, data=col, scale=cs, amax=ca, rht=rht) if columnwise else None
    return r, c


def run(q: NVFP4Quantizer, x2d, rowwise, columnwise, shard=None, stats=None, global_stats=None, **_):
    x = x2d.contiguous()
    m, k = x.shape
    rht = q.rht and not q.block_2d
    amaxes = (None, None)
    if shard is not None and not shard.is_whole:
        amaxes = tuple(a.to(x.device) for a in q.plain_shard_amaxes(shard, k, stats))
    elif global_stats is not None:  # a piece of a tensor (tensor parallelism): its global amaxes
        g = global_stats.reshape(-1).to(device=x.device, dtype=torch.float32)
        amaxes = (g[:1], g[:1]) if q.block_2d else (g[:1], g[1:2])
    out = ops().nvfp4_quantize(x, q.block_2d, rht, q.stochastic_rounding,
                               q.generator if q.stochastic_rounding else None, rowwise, columnwise, *amaxes)
    return _parts(m, k, rht, *out, rowwise, columnwise)


def row_groups(q: NVFP4Quantizer, x2d, sizes, rowwise, columnwise, order):
    """`NVFP4Quantizer.quantize_groups` in one amax launch and one quantize launch for all groups (None: the
    reference runs): (rowwise part, columnwise part) holding amax `[G]`. Stochastic rounding: group g draws as the
    `order.index(g)`-th of `len(order)` consecutive `nvfp4_quantize` launches would (one Philox offset step each)."""
    if not (option_names(type(q)) <= OPTIONS and supports(q, x2d, rowwise, columnwise)):
        return None
    x = x2d.contiguous()
    m, k = x.shape
    rht = q.rht and not q.block_2d
    rank = [0] * len(sizes)
    for i, g in enumerate(order):
        rank[g] = i
    out = ops().nvfp4_quantize_grouped(x, q.block_2d, rht, q.stochastic_rounding,
                                       q.generator if q.stochastic_rounding else None, rowwise, columnwise,
                                       list(sizes), rank, len(order))
    return _parts(m, k, rht, *out, rowwise, columnwise)


def part_supports(part: NVFP4Part, undo_transform) -> bool:
    return (part.data.dtype == torch.uint8 and part.data.dim() == 2 and part.scale.element_size() == 1
            and part.amax.dtype == torch.float32 and part.amax.numel() == 1
            and part_ok(part, ("data", "scale", "amax")))


def dequantize(part: NVFP4Part, undo_transform=True):
    return ops().nvfp4_dequantize(part.data, part.scale, part.amax, bool(part.rht and undo_transform), True,
                                  torch.float32)


def register_fakes() -> None:
    from torch.library import register_fake

    f32, e4 = torch.float32, torch.float8_e4m3fn

    def outputs(x, rowwise, columnwise, n_amax):
        m, k = x.shape
        return (or_empty(x, (m, k // 2), torch.uint8, rowwise), or_empty(x, (m, k // 16), e4, rowwise),
                or_empty(x, (n_amax,), f32, rowwise), or_empty(x, (k, m // 2), torch.uint8, columnwise),
                or_empty(x, (k, m // 16), e4, columnwise), or_empty(x, (n_amax,), f32, columnwise))

    @register_fake("hybridq::nvfp4_quantize")
    def _quantize(x, block_2d, rht, stochastic_rounding, generator, rowwise, columnwise, amax=None, amax_col=None):
        return outputs(x, rowwise, columnwise, 1)

    @register_fake("hybridq::nvfp4_quantize_grouped")
    def _quantize_grouped(x, block_2d, rht, stochastic_rounding, generator, rowwise, columnwise, sizes, draw_rank,
                          n_draws):
        return outputs(x, rowwise, columnwise, len(sizes))

    @register_fake("hybridq::nvfp4_dequantize")
    def _dequantize(data, scale, amax, rht_inverse, apply_global, out_dtype):
        return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=out_dtype)


def register() -> None:
    register_quantize(NVFP4Quantizer, KernelImpl("cuda-nvfp4", "cuda", run, supports, OPTIONS))
    register_row_groups(NVFP4Quantizer, "cuda", row_groups)
    register_dequantize(NVFP4Part, KernelImpl("cuda-nvfp4", "cuda", dequantize, part_supports))
