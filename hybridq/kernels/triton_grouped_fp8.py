"""Per-tensor FP8 grouped GEMMs of a grouped linear (mixture of experts) for Hopper (sm_90) in Triton, on the jagged
token layout: every expert's tokens are consecutive rows of one tensor, group g's rows `[starts[g], ends[g])` with
`ends` (int32 `[E]`, cumulative token counts, the `offs` of `torch._grouped_mm`) on the device. No padding, no
packing copy and no host synchronization: the kernels read the group bounds from `ends` and mask the rows (fprop,
dgrad) or the contracted tokens (wgrad) of each group.

  - `jagged_mm` (fprop, dgrad: 2-D x 3-D): `out[rows of g] = (a[rows of g] @ b[g]^T) * (sa[g] * sb[g])` with
    `a` fp8 `[T, K]` (rows), `b[g]` fp8 `[N, K]` given by a base tensor and strides (the weight's rowwise bytes
    `[E*N, K]` for fprop, a column slice of its columnwise bytes `[K, E*N]` for dgrad: no per-expert copy);
  - `jagged_wgrad` (wgrad: 2-D x 2-D, contracted over each group's tokens): `out[g] = (a_t[:, tokens of g] @
    b_t[:, tokens of g]^T) * (sa[g] * sb[g])` with the columnwise (transposed) bytes `a_t [N, T]`, `b_t [K, T]`;
    an expert without tokens gets a zero product.

Any pairing of E4M3 / E5M2 (the gradients of the fp8_tensorwise preset are E5M2, which `torch._scaled_grouped_mm`
does not take on sm_90). The products accumulate in fp32 on the tensor cores; with `precise=True` (the backward
GEMMs, as `torch._scaled_mm` without fast accumulation) each 128-wide K block's partial sum is added into a separate
fp32 accumulator (DeepGEMM's promotion; Triton's `max_num_imprecise_acc`), with `precise=False` (fprop, fast
accumulation) the tensor cores accumulate the whole K. The per-group scales multiply the fp32 result once, before the
one rounding to the output dtype. Numerics against one `torch._scaled_mm` per expert (docs/numerics.md "Row groups and
grouped GEMMs"): the same operands and the same exact products, summed in another order.

wgrad reads 16-byte chunks of the columnwise rows: their row pitch (stride) must be a multiple of 16 bytes (the
grouped quantize writes them so); a group's first and last K tiles are read aligned and the tokens of the
neighbouring groups are zeroed in registers (both operands: a NaN of another expert must not enter this one's sum).

Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import torch

from .triton_launch import config_key, kept_plan, launch
from .triton_tiles import cdiv as _cdiv, next_pow2 as _next_pow2  # (also triton_slot_layout's, triton_grouped_blocks')

try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PROMOTE_K = 128  # precise accumulation: a separate fp32 sum every 128 products (the K tile)
LAST_COMPILED: dict = {}  # the last compiled kernel per name (benchmarks read registers / spills)

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per kernel and accumulation mode; overridable per call
# for the benchmarks (`config=`)
# (the fastest of those measured on an H200 at the bench_grouped configs; the precise ones keep two fp32 accumulators,
# which larger tiles spill: BENCHMARKS.md "MoE")
CONFIGS = {
    ("mm", False): (128, 256, 128, 8, 8, 3),
    ("mm", True): (256, 128, 128, 8, 8, 3),
    ("wgrad", False): (128, 256, 128, 8, 8, 3),
    ("wgrad", True): (128, 128, 128, 8, 8, 4),
}


def available() -> bool:
    """True when Triton imports (the device checks are the caller's)."""
    return triton is not None


if triton is not None:
    from .triton_tiles import grouped_tile
    @triton.jit
    def _group_bounds(ends_ptr, E, EP: tl.constexpr):
        """(group index vector, starts, sizes) of the E groups, padded to EP lanes with empty groups."""
        gi = tl.arange(0, EP)
        ends = tl.load(ends_ptr + gi, mask=gi < E, other=0)
        starts = tl.load(ends_ptr + gi - 1, mask=(gi >= 1) & (gi < E), other=0)
        sizes = tl.where(gi < E, ends - starts, 0)
        return gi, starts, sizes

    @triton.jit
    def _dot(a, b, acc, PRECISE: tl.constexpr, WIDTH: tl.constexpr):
        """acc + a @ b^T of FP8 tiles contracting WIDTH elements; PRECISE: the product summed into acc at full fp32
        precision (max_num_imprecise_acc = WIDTH: the promotion the module docstring describes)."""
        if PRECISE:
            return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=WIDTH)
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def _pick(gi, vec, g):
        """vec[g] as a scalar."""
        return tl.sum(tl.where(gi == g, vec, 0), axis=0)

    @triton.jit(do_not_specialize=["T", "E"])
    def _jagged_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, ends_ptr, T, N, K, E,
                          stride_am, stride_bg, stride_bn, stride_cm, stride_sb,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, EP: tl.constexpr, PRECISE: tl.constexpr):
        pid = tl.program_id(0)
        gi, starts, sizes = _group_bounds(ends_ptr, E, EP)
        mt = (sizes + BLOCK_M - 1) // BLOCK_M  # row tiles of each group
        mt_end = tl.cumsum(mt, 0)
        total_mt = tl.sum(mt, axis=0)
        num_n = tl.cdiv(N, BLOCK_N)
        if pid >= total_mt * num_n:  # (the grid is an upper bound: the tile counts live on the device)
            return
        tm, tn = grouped_tile(pid, total_mt, num_n, GROUP_M)
        g = tl.sum((mt_end <= tm).to(tl.int32), axis=0)  # the group of row tile tm
        g_start = _pick(gi, starts, g)
        g_size = _pick(gi, sizes, g)
        row0 = (tm - _pick(gi, mt_end - mt, g)) * BLOCK_M

        rm = row0 + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < g_size
        col_ok = rn < N
        a_ptrs = a_ptr + (g_start + rm).to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + g.to(tl.int64) * stride_bg + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
            acc = _dot(a, b, acc, PRECISE, BLOCK_K)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        scale = tl.load(sa_ptr + g) * tl.load(sb_ptr + g * stride_sb)
        c = (acc * scale).to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + (g_start + rm).to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _wgrad_edge(acc, a_ptr, b_ptr, a_rows, b_rows, row_ok, col_ok, k, lo, hi, PRECISE: tl.constexpr):
        """The group's tokens [lo, hi) (fewer than 16, at a 16-token boundary) inside the 32-token window from the
        16-aligned token k: masked loads (the neighbours' tokens read as zeros), one K = 32 product."""
        rk = k + tl.arange(0, 32)
        mine = ((rk >= lo) & (rk < hi))[None, :]
        a = tl.load(a_ptr + a_rows[:, None] + rk[None, :], mask=row_ok[:, None] & mine, other=0.0)
        b = tl.load(b_ptr + b_rows[:, None] + rk[None, :], mask=col_ok[:, None] & mine, other=0.0)
        return _dot(a, b, acc, PRECISE, 32)

    @triton.jit(do_not_specialize=["E"])
    def _jagged_wgrad_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, ends_ptr, M, N, E, pitch_a, pitch_b,
                             stride_cg, stride_cm,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, PRECISE: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        g = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        tm, tn = grouped_tile(pid, num_m, num_n, GROUP_M)
        end = tl.load(ends_ptr + g)
        start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        if ALIGNED:  # (the padded layout: every group's bounds are multiples of 16, no edge tokens)
            start = tl.multiple_of(start, 16)
            end = tl.multiple_of(end, 16)

        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < M
        col_ok = rn < N
        a_rows = rm.to(tl.int64) * pitch_a
        b_rows = rn.to(tl.int64) * pitch_b
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the group's whole 16-token chunks [s16, e16) in the main loop (16-byte loads, a 16-token granular mask on
        # the last tile); the < 16 tokens before s16 and from e16 on as two small masked products
        s16 = tl.multiple_of((start + 15) // 16 * 16, 16)
        e16 = tl.multiple_of(end // 16 * 16, 16)
        if not ALIGNED:
            if start < tl.minimum(s16, end):  # head: [start, min(s16, end))
                acc = _wgrad_edge(acc, a_ptr, b_ptr, a_rows, b_rows, row_ok, col_ok, s16 - 16, start,
                                  tl.minimum(s16, end), PRECISE)
        a_ptrs = a_ptr + a_rows[:, None] + (s16 + rk)[None, :]
        b_ptrs = b_ptr + b_rows[:, None] + (s16 + rk)[None, :]
        n_full = tl.maximum(e16 - s16, 0) // BLOCK_K
        for _ in range(0, n_full):  # whole K tiles: the masks are loop-invariant (as in fprop)
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
            acc = _dot(a, b, acc, PRECISE, BLOCK_K)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        k_last = s16 + n_full * BLOCK_K
        if k_last < e16:  # the last, partial tile of whole 16-token chunks
            inside = (k_last + rk < e16)[None, :]
            a = tl.load(a_ptrs, mask=row_ok[:, None] & inside, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None] & inside, other=0.0)
            acc = _dot(a, b, acc, PRECISE, BLOCK_K)
        if not ALIGNED:
            if (e16 >= s16) & (e16 < end):  # tail: [e16, end)
                acc = _wgrad_edge(acc, a_ptr, b_ptr, a_rows, b_rows, row_ok, col_ok, e16, e16, end, PRECISE)
        scale = tl.load(sa_ptr + g) * tl.load(sb_ptr + g)
        c = (acc * scale).to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + g.to(tl.int64) * stride_cg + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])


