"""MXFP8 / NVFP4 GEMMs for Hopper (sm_90) in Triton: dequantize each K tile in registers, multiply in bf16.

cuBLAS has no MXFP8 or NVFP4 GEMM on sm_90, so hybridq emulates them there (`native_gemm._bf16_run`): a CUDA kernel
writes a bf16 copy of each operand to HBM (exact, see `native_gemm.exact_bf16_operand`), then cuBLAS multiplies
the copies in bf16 with fp32 accumulation. This kernel computes the same `a @ b^T` without the copies: it reads the
codes and scales as stored, any pairing of

  - MXFP8: fp8 codes `[rows, K]` (E4M3 or E5M2) and E8M0 scale bytes `[rows, K/32]`;
  - NVFP4: packed E2M1 codes uint8 `[rows, K/2]` (element 2i in the low nibble), E4M3 block scales
    `[rows, K/16]` and the fp32 global factor `amax / 2688`,

and for every K tile turns each operand tile into bf16 values in registers, exactly as the emulation's dequantize
kernel does (MXFP8: fp32 `code * 2^(e - 127)` rounded to bf16; NVFP4: `e2m1 * fp32(scale)`, at most 6 significant
bits, so exact in bf16), feeds them to bf16 `tl.dot` (wgmma) accumulating in fp32 over the whole K, and at the end
multiplies the fp32 result by the global factor of each NVFP4 operand (a's, then b's, as the emulation does) before
the one rounding to the output dtype. Numerics against the emulation (docs/numerics.md "Block-scaled GEMMs on
sm_90 (Triton, dequantize in registers)"): the operands' bf16 values are bitwise those of the emulation and their
products exact in fp32; only the order of the fp32 accumulation differs (and the emulation of MXFP8 x MXFP8
rounds its result to bf16 before any other output dtype, this kernel does not).

Operands in the Hadamard domain (NVFP4 with RHT) are multiplied as stored: the caller passes them only when both
carry the same transform (`native_gemm._dequant_gemm_supports`), as `native_gemm._bf16_supports` does.

Why not the FP8 tensor cores for NVFP4 (per-16 scales in the main loop, like `triton_mxfp8` does per 32): an FP8
wgmma contracts at least 32 elements, so a per-16 scale means a 32-wide product of which half is zeros (twice the
tensor-core work per useful K) and two scale applications per 32 of K (2 x the CUDA-core work of `triton_mxfp8`,
which is already issue-bound at 186 TFLOP/s at 8192^3 on an H100 with 1 FFMA + 1 FMUL per output element per 32 of
K, against 322-473 for the same kernel with the scales ignored). Expected below ~100 TFLOP/s: not built.

Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .triton_tiles import autotune_configs, next_pow2, run_block_gemm, small_tiles

MXFP8 = 0  # values of the A_FMT / B_FMT kernel arguments
NVFP4 = 1
FORMAT_NAMES = {MXFP8: "MXFP8", NVFP4: "NVFP4"}
MXFP8_BLOCK = 32  # elements per scale (hybridq.formats.mxfp8.BLOCK)
NVFP4_BLOCK = 16  # (hybridq.formats.nvfp4.BLOCK)
NVFP4_GLOBAL_DIVISOR = 2688.0  # 6 * 448: dequantized value = e2m1 * scale * amax / 2688 (formats.nvfp4)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LAST_COMPILED: dict = {}  # the compiled kernel of the last call with a fixed config (benchmarks read its registers)

# autotuning candidates: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps). Not yet timed on hardware (written
# without a GPU). Compiled for sm_90 with Triton 3.6 ahead of time (test_compiles_for_sm90), all use 168-255
# registers without spilling; 64x128 / 128x64 with 4 warps fit 3 CTAs per SM (168 registers), so one CTA's
# dequantization can overlap another's wgmma; the 8-warp tiles fit one.
# The BLOCK_K 32 / 16 entries serve K that no larger BLOCK_K divides (K % 64 != 0; 16: NVFP4 x NVFP4 only).
_CONFIGS = ((128, 128, 64, 4, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 256, 64, 3, 8),
            (128, 128, 128, 3, 8), (64, 128, 32, 4, 4), (64, 128, 16, 4, 4))
_SMALL_K = 64  # configs with BLOCK_K below this are only for K that the others cannot take


@dataclasses.dataclass(frozen=True)
class Operand:
    """One GEMM operand as stored, in GEMM orientation (blocks along K, the stored rows' direction).

    fmt: MXFP8 or NVFP4. codes: fp8 `[rows, K]` (MXFP8) or uint8 `[rows, K/2]` (NVFP4, element 2i in the low
    nibble). scale: uint8 E8M0 `[rows, K/32]` (MXFP8) or E4M3 `[rows, K/16]` (NVFP4; uint8 bytes or
    float8_e4m3fn). amax: the NVFP4 global amax, fp32 `[1]` (the kernel applies `amax / 2688`), None for MXFP8.
    k: the contracted size."""

    fmt: int
    codes: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor | None
    k: int

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def describe(self) -> str:
        if self.fmt == MXFP8:
            return f"MXFP8 {'E5M2' if self.codes.dtype == torch.float8_e5m2 else 'E4M3'} [{self.rows}, {self.k}]"
        return f"NVFP4 [{self.rows}, {self.k}]"


def mxfp8_operand(data: torch.Tensor, scale: torch.Tensor) -> Operand:
    """An MXFP8 part's fields (`MXFP8Part.data`, `.scale`) as an operand."""
    return Operand(MXFP8, data, scale, None, data.shape[-1])


def nvfp4_global_factor(amax: torch.Tensor) -> torch.Tensor:
    """fp32 `amax / 2688`, the factor the emulation applies to its fp32 product (`exact_bf16_operand`), computed the
    same way (one fp32 division of the stored amax)."""
    return amax.reshape(1).float() / NVFP4_GLOBAL_DIVISOR


def nvfp4_operand(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> Operand:
    """An NVFP4 part's fields (`NVFP4Part.data`, `.scale`, `.amax`) as an operand."""
    return Operand(NVFP4, data, scale, amax, 2 * data.shape[-1])


def check_operands(a: Operand, b: Operand, contiguous: bool = True) -> str | None:
    """Why the kernel cannot take these operands, or None. Codes 2-D, rows contiguous (unless `contiguous=False`:
    the caller makes them so), one K; MXFP8: fp8 codes, K % 32 == 0, uint8 scales `[rows, K/32]`; NVFP4: uint8
    codes `[rows, K/2]`, K % 16 == 0, one-byte scales `[rows, K/16]`, a one-element fp32 global amax."""
    if a.k != b.k:
        return f"contracted sizes differ: {a.describe()} x {b.describe()}"
    for p in (a, b):
        if p.codes.dim() != 2 or p.scale.dim() != 2:
            return f"{p.describe()}: codes and scales must be 2-D"
        if p.fmt == MXFP8:
            if p.codes.dtype not in _FP8:
                return f"{p.describe()}: fp8 codes expected, got {p.codes.dtype}"
            block, want_scale = MXFP8_BLOCK, (torch.uint8,)
        elif p.fmt == NVFP4:
            if p.codes.dtype != torch.uint8:
                return f"{p.describe()}: packed uint8 codes expected, got {p.codes.dtype}"
            if p.amax is None or p.amax.numel() != 1 or p.amax.dtype != torch.float32:
                return f"{p.describe()}: needs an fp32 global amax of one element"
            block, want_scale = NVFP4_BLOCK, (torch.uint8, torch.float8_e4m3fn)
        else:
            return f"unknown operand format {p.fmt}"
        if p.k % block:
            return f"{p.describe()}: K = {p.k} is not a multiple of {block}"
        if p.scale.dtype not in want_scale or tuple(p.scale.shape) != (p.rows, p.k // block):
            return (f"{p.describe()}: scales {tuple(p.scale.shape)} {p.scale.dtype} do not match "
                    f"([rows, K/{block}] of {', '.join(str(d) for d in want_scale)})")
        if contiguous and p.rows > 1 and p.codes.stride(1) != 1:
            return f"{p.describe()}: codes not contiguous along K"
    return None


def block_k_for(k: int, a_fmt: int, b_fmt: int, largest: int = 128) -> int:
    """The largest BLOCK_K (<= `largest`, a power of two >= 16) that divides K and holds whole scale blocks of both
    operands (32 for an MXFP8 operand)."""
    smallest = MXFP8_BLOCK if MXFP8 in (a_fmt, b_fmt) else NVFP4_BLOCK
    bk = largest
    while bk > smallest and k % bk:
        bk //= 2
    return bk


def config_dict(c) -> dict:
    """The `config` argument of `dequant_mm` for one entry of _CONFIGS."""
    bm, bn, bk, st, w = c
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_stages": st, "num_warps": w}


def _prune(configs, named_args, **kwargs):
    """Configs whose BLOCK_K divides K and holds whole scale blocks; the small-K ones only when no other fits;
    tiles much larger than the problem dropped when smaller ones remain."""
    k, m, n = named_args["K"], named_args["M"], named_args["N"]
    fmts = (kwargs.get("A_FMT", named_args.get("A_FMT")), kwargs.get("B_FMT", named_args.get("B_FMT")))
    smallest = MXFP8_BLOCK if MXFP8 in fmts else NVFP4_BLOCK
    fit = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_K"] >= smallest]
    return small_tiles([c for c in fit if c.kwargs["BLOCK_K"] >= _SMALL_K] or fit, m, n)


def default_config(k: int, a_fmt: int, b_fmt: int) -> dict:
    """The first config of _CONFIGS whose BLOCK_K divides K (without autotuning)."""
    bk = block_k_for(k, a_fmt, b_fmt, largest=_CONFIGS[0][2])
    for c in _CONFIGS:
        if c[2] == bk:
            return config_dict(c)
    return config_dict((64, 128, bk, 4, 4))


try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None


def available() -> bool:
    """True when Triton imports (the device checks are the caller's)."""
    return triton is not None


if triton is not None:
    from .triton_tiles import e8m0_to_pow2, output_tile, store_tile

    @triton.jit
    def _e2m1_times_2_pow_m14(codes):
        """fp32 of E2M1 codes (uint8, 0-15, bit 3 the sign; formats._numerics.e2m1_decode) times 2^-14: the 3 value
        bits become the top of an fp16's exponent and mantissa (bits 9-11) and the sign its bit 15, and fp16
        (sign, 2^(e - 15) * (1 + m / 2), subnormal m * 2^-15) is exactly E2M1 (2^(e - 1) * (1 + m / 2), m / 2)
        times 2^-14. Integer ops and one exact fp16 -> fp32 conversion, no table; the 2^14 goes into the scale."""
        c = codes.to(tl.uint16)
        h = ((c & 7) << 9) | ((c & 8) << 12)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _expand_blocks(s, ROWS: tl.constexpr, NB: tl.constexpr, G: tl.constexpr):
        """[ROWS, NB] per-block values repeated G times along K: [ROWS, NB * G] (formats._numerics.expand_blocks)."""
        return tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, NB, G)), (ROWS, NB * G))

    @triton.jit
    def _bf16_tile(codes_ptrs, scale_ptrs, FMT: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """The [ROWS, BLOCK_K] bf16 values of one operand tile, bitwise those of the emulation's dequantize kernel
        (`torch.ops.hybridq.mxfp8_dequantize` / `nvfp4_dequantize` without the global factor, bf16 out).
        codes_ptrs: [ROWS, BLOCK_K] fp8 (MXFP8) or [ROWS, BLOCK_K / 2] uint8 (NVFP4) pointers; scale_ptrs:
        [ROWS, BLOCK_K / 32] uint8 (MXFP8) or [ROWS, BLOCK_K / 16] E4M3 (NVFP4) pointers."""
        if FMT == 0:  # MXFP8: fp32 code * 2^(e - 127), rounded to bf16 (exact down to bf16's subnormals)
            s = e8m0_to_pow2(tl.load(scale_ptrs).to(tl.int32))
            v = tl.load(codes_ptrs).to(tl.float32) * _expand_blocks(s, ROWS, BLOCK_K // 32, 32)
        else:  # NVFP4: e2m1 * fp32(E4M3 scale), <= 6 significant bits: exact in bf16
            packed = tl.load(codes_ptrs)
            codes = tl.interleave(packed & 0xF, packed >> 4)  # element 2i is the low nibble of byte i
            s = tl.load(scale_ptrs).to(tl.float32) * 16384.0  # 2^14: see _e2m1_times_2_pow_m14 (exact)
            v = _e2m1_times_2_pow_m14(codes) * _expand_blocks(s, ROWS, BLOCK_K // 16, 16)
        return v.to(tl.bfloat16)

    # sizes are not specialized on (one compile serves every M, N, K), nor the scales' row strides (K/32, K/16: tiny
    # loads, fewer compiles); the codes' and output's row strides are (16-byte alignment), the scales' K stride too
    # (1: contiguous scale loads)
    @triton.jit(do_not_specialize=["M", "N", "K", "stride_sam", "stride_sbn", "M_KEY", "N_KEY", "K_KEY"])
    def _dequant_gemm_kernel(a_ptr, sa_ptr, ga_ptr, b_ptr, sb_ptr, gb_ptr, c_ptr, M, N, K,
                             stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_sbk, stride_cm,
                             M_KEY, N_KEY, K_KEY,
                             A_FMT: tl.constexpr, B_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        offs_m, offs_n, rm, rn = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # per K tile: codes (NVFP4 packs two per byte) and scales (one per 32 / 16 elements) of each operand
        A_BYTES: tl.constexpr = BLOCK_K if A_FMT == 0 else BLOCK_K // 2
        B_BYTES: tl.constexpr = BLOCK_K if B_FMT == 0 else BLOCK_K // 2
        A_SCALES: tl.constexpr = BLOCK_K // 32 if A_FMT == 0 else BLOCK_K // 16
        B_SCALES: tl.constexpr = BLOCK_K // 32 if B_FMT == 0 else BLOCK_K // 16
        a_ptrs = a_ptr + rm[:, None] * stride_am + tl.arange(0, A_BYTES)[None, :]
        b_ptrs = b_ptr + rn[:, None] * stride_bn + tl.arange(0, B_BYTES)[None, :]
        sa_ptrs = sa_ptr + rm[:, None] * stride_sam + tl.arange(0, A_SCALES)[None, :] * stride_sak
        sb_ptrs = sb_ptr + rn[:, None] * stride_sbn + tl.arange(0, B_SCALES)[None, :] * stride_sbk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            a = _bf16_tile(a_ptrs, sa_ptrs, A_FMT, BLOCK_M, BLOCK_K)
            b = _bf16_tile(b_ptrs, sb_ptrs, B_FMT, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, tl.trans(b), acc)  # bf16 products are exact in fp32; fp32 accumulation
            a_ptrs += A_BYTES
            b_ptrs += B_BYTES
            sa_ptrs += A_SCALES * stride_sak
            sb_ptrs += B_SCALES * stride_sbk

        # the NVFP4 global factors on the fp32 result, a's then b's (the emulation's order), before the rounding
        if A_FMT == 1:
            acc = acc * tl.load(ga_ptr)
        if B_FMT == 1:
            acc = acc * tl.load(gb_ptr)
        store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm)

    _dequant_gemm_tuned = triton.autotune(configs=autotune_configs(_CONFIGS, config_dict),
                                          key=["M_KEY", "N_KEY", "K_KEY", "A_FMT", "B_FMT"],
                                          prune_configs_by={"early_config_prune": _prune})(_dequant_gemm_kernel)
else:  # (without Triton: `available()` is False)
    _dequant_gemm_kernel = _dequant_gemm_tuned = None


def _kernel_scale(p: Operand) -> torch.Tensor:
    """Scales as the kernel reads them: E8M0 bytes (uint8), E4M3 typed so that the kernel converts them."""
    return p.scale.view(torch.float8_e4m3fn) if p.fmt == NVFP4 else p.scale


def dequant_mm(a: Operand, b: Operand, out_dtype: torch.dtype = torch.bfloat16,
               config: dict | None = None) -> torch.Tensor:
    """`a @ b^T` (`[M, N]` in out_dtype: bf16, fp16 or fp32 in the kernel, other dtypes through fp32) of two
    operands as stored, each dequantized to bf16 per K tile in registers, multiplied with fp32 accumulation, the
    NVFP4 global factors applied to the fp32 result.

    `config`: a fixed {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} instead of the
    autotuned choice (benchmarks, tests); its BLOCK_K is lowered to one that divides K. HYBRIDQ_DEQUANT_GEMM_NO_AUTOTUNE=1
    uses `default_config` for every call."""
    why = check_operands(a, b)
    if why is not None:
        raise ValueError(f"dequant_mm: {why}")
    m, n, k = a.rows, b.rows, a.k

    def args(c):
        sa, sb = _kernel_scale(a), _kernel_scale(b)
        # an MXFP8 operand has no global factor: the kernel never reads the pointer then (A_FMT / B_FMT are constexpr)
        ga = nvfp4_global_factor(a.amax) if a.fmt == NVFP4 else sa
        gb = nvfp4_global_factor(b.amax) if b.fmt == NVFP4 else sb
        return (a.codes, sa, ga, b.codes, sb, gb, c, m, n, k, a.codes.stride(0), sa.stride(0), sa.stride(1),
                b.codes.stride(0), sb.stride(0), sb.stride(1), c.stride(0), next_pow2(m), next_pow2(n), next_pow2(k))

    def fix_config(cfg):
        cfg["BLOCK_K"] = block_k_for(k, a.fmt, b.fmt, largest=cfg.get("BLOCK_K", 64))

    if config is None and os.environ.get("HYBRIDQ_DEQUANT_GEMM_NO_AUTOTUNE") == "1":
        config = default_config(k, a.fmt, b.fmt)
    return run_block_gemm(_dequant_gemm_tuned, _dequant_gemm_kernel, m, n, k, a.codes.device, out_dtype, args,
                          dict(A_FMT=a.fmt, B_FMT=b.fmt), config, fix_config, LAST_COMPILED)
