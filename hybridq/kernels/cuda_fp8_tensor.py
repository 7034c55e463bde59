"""Per-tensor FP8 (`Float8Quantizer`, `Float8TensorPart`) on the CUDA kernels of csrc/quantize_fp8_tensor.cu: the
fused cast + transpose (current and delayed scaling), the row-group cast of grouped linears, and the dequantize.

Ops (inputs 2-D and contiguous; a direction not asked for returns an empty `[0]` tensor):
- fp8_tensor_quantize(x, dtype, scale?, amax?, eps, pow2, rowwise, columnwise, want_amax)
    -> (rowwise [M, K] fp8, columnwise [K, M] fp8, scale_inv [1], amax [1] | [0])
- fp8_tensor_quantize_delayed(x, dtype, scale, amax_history, eps, pow2, rowwise, columnwise): delayed scaling's cast,
  max|x| max-combined into amax_history[0] in place -> (rowwise, columnwise, scale_inv [1])
- fp8_tensor_quantize_grouped(x, dtype, row_group, n_groups, eps, pow2, columnwise, col_pitch=0, ends=None,
  padded_ends=None): row r quantized with the scale of group row_group[r] (int32 [M]), each group's scale from its
  own max|x|; the columnwise rows col_pitch (>= M; 0: M) elements apart; with ends and padded_ends (int32 [n_groups]
  cumulative counts, padded_ends' groups rounded up to multiples of 16) the columnwise part in the padded layout
  (group g's rows from column padded_ends[g-1], zeros in the other columns up to col_pitch >= padded_ends[-1])
    -> (rowwise [M, K] fp8, columnwise [K, M] fp8 (strides (col_pitch, 1)) | [K, col_pitch] (padded) | [0],
        scale_inv [n_groups], amax [n_groups])
- fp8_tensors_quantize(xs, param_dtype, amax, e5m2, eps, pow2, regions): many fp32 tensors, each rounded to
  param_dtype and quantized as its own tensor (its max|x|, or amax[i]) into its region of one byte buffer (zeros past
  its elements) -> (uint8 [sum(regions)], scale_inv [N, 4] (column 0), amax used [N]); csrc/fp8_tensors.cu, called
  by fp8_tensors.py
- fp8_tensor_dequantize(data, scale_inv [1], out_dtype) -> [rows, cols] of out_dtype (float32 or bfloat16)
- fp8_linear(x, weight, bias?, x_row?, x_row_scale_inv?, x_col?, x_col_scale_inv?, x_dtype, x_eps, x_pow2, w_dtype,
  w_eps, w_pow2, g_dtype, g_eps, g_pow2, need_dgrad, need_wgrad, save_original_input, fast_accum_fprop, w_row?=None,
  w_row_scale_inv?=None, w_col?=None, w_col_scale_inv?=None) -> y: an eager per-tensor FP8 Linear (current scaling)
  as one op whose autograd node is C++ (csrc/linear_fp8.cpp; its caller is nn/float8_graph.py's eager fast path);
  w_row..w_col_scale_inv: the weight already quantized (FSDP2's gathered weight), the columnwise tensors held by
  reference and read in backward (after the backward unshard refilled them)
- fp8_linear_delayed(x, weight, bias?, x_scale, x_amax_history?, w_scale, w_amax_history?, g_scale?, g_amax_history?,
  x_dtype, x_eps, x_pow2, w_dtype, w_eps, w_pow2, g_dtype, g_eps, g_pow2, need_dgrad, need_wgrad, fast_accum_fprop)
  -> y: fp8_linear with delayed scaling (the quantizers' state tensors given; a history None: that forward cast is a
  replay, nothing recorded; dy's state None where backward casts nothing); the histories change in place, x's and the
  weight's in the call, dy's in backward (csrc/linear_fp8.cpp; its caller is nn/delayed_linear.py, eager only)
- fp8_linear_fprop(x, w_row, w_row_scale_inv, bias?, x_dtype, x_eps, x_pow2, need_wgrad, save_original_input,
  fast_accum_fprop, x_row?, x_row_scale_inv?) -> (y, x_col | [0], x_col_scale_inv | [0]) (x_row given: x already
  quantized rowwise, nothing quantized, both [0]) and fp8_linear_grads(dy, x_saved?, x_col_scale_inv?,
  w_col?, w_col_scale_inv?, x_dtype, x_eps, x_pow2, g_dtype, g_eps, g_pow2, save_original_input, need_dgrad,
  need_wgrad, need_bgrad, x_shape, w_dtype, b_dtype) -> (dx | [0], dw | [0], db | [0]): the forward and the
  gradients of that Linear as two ops without an autograd node (csrc/linear_fp8.cpp; their caller is the compiled
  Linear's gathered fast path, nn/float8_graph.py's `gathered_forward` / `gathered_grads`, inside opaque ops at run
  time only: no fakes)
- grouped_fp8_tensor_cublas_mm(a, a_scale [E], b, b_group_stride, b_row_stride, n, b_scale [E], sizes, out_dtype,
  fast_accum, streams=1) -> [T, n] and grouped_fp8_tensor_cublas_wgrad(a_t, a_scale [E], b_t, b_scale [E], offsets,
  rows, out_dtype, streams=1) -> [E, M, N]: the jagged experts' fprop / dgrad and wgrad as one cuBLAS GEMM per expert
  from C++ (csrc/grouped_fp8_tensor_gemm.cpp; their caller is grouped_fp8.py where the host has the token counts),
  on `streams` (1 or 2) CUDA streams (kernels/expert_streams.py picks)
"""