def _config(kind: str, precise: bool, k: int, config) -> tuple:
    bm, bn, bk, gm, w, st = config if config is not None else CONFIGS[(kind, precise)]
    while bk > 32 and k % bk:
        bk //= 2
    return bm, bn, bk, gm, w, st


def _mm_plan(t: int, n: int, k: int, e: int, precise: bool, config) -> tuple:
    bm, bn, bk, gm, w, st = _config("mm", precise, k, config)
    # (grid: an upper bound of the row tiles, each group may end one partial)
    return ((_cdiv(t, bm) + e) * _cdiv(n, bn),), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                                                       EP=max(16, _next_pow2(e)), PRECISE=precise, num_warps=w,
                                                       num_stages=st)


def _wgrad_plan(m: int, n: int, e: int, precise: bool, aligned: bool, config) -> tuple:
    bm, bn, bk, gm, w, st = _config("wgrad", precise, 128, config)
    return (_cdiv(m, bm) * _cdiv(n, bn), e), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, PRECISE=precise,
                                                  ALIGNED=aligned, num_warps=w, num_stages=st)


_PLAN_MAKERS = {"mm": _mm_plan, "wgrad": _wgrad_plan}
# (kind, the plan maker's arguments) -> (grid, the constexprs and options): triton_launch's [Note: launch plans]
# (5 launches per expert layer's forward + backward)
_PLANS: dict = {}


