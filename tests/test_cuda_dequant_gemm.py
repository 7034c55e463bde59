"""The sm_90 MXFP8 / NVFP4 GEMM that dequantizes K tiles in registers (hybridq.kernels.triton_dequant_gemm,
registered as "triton-dequant-sm90" for the four pairings of MXFP8Part and NVFP4Part).

The kernel is opt-in (HYBRIDQ_TRITON_DEQUANT_GEMM=1, `native_gemm.TRITON_DEQUANT_GEMM`); every test here turns it
on. CPU tests (no mark): registration order and gating (off by default, declines without CUDA, without Triton, off
sm_90, on operands it cannot take, on a Hadamard-rotated NVFP4 part against an unrotated one), the fallback when the
kernel fails, the host-side helpers, and, where Triton is installed (no GPU needed), that every pairing compiles for
sm_90. GPU tests (`gpu`, skipped without CUDA, Triton or an sm_90 device) check the kernel against

  - `exact`: the fp64 product of the emulation's bf16 operands (built here with torch ops that mirror the
    dequantize kernels: MXFP8 bf16(fp32(code) * 2^(e - 127)), NVFP4 bf16(e2m1 * fp32(scale))) times the NVFP4
    global factors fp32(amax / 2688), within the bound of docs/numerics.md "Block-scaled GEMMs on sm_90 (Triton,
    dequantize in registers)":

        |y - exact| <= f * (2 K 2^-23 (|A| @ |B|^T) + K 2^-126) + (n_f 2^-24 + u_out) (|exact| + acc) + 2^-133

    (f the product of the global factors, 1 for MXFP8; acc the first term; n_f the number of NVFP4 operands;
    u_out the output's unit roundoff: 2^-8 bf16, 2^-11 fp16, 0 fp32);
  - `emulation`: the same math as `native_gemm._bf16_run` (cuBLAS bf16 torch.mm of those operands, fp32 result for
    NVFP4, the factors, the rounding), within the sum of both bounds, with the same NaN pattern.
Where the CUDA extension is built, the mirrored bf16 operands are also checked bitwise against
`native_gemm.exact_bf16_operand` (the emulation's own dequantize kernels). Operands are quantized on the CPU by the
reference quantizers (or built from random codes) and moved to the GPU.
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import hybridq.kernels.native_gemm as ng
from hybridq import dispatch
from hybridq.formats import MXFP8Part, MXFP8Quantizer, NVFP4Part, NVFP4Quantizer
from hybridq.formats._numerics import e2m1_decode, e8m0_to_pow2, unpack_nibbles
from hybridq.gemm import emulated_gemm, find_native_gemm, gemm
from hybridq.kernels import _ext
from hybridq.kernels import triton_dequant_gemm as tdg

from _gpu import default_config_fixture, sm90_triton_test
from _triton_aot import compile_sm90

NAME = "triton-dequant-sm90"
SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
PAIRS = [(MXFP8Part, MXFP8Part), (NVFP4Part, NVFP4Part), (MXFP8Part, NVFP4Part), (NVFP4Part, MXFP8Part)]


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setattr(ng.TRITON_DEQUANT_GEMM, "on", True)
    monkeypatch.setattr(ng.TRITON_MXFP8, "on", False)  # MXFP8 x MXFP8 would go to that kernel first


def _quantized(rows: int, k: int, fmt: str, g: torch.Generator, device="cpu"):
    """A rowwise part of `rows` x `k` N(0, 1) values: fmt "e4m3" / "e5m2" (MXFP8), "nvfp4", "nvfp4_2d" (16x16
    tiles), or "nvfp4_rht" (the columnwise, Hadamard-rotated form of the transpose)."""
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    if fmt in ("e4m3", "e5m2"):
        p = MXFP8Quantizer(fmt).quantize_parts(x, True, False)[0]
    elif fmt == "nvfp4_rht":
        p = NVFP4Quantizer(rht=True).quantize_parts(x.t().contiguous(), False, True)[1]
        assert p.rht and (p.rows, p.cols) == (rows, k)
    else:
        p = NVFP4Quantizer(block_2d=fmt == "nvfp4_2d").quantize_parts(x, True, False)[0]
    return p.map_tensors(lambda t: t.to(device))


def _parts(m, n, k, fa, fb, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return _quantized(m, k, fa, g, device), _quantized(n, k, fb, g, device)


# ---- CPU: registration, gating, helpers -----------------------------------------------------------------------

def test_module_imports_and_says_whether_triton_is_there():
    try:
        import triton  # noqa: F401
        have = True
    except Exception:  # noqa: BLE001
        have = False
    assert tdg.available() == have


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0].__name__}x{p[1].__name__}")
def test_registered_before_the_bf16_emulation(pair):
    g = torch.Generator().manual_seed(0)
    parts = [_quantized(32, 64, "e4m3" if t is MXFP8Part else "nvfp4", g) for t in pair]
    assert tuple(type(p) for p in parts) == pair
    names = [c.name for c in dispatch.gemm_candidates(*parts)]
    assert NAME in names and "cuda-emulated-bf16" in names, names
    assert names.index(NAME) < names.index("cuda-emulated-bf16"), names
    if pair == (MXFP8Part, MXFP8Part):  # the older MXFP8 kernel keeps its place when both are switched on
        assert names.index("triton-mxfp8-sm90") < names.index(NAME), names


def test_off_by_default():
    """An opt-in switch: off unless HYBRIDQ_TRITON_DEQUANT_GEMM is "1" at import (the rule: tests/test_switches.py)."""
    s = ng.TRITON_DEQUANT_GEMM
    assert (s.env, s.default) == ("HYBRIDQ_TRITON_DEQUANT_GEMM", False), f"{s!r}: not the opt-in switch"


@pytest.fixture
def fake_sm90(monkeypatch):
    """CPU parts taken for CUDA parts of an sm_90 device with Triton, so the gating past the device checks runs
    here."""
    monkeypatch.setattr(ng, "_on_cuda", lambda a, b: ng._NATIVE.on)
    monkeypatch.setattr(ng, "_cap", lambda t: (9, 0))
    monkeypatch.setattr(ng, "_failed", set())
    monkeypatch.setattr(ng, "_warned", set())
    monkeypatch.setattr(tdg, "triton", object())  # stands in for an importable Triton


FMT_PAIRS = [("e4m3", "e4m3"), ("nvfp4", "nvfp4"), ("e4m3", "nvfp4"), ("nvfp4", "e5m2"), ("nvfp4_2d", "nvfp4"),
             ("nvfp4_rht", "nvfp4_rht")]


@pytest.mark.parametrize("fmts", FMT_PAIRS, ids="x".join)
def test_gating_takes_every_pairing(fake_sm90, fmts):
    a, b = _parts(64, 48, 96, *fmts)
    assert ng._triton_dequant_supports(a, b), fmts
    assert find_native_gemm(a, b).name == NAME
    with ng.disabled():
        assert not ng._triton_dequant_supports(a, b)


def test_default_off_declines(fake_sm90, monkeypatch):
    monkeypatch.setattr(ng.TRITON_DEQUANT_GEMM, "on", False)
    a, b = _parts(64, 32, 64, "nvfp4", "e4m3")
    assert not ng._triton_dequant_supports(a, b)


def test_declines_on_cpu_parts():
    a, b = _parts(64, 32, 64, "nvfp4", "nvfp4")
    assert not ng._triton_dequant_supports(a, b)
    assert find_native_gemm(a, b) is None


def test_declines_without_triton(fake_sm90, monkeypatch):
    monkeypatch.setattr(tdg, "triton", None)
    assert not tdg.available()
    a, b = _parts(64, 32, 64, "nvfp4", "nvfp4")
    assert not ng._triton_dequant_supports(a, b)


@pytest.mark.parametrize("cap", [(8, 9), (9, 1), (10, 0), (12, 0)])
def test_declines_off_sm90(fake_sm90, monkeypatch, cap):
    monkeypatch.setattr(ng, "_cap", lambda t: cap)
    a, b = _parts(64, 32, 64, "e4m3", "nvfp4")
    assert not ng._triton_dequant_supports(a, b)


@pytest.mark.parametrize("fmts", [("nvfp4_rht", "nvfp4"), ("nvfp4", "nvfp4_rht"), ("e4m3", "nvfp4_rht"),
                                  ("nvfp4_rht", "e4m3")], ids="x".join)
def test_declines_a_rotated_part_against_an_unrotated_one(fake_sm90, fmts):
    """As the bf16 emulation: the fp32 emulation undoes the transform; the kernel multiplies as stored."""
    a, b = _parts(64, 32, 64, *fmts)
    assert not ng._triton_dequant_supports(a, b)
    assert not ng._transforms_compatible(a, b)


def test_declines_k_an_mxfp8_operand_cannot_take(fake_sm90):
    a, b = _parts(64, 32, 48, "nvfp4", "nvfp4")  # K = 48: NVFP4 x NVFP4 only
    assert ng._triton_dequant_supports(a, b)
    n = _quantized(32, 48, "nvfp4", torch.Generator().manual_seed(1))
    m = MXFP8Part(rows=32, cols=48, columnwise=False, data=torch.zeros(32, 48, dtype=torch.float8_e4m3fn),
                  scale=torch.zeros(32, 1, dtype=torch.uint8))
    assert not ng._triton_dequant_supports(n, m)


def test_check_operands_messages():
    a, b = _parts(64, 32, 96, "e4m3", "nvfp4")
    oa, ob = tdg.mxfp8_operand(a.data, a.scale), tdg.nvfp4_operand(b.data, b.scale, b.amax)
    assert tdg.check_operands(oa, ob) is None and tdg.check_operands(ob, oa) is None
    assert ob.k == 96 and ob.rows == 32 and oa.k == 96
    cases = {
        "contracted sizes differ": (oa, tdg.nvfp4_operand(b.data[:, :32], b.scale[:, :4], b.amax)),
        "fp8 codes expected": (tdg.mxfp8_operand(a.data.view(torch.uint8), a.scale), ob),
        "packed uint8 codes expected": (oa, tdg.nvfp4_operand(b.data.view(torch.int8), b.scale, b.amax)),
        "global amax": (oa, tdg.nvfp4_operand(b.data, b.scale, b.amax.double())),
        "do not match": (tdg.mxfp8_operand(a.data, a.scale[:, :2]), ob),
        "not contiguous": (tdg.mxfp8_operand(a.data.t().contiguous().t(), a.scale), ob),
    }
    for want, (x, y) in cases.items():
        why = tdg.check_operands(x, y)
        assert why is not None and want in why, f"expected {want!r}, got {why!r}"
    assert tdg.check_operands(cases["not contiguous"][0], ob, contiguous=False) is None
    d = torch.zeros(8, 48, dtype=torch.float8_e4m3fn)
    why = tdg.check_operands(tdg.mxfp8_operand(d, torch.zeros(8, 1, dtype=torch.uint8)),
                             tdg.nvfp4_operand(torch.zeros(8, 24, dtype=torch.uint8),
                                               torch.zeros(8, 3, dtype=torch.uint8), torch.ones(1)))
    assert why is not None and "multiple of 32" in why, why


def test_failure_falls_back_to_the_emulation_with_one_warning(fake_sm90, monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(tdg, "dequant_mm", broken)
    a, b = _parts(64, 32, 64, "nvfp4", "e4m3")
    assert find_native_gemm(a, b).name == NAME
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = gemm(a, b, torch.float32)
        gemm(a, b, torch.float32)
    msgs = [str(x.message) for x in w if "Triton NVFP4 x MXFP8 GEMM" in str(x.message)]
    assert len(msgs) == 1 and "compile failed" in msgs[0], [str(x.message) for x in w]
    assert torch.equal(y, emulated_gemm(a, b, torch.float32))
    assert find_native_gemm(a, b) is None  # off for the device now (CPU parts: no other GEMM takes them)


@pytest.mark.parametrize("k,fmts,want", [(4096, (0, 0), 128), (4096, (1, 1), 128), (96, (0, 1), 32),
                                         (160, (1, 1), 32), (48, (1, 1), 16), (80, (1, 1), 16), (192, (1, 0), 64)])
def test_block_k_for(k, fmts, want):
    assert tdg.block_k_for(k, *fmts) == want
    assert k % want == 0


def test_default_config_divides_k():
    for k, fmts in ((4096, (0, 0)), (96, (0, 1)), (48, (1, 1)), (8192 + 64, (1, 0))):
        c = tdg.default_config(k, *fmts)
        assert k % c["BLOCK_K"] == 0 and c["BLOCK_K"] >= (32 if 0 in fmts else 16), (k, fmts, c)


def test_autotune_prune():
    class Cfg:
        def __init__(self, bm, bn, bk):
            self.kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}

    cfgs = [Cfg(*c[:3]) for c in tdg._CONFIGS]
    big = tdg._prune(cfgs, {"M": 4096, "N": 4096, "K": 4096}, A_FMT=0, B_FMT=1)
    assert {c.kwargs["BLOCK_K"] for c in big} == {64, 128}
    assert [c.kwargs["BLOCK_K"] for c in tdg._prune(cfgs, {"M": 4096, "N": 4096, "K": 96}, A_FMT=0, B_FMT=0)] == [32]
    assert [c.kwargs["BLOCK_K"] for c in tdg._prune(cfgs, {"M": 4096, "N": 4096, "K": 48}, A_FMT=1, B_FMT=1)] == [16]
    small = tdg._prune(cfgs, {"M": 40, "N": 4096, "K": 256}, A_FMT=1, B_FMT=1)
    assert small and all(c.kwargs["BLOCK_M"] == 64 for c in small)


def test_e2m1_bit_construction_the_kernel_uses():
    """`_e2m1_times_2_pow_m14`: fp16 bits ((c & 7) << 9) | ((c & 8) << 12) are E2M1 code c times 2^-14 (torch
    here, the same integer ops as the kernel)."""
    c = torch.arange(16, dtype=torch.int32)
    h = (((c & 7) << 9) | ((c & 8) << 12)).to(torch.int16)  # 0x8000 wraps to the int16 sign bit, as in the kernel
    got = h.view(torch.float16).float() * 16384.0
    want = e2m1_decode(c.to(torch.uint8))
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)


def _aot_compile_sm90(a_fmt: int, b_fmt: int, a_ptr: str, b_ptr: str, out_ptr: str, cfg: dict):
    """The kernel compiled for sm_90 with the pointer / stride specializations a real launch gets (16-byte alignment,
    unit scale stride)."""
    sig = {"a_ptr": a_ptr, "sa_ptr": "*u8" if a_fmt == 0 else "*fp8e4nv", "ga_ptr": "*u8" if a_fmt == 0 else "*fp32",
           "b_ptr": b_ptr, "sb_ptr": "*u8" if b_fmt == 0 else "*fp8e4nv", "gb_ptr": "*u8" if b_fmt == 0 else "*fp32",
           "c_ptr": out_ptr}
    for n in ("M", "N", "K", "stride_am", "stride_sam", "stride_sak", "stride_bn", "stride_sbn", "stride_sbk",
              "stride_cm", "M_KEY", "N_KEY", "K_KEY"):
        sig[n] = "i32"
    cons = {"A_FMT": a_fmt, "B_FMT": b_fmt, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
            "BLOCK_K": cfg["BLOCK_K"], "GROUP_M": 8, "stride_sak": 1, "stride_sbk": 1}
    aligned = ("a_ptr", "sa_ptr", "ga_ptr", "b_ptr", "sb_ptr", "gb_ptr", "c_ptr", "stride_am", "stride_bn", "stride_cm")
    return compile_sm90(tdg._dequant_gemm_kernel, sig, cons, aligned, cfg["num_warps"], cfg["num_stages"])


AOT = [(0, 0, "*fp8e4nv", "*fp8e4nv"), (1, 1, "*u8", "*u8"), (0, 1, "*fp8e5", "*u8"), (1, 0, "*u8", "*fp8e4nv")]


@pytest.mark.skipif(not tdg.available(), reason="needs Triton (no GPU needed: compiles ahead of time for sm_90)")
@pytest.mark.parametrize("fmts", AOT, ids=["mxfp8xmxfp8", "nvfp4xnvfp4", "mxfp8e5xnvfp4", "nvfp4xmxfp8"])
def test_compiles_for_sm90(fmts):
    """Every pairing compiles for sm_90 at every config, to wgmma with pipelined (cp.async) loads."""
    for c in tdg._CONFIGS:
        cfg = tdg.config_dict(c)
        if 0 in fmts[:2] and cfg["BLOCK_K"] < 32:
            continue
        try:
            k = _aot_compile_sm90(*fmts, "*bf16", cfg)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"config {c} does not compile for sm_90: {type(e).__name__}: {str(e)[:2000]}")
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        assert "wgmma.mma_async" in ptx, f"config {c}: no wgmma in the PTX"
        assert "async_copy_global_to_local" in ttgir, f"config {c}: the loads are not pipelined"


# ---- GPU: the kernel ------------------------------------------------------------------------------------------

on_gpu = sm90_triton_test(tdg.available(), "the Triton dequant GEMM")
fixed_config = default_config_fixture("HYBRIDQ_DEQUANT_GEMM_NO_AUTOTUNE",
                                      "one compile per pairing, BLOCK_K and output dtype")


def _bf16_operand(p) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(bf16 matrix, fp32 global factor or None): the emulation's operand (`exact_bf16_operand`), by torch ops that
    mirror its dequantize kernels."""
    if isinstance(p, MXFP8Part):
        s = e8m0_to_pow2(p.scale).repeat_interleave(32, dim=1)
        return (p.data.float() * s).to(torch.bfloat16), None
    s = p.scale.float().repeat_interleave(16, dim=1)
    return (e2m1_decode(unpack_nibbles(p.data)) * s).to(torch.bfloat16), p.amax / 2688.0


