"""CUDA implementations of every quantizer's `quantize_parts` and every part's `dequantize_2d`, registered into
the dispatch tables (they run for CUDA tensors when the extension is built; the references run otherwise).

Each `run` returns the same parts, bit for bit, as the reference would for the same input (stochastic rounding
aside: it draws from its own Philox stream). Each `supports` returns False for anything it does not handle
(unknown keyword arguments, unsupported dtypes), so the reference runs instead; each registration lists the
quantizer options the kernel implements, and the dispatch sends a quantizer with any other option to the
reference.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..formats import (Float8BlockPart, Float8BlockQuantizer, Float8Quantizer, Float8TensorPart, MXFP8Part,
                       MXFP8Quantizer, NVFP4Part, NVFP4Quantizer)
from . import _ext
from .delayed import update_before_cast
from ..dispatch import KernelImpl, register_dequantize, register_quantize, register_row_groups

log = logging.getLogger("hybridq")

IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# The quantizer options each kernel implements (the dispatch sends a quantizer with any other option to the
# reference, so an option added later is never silently ignored by a kernel).
FP8_TENSOR_OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "scaling", "amax_epsilon", "power_2_scale",
                                "amax_history_len", "amax_compute_algo", "margin", "amax_reduction_group"})
FP8_BLOCK_OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "block_dim", "power_2_scale", "amax_epsilon"})
MXFP8_OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "block_2d"})
NVFP4_OPTIONS = frozenset({"rowwise", "columnwise", "block_2d", "rht", "stochastic_rounding", "generator"})


def _input_ok(q, x2d: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    return (x2d.is_cuda and x2d.dim() == 2 and x2d.dtype in IN_DTYPES and x2d.numel() > 0 and (rowwise or columnwise)
            and q.shape_rule(x2d.shape[0], x2d.shape[1], rowwise, columnwise) is None
            and _ext.available_for(x2d.device))


def _ops():
    return torch.ops.hybridq


def _plain_kw(kw: dict, allowed=()) -> bool:
    """True when the keyword arguments change nothing these kernels do not implement: None values, a whole-tensor
    `shard` (FSDP sharded quantization of a row shard otherwise), or the names in `allowed`."""
    for name, v in kw.items():
        if v is None or name in allowed:
            continue
        if name == "shard" and getattr(v, "is_whole", False):
            continue
        return False
    return True


# ---- per-tensor FP8 ---------------------------------------------------------------------------------------

def _fp8_supports(q: Float8Quantizer, x2d, rowwise, columnwise, **kw) -> bool:
    # per-tensor scaling: rows are independent, so a row shard only needs the global amax (`amax`, or `stats`,
    # the MAX-reduced shard statistics, whose first value is that amax)
    if q.scaling == "delayed":
        if not _plain_kw({n: v for n, v in kw.items() if n != "shard"}) or kw.get("shard") is not None:
            return False
    elif not _plain_kw(kw, ("amax", "stats", "shard", "global_stats")):
        return False
    return _input_ok(q, x2d, rowwise, columnwise)


def _fp8_run(q: Float8Quantizer, x2d, rowwise, columnwise, amax=None, stats=None, shard=None, global_stats=None,
             **_):
    x = x2d.contiguous()
    m, k = x.shape
    if q.scaling == "delayed":
        # the pending update in one launch instead of the Python update's ~10 small ops (same values), and the
        # cast's max|x| max-combined into the history slot by the cast kernel itself (a replay records nothing)
        replay = q.replaying()
        scale = q.begin_delayed_cast(x.device, lambda: update_before_cast(q))
        if replay:
            row, col, scale_inv, _ = _ops().fp8_tensor_quantize(x, q.dtype, scale, None, q.amax_epsilon,
                                                                q.power_2_scale, rowwise, columnwise, False)
        else:
            row, col, scale_inv = _ops().fp8_tensor_quantize_delayed(x, q.dtype, scale, q.amax_history,
                                                                     q.amax_epsilon, q.power_2_scale, rowwise,
                                                                     columnwise)
            q.mark_amax_recorded()
    else:
        for given in (stats, global_stats):
            if amax is None and given is not None:
                amax = given.reshape(-1)[0]
        if amax is not None:
            amax = amax.to(device=x.device, dtype=torch.float32).reshape(1)
        row, col, scale_inv, _ = _ops().fp8_tensor_quantize(x, q.dtype, None, amax, q.amax_epsilon, q.power_2_scale,
                                                            rowwise, columnwise, False)
    r = Float8TensorPart(rows=m, cols=k, columnwise=False, data=row, scale_inv=scale_inv) if rowwise else None
    c = Float8TensorPart(rows=k, cols=m, columnwise=True, data=col, scale_inv=scale_inv) if columnwise else None
    return r, c


def _fp8_row_groups(q: Float8Quantizer, x2d, sizes):
    """`Float8Quantizer.quantize_row_groups` in one amax pass and one cast (None: the reference runs)."""
    fields = {f.name for f in dataclasses.fields(q)}
    if not (fields <= FP8_TENSOR_OPTIONS and _input_ok(q, x2d, True, False)):
        return None
    x = x2d.contiguous()
    counts = torch.tensor(sizes, dtype=torch.int64).to(x.device, non_blocking=True)
    row_group = torch.repeat_interleave(torch.arange(len(sizes), device=x.device, dtype=torch.int32), counts,
                                        output_size=x.shape[0])
    row, _, scale_inv, _ = _ops().fp8_tensor_quantize_grouped(x, q.dtype, row_group, len(sizes), q.amax_epsilon,
                                                              q.power_2_scale, False)
    return row, scale_inv


# ---- FP8 block ----------------------------------------------------------------------------------------------

def _block_supports(q, x2d, rowwise, columnwise, **kw) -> bool:
    return _plain_kw(kw) and _input_ok(q, x2d, rowwise, columnwise)


def _fp8_block_supports(q: Float8BlockQuantizer, x2d, rowwise, columnwise, **kw) -> bool:
    shard = kw.get("shard")
    if shard is not None and not shard.is_whole:
        # a row shard (FSDP) of 128x128 tiles none of which it splits: plain quantization of its rows, with the
        # whole tile-scale grid of the reduced statistics
        if kw.get("stats") is None or not q.tiles_inside(shard):
            return False
        kw = {n: v for n, v in kw.items() if n not in ("shard", "stats")}
    return _block_supports(q, x2d, rowwise, columnwise, **kw)


def _block_run(q: Float8BlockQuantizer, x2d, rowwise, columnwise, shard=None, stats=None, **_):
    x = x2d.contiguous()
    m, k = x.shape
    row, rs, col, cs = _ops().fp8_block_quantize(x, q.dtype, q.block_dim, q.amax_epsilon, q.power_2_scale, rowwise,
                                                 columnwise)
    if shard is not None and not shard.is_whole:  # the shard's own tile scales are rows of the whole grid
        rs = q.shard_scale_inv(shard, k, stats.to(x.device))
        cs = rs.t().contiguous() if columnwise else cs
    r = Float8BlockPart(rows=m, cols=k, columnwise=False, data=row, scale_inv=rs, block_dim=q.block_dim) \
        if rowwise else None
    c = Float8BlockPart(rows=k, cols=m, columnwise=True, data=col, scale_inv=cs, block_dim=q.block_dim) \
        if columnwise else None
    return r, c


# ---- MXFP8 ----------------------------------------------------------------------------------------------------

def _mx_run(q: MXFP8Quantizer, x2d, rowwise, columnwise, **_):
    x = x2d.contiguous()
    m, k = x.shape
    row, rs, col, cs = _ops().mxfp8_quantize(x, q.dtype, q.block_2d, rowwise, columnwise, False)
    r = MXFP8Part(rows=m, cols=k, columnwise=False, data=row, scale=rs) if rowwise else None
    c = MXFP8Part(rows=k, cols=m, columnwise=True, data=col, scale=cs) if columnwise else None
    return r, c


def mxfp8_quantize(x2d: torch.Tensor, fp8=torch.float8_e4m3fn, *, block_2d=False, rowwise=True, columnwise=False,
                   swizzle=False):
    """Direct access to the MXFP8 kernel: (rowwise, scales, columnwise, scales) with the scales compact or, with
    swizzle=True, in the GEMM-ready layout of `swizzle_mx_scales` (flat uint8)."""
    return _ops().mxfp8_quantize(x2d.contiguous(), fp8, block_2d, rowwise, columnwise, swizzle)


# ---- NVFP4 ----------------------------------------------------------------------------------------------------

def _nvfp4_supports(q: NVFP4Quantizer, x2d, rowwise, columnwise, **kw) -> bool:
    shard = kw.get("shard")
    if shard is not None and not shard.is_whole:
        # a row shard (FSDP) whose blocks all lie inside it: plain quantization with the global amaxes of `stats`
        if q.stochastic_rounding or q.plain_shard_amaxes(shard, x2d.shape[1], kw.get("stats")) is None:
            return False
        kw = {n: v for n, v in kw.items() if n not in ("shard", "stats")}
    if not _plain_kw(kw, ("global_stats",)):
        return False
    g = q.generator
    if q.stochastic_rounding and g is not None:
        if g.device.type != "cuda" or (g.device.index is not None and g.device.index != x2d.device.index):
            return False
    return _input_ok(q, x2d, rowwise, columnwise)


def _nvfp4_run(q: NVFP4Quantizer, x2d, rowwise, columnwise, shard=None, stats=None, global_stats=None, **_):
    x = x2d.contiguous()
    m, k = x.shape
    rht = q.rht and not q.block_2d
    amaxes = (None, None)
    if shard is not None and not shard.is_whole:
        amaxes = tuple(a.to(x.device) for a in q.plain_shard_amaxes(shard, k, stats))
    elif global_stats is not None:  # a piece of a tensor (tensor parallelism): its global amaxes
        g = global_stats.reshape(-1).to(device=x.device, dtype=torch.float32)
        amaxes = (g[:1], g[:1]) if q.block_2d else (g[:1], g[1:2])
    row, rs, ra, col, cs, ca = _ops().nvfp4_quantize(x, q.block_2d, rht, q.stochastic_rounding,
                                                     q.generator if q.stochastic_rounding else None, rowwise,
                                                     columnwise, *amaxes)
    r = NVFP4Part(rows=m, cols=k, columnwise=False, data=row, scale=rs, amax=ra, rht=False) if rowwise else None
    c = NVFP4Part(rows=k, cols=m, columnwise=True, data=col, scale=cs, amax=ca, rht=rht) if columnwise else None
    return r, c


def _nvfp4_row_groups(q: NVFP4Quantizer, x2d, sizes, rowwise, columnwise, order):
    """`NVFP4Quantizer.quantize_groups` in one amax launch and one quantize launch for all groups (None: the
    reference runs): (rowwise part, columnwise part) holding amax `[G]`. Stochastic rounding: group g draws as the
    `order.index(g)`-th of `len(order)` consecutive `nvfp4_quantize` launches would (one Philox offset step each)."""
    fields = {f.name for f in dataclasses.fields(q)}
    if not (fields <= NVFP4_OPTIONS and _nvfp4_supports(q, x2d, rowwise, columnwise)):
        return None
    x = x2d.contiguous()
    m, k = x.shape
    rht = q.rht and not q.block_2d
    rank = [0] * len(sizes)
    for i, g in enumerate(order):
        rank[g] = i
    row, rs, ra, col, cs, ca = _ops().nvfp4_quantize_grouped(x, q.block_2d, rht, q.stochastic_rounding,
                                                             q.generator if q.stochastic_rounding else None, rowwise,
                                                             columnwise, list(sizes), rank, len(order))
    r = NVFP4Part(rows=m, cols=k, columnwise=False, data=row, scale=rs, amax=ra, rht=False) if rowwise else None
    c = NVFP4Part(rows=k, cols=m, columnwise=True, data=col, scale=cs, amax=ca, rht=rht) if columnwise else None
    return r, c


# ---- dequantize -------------------------------------------------------------------------------------------------

def _part_ok(part, fields) -> bool:
    ts = [getattr(part, f) for f in fields]
    return (all(t is not None and t.is_cuda and t.is_contiguous() for t in ts)
            and _ext.available_for(part.device))


def _fp8_part_supports(part, undo_transform) -> bool:
    return part.data.dtype in FP8_DTYPES and part.data.dim() == 2 and part.scale_inv.dtype == torch.float32 and \
        _part_ok(part, ("data", "scale_inv"))


def _deq_tensor(part: Float8TensorPart, undo_transform=True):
    return _ops().dequantize_fp8(part.data, part.scale_inv, 0, torch.float32)


def _deq_block(part: Float8BlockPart, undo_transform=True):
    return _ops().dequantize_fp8(part.data, part.scale_inv, 2 if part.block_dim == 2 else 1, torch.float32)


def _mx_part_supports(part, undo_transform) -> bool:
    return (part.data.dtype in FP8_DTYPES and part.data.dim() == 2 and part.scale.dtype == torch.uint8
            and tuple(part.scale.shape) == (part.rows, part.cols // 32) and _part_ok(part, ("data", "scale")))


def _deq_mx(part: MXFP8Part, undo_transform=True):
    return _ops().dequantize_fp8(part.data, part.scale, 3, torch.float32)


def _nvfp4_part_supports(part, undo_transform) -> bool:
    return (part.data.dtype == torch.uint8 and part.data.dim() == 2 and part.scale.element_size() == 1
            and part.amax.dtype == torch.float32 and part.amax.numel() == 1
            and _part_ok(part, ("data", "scale", "amax")))


def _deq_nvfp4(part: NVFP4Part, undo_transform=True):
    return _ops().dequantize_nvfp4(part.data, part.scale, part.amax, bool(part.rht and undo_transform), True,
                                   torch.float32)


def register_all() -> None:
    register_quantize(Float8Quantizer, KernelImpl("cuda-fp8-tensor", "cuda", _fp8_run, _fp8_supports,
                                                  FP8_TENSOR_OPTIONS))
    register_row_groups(Float8Quantizer, "cuda", _fp8_row_groups)
    register_quantize(Float8BlockQuantizer, KernelImpl("cuda-fp8-block", "cuda", _block_run, _fp8_block_supports,
                                                       FP8_BLOCK_OPTIONS))
    register_quantize(MXFP8Quantizer, KernelImpl("cuda-mxfp8", "cuda", _mx_run, _block_supports, MXFP8_OPTIONS))
    register_quantize(NVFP4Quantizer, KernelImpl("cuda-nvfp4", "cuda", _nvfp4_run, _nvfp4_supports, NVFP4_OPTIONS))
    register_row_groups(NVFP4Quantizer, "cuda", _nvfp4_row_groups)
    register_dequantize(Float8TensorPart, KernelImpl("cuda-fp8-tensor", "cuda", _deq_tensor, _fp8_part_supports))
    register_dequantize(Float8BlockPart, KernelImpl("cuda-fp8-block", "cuda", _deq_block, _fp8_part_supports))
    register_dequantize(MXFP8Part, KernelImpl("cuda-mxfp8", "cuda", _deq_mx, _mx_part_supports))
    register_dequantize(NVFP4Part, KernelImpl("cuda-nvfp4", "cuda", _deq_nvfp4, _nvfp4_part_supports))
