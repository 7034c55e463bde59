"""The sm_90 MXFP8 x MXFP8 GEMM in Triton (hybridq.kernels.triton_mxfp8, registered as "triton-mxfp8-sm90").

The kernel is opt-in (HYBRIDQ_TRITON_MXFP8=1, `native_gemm.TRITON_MXFP8`): it is correct but slower than the bf16
emulation so far. Every test here turns it on. CPU tests (no mark): the registration order and gating (off by
default, declines without CUDA, without Triton, off sm_90, on operands it cannot take) and the fallback when the
kernel fails. GPU tests (`gpu`, skipped without CUDA, Triton or
an sm_90 device): the kernel against the exact product of the dequantized operands (fp64) and against the fp32
emulation, within the bound of docs/numerics.md "MXFP8 GEMM on sm_90":

    |y - exact| <= ACC_TOL * (|A| @ |B|^T) + u_out * |exact|     (elementwise; u_out = 2^-8 for bf16, 0 for fp32)

ACC_TOL covers the tensor core's sum of the 32 products of a K block and the fp32 accumulation over K blocks.
Operands are quantized on the CPU by the reference quantizer and moved to the GPU (no CUDA extension needed)."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import hybridq.kernels.native_gemm as ng
from hybridq import dispatch
from hybridq.formats import MXFP8Part, MXFP8Quantizer
from hybridq.gemm import emulated_gemm, find_native_gemm, gemm
from hybridq.kernels import triton_mxfp8 as tm

from _gpu import default_config_fixture, sm90_triton_test

NAME = "triton-mxfp8-sm90"
SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
ACC_TOL = 2.0 ** -10


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setattr(ng.TRITON_MXFP8, "on", True)


def _parts(m, n, k, fa="e4m3", fb="e4m3", seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    xa = torch.randn(m, k, generator=g).to(torch.bfloat16)
    xb = torch.randn(n, k, generator=g).to(torch.bfloat16)
    a = MXFP8Quantizer(fa).quantize_parts(xa, True, False)[0]
    b = MXFP8Quantizer(fb).quantize_parts(xb, True, False)[0]
    return a.map_tensors(lambda t: t.to(device)), b.map_tensors(lambda t: t.to(device))


# ---- CPU: registration and gating ---------------------------------------------------------------------------

def test_registered_before_the_bf16_emulation():
    names = [g.name for g in dispatch.gemm_candidates(*_parts(32, 32, 64))]
    assert NAME in names and "cuda-emulated-bf16" in names, names
    assert names.index(NAME) < names.index("cuda-emulated-bf16"), names


def test_off_by_default():
    """An opt-in switch: off unless HYBRIDQ_TRITON_MXFP8 is "1" at import (the rule: tests/test_switches.py)."""
    s = ng.TRITON_MXFP8
    assert (s.env, s.default) == ("HYBRIDQ_TRITON_MXFP8", False), f"{s!r}: not the opt-in switch of that variable"


def test_default_off_declines(fake_sm90, monkeypatch):
    monkeypatch.setattr(ng.TRITON_MXFP8, "on", False)
    monkeypatch.setattr(tm, "triton", object())
    a, b = _parts(64, 32, 64)
    assert not ng._triton_mxfp8_supports(a, b)


def test_declines_on_cpu_parts():
    a, b = _parts(64, 32, 64)
    assert not ng._triton_mxfp8_supports(a, b)
    assert find_native_gemm(a, b) is None


@pytest.fixture
def fake_sm90(monkeypatch):
    """CPU parts taken for CUDA parts of an sm_90 device, so the gating past the device checks runs here."""
    monkeypatch.setattr(ng, "_on_cuda", lambda a, b: ng._NATIVE.on)
    monkeypatch.setattr(ng, "_cap", lambda t: (9, 0))
    monkeypatch.setattr(ng, "_failed", set())
    monkeypatch.setattr(ng, "_warned", set())


def test_declines_without_triton(fake_sm90, monkeypatch):
    monkeypatch.setattr(tm, "triton", None)
    assert not tm.available()
    a, b = _parts(64, 32, 64)
    assert not ng._triton_mxfp8_supports(a, b)


@pytest.mark.parametrize("cap", [(8, 9), (9, 1), (10, 0), (12, 0)])
def test_declines_off_sm90(fake_sm90, monkeypatch, cap):
    monkeypatch.setattr(tm, "triton", object())
    monkeypatch.setattr(ng, "_cap", lambda t: cap)
    a, b = _parts(64, 32, 64)
    assert not ng._triton_mxfp8_supports(a, b)


def test_gating_with_triton(fake_sm90, monkeypatch):
    monkeypatch.setattr(tm, "triton", object())  # stands in for an importable Triton
    a, b = _parts(64, 32, 96, "e5m2", "e4m3")
    assert ng._triton_mxfp8_supports(a, b)
    with ng.disabled():
        assert not ng._triton_mxfp8_supports(a, b)
    monkeypatch.setattr(ng.TRITON_MXFP8, "on", False)
    assert not ng._triton_mxfp8_supports(a, b)


def test_check_operands():
    a, b = _parts(64, 32, 96)
    assert tm.check_operands(a.data, a.scale, b.data, b.scale) is None
    assert "not contiguous" in tm.check_operands(a.data.t().contiguous().t(), a.scale, b.data, b.scale)
    assert tm.check_operands(a.data.t().contiguous().t(), a.scale, b.data, b.scale, contiguous=False) is None
    assert "uint8" in tm.check_operands(a.data, a.scale.view(torch.int8), b.data, b.scale)
    assert "uint8" in tm.check_operands(a.data, a.scale[:, :2], b.data, b.scale)
    assert "fp8" in tm.check_operands(a.data.view(torch.uint8), a.scale, b.data, b.scale)
    assert "[rows, K]" in tm.check_operands(a.data, a.scale, b.data[:, :64].contiguous(), b.scale[:, :2])
    d = torch.zeros(8, 48, dtype=torch.float8_e4m3fn)
    assert "multiple of 32" in tm.check_operands(d, torch.zeros(8, 1, dtype=torch.uint8), d,
                                                 torch.zeros(8, 1, dtype=torch.uint8))


def test_failure_falls_back_to_the_emulation_with_one_warning(fake_sm90, monkeypatch):
    monkeypatch.setattr(tm, "triton", object())

    def broken(*args, **kw):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(tm, "mxfp8_mm", broken)
    a, b = _parts(64, 32, 64)
    g = find_native_gemm(a, b)
    assert g is not None and g.name == NAME
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = gemm(a, b, torch.float32)
    assert any("Triton MXFP8 GEMM" in str(x.message) for x in w), [str(x.message) for x in w]
    assert torch.equal(y, emulated_gemm(a, b, torch.float32))
    assert find_native_gemm(a, b) is None or find_native_gemm(a, b).name != NAME  # off for the device now


def test_autotune_prune_keeps_configs_that_divide_k():
    class Cfg:
        def __init__(self, bm, bn, sl):
            self.kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "SLICES": sl}

    cfgs = [Cfg(128, 128, 4), Cfg(128, 128, 2), Cfg(128, 128, 1), Cfg(64, 128, 4)]
    assert [c.kwargs["SLICES"] for c in tm._prune(cfgs, {"M": 4096, "N": 4096, "K": 96})] == [1]
    assert len(tm._prune(cfgs, {"M": 4096, "N": 4096, "K": 4096})) == 4
    assert [c.kwargs["BLOCK_M"] for c in tm._prune(cfgs, {"M": 40, "N": 4096, "K": 128})] == [64]


# ---- GPU: the kernel ------------------------------------------------------------------------------------------

on_gpu = sm90_triton_test(tm.available(), "the Triton MXFP8 GEMM")
fixed_config = default_config_fixture("HYBRIDQ_MXFP8_NO_AUTOTUNE", "one compile per dtype pairing")


def _exact(a, b):
    """fp64 a @ b^T of the dequantized parts (each fp32 dequantized value is exact), and |a| @ |b|^T."""
    da, db = a.dequantize_2d().double(), b.dequantize_2d().double()
    return da @ db.t(), da.abs() @ db.abs().t()


def _check(y, a, b, what=""):
    exact, absref = _exact(a, b)
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}[y.dtype]
    fin = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(y), fin), f"{what}: non-finite pattern differs from the exact product"
    err = (y.double() - exact).abs()
    excess = err - (ACC_TOL * absref + u * exact.abs() + 2.0 ** -110)
    worst = float(excess[fin].max()) if fin.any() else -1.0
    ratio = float(((err - u * exact.abs()).clamp_min(0) / absref.clamp_min(1e-300))[fin].max()) if fin.any() else 0.0
    print(f"{what}: max (|err| - rounding) / (|A||B|^T) = {ratio:.3e}")
    assert worst <= 0, f"{what}: error above the bound (worst excess {worst:.3e}, ratio {ratio:.3e})"
    return ratio


FMTS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")]
SHAPES = [(128, 128, 32), (200, 72, 96), (257, 384, 4096), (1, 300, 64), (1000, 136, 256), (64, 64, 4096 + 32)]


@pytest.mark.parametrize("fmts", FMTS, ids=["x".join(f) for f in FMTS])
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
    with ng.disabled():
        ref = emulated_gemm(a, b, torch.float32)
    e = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    assert e < (5e-3 if out == torch.bfloat16 else 1e-4), f"relative error vs the emulation {e:.2e}"


def _adversarial(m, n, k, fa, fb, seed):
    """Parts with random codes and per-block scales: a's span 2^-100..2^100, b's 2^-30..2^-10 (every sum of 32
    products of a pair of blocks stays below the fp32 overflow: |P| < 2^37, scale products <= 2^90), a zero block, a NaN scale byte on one row of a and one row (output
    column) of b."""
    g = torch.Generator().manual_seed(seed)

    def part(rows, dt, lo, hi):
        fmax = 448.0 if dt == torch.float8_e4m3fn else 57344.0
        mag = torch.exp2(torch.randint(-12, 1, (rows, k), generator=g).float())  # codes over the fp8 range
        d = (torch.randn(rows, k, generator=g).sign() * mag * fmax * torch.rand(rows, k, generator=g)).to(dt)
        s = torch.randint(lo, hi + 1, (rows, k // 32), generator=g).to(torch.uint8)
        return MXFP8Part(rows=rows, cols=k, columnwise=False, data=d, scale=s)

    a = part(m, tm._FP8[fa == "e5m2"], 27, 227)
    b = part(n, tm._FP8[fb == "e5m2"], 97, 117)
    a.data[1, :32] = 0                   # a zero block (its byte is 0, as the quantizer gives it)
    a.scale[1, 0] = 0
    a.scale[4, k // 32 - 1] = 255        # NaN scale: row 4 NaN
    b.scale[5, 0] = 255                  # NaN scale: column 5 NaN
    return a.map_tensors(lambda t: t.cuda()), b.map_tensors(lambda t: t.cuda())


@pytest.mark.parametrize("fmts", FMTS, ids=["x".join(f) for f in FMTS])
@pytest.mark.parametrize("mnk", [(130, 200, 32), (96, 136, 96), (256, 128, 4096)], ids=str)
@on_gpu
def test_adversarial_scales(fmts, mnk):
    a, b = _adversarial(*mnk, *fmts, seed=SEED)
    y = gemm(a, b, torch.float32)
    with ng.disabled():
        ref = emulated_gemm(a, b, torch.float32)
    nan_y, nan_ref = torch.isnan(y), torch.isnan(ref)
    assert torch.equal(nan_y, nan_ref), "NaN pattern differs from the emulation"
    assert nan_y[4].all() and nan_y[:, 5].all() and int(nan_y.sum()) == mnk[0] + mnk[1] - 1
    keep = ~nan_y
    exact, absref = _exact(a, b)
    err = (y.double() - exact).abs()[keep]
    assert (err <= ACC_TOL * absref[keep] + 2.0 ** -110).all(), \
        f"max ratio {float((err / absref[keep].clamp_min(1e-300)).max()):.3e}"
    assert bool((y[1][keep[1]].abs() <= absref[1][keep[1]] * 2).all())


@on_gpu
def test_extreme_scale_bytes():
    """E8M0 bytes at the ends of the range: 254 (2^127) against 0 (2^-127) multiplies at the scale 2^0; 0 against
    0 (2^-254) is below fp32 and gives 0, as the emulation's fp32 products do. (Codes below 2 in magnitude, so
    that the blocks scaled by 2^127 dequantize to finite fp32 values: a quantizer never gives larger ones.)"""
    g = torch.Generator().manual_seed(SEED)
    d = lambda r: (torch.rand(r, 64, generator=g) * 3.8 - 1.9).to(torch.float8_e4m3fn)  # noqa: E731
    sa = torch.tensor([[254, 254], [0, 0], [0, 0], [120, 200]], dtype=torch.uint8)
    sb = torch.tensor([[0, 0], [254, 254], [0, 0], [134, 54]], dtype=torch.uint8)
    a = MXFP8Part(rows=4, cols=64, columnwise=False, data=d(4), scale=sa).map_tensors(lambda t: t.cuda())
    b = MXFP8Part(rows=4, cols=64, columnwise=False, data=d(4), scale=sb).map_tensors(lambda t: t.cuda())
    y = gemm(a, b, torch.float32)
    with ng.disabled():
        ref = emulated_gemm(a, b, torch.float32)
    exact, absref = _exact(a, b)
    for i, j in ((0, 0), (1, 1), (3, 3)):  # scale products 2^0
        assert abs(float(y[i, j]) - float(exact[i, j])) <= ACC_TOL * float(absref[i, j]), (i, j)
        assert abs(float(y[i, j]) - float(ref[i, j])) <= ACC_TOL * float(absref[i, j]), (i, j)
    assert float(y[2, 2]) == 0.0 and float(ref[2, 2]) == 0.0


@pytest.mark.parametrize("cfg", range(len(tm._CONFIGS)))
@on_gpu
def test_every_config(cfg):
    """Each autotuning candidate compiles and is correct (the autotuner may pick any of them)."""
    conf = tm.config_dict(tm._CONFIGS[cfg])
    a, b = _parts(300, 260, 512, "e4m3", "e5m2", seed=SEED, device="cuda")
    y32 = tm.mxfp8_mm(a.data, a.scale, b.data, b.scale, torch.float32, config=conf)
    _check(y32, a, b, f"config {conf}")
    if cfg == 0:
        y16 = tm.mxfp8_mm(a.data, a.scale, b.data, b.scale, torch.bfloat16, config=conf)
        assert torch.equal(y16, y32.to(torch.bfloat16)), "bf16 output is not the fp32 result rounded"


@on_gpu
def test_autotuned():
    """The autotuned launch (what training runs) on two shapes."""
    for m, n, k in ((512, 384, 1024), (300, 1000, 96)):
        a, b = _parts(m, n, k, "e4m3", "e4m3", seed=SEED, device="cuda")
        _check(tm.mxfp8_mm(a.data, a.scale, b.data, b.scale, torch.bfloat16), a, b, f"autotuned {m}x{n}x{k}")


@on_gpu
def test_strided_parts_are_taken():
    """The reference quantizer's columnwise parts are transposed views: the GEMM copies them row-major."""
    a, b = _parts(96, 64, 128, device="cuda")
    at = MXFP8Part(rows=a.rows, cols=a.cols, columnwise=True, data=a.data.t().contiguous().t(), scale=a.scale)
    assert not at.data.is_contiguous()
    assert find_native_gemm(at, b).name == NAME
    assert torch.equal(gemm(at, b, torch.float32), gemm(a, b, torch.float32))