def _emulation(a, b, out_dtype):
    """`native_gemm._bf16_run` with the mirrored operands (cuBLAS bf16 GEMM; MXFP8 x MXFP8 rounded to bf16 first,
    here with cuBLAS's reduced-precision (bf16) split-K reductions off, so that it is rounded once)."""
    (ma, fa), (mb, fb) = _bf16_operand(a), _bf16_operand(b)
    if fa is None and fb is None:
        flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            return torch.mm(ma, mb.t()).to(out_dtype)
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    y = ng._mm_fp32_out(ma, mb.t())
    for f in (fa, fb):
        if f is not None:
            y = y * f
    return y.to(out_dtype)


U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}


def _exact_and_bound(a, b, u_out: float):
    """fp64 product of the emulation's operands times the factors, and the elementwise bound of the module doc."""
    (ma, fa), (mb, fb) = _bf16_operand(a), _bf16_operand(b)
    da, db = ma.double(), mb.double()
    f = 1.0
    for x in (fa, fb):
        if x is not None:
            f = f * float(x)
    k = a.cols
    acc = f * (2 * k * 2.0 ** -23 * (da.abs() @ db.abs().t()) + k * 2.0 ** -126)
    exact = (da @ db.t()) * f
    nf = sum(x is not None for x in (fa, fb))
    return exact, acc + (nf * 2.0 ** -24 + u_out) * (exact.abs() + acc) + 2.0 ** -133


