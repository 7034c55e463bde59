"""MXFP8 x MXFP8 GEMM for Hopper (sm_90) in Triton: reads the fp8 bytes and E8M0 scales as stored.

cuBLAS has no MXFP8 GEMM on sm_90. This kernel computes `a @ b^T` for two MXFP8 parts stored `[rows, K]`
(E4M3 or E5M2, any pairing) on the FP8 tensor cores, applying the per-32-element K-block scales in the main loop:

    acc[m, n] += dot32(a[m, kb], b[n, kb]) * (2^(ea[m, kb] - 127) * 2^(eb[n, kb] - 127))

Each 32-wide K slice is one fresh tensor-core product `P` (one wgmma of K = 32, fp32 result) that is scaled and
added into the fp32 accumulator on the CUDA cores, so products of different block scales never share a
tensor-core accumulation. The scale of a pair of blocks is the fp32 product of the two decoded E8M0 scales
(each exact: 2^-127 is an fp32 subnormal, byte 255 is NaN). Numerics against the fp32 emulation
(docs/numerics.md "MXFP8 GEMM on sm_90"):
  - not bitwise (another summation order; the tensor core sums the 32 products of a slice itself);
  - a NaN scale byte or a NaN/inf element makes the rows / columns it enters non-finite, as in the emulation;
  - a pair of blocks whose scale product is below 2^-149 (ea + eb < 105) contributes 0 (|P| * 2^-150 at most
    is lost, below 2^-113 for E5M2 x E5M2 and 2^-126 for E4M3); one whose scale product overflows fp32
    (ea + eb >= 382, both blocks within 2^9 of the fp32 range) gives +-inf (NaN where P == 0), where the
    emulation can be finite.

Performance (BENCHMARKS.md "MXFP8 GEMM on sm_90 in Triton"): 186 TFLOP/s at 8192^3 on an H100, against 773 for
bf16 torch.mm, so hybridq registers it opt-in only (HYBRIDQ_TRITON_MXFP8=1). The compiled kernels are register
bound (221-255 registers per thread, most configs spill), and the scaling itself costs two fp32 instructions per
output element per 32-wide K block, twice the tensor-core time of the block's products.

Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import os

import torch

from .triton_tiles import autotune_configs, next_pow2, run_block_gemm, small_tiles

BLOCK = 32
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LAST_COMPILED: dict = {}  # the compiled kernel of the last call with a fixed config (benchmarks read its registers)


# autotuning candidates: (BLOCK_M, BLOCK_N, SLICES of 32 along K per iteration, num_stages, num_warps); the
# four that ran fastest of nine at 8192^3 on an H100 (BENCHMARKS.md: 186, 119, 115 and 98 TFLOP/s). Larger tiles
# (128x256, 256x128, 128x128 with 4 slices) spilled registers and ran at 57-74 TFLOP/s.
_CONFIGS = ((64, 128, 4, 4, 4), (128, 64, 4, 4, 4), (128, 128, 1, 6, 8), (128, 128, 2, 4, 8))


def config_dict(c) -> dict:
    """The `config` argument of `mxfp8_mm` for one entry of _CONFIGS."""
    bm, bn, sl, st, w = c
    return {"BLOCK_M": bm, "BLOCK_N": bn, "SLICES": sl, "GROUP_M": 8, "num_stages": st, "num_warps": w}


def _prune(configs, named_args, **kwargs):
    """Configs whose 32 * SLICES divides K, the tiles not much larger than the problem where any are."""
    k = named_args["K"]
    return small_tiles([c for c in configs if k % (BLOCK * c.kwargs["SLICES"]) == 0], named_args["M"],
                       named_args["N"])


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

    # sizes are not specialized on (one compile serves every M, N, K); the data strides are (16-byte alignment)
    @triton.jit(do_not_specialize=["M", "N", "K", "stride_sak", "stride_sbk", "M_KEY", "N_KEY", "K_KEY"])
    def _mxfp8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K,
                           stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_cm,
                           M_KEY, N_KEY, K_KEY,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLICES: tl.constexpr,
                           GROUP_M: tl.constexpr, MODE: tl.constexpr = 0):
        offs_m, offs_n, rm, rn = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_k = tl.arange(0, 32)
        a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + rn[:, None] * stride_bn + offs_k[None, :]
        sa_ptrs = sa_ptr + rm * stride_sam
        sb_ptrs = sb_ptr + rn * stride_sbn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, 32 * SLICES):
            for j in tl.static_range(SLICES):
                a = tl.load(a_ptrs + j * 32)
                b = tl.load(b_ptrs + j * 32)
                ea = tl.load(sa_ptrs + j * stride_sak).to(tl.int32)
                eb = tl.load(sb_ptrs + j * stride_sbk).to(tl.int32)
                if MODE == 2:  # (benchmark only) a plain FP8 GEMM, scales ignored: the tensor-core ceiling
                    acc = tl.dot(a, tl.trans(b), acc)
                else:
                    p = tl.dot(a, tl.trans(b))  # fresh fp32 product of one 32-wide K block
                    if MODE == 1:  # (benchmark only) scales ignored
                        acc += p
                    else:
                        acc += p * (e8m0_to_pow2(ea)[:, None] * e8m0_to_pow2(eb)[None, :])
            a_ptrs += 32 * SLICES
            b_ptrs += 32 * SLICES
            sa_ptrs += SLICES * stride_sak
            sb_ptrs += SLICES * stride_sbk

        store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm)

    _mxfp8_gemm_tuned = triton.autotune(configs=autotune_configs(_CONFIGS, config_dict),
                                        key=["M_KEY", "N_KEY", "K_KEY"],
                                        prune_configs_by={"early_config_prune": _prune})(_mxfp8_gemm_kernel)
else:  # (without Triton: `available()` is False)
    _mxfp8_gemm_kernel = _mxfp8_gemm_tuned = None


def _bucket(v: int) -> int:
    """Autotuning key of a dimension: the next power of two (one tuning per size class, not per exact size)."""
    return next_pow2(v)


def check_operands(a_data, a_scale, b_data, b_scale, contiguous: bool = True) -> str | None:
    """Why the kernel cannot take these operands, or None. data fp8 `[rows, K]` contiguous (unless
    `contiguous=False`: the caller makes it so), K % 32 == 0, scales uint8 `[rows, K/32]`."""
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[1]:
        return "operands are not [rows, K] x [cols, K]"
    if a_data.dtype not in _FP8 or b_data.dtype not in _FP8:
        return f"fp8 data expected, got {a_data.dtype} x {b_data.dtype}"
    k = a_data.shape[1]
    if k % BLOCK:
        return f"K = {k} is not a multiple of {BLOCK}"
    for d, s in ((a_data, a_scale), (b_data, b_scale)):
        if s.dtype != torch.uint8 or tuple(s.shape) != (d.shape[0], k // BLOCK):
            return f"scales {tuple(s.shape)} {s.dtype} do not match data {tuple(d.shape)} (uint8 [rows, K/32])"
        if contiguous and not d.is_contiguous():
            return "fp8 data not contiguous"
    return None


def mxfp8_mm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """`(a_data * 2^(a_scale - 127)) @ (b_data * 2^(b_scale - 127))^T` with the 32-element K blocks' scales,
    result `[M, N]` in out_dtype (bf16, fp16 or fp32 in the kernel; other dtypes through fp32).

    `config`: a fixed {"BLOCK_M", "BLOCK_N", "SLICES", "GROUP_M", "num_warps", "num_stages"} instead of the
    autotuned choice (benchmarks, tests). HYBRIDQ_MXFP8_NO_AUTOTUNE=1 uses the default config for every call."""
    why = check_operands(a_data, a_scale, b_data, b_scale)
    if why is not None:
        raise ValueError(f"mxfp8_mm: {why}")
    m, k = a_data.shape
    n = b_data.shape[0]

    def args(c):
        # K-block-major scales: one K block's BLOCK_M scales of a tile are one coalesced read
        sa, sb = a_scale.t().contiguous(), b_scale.t().contiguous()  # [K/32, rows]
        return (a_data, b_data, sa, sb, c, m, n, k, a_data.stride(0), b_data.stride(0), sa.stride(1), sa.stride(0),
                sb.stride(1), sb.stride(0), c.stride(0), _bucket(m), _bucket(n), _bucket(k))

    def fix_config(cfg):
        if k % (BLOCK * cfg["SLICES"]):
            raise ValueError(f"mxfp8_mm: K = {k} is not a multiple of 32 * SLICES = {BLOCK * cfg['SLICES']}")

    if config is None and os.environ.get("HYBRIDQ_MXFP8_NO_AUTOTUNE") == "1":
        config = default_config(k)
    return run_block_gemm(_mxfp8_gemm_tuned, _mxfp8_gemm_kernel, m, n, k, a_data.device, out_dtype, args, {}, config,
                          fix_config, LAST_COMPILED)


def default_config(k: int) -> dict:
    """The fastest measured config that takes this K (without autotuning)."""
    return config_dict(_CONFIGS[0] if k % 128 == 0 else _CONFIGS[2])