from __future__ import annotations

import torch

from ..dispatch import KernelImpl, register_dequantize, register_quantize, register_row_groups
from ..enums import Scaling
from ..formats import Float8Quantizer, Float8TensorPart
from ..formats.base import option_names
from ..torch_private import current_raw_stream
from .cuda import FP8_DTYPES, input_ok, ops, or_empty, part_ok, plain_kw
from .delayed import update_before_cast

OPS = ("fp8_tensor_quantize", "fp8_tensor_quantize_delayed", "fp8_tensor_quantize_grouped", "fp8_tensor_dequantize",
       "fp8_linear", "fp8_linear_delayed", "fp8_linear_fprop", "fp8_linear_grads", "fp8_tensors_quantize",
       "grouped_fp8_tensor_cublas_mm", "grouped_fp8_tensor_cublas_wgrad")

# The quantizer options the kernel implements (the dispatch sends a quantizer with any other option to the
# reference, so an option added later is never silently ignored by the kernel).
OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "scaling", "amax_epsilon", "power_2_scale", "amax_history_len",
                     "amax_compute_algo", "margin", "amax_reduction_group"})


def supports(q: Float8Quantizer, x2d, rowwise, columnwise, **kw) -> bool:
    # per-tensor scaling: rows are independent, so a row shard only needs the global amax (`amax`, or `stats`,
    # the MAX-reduced shard statistics, whose first value is that amax)
    if q.scaling == Scaling.DELAYED:
        if not plain_kw({n: v for n, v in kw.items() if n != "shard"}) or kw.get("shard") is not None:
            return False
    elif not plain_kw(kw, ("amax", "stats", "shard", "global_stats")):
        return False
    return input_ok(q, x2d, rowwise, columnwise)