def _check(y, a, b, what: str) -> float:
    """y against the exact product (bound) and the emulation (both bounds, same NaN pattern); returns the largest
    ratio |y - exact| / bound over finite entries."""
    exact, bound = _exact_and_bound(a, b, U[y.dtype])
    emu = _emulation(a, b, y.dtype)
    both_mx = isinstance(a, MXFP8Part) and isinstance(b, MXFP8Part)
    _, emu_bound = _exact_and_bound(a, b, U[y.dtype] + (2.0 ** -8 if both_mx and y.dtype != torch.bfloat16 else 0))
    assert torch.equal(torch.isnan(y), torch.isnan(emu)), \
        f"{what}: NaN pattern differs from the emulation ({int(torch.isnan(y).sum())} vs {int(torch.isnan(emu).sum())} NaNs)"
    fin = torch.isfinite(exact) & torch.isfinite(emu)
    assert torch.equal(torch.isfinite(y)[fin], torch.ones_like(y[fin], dtype=torch.bool)), \
        f"{what}: non-finite where the exact product and the emulation are finite"
    err = (y.double() - exact).abs()
    ratio = float((err / bound)[fin].max()) if fin.any() else 0.0
    worst = int((err / bound).masked_fill(~fin, 0).argmax()) if fin.any() else 0
    i, j = divmod(worst, y.shape[1])
    assert ratio <= 1, (f"{what}: |y - exact| above the bound at [{i}, {j}]: y {float(y[i, j]):.9e}, exact "
                        f"{float(exact[i, j]):.9e}, bound {float(bound[i, j]):.3e} (ratio {ratio:.3f})")
    e_emu = (y.double() - emu.double()).abs()
    r_emu = float((e_emu / (bound + emu_bound))[fin].max()) if fin.any() else 0.0
    assert r_emu <= 1, f"{what}: |y - emulation| above the sum of the bounds (ratio {r_emu:.3f})"
    print(f"{what}: max |y - exact| / bound = {ratio:.3e}, |y - emulation| / bounds = {r_emu:.3e}")
    return ratio