@on_gpu
def test_empty_and_nonfinite_data():
    a, b = _parts(64, 48, 64, device="cuda")
    a.data[3, 5] = float("nan")
    a.scale[3, 0] = 127
    y = gemm(a, b, torch.float32)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(64) != 3]).all()
    e = MXFP8Part(rows=0, cols=64, columnwise=False, data=a.data[:0], scale=a.scale[:0])
    assert gemm(e, b, torch.bfloat16).shape == (0, 48)


@on_gpu
def test_linear_mxfp8_uses_the_kernel(monkeypatch):
    """An mxfp8 Linear's three GEMMs run the kernel, and agree with the emulated path (PRESET_BOUND of
    test_cuda_gemm.py for mxfp8)."""
    import contextlib

    import hybridq

    calls = []
    real = tm.mxfp8_mm
    monkeypatch.setattr(tm, "mxfp8_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(SEED)
    lin = hybridq.Linear(256, 192, bias=False, device="cuda", dtype=torch.bfloat16, recipe=hybridq.recipe("mxfp8"))
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 192, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for native in (True, False):
        x.grad, lin.weight.grad = None, None
        with (contextlib.nullcontext() if native else ng.disabled()):
            y = lin(x)
            y.backward(dy)
        outs[native] = (y.detach().float(), x.grad.float(), lin.weight.grad.float())
        if native:
            assert len(calls) == 3, f"the kernel ran {len(calls)} times for fprop, dgrad and wgrad"
    for name, g, r in zip(("y", "dx", "dw"), outs[True], outs[False]):
        e = float((g - r).norm() / r.norm())
        assert e < 5e-3, f"{name}: native vs emulated relative error {e:.2e}"
