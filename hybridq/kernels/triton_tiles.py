"""What the Triton GEMM kernels share: device functions (Triton is optional: none is defined without it) and the host
side of the two block-scaled GEMMs over one output tile per program (triton_mxfp8.mxfp8_mm,
triton_dequant_gemm.dequant_mm): their autotuning candidates, pruning and launch."""

from __future__ import annotations

from typing import Callable

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

# the dtypes the block-scaled GEMMs write (others through fp32)
GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def small_tiles(configs: list, m: int, n: int) -> list:
    """The configs whose tiles are not much larger than the [m, n] problem (they only add masked work), or all of
    them where none is."""
    small = [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, next_pow2(m))
             and c.kwargs["BLOCK_N"] <= max(64, next_pow2(n))]
    return small or configs


def autotune_configs(entries, config_dict: Callable) -> list:
    """triton.Config of each entry, through the kernel's `config_dict` (its keywords plus num_stages, num_warps)."""
    out = []
    for c in entries:
        d = config_dict(c)
        st, w = d.pop("num_stages"), d.pop("num_warps")
        out.append(triton.Config(d, num_stages=st, num_warps=w))
    return out


def run_block_gemm(tuned, kernel, m: int, n: int, k: int, device: torch.device, out_dtype: torch.dtype,
                   args: Callable, constexprs: dict, config: dict | None, fix_config: Callable,
                   last_compiled: dict) -> torch.Tensor:
    """The `[m, n]` product in out_dtype of a block-scaled GEMM kernel with one output tile per program: the result
    written in fp32 where the kernel cannot write out_dtype; an empty or zero-K product without a launch; else
    `tuned` (the autotuned kernel) where `config` is None, or `kernel` with `config` -- a dict of its tile keywords
    with num_warps (default 8) and num_stages (3), GROUP_M defaulting to 8, then `fix_config(cfg)` (which may adapt
    it to K, or raise) -- whose compiled kernel goes to last_compiled["kernel"]. `args(c)`: the
    kernel's arguments with the output c; `constexprs`: its keywords besides the tile's."""
    od = out_dtype if out_dtype in GEMM_OUT_DTYPES else torch.float32
    c = torch.empty(m, n, device=device, dtype=od)
    if m and n and not k:
        c.zero_()
    elif m and n:
        if config is None:
            grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
            tuned[grid](*args(c), **constexprs)
        else:
            cfg = dict(config)
            w, st = cfg.pop("num_warps", 8), cfg.pop("num_stages", 3)
            cfg.setdefault("GROUP_M", 8)
            fix_config(cfg)
            grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
            last_compiled["kernel"] = kernel[grid](*args(c), **constexprs, num_warps=w, num_stages=st, **cfg)
    return c if od == out_dtype else c.to(out_dtype)


if triton is not None:
    @triton.jit
    def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of program `pid` among num_m x num_n output tiles in the grouped launch order:
        GROUP_M row tiles in a row share their column operand's tiles in L2."""
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(offs_m, offs_n, rm, rn) of this program's [BLOCK_M, BLOCK_N] tile of an [M, N] output in the grouped
        launch order: its rows and columns, and the operand rows it reads, int64 -- edge tiles read a valid row (row
        0) in place of the missing ones, whose results `store_tile` does not store."""
        pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        return offs_m, offs_n, rm, rn

    @triton.jit
    def store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm):
        """The fp32 tile `acc` rounded to the output's dtype and stored where it lies inside [M, N]."""
        c = acc.to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def e8m0_to_pow2(e):
        """fp32 2^(e - 127) of int32 E8M0 bytes in [0, 255] (formats._numerics.e8m0_to_pow2): exact, byte 0 the
        fp32 subnormal 2^-127, byte 255 NaN."""
        bits = tl.where(e == 0, 0x00400000, e << 23)
        return tl.where(e == 255, float("nan"), bits.to(tl.float32, bitcast=True))