def _check_operands_match_the_emulation(a, b):
    """Where the CUDA extension is built: the mirrored bf16 operands are bitwise the emulation's."""
    if not _ext.available_for(a.device):
        return
    same = a.transform is not None and a.transform == b.transform
    for p in (a, b):
        want = ng.exact_bf16_operand(p, same)
        got = _bf16_operand(p)
        assert torch.equal(got[0].view(torch.int16), want[0].contiguous().view(torch.int16)), \
            f"{p.format_name}: mirrored bf16 operand differs from exact_bf16_operand"
        assert (got[1] is None) == (want[1] is None) and (got[1] is None or torch.equal(got[1], want[1]))


GPU_PAIRS = [("e4m3", "e4m3"), ("nvfp4", "nvfp4"), ("e4m3", "nvfp4"), ("nvfp4", "e4m3"), ("e5m2", "nvfp4"),
             ("e5m2", "e4m3")]
SHAPES = [(128, 128, 64), (200, 72, 96), (257, 384, 4096), (1, 300, 64), (1000, 136, 256)]


@pytest.mark.parametrize("fmts", GPU_PAIRS, ids="x".join)
@pytest.mark.parametrize("mnk", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@on_gpu
def test_random(fmts, mnk, out):
    a, b = _parts(*mnk, *fmts, seed=SEED, device="cuda")
    g = find_native_gemm(a, b)
    assert g is not None and g.name == NAME, g
    y = gemm(a, b, out)
    assert y.dtype == out and y.shape == (mnk[0], mnk[1])
    _check(y, a, b, f"{fmts} {mnk} {out}")
    if mnk == SHAPES[0]:
        _check_operands_match_the_emulation(a, b)


@pytest.mark.parametrize("mnk", [(96, 80, 48), (33, 130, 80), (64, 64, 16)], ids=str)
@on_gpu
def test_nvfp4_k_multiple_of_16(mnk):
    """NVFP4 x NVFP4 takes any K % 16 == 0 (BLOCK_K 16 where no larger one divides K)."""
    a, b = _parts(*mnk, "nvfp4", "nvfp4", seed=SEED, device="cuda")
    assert find_native_gemm(a, b).name == NAME
    _check(gemm(a, b, torch.float32), a, b, f"nvfp4 K={mnk[2]}")


@on_gpu
def test_nvfp4_16x16_weight_tiles():
    """A 16x16-tiled NVFP4 part (weights; rows a multiple of 16) against NVFP4 and MXFP8 E5M2."""
    for fb in ("nvfp4", "e5m2"):
        a, b = _parts(256, 72, 512, "nvfp4_2d", fb, seed=SEED, device="cuda")
        assert find_native_gemm(a, b).name == NAME
        _check(gemm(a, b, torch.bfloat16), a, b, f"nvfp4 16x16 x {fb}")


@on_gpu
def test_hadamard_rotated_pair():
    """Two NVFP4 parts with the same transform multiply as stored (in the rotated domain), as the emulation does."""
    a, b = _parts(160, 96, 512, "nvfp4_rht", "nvfp4_rht", seed=SEED, device="cuda")
    assert find_native_gemm(a, b).name == NAME
    _check(gemm(a, b, torch.bfloat16), a, b, "rht x rht")
    _check_operands_match_the_emulation(a, b)
    ref = emulated_gemm(a, b, torch.float32)  # the fp32 path (rotated domain too)
    y = gemm(a, b, torch.float32)
    e = float((y - ref).norm() / ref.norm())
    assert e < 1e-5, f"rht x rht vs the fp32 emulated GEMM: relative error {e:.2e}"


@on_gpu
def test_fp16_output():
    a, b = _parts(130, 70, 256, "nvfp4", "e4m3", seed=SEED, device="cuda")
    _check(gemm(a, b, torch.float16), a, b, "fp16 out")


def _random_codes_part(rows: int, k: int, fmt: str, g: torch.Generator, scale_lo: int, scale_hi: int):
    """A part of random codes and random scale bytes in [scale_lo, scale_hi] (MXFP8: E8M0 bytes; NVFP4: E4M3 bytes,
    0x7E at most = 448) and, for NVFP4, a random global amax in [2^-20, 2^20]."""
    if fmt == "nvfp4":
        data = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(scale_lo, scale_hi + 1, (rows, k // 16), generator=g).to(torch.uint8)
        amax = torch.exp2(torch.empty(1).uniform_(-20, 20, generator=g))
        return NVFP4Part(rows=rows, cols=k, columnwise=False, data=data, scale=scale.view(torch.float8_e4m3fn),
                         amax=amax, rht=False)
    dt = torch.float8_e5m2 if fmt == "e5m2" else torch.float8_e4m3fn
    fmax = 57344.0 if fmt == "e5m2" else 448.0
    mag = torch.exp2(torch.randint(-12, 1, (rows, k), generator=g).float())
    data = (torch.randn(rows, k, generator=g).sign() * mag * fmax * torch.rand(rows, k, generator=g)).to(dt)
    scale = torch.randint(scale_lo, scale_hi + 1, (rows, k // 32), generator=g).to(torch.uint8)
    return MXFP8Part(rows=rows, cols=k, columnwise=False, data=data, scale=scale)


# scale ranges: MXFP8 a 2^-60..2^60 against b 2^-30..2^-10 (every product and sum finite in fp32, products down to
# 2^-90 * code); NVFP4 every finite E4M3 byte (0 .. 0x7E: zero, subnormals 2^-9.., up to 448)
SCALES = {"e4m3": ((67, 187), (97, 117)), "e5m2": ((67, 187), (97, 117)), "nvfp4": ((0, 0x7E), (0, 0x7E))}


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("nvfp4", "nvfp4"), ("e5m2", "nvfp4"), ("nvfp4", "e4m3")],
                         ids="x".join)
@pytest.mark.parametrize("mnk", [(130, 200, 64), (96, 136, 96), (256, 128, 4096)], ids=str)
@on_gpu
def test_scales_spanning_the_range_and_nan(fmts, mnk):
    """Random codes, scale bytes over the range, a zero block, NaN scale bytes on row 4 of a and row 5 of b (output
    column 5), a NaN code (E4M3 / E5M2) on row 7 of an MXFP8 operand: NaN exactly there, as in the emulation."""
    g = torch.Generator().manual_seed(SEED)
    m, n, k = mnk
    a = _random_codes_part(m, k, fmts[0], g, *SCALES[fmts[0]][0])
    b = _random_codes_part(n, k, fmts[1], g, *SCALES[fmts[1]][1])
    nan_scale = {MXFP8Part: 255, NVFP4Part: 0x7F}
    for p, row in ((a, 4), (b, 5)):
        p.scale.view(torch.uint8)[row, -1] = nan_scale[type(p)]
        p.data.view(torch.uint8)[1, :16] = 0  # a zero block (its scale left random)
        if isinstance(p, MXFP8Part):
            p.data.view(torch.uint8)[7, 3] = 0x7F  # E4M3 NaN; E5M2 0x7F is NaN too
    a, b = (p.map_tensors(lambda t: t.cuda()) for p in (a, b))
    y = gemm(a, b, torch.float32)
    _check(y, a, b, f"{fmts} {mnk} scales over the range")
    nan = torch.isnan(y)
    want = torch.zeros_like(nan)
    want[4, :] = True
    want[:, 5] = True
    if isinstance(a, MXFP8Part):
        want[7, :] = True
    if isinstance(b, MXFP8Part):
        want[:, 7] = True
    assert torch.equal(nan, want), f"NaN at {nan.nonzero().tolist()[:10]}..., expected rows/columns 4, 5 (and 7)"


@on_gpu
def test_extreme_e8m0_bytes():
    """E8M0 bytes 254 (2^127) against 0 (2^-127, the fp32 subnormal) multiply at the scale 2^0, either way round; 0
    against 0 gives 0 (products below fp32), as in the emulation. Codes below 2 on the 2^127 side (finite
    dequantized values), codes of magnitude >= 2 on the 2^-127 side (bf16 normals). One GEMM per pair of rows, so
    that no 2^127 block meets another (its products would overflow fp32)."""
    g = torch.Generator().manual_seed(SEED)
    small = lambda: (torch.rand(1, 64, generator=g) * 3.8 - 1.9).to(torch.float8_e4m3fn)  # noqa: E731
    big = lambda: ((torch.rand(1, 64, generator=g) * 100 + 2)  # noqa: E731
                   * torch.randn(1, 64, generator=g).sign()).to(torch.float8_e4m3fn)
    cases = {"254 x 0": (small(), (254, 254), big(), (0, 0)), "0 x 254": (big(), (0, 0), small(), (254, 254)),
             "0 x 0": (big(), (0, 0), big(), (0, 0)), "2^-7 x 2^7, 2^73 x 2^-73": (small(), (120, 200), small(), (134, 54))}
    for what, (da, ea, db, eb) in cases.items():
        a, b = (MXFP8Part(rows=1, cols=64, columnwise=False, data=d, scale=torch.tensor([e], dtype=torch.uint8))
                .map_tensors(lambda t: t.cuda()) for d, e in ((da, ea), (db, eb)))
        y = gemm(a, b, torch.float32)
        _check(y, a, b, f"E8M0 bytes {what}")
        if what == "0 x 0":
            assert float(y) == 0.0, f"{what}: {float(y)}"
        else:
            assert float(y) != 0.0, f"{what}: scale product 2^0 gave 0"


@on_gpu
def test_zeros_and_zero_amax():
    a, b = _parts(64, 48, 128, "nvfp4", "e4m3", seed=SEED, device="cuda")
    a.data.zero_()
    assert torch.equal(gemm(a, b, torch.float32), torch.zeros(64, 48, device="cuda"))
    a2, b2 = _parts(64, 48, 128, "nvfp4", "nvfp4", seed=SEED, device="cuda")
    a2.amax.zero_()  # global factor 0: the whole product 0
    assert torch.equal(gemm(a2, b2, torch.float32), torch.zeros(64, 48, device="cuda"))
    b2.amax.fill_(float("nan"))  # a NaN global amax: every output NaN, as the emulation's y * NaN
    assert torch.isnan(gemm(a2, b2, torch.bfloat16)).all()


@on_gpu
def test_empty_operands():
    a, b = _parts(64, 48, 64, "nvfp4", "e4m3", seed=SEED, device="cuda")
    e = NVFP4Part(rows=0, cols=64, columnwise=False, data=a.data[:0], scale=a.scale[:0], amax=a.amax, rht=False)
    assert tdg.dequant_mm(tdg.nvfp4_operand(e.data, e.scale, e.amax), tdg.mxfp8_operand(b.data, b.scale)).shape == (0, 48)


@on_gpu
def test_strided_mxfp8_part_is_taken():
    """The reference quantizer's columnwise MXFP8 parts are transposed views: the GEMM copies them row-major."""
    a, b = _parts(96, 64, 128, "e4m3", "nvfp4", device="cuda")
    at = MXFP8Part(rows=a.rows, cols=a.cols, columnwise=True, data=a.data.t().contiguous().t(), scale=a.scale)
    assert not at.data.is_contiguous()
    assert find_native_gemm(at, b).name == NAME
    assert torch.equal(gemm(at, b, torch.float32), gemm(a, b, torch.float32))


@pytest.mark.parametrize("cfg", range(len(tdg._CONFIGS)))
@on_gpu
def test_every_config(cfg):
    """Each autotuning candidate compiles, runs and is within the bound (the autotuner may pick any of them); the
    bf16 output is the fp32 result rounded."""
    conf = tdg.config_dict(tdg._CONFIGS[cfg])
    k = 512 if conf["BLOCK_K"] >= 64 else (96 if conf["BLOCK_K"] == 32 else 48)
    fmts = ("e4m3", "nvfp4") if conf["BLOCK_K"] >= 32 else ("nvfp4", "nvfp4")
    a, b = _parts(300, 260, k, *fmts, seed=SEED, device="cuda")
    oa = tdg.mxfp8_operand(a.data, a.scale) if isinstance(a, MXFP8Part) else tdg.nvfp4_operand(a.data, a.scale, a.amax)
    ob = tdg.nvfp4_operand(b.data, b.scale, b.amax)
    y32 = tdg.dequant_mm(oa, ob, torch.float32, config=conf)
    _check(y32, a, b, f"config {conf}")
    y16 = tdg.dequant_mm(oa, ob, torch.bfloat16, config=conf)
    assert torch.equal(y16, y32.to(torch.bfloat16)), "bf16 output is not the fp32 result rounded"


@on_gpu
def test_autotuned():
    """The autotuned launch (what training runs) on two shapes and two pairings."""
    for (m, n, k), fmts in (((512, 384, 1024), ("nvfp4", "nvfp4")), ((300, 1000, 96), ("e4m3", "nvfp4"))):
        a, b = _parts(m, n, k, *fmts, seed=SEED, device="cuda")
        _check(gemm(a, b, torch.bfloat16), a, b, f"autotuned {fmts} {m}x{n}x{k}")


# Linear through the kernel vs the emulation: each side rounds each GEMM's fp32 result to bf16 once (<= 2^-8
# relative per element, so <= 2^-7 between the two) and their fp32 sums differ by far less (bound above, K <= 512).
LINEAR_BOUND = 2.0 ** -7 + 1e-3


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
@on_gpu
def test_linear_uses_the_kernel(monkeypatch, preset):
    """A Linear's three GEMMs (fprop, dgrad, wgrad) run the kernel with the switch on, and agree with the switch
    off (the emulation) within LINEAR_BOUND (relative, per output tensor)."""
    import hybridq

    calls = []
    real = tdg.dequant_mm
    monkeypatch.setattr(tdg, "dequant_mm", lambda a, b, *r, **kw: calls.append(
        (tdg.FORMAT_NAMES[a.fmt], tdg.FORMAT_NAMES[b.fmt])) or real(a, b, *r, **kw))
    torch.manual_seed(SEED)
    lin = hybridq.Linear(512, 384, bias=False, device="cuda", dtype=torch.bfloat16, recipe=hybridq.recipe(preset))
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(ng.TRITON_DEQUANT_GEMM, "on", on)
        x.grad, lin.weight.grad = None, None
        torch.cuda.manual_seed(SEED)  # the same stochastic rounding draws on both sides
        y = lin(x)
        y.backward(dy)
        outs[on] = (y.detach().float(), x.grad.float(), lin.weight.grad.float())
        if on:
            assert len(calls) == 3, f"{preset}: the kernel ran for {calls}, expected fprop, dgrad and wgrad"
            print(f"{preset}: pairings {calls}")
    for name, g, r in zip(("y", "dx", "dw"), outs[True], outs[False]):
        assert torch.isfinite(g).all(), f"{preset}: non-finite {name}"
        e = float((g - r).norm() / r.norm())
        assert e < LINEAR_BOUND, f"{preset}: {name} kernel vs emulation relative error {e:.2e} > {LINEAR_BOUND:.2e}"


def test_linear_presets_exist():
    import hybridq

    for p in ("mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"):
        assert p in hybridq.preset_names()



def test_bench_linear_switch_toggles_and_restores(monkeypatch):
    """benchmarks/bench_linear.py --triton-dequant-gemm: the wrapped step runs with the switch as asked, then restores
    it (so the interleaved variants of a preset do not leak into each other)."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench_linear = importlib.import_module("bench_linear")
    seen = []
    for on in (True, False):
        monkeypatch.setattr(ng.TRITON_DEQUANT_GEMM, "on", not on)
        bench_linear.dequant_gemm_switch(lambda: seen.append(ng.TRITON_DEQUANT_GEMM.on), on)()
        assert ng.TRITON_DEQUANT_GEMM.on is (not on), "switch not restored"
    assert seen == [True, False], seen
    assert "bench_linear" in sys.modules
