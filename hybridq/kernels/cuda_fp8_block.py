"""Float8 block scaling (`Float8BlockQuantizer`, `Float8BlockPart`) on the CUDA kernels of
csrc/quantize_fp8_block.cu: 1x128 / 128x1 blocks or 128x128 tiles, and the dequantize.

Ops (inputs 2-D and contiguous; a direction not asked for returns an empty `[0]` tensor):
- fp8_block_quantize(x, dtype, block_dim, eps, pow2, rowwise, columnwise, src_rows=None)
    -> (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv); block_dim 1: scales [M, ceil(K/128)] and
    [K, ceil(M/128)]; block_dim 2: [ceil(M/128), ceil(K/128)] and its transpose; src_rows (int32 [S], block_dim 1):
    the [S, K] of x's rows through that map is quantized (zero rows where < 0)
- fp8_block_dequantize(data, scale_inv, block_dim, out_dtype) -> [rows, cols] of out_dtype (float32 or bfloat16)
- fp8_block_mm(a, a_scale, b, b_scale, b_tiles, out_dtype) -> a @ b^T `[M, N]`: the dense block GEMM (1x128 x
    128x128 tiles or 1x128 x 1x128; csrc/block_gemm.cu, run by hybridq/kernels/native_gemm.py)
- fp8_block_linear(x, weight, bias?, x_row?, x_row_scale_inv?, x_col?, x_col_scale_inv?, x_dtype, x_eps, x_pow2,
  w_dtype, w_block_dim, w_eps, w_pow2, g_dtype, g_eps, g_pow2, need_dgrad, need_wgrad, save_original_input) -> y: an
  eager FP8 block Linear (1x128 input and grad_output blocks, the weight's 128x128 tiles or 1x128 blocks, current
  scaling) as one op whose autograd node is C++ (csrc/linear_fp8_block.cpp: the quantize and GEMM ops above; its
  caller is nn/float8_graph.py's eager fast path, on a plain weight)
- fp8_block_linear_fprop(x, w_row, w_row_scale_inv, bias?, x_dtype, x_eps, x_pow2, w_block_dim, need_wgrad,
  save_original_input) -> (y, x_col | [0], x_col_scale_inv | [0]) and fp8_block_linear_grads(dy, x_saved?,
  x_col_scale_inv?, w_col?, w_col_scale_inv?, x_dtype, x_eps, x_pow2, g_dtype, g_eps, g_pow2, w_block_dim,
  save_original_input, need_dgrad, need_wgrad, need_bgrad, x_shape, w_dtype, b_dtype) -> (dx | [0], dw | [0],
  db | [0]): the forward and the gradients of that Linear as two ops without an autograd node (csrc/
  linear_fp8_block.cpp; their caller is the compiled Linear's gathered fast path, nn/float8_graph.py's
  `gathered_forward` / `gathered_grads`, inside opaque ops at run time)
- fp8_block_tensors_quantize(xs, param_dtype, e5m2, eps, pow2, regions): many 2-D fp32 tensors, each rounded to
  param_dtype and quantized in 128x128 tiles into its region of one byte buffer -> (uint8 [sum(regions)], fp32 tile
  scale_inv grids one after another, each 16-byte aligned); csrc/fp8_block_tensors.cu, called by fp8_block_tensors.py
"""

from __future__ import annotations

import torch

from ..dispatch import KernelImpl, register_dequantize, register_quantize
from ..formats import Float8BlockPart, Float8BlockQuantizer
from .cuda import FP8_DTYPES, input_ok, ops, or_empty, part_ok, plain_kw

OPS = ("fp8_block_quantize", "fp8_block_dequantize", "fp8_block_mm", "grouped_block_cublas_mm",
       "grouped_block_cublas_wgrad", "fp8_block_linear", "fp8_block_linear_fprop", "fp8_block_linear_grads",
       "fp8_block_tensors_quantize")

# The quantizer options the kernel implements (any other: the reference runs)
OPTIONS = frozenset({"rowwise", "columnwise", "fp8", "block_dim", "power_2_scale", "amax_epsilon"})


def supports(q: Float8BlockQuantizer, x2d, rowwise, columnwise, **kw) -> bool:
    shard = kw.get("shard")
    if shard is not None and not shard.is_whole:
        # a row shard (FSDP) of 128x128 tiles none of which it splits: plain quantization of its rows, with the
        # whole tile-scale grid of the reduced statistics
        if kw.get("stats") is None or not q.tiles_inside(shard):
            return False
        kw = {n: v for n, v in kw.items() if n not in ("shard", "stats")}
    return plain_kw(kw) and input_ok(q, x2d, rowwise, columnwise)


def run(q: Float8BlockQuantizer, x2d, rowwise, columnwise, shard=None, stats=None, src_rows=None, **_):
    """The parts of x2d, or (`src_rows`, 1x128 blocks) of the `[S, K]` whose row r is x2d's row src_rows[r] (a zero
    row where < 0)."""
    x = x2d.contiguous()
    m, k = x.shape[0] if src_rows is None else src_rows.shape[0], x.shape[1]
    row, rs, col, cs = ops().fp8_block_quantize(x, q.dtype, q.block_dim, q.amax_epsilon, q.power_2_scale, rowwise,
                                                columnwise, src_rows)
    if shard is not None and not shard.is_whole:  # the shard's own tile scales are rows of the whole grid
        rs = q.shard_scale_inv(shard, k, stats.to(x.device))
        cs = rs.t().contiguous() if columnwise else cs
    r = Float8BlockPart(rows=m, cols=k, columnwise=False, data=row, scale_inv=rs, block_dim=q.block_dim) \
        if rowwise else None
    c = Float8BlockPart(rows=k, cols=m, columnwise=True, data=col, scale_inv=cs, block_dim=q.block_dim) \
        if columnwise else None
    return r, c


