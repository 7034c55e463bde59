"""Grouped FP8 block-scaled GEMMs of a grouped linear (mixture of experts) for Hopper (sm_90) in Triton: one launch
per phase for all experts, reading the packed quantized buffers of `hybridq.nn.grouped_packed_blocks` as they are
(every expert's tokens in a slot of one buffer), the group bounds from a device tensor (no per-expert Python loop,
no host sync).

  - `grouped_block_mm` (fprop, dgrad: 2-D x 3-D): for every group g, the first `rows[g]` rows of its slot,
    `out[out_start[g] + r] = sum_kb (a[a_start[g] + r, kb-block] . b_g[:, kb-block]) * sa[a_start[g] + r, kb] *
    sb_g[:, kb]` with `a` fp8 `[S, K]` in 1x128 blocks (scales `[S, ceil(K/128)]`) and `b_g[j, :]` (contiguous along
    K) at `b + g * b_group_stride + j * b_row_stride`, scaled in 128x128 tiles or 1x128 rows (`b_row_block` 128 /
    1: the scale of `b_g[j, kb-block]` at `sb + g * sb_group_stride + (j // b_row_block) * sb_row_stride + kb *
    sb_k_stride`). The rows come out where the caller wants them (the unpacked token order: no unpack copy).
  - `grouped_block_wgrad` (wgrad: 2-D x 2-D, contracted over each group's slot): `out[g] = sum_kb (a_t[:, kb-block
    of slot g] . b_t[:, kb-block of slot g]^T) * sa[:, kb] * sb[:, kb]` with the columnwise forms `a_t [M, S]`,
    `b_t [N, S]` in 128-token blocks (scales `[M, ceil(S/128)]`, `[N, ...]`); every slot starts on a 128-token
    boundary, so no block holds two experts' tokens; an empty slot gives a zero product.

Numerics: DeepGEMM's promotion. Each 128-wide K block's products are summed on the tensor cores (fp32 accumulator,
a fresh one per block), then the block's partial sum is multiplied by `sa * sb` (the product of the two fp32
scale_inv, one rounding) and added to an fp32 accumulator; the output is rounded once to out_dtype. Against the
per-expert `hybridq.gemm.gemm` of the same operands (cuBLAS's block-scaled GEMM on sm_90, the fp32 emulation on
the CPU): the same exact products, summed in another order and with the scales applied per block instead of per
element -- not bitwise; tested per expert within 1e-3 of the largest magnitude of the fp32 product of the dequantized
operands (docs/numerics.md "Row groups and grouped GEMMs"). With power-of-two scales (the presets') `sa * sb` is exact
while it is a normal fp32 number (>= 2^-126: two blocks whose amaxes multiply to more than ~2^-108); below that the
block's contribution loses precision where the per-expert emulation, which scales each operand first, would not.
Rows and columns are independent: a non-finite value
reaches only the outputs of its own expert (its rows in fprop / dgrad, its slot in wgrad).

Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import torch

from .triton_grouped_fp8 import available
from .triton_tiles import cdiv as _cdiv, next_pow2 as _next_pow2
from .triton_launch import config_key, kept_plan, launch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

BLOCK = 128  # elements per scale along the contracted dim (FP8 1x128 blocks / 128x128 tiles): the K tile
LAST_COMPILED: dict = {}  # the last compiled kernel per name (benchmarks read registers / spills)

# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) per kernel; BLOCK_K is the scaling block. Two fp32 accumulators
# (the block's partial sum and the promoted one): compiled for sm_90 (Triton 3.6, ptxas 13.0), 64x128 with 4 warps
# uses 231-242 registers and spills nothing (two CTAs per SM, so one CTA's scaling overlaps another's wgmma), where
# 128x128 with 8 warps spills in wgrad and 128x128 with 4 warps / 128x256 spill everywhere; vLLM's tuned H200 configs
# of the same kernel form (`acc += dot(a, b) * sa * sb`, 128x128 blocks) take 64x128, 4 warps, 3-4 stages at large M.
# The first GPU measurement (BENCHMARKS.md "Grouped FP8 block GEMMs") ran 128x128 with 8 warps and 4 stages.
# The sweep of 2026-11-27 09:50 UTC (one H200, `.devrun/b3/sweep.py`: fprop, dgrad and wgrad at bench_grouped's three
# configs, six candidates) put 64x128, GROUP_M 8, 4 warps, 4 stages first for both kernels: 17.6 ms over the mm shapes,
# 13.6 ms over the wgrad ones (30-33 ms for the 128x128 configs).
CONFIGS = {
    "mm": (64, 128, 8, 4, 4),
    "wgrad": (64, 128, 8, 4, 4),
}


if triton is not None:
    from .triton_grouped_fp8 import _pick  # vec[g] as a scalar
    from .triton_tiles import grouped_tile

    @triton.jit(do_not_specialize=["E"])
    def _grouped_block_mm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, bounds_ptr, N, K, E,
                                 stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_sbk,
                                 stride_cm,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, EP: tl.constexpr, B_ROW_BLOCK: tl.constexpr,
                                 EVEN_K: tl.constexpr, SB_SCALAR: tl.constexpr):
        pid = tl.program_id(0)
        gi = tl.arange(0, EP)
        on = gi < E
        a_starts = tl.load(bounds_ptr + gi, mask=on, other=0)
        c_starts = tl.load(bounds_ptr + E + gi, mask=on, other=0)
        sizes = tl.load(bounds_ptr + 2 * E + gi, mask=on, other=0)
        mt = (sizes + BLOCK_M - 1) // BLOCK_M  # row tiles of each group
        mt_end = tl.cumsum(mt, 0)
        total_mt = tl.sum(mt, axis=0)
        num_n = tl.cdiv(N, BLOCK_N)
        if pid >= total_mt * num_n:  # (the grid is an upper bound: the tile counts live on the device)
            return
        tm, tn = grouped_tile(pid, total_mt, num_n, GROUP_M)
        g = tl.sum((mt_end <= tm).to(tl.int32), axis=0)  # the group of row tile tm
        row0 = (tm - _pick(gi, mt_end - mt, g)) * BLOCK_M
        a_start = _pick(gi, a_starts, g)
        c_start = _pick(gi, c_starts, g)
        size = _pick(gi, sizes, g)

        rm = row0 + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < size
        col_ok = rn < N
        a_rows = (a_start + rm).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
        sa_ptrs = sa_ptr + a_rows * stride_sam
        b_ptrs = b_ptr + g.to(tl.int64) * stride_bg + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
        sb_base = sb_ptr + g.to(tl.int64) * stride_sbg
        if SB_SCALAR:  # (the tile's columns share one scale row: 128x128 tiles, BLOCK_N dividing 128)
            sb_ptrs = sb_base + ((tn * BLOCK_N) // B_ROW_BLOCK).to(tl.int64) * stride_sbn
        else:
            sb_ptrs = sb_base + (rn // B_ROW_BLOCK).to(tl.int64) * stride_sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // BLOCK_K
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
            else:  # (a partial last block: its missing products are zeros)
                k_ok = (k0 + rk < K)[None, :]
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok, other=0.0)
            part = tl.dot(a, tl.trans(b))  # the block's products, a fresh fp32 sum
            sa = tl.load(sa_ptrs + kb, mask=row_ok, other=0.0)
            if SB_SCALAR:
                acc += part * (sa * tl.load(sb_ptrs + kb * stride_sbk))[:, None]
            else:
                sb = tl.load(sb_ptrs + kb * stride_sbk, mask=col_ok, other=0.0)
                acc += part * (sa[:, None] * sb[None, :])
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c = acc.to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + (c_start + rm).to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["E"])
    def _grouped_block_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, starts_ptr, sizes_ptr, M, N,
                                    pitch_a, pitch_sa, pitch_b, pitch_sb, stride_cg, stride_cm,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, EVEN: tl.constexpr):
        tm, tn = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        g = tl.program_id(1)
        start = tl.multiple_of(tl.load(starts_ptr + g), BLOCK_K)  # the slot's first token, a block boundary
        size = tl.load(sizes_ptr + g)
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < M
        col_ok = rn < N
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * pitch_a + (start + rk)[None, :]
        b_ptrs = b_ptr + rn.to(tl.int64)[:, None] * pitch_b + (start + rk)[None, :]
        sa_ptrs = sa_ptr + rm.to(tl.int64) * pitch_sa + start // BLOCK_K
        sb_ptrs = sb_ptr + rn.to(tl.int64) * pitch_sb + start // BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, size, BLOCK_K):
            kb = k0 // BLOCK_K
            if EVEN:  # (every slot whole blocks)
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
            else:  # (a partial last block: the tokens after the slot are not this group's)
                k_ok = (k0 + rk < size)[None, :]
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok, other=0.0)
            part = tl.dot(a, tl.trans(b))
            sa = tl.load(sa_ptrs + kb, mask=row_ok, other=0.0)
            sb = tl.load(sb_ptrs + kb, mask=col_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c = acc.to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + g.to(tl.int64) * stride_cg + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])


def grouped_block_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_group_stride: int,
                     b_row_stride: int, n: int, b_scale_inv: torch.Tensor, b_scale_strides: tuple[int, int, int],
                     b_row_block: int, bounds: torch.Tensor, out_rows: int,
                     out_dtype: torch.dtype = torch.bfloat16, config=None) -> torch.Tensor:
    """`[out_rows, n]`: for every group g of `bounds` (int32 `[3, E]` on the device: a_start, out_start, rows), rows
    `out_start[g] + r` = row `a_start[g] + r` of `a` times `b_g^T` (module docstring). `a` fp8 `[S, K]` with unit
    stride along K, `a_scale_inv` fp32 `[S, ceil(K/128)]` (unit stride along the blocks); `b_scale_strides`: the
    element strides of `b_scale_inv` per group, per `b_row_block` rows of `b_g`, per K block. Rows of the result
    that no group covers are not written."""
    k = a.shape[1]
    e = bounds.shape[1]
    c = torch.empty(out_rows, n, device=a.device, dtype=out_dtype)
    if c.numel() == 0 or e == 0:
        return c
    grid, kw = launch_plan("mm", out_rows, n, k, e, b_row_block, config_key(config))
    sbg, sbn, sbk = b_scale_strides
    LAST_COMPILED["mm"] = launch(
        _grouped_block_mm_kernel, grid, a, a_scale_inv, b, b_scale_inv, c, bounds, n, k, e, a.stride(0),
        a_scale_inv.stride(0), b_group_stride, b_row_stride, sbg, sbn, sbk, c.stride(0), **kw)
    return c


def grouped_block_wgrad(a_t: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor, b_scale_inv: torch.Tensor,
                        starts: torch.Tensor, sizes: torch.Tensor, even: bool, out_dtype: torch.dtype = torch.bfloat16,
                        config=None) -> torch.Tensor:
    """`[E, M, N]`: `out[g] = a_t[:, slot g] @ b_t[:, slot g]^T` with per-128-token block scales (module docstring);
    `starts` / `sizes`: int32 `[E]` on the device, each slot's first token (a multiple of 128) and its tokens;
    `even`: every size is a multiple of 128. `a_t` fp8 `[M, S]`, `b_t` fp8 `[N, S]`, unit stride along the tokens;
    scales fp32 `[M, ceil(S/128)]`, `[N, ceil(S/128)]`, unit stride along the blocks."""
    m, n = a_t.shape[0], b_t.shape[0]
    e = starts.shape[0]
    c = torch.empty(e, m, n, device=a_t.device, dtype=out_dtype)
    if c.numel() == 0:
        return c
    grid, kw = launch_plan("wgrad", m, n, e, even, config_key(config))
    LAST_COMPILED["wgrad"] = launch(
        _grouped_block_wgrad_kernel, grid, a_t, a_scale_inv, b_t, b_scale_inv, c, starts, sizes, m, n, a_t.stride(0),
        a_scale_inv.stride(0), b_t.stride(0), b_scale_inv.stride(0), c.stride(0), c.stride(1), **kw)
    return c


def _mm_plan(out_rows: int, n: int, k: int, e: int, b_row_block: int, config) -> tuple:
    bm, bn, gm, w, st = config if config is not None else CONFIGS["mm"]
    # (grid: an upper bound of the row tiles, each group may end one partial tile)
    return ((_cdiv(out_rows, bm) + e) * _cdiv(n, bn),), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=gm, EP=max(16, _next_pow2(e)), B_ROW_BLOCK=b_row_block,
        EVEN_K=k % BLOCK == 0, SB_SCALAR=b_row_block % bn == 0, num_warps=w, num_stages=st)


def _wgrad_plan(m: int, n: int, e: int, even: bool, config) -> tuple:
    bm, bn, gm, w, st = config if config is not None else CONFIGS["wgrad"]
    return (_cdiv(m, bm) * _cdiv(n, bn), e), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=gm, EVEN=even,
                                                  num_warps=w, num_stages=st)


_PLAN_MAKERS = {"mm": _mm_plan, "wgrad": _wgrad_plan}
# (kind, the plan maker's arguments) -> (grid, the constexprs and options): a launch's parameters depend on nothing
# else (derived anew they cost ~10 Python calls per launch, 3 launches per expert projection's forward + backward)
_PLANS: dict = {}


def launch_plan(kind: str, *shape) -> tuple:
    """(grid, keyword arguments of `launch`) of a `kind` kernel ("mm", "wgrad") for these sizes and options (the
    arguments of its `_*_plan` maker), made once per distinct arguments ([Note: launch plans])."""
    return kept_plan(_PLANS, (kind, *shape), _PLAN_MAKERS[kind], *shape)