def launch_plan(kind: str, *shape) -> tuple:
    """(grid, keyword arguments of `launch`) of a `kind` kernel ("mm", "wgrad") for these sizes and
    options (the arguments of its `_*_plan` maker), made once per distinct arguments."""
    return kept_plan(_PLANS, (kind, *shape), _PLAN_MAKERS[kind], *shape)


def check_jagged(a: torch.Tensor, b_rows: int, k: int, ends: torch.Tensor) -> str | None:
    """Why `jagged_mm` / `jagged_wgrad` cannot take these operands, or None."""
    if a.dtype not in _FP8 or not a.is_cuda:
        return f"fp8 CUDA operands expected, got {a.dtype} on {a.device}"
    if k % 32:
        return f"the contracted size {k} is not a multiple of 32"
    if ends.dtype != torch.int32 or ends.dim() != 1 or not ends.is_contiguous():
        return "ends must be a contiguous int32 [E] tensor"
    return None


def jagged_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_group_stride: int, b_row_stride: int,
              n: int, b_scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
              precise: bool = False, config=None) -> torch.Tensor:
    """`out[rows of g] = a[rows of g] @ b_g^T * (a_scale_inv[g] * b_scale_inv[g])` for the E groups of `ends` (see
    the module docstring); `b_g[j, :]` starts at element `g * b_group_stride + j * b_row_stride` of `b` (contiguous
    along K), `n` rows each. `a` fp8 `[T, K]` contiguous; result `[T, n]` in out_dtype. `b_scale_inv` fp32 `[E]` of any
    stride (the gathered experts' scales are read in place: a column of their 16-byte aligned `[E, 4]` buffer)."""
    t, k = a.shape
    e = ends.shape[0]
    c = torch.empty(t, n, device=a.device, dtype=out_dtype)
    if t == 0 or n == 0:
        return c
    grid, kw = launch_plan("mm", t, n, k, e, precise, config_key(config))
    LAST_COMPILED["mm"] = launch(
        _jagged_mm_kernel, grid, a, b, c, a_scale_inv, b_scale_inv, ends, t, n, k, e, a.stride(0), b_group_stride,
        b_row_stride, c.stride(0), b_scale_inv.stride(0), **kw)
    return c


def jagged_wgrad(a_t: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor, b_scale_inv: torch.Tensor,
                 ends: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, precise: bool = True,
                 config=None, aligned: bool = False) -> torch.Tensor:
    """`out[g] = a_t[:, tokens of g] @ b_t[:, tokens of g]^T * (a_scale_inv[g] * b_scale_inv[g])`: `[E, M, N]` for
    `a_t` fp8 `[M, T]`, `b_t` fp8 `[N, T]` (unit stride along the tokens; row strides multiples of 16). `aligned`:
    every group's bounds in `ends` are multiples of 16 (the padded layout of the grouped cast's columnwise form), so
    the kernel has no edge products (~1.4x faster)."""
    m, n = a_t.shape[0], b_t.shape[0]
    e = ends.shape[0]
    c = torch.empty(e, m, n, device=a_t.device, dtype=out_dtype)
    if c.numel() == 0:
        return c
    if a_t.shape[1] == 0:  # no tokens at all: every expert's product is empty
        return c.zero_()
    if a_t.stride(0) % 16 or b_t.stride(0) % 16 or a_t.stride(0) != b_t.stride(0):
        raise ValueError(f"jagged_wgrad: the columnwise rows need one row pitch, a multiple of 16 bytes; got "
                         f"{a_t.stride(0)} and {b_t.stride(0)}")
    grid, kw = launch_plan("wgrad", m, n, e, precise, aligned, config_key(config))
    LAST_COMPILED["wgrad"] = launch(
        _jagged_wgrad_kernel, grid, a_t, b_t, c, a_scale_inv, b_scale_inv, ends, m, n, e, a_t.stride(0),
        b_t.stride(0), c.stride(0), c.stride(1), **kw)
    return c