def part_supports(part: Float8BlockPart, undo_transform) -> bool:
    return part.data.dtype in FP8_DTYPES and part.data.dim() == 2 and part.scale_inv.dtype == torch.float32 and \
        part_ok(part, ("data", "scale_inv"))


def dequantize(part: Float8BlockPart, undo_transform=True):
    return ops().fp8_block_dequantize(part.data, part.scale_inv, part.block_dim, torch.float32)


def register_fakes() -> None:
    from torch.library import register_fake

    f32 = torch.float32

    @register_fake("hybridq::fp8_block_quantize")
    def _quantize(x, dtype, block_dim, eps, pow2, rowwise, columnwise, src_rows=None):
        m, k = x.shape if src_rows is None else (src_rows.shape[0], x.shape[1])
        bm, bk = -(-m // 128), -(-k // 128)
        rs, cs = ((m, bk), (k, bm)) if block_dim == 1 else ((bm, bk), (bk, bm))
        return (or_empty(x, (m, k), dtype, rowwise), or_empty(x, rs, f32, rowwise),
                or_empty(x, (k, m), dtype, columnwise), or_empty(x, cs, f32, columnwise))

    @register_fake("hybridq::fp8_block_tensors_quantize")
    def _quantize_tensors(xs, param_dtype, e5m2, eps, pow2, regions):
        from .fp8_block_tensors import scale_slots

        scales = scale_slots([(x.shape[0], x.shape[1]) for x in xs])[1]
        return xs[0].new_empty((sum(regions),), dtype=torch.uint8), xs[0].new_empty((scales,), dtype=f32)

    @register_fake("hybridq::fp8_block_dequantize")
    def _dequantize(data, scale_inv, block_dim, out_dtype):
        return data.new_empty(data.shape, dtype=out_dtype)

    # (the grouped GEMMs' results: bfloat16 / float32 as asked, float16 as float32: csrc/grouped_block_gemm.cu)
    def _gemm_dtype(out_dtype):
        return f32 if out_dtype == torch.float16 else out_dtype

    @register_fake("hybridq::fp8_block_mm")
    def _block_mm(a, a_scale, b, b_scale, b_tiles, out_dtype):
        return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)

    @register_fake("hybridq::fp8_block_linear")
    def _linear(x, weight, bias, x_row, x_row_scale_inv, x_col, x_col_scale_inv, *casts_and_flags):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @register_fake("hybridq::fp8_block_linear_fprop")
    def _linear_fprop(x, w_row, w_row_scale_inv, bias, x_dtype, x_eps, x_pow2, w_block_dim, need_wgrad,
                      save_original_input):
        y = x.new_empty((*x.shape[:-1], w_row.shape[0]))
        columnwise = need_wgrad and not save_original_input
        k = x.shape[-1]
        m = x.numel() // k
        return (y, or_empty(x, (k, m), x_dtype, columnwise), or_empty(x, (k, -(-m // 128)), f32, columnwise))

    @register_fake("hybridq::fp8_block_linear_grads")
    def _linear_grads(dy, x_saved, x_col_scale_inv, w_col, w_col_scale_inv, x_dtype, x_eps, x_pow2, g_dtype, g_eps,
                      g_pow2, w_block_dim, save_original_input, need_dgrad, need_wgrad, need_bgrad, x_shape, w_dtype,
                      b_dtype):
        n = dy.shape[-1]
        return (dy.new_empty(tuple(x_shape)) if need_dgrad else dy.new_empty((0,)),
                dy.new_empty((n, x_shape[-1]), dtype=w_dtype) if need_wgrad else dy.new_empty((0,)),
                dy.new_empty((n,), dtype=b_dtype) if need_bgrad else dy.new_empty((0,)))

    @register_fake("hybridq::grouped_block_cublas_mm")
    def _cublas_mm(a, a_scale, b, b_scale, b_tiles, b_dim, offsets, rows, tokens, slot_offsets, slot_rows,
                   out_dtype, streams=1):
        n = b.shape[0] if b_dim == 1 else b.shape[0] // len(tokens)
        return a.new_empty((sum(tokens), n), dtype=_gemm_dtype(out_dtype))

    @register_fake("hybridq::grouped_block_cublas_wgrad")
    def _cublas_wgrad(a_t, a_scale, b_t, b_scale, offsets, rows, out_dtype, streams=1):
        return a_t.new_empty((len(offsets), a_t.shape[0], b_t.shape[0]), dtype=_gemm_dtype(out_dtype))


_LINEAR: dict = {}


def linear_op(name: str = "fp8_block_linear"):
    """The overload of `hybridq::fp8_block_linear` (or of the op `name`, one of the Linear ops above) itself (called
    as is: no overload resolution per call)."""
    op = _LINEAR.get(name)
    if op is None:
        op = _LINEAR[name] = getattr(ops(), name).default
    return op


def register() -> None:
    register_quantize(Float8BlockQuantizer, KernelImpl("cuda-fp8-block", "cuda", run, supports, OPTIONS))
    register_dequantize(Float8BlockPart, KernelImpl("cuda-fp8-block", "cuda", dequantize, part_supports))