def delayed_cast(q: Float8Quantizer, x: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple:
    """A delayed-scaling cast of the 2-D contiguous CUDA tensor `x` -> (rowwise data, columnwise data, scale_inv);
    `run`'s, and nn/delayed_linear.py's fast path's (one copy of the state steps). The pending update in one launch
    instead of the Python update's ~10 small ops (same values), and the cast's max|x| max-combined into the history
    slot by the cast kernel itself (a replay records nothing and casts with the forward's scale)."""
    replay = q.replaying()
    scale = q.begin_delayed_cast(x.device, lambda: update_before_cast(q))
    if replay:
        row, col, scale_inv, _ = ops().fp8_tensor_quantize(x, q.dtype, scale, None, q.amax_epsilon,
                                                           q.power_2_scale, rowwise, columnwise, False)
    else:
        row, col, scale_inv = ops().fp8_tensor_quantize_delayed(x, q.dtype, scale, q.amax_history,
                                                                q.amax_epsilon, q.power_2_scale, rowwise, columnwise)
        q.mark_amax_recorded()
    return row, col, scale_inv


def run(q: Float8Quantizer, x2d, rowwise, columnwise, amax=None, stats=None, shard=None, global_stats=None, **_):
    x = x2d.contiguous()
    m, k = x.shape
    if q.scaling == Scaling.DELAYED:
        row, col, scale_inv = delayed_cast(q, x, rowwise, columnwise)
    else:
        for given in (stats, global_stats):
            if amax is None and given is not None:
                amax = given.reshape(-1)[0]
        if amax is not None:
            amax = amax.to(device=x.device, dtype=torch.float32).reshape(1)
        row, col, scale_inv, _ = ops().fp8_tensor_quantize(x, q.dtype, None, amax, q.amax_epsilon, q.power_2_scale,
                                                           rowwise, columnwise, False)
    r = Float8TensorPart(rows=m, cols=k, columnwise=False, data=row, scale_inv=scale_inv) if rowwise else None
    c = Float8TensorPart(rows=k, cols=m, columnwise=True, data=col, scale_inv=scale_inv) if columnwise else None
    return r, c


def row_groups(q: Float8Quantizer, x2d, sizes):
    """`Float8Quantizer.quantize_row_groups` in one amax pass and one cast (None: the reference runs)."""
    if not (option_names(type(q)) <= OPTIONS and input_ok(q, x2d, True, False)):
        return None
    x = x2d.contiguous()
    row, _, scale_inv, _ = ops().fp8_tensor_quantize_grouped(x, q.dtype, _row_group(sizes, x), len(sizes),
                                                             q.amax_epsilon, q.power_2_scale, False)
    return row, scale_inv


_ROW_GROUPS: dict = {}


def _row_group(sizes, x: torch.Tensor) -> torch.Tensor:
    """Each row's group (int32 `[rows]`), made once per sizes, device and stream (the experts of a weight are the same
    groups at every unshard: no host-to-device copy and no launches per call)."""
    key = (tuple(sizes), x.device, current_raw_stream(x.device))
    hit = _ROW_GROUPS.get(key)
    if hit is None:
        if len(_ROW_GROUPS) >= 64:
            _ROW_GROUPS.clear()
        counts = torch.tensor(sizes, dtype=torch.int64).to(x.device, non_blocking=True)
        hit = _ROW_GROUPS[key] = torch.repeat_interleave(
            torch.arange(len(sizes), device=x.device, dtype=torch.int32), counts, output_size=sum(sizes))
    return hit


def part_supports(part: Float8TensorPart, undo_transform) -> bool:
    return part.data.dtype in FP8_DTYPES and part.data.dim() == 2 and part.scale_inv.dtype == torch.float32 and \
        part_ok(part, ("data", "scale_inv"))


def dequantize(part: Float8TensorPart, undo_transform=True):
    return ops().fp8_tensor_dequantize(part.data, part.scale_inv, torch.float32)


def register_fakes() -> None:
    from torch.library import register_fake

    f32 = torch.float32

    @register_fake("hybridq::fp8_tensor_quantize")
    def _quantize(x, dtype, scale, amax, eps, pow2, rowwise, columnwise, want_amax):
        m, k = x.shape
        return (or_empty(x, (m, k), dtype, rowwise), or_empty(x, (k, m), dtype, columnwise),
                x.new_empty((1,), dtype=f32), or_empty(x, (1,), f32, scale is None or want_amax))

    @register_fake("hybridq::fp8_tensor_quantize_delayed")
    def _quantize_delayed(x, dtype, scale, amax_history, eps, pow2, rowwise, columnwise):
        return _quantize(x, dtype, scale, None, eps, pow2, rowwise, columnwise, False)[:3]

    @register_fake("hybridq::fp8_tensor_quantize_grouped")
    def _quantize_grouped(x, dtype, row_group, n_groups, eps, pow2, columnwise, col_pitch=0, ends=None,
                          padded_ends=None):
        m, k = x.shape
        col = (x.new_empty((0,), dtype=dtype) if not columnwise
               else x.new_empty((k, col_pitch), dtype=dtype) if ends is not None
               else x.new_empty_strided((k, m), (col_pitch or m, 1), dtype=dtype))
        return (x.new_empty((m, k), dtype=dtype), col, x.new_empty((n_groups,), dtype=f32),
                x.new_empty((n_groups,), dtype=f32))

    @register_fake("hybridq::fp8_tensors_quantize")
    def _quantize_tensors(xs, param_dtype, amax, e5m2, eps, pow2, regions):
        n = len(xs)
        return (xs[0].new_empty((sum(regions),), dtype=torch.uint8), xs[0].new_empty((n, 4), dtype=f32),
                xs[0].new_empty((n,), dtype=f32))

    @register_fake("hybridq::fp8_tensor_dequantize")
    def _dequantize(data, scale_inv, out_dtype):
        return data.new_empty(data.shape, dtype=out_dtype)

    @register_fake("hybridq::grouped_fp8_tensor_cublas_mm")
    def _grouped_cublas_mm(a, a_scale, b, b_group_stride, b_row_stride, n, b_scale, sizes, out_dtype, fast_accum,
                           streams=1):
        return a.new_empty((a.shape[0], n), dtype=out_dtype)

    @register_fake("hybridq::grouped_fp8_tensor_cublas_wgrad")
    def _grouped_cublas_wgrad(a_t, a_scale, b_t, b_scale, offsets, rows, out_dtype, streams=1):
        return a_t.new_empty((len(offsets), a_t.shape[0], b_t.shape[0]), dtype=out_dtype)

    @register_fake("hybridq::fp8_linear")
    def _linear(x, weight, bias, x_row, x_row_scale_inv, x_col, x_col_scale_inv, *casts_and_flags):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @register_fake("hybridq::fp8_linear_delayed")
    def _linear_delayed(x, weight, *state_casts_and_flags):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @register_fake("hybridq::fp8_linear_fprop")
    def _linear_fprop(x, w_row, w_row_scale_inv, bias, x_dtype, x_eps, x_pow2, need_wgrad, save_original_input,
                      fast_accum_fprop, x_row=None, x_row_scale_inv=None):
        y = x.new_empty((*x.shape[:-1], w_row.shape[0]))
        columnwise = need_wgrad and not save_original_input and x_row is None
        m = x.numel() // x.shape[-1]
        return (y, or_empty(x, (x.shape[-1], m), x_dtype, columnwise), or_empty(x, (1,), f32, columnwise))

    @register_fake("hybridq::fp8_linear_grads")
    def _linear_grads(dy, x_saved, x_col_scale_inv, w_col, w_col_scale_inv, x_dtype, x_eps, x_pow2, g_dtype, g_eps,
                      g_pow2, save_original_input, need_dgrad, need_wgrad, need_bgrad, x_shape, w_dtype, b_dtype):
        n = dy.shape[-1]
        return (dy.new_empty(tuple(x_shape)) if need_dgrad else dy.new_empty((0,)),
                dy.new_empty((n, x_shape[-1]), dtype=w_dtype) if need_wgrad else dy.new_empty((0,)),
                dy.new_empty((n,), dtype=b_dtype) if need_bgrad else dy.new_empty((0,)))


_LINEAR: dict = {}


def linear_op(name: str = "fp8_linear"):
    """The overload of `hybridq::fp8_linear` (or of the op `name`, one of the Linear ops above) itself (called as
    is: no overload resolution per call)."""
    op = _LINEAR.get(name)
    if op is None:
        op = _LINEAR[name] = getattr(ops(), name).default
    return op


def register() -> None:
    register_quantize(Float8Quantizer, KernelImpl("cuda-fp8-tensor", "cuda", run, supports, OPTIONS))
    register_row_groups(Float8Quantizer, "cuda", row_groups)
    register_dequantize(Float8TensorPart, KernelImpl("cuda-fp8-tensor", "cuda", dequantize, part_supports))
