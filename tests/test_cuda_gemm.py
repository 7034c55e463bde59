"""Native GEMMs on CUDA (FP8 tensorwise / blockwise through torch's scaled_mm, the bf16 emulation of MXFP8 and
NVFP4) against the generic emulated GEMM (dequantize to fp32, multiply), and Linear forward/backward with
native GEMMs against the emulated path, within each format's error bound. Skipped without CUDA."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import hybridq
from hybridq.formats import (Float8BlockQuantizer, Float8Quantizer, IdentityQuantizer, MXFP8Quantizer,
                             NVFP4Quantizer)
from hybridq.gemm import emulated_gemm, find_native_gemm, gemm
from _gpu import extension_ready

HAVE_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")]

SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))


needs_ext = pytest.mark.skipif(HAVE_CUDA and not extension_ready(), reason="the hybridq CUDA extension is not built")


def _native():
    from hybridq.kernels import native_gemm
    return native_gemm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(SEED)


def _parts(q, x, direction):
    return q.quantize(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise").part(direction)


def _pair(qa, qb, m, n, k, gen, da="rowwise", db="rowwise"):
    """Parts a: [m, k], b: [n, k] in GEMM orientation (a columnwise part quantizes the transposed input)."""
    xa = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    xb = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    a = _parts(qa, xa if da == "rowwise" else xa.t().contiguous(), da)
    b = _parts(qb, xb if db == "rowwise" else xb.t().contiguous(), db)
    return a, b


def check_native_vs_emulated(a, b, name, bound, out_dtype=torch.bfloat16):
    g = find_native_gemm(a, b)
    assert g is not None, f"{name}: no native GEMM accepted {a!r} x {b!r}"
    assert g.name == name, f"expected {name}, got {g.name}"
    y = gemm(a, b, out_dtype)
    with _native().disabled():
        ref = emulated_gemm(a, b, torch.float32)
    assert y.dtype == out_dtype and y.shape == ref.shape
    e = rel_err(y, ref)
    assert e < bound, f"{name}: relative error {e:.2e} vs the emulated GEMM (bound {bound})"
    return e


# ---- FP8 tensorwise ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")])
@pytest.mark.parametrize("dirs", [("rowwise", "rowwise"), ("rowwise", "columnwise"), ("columnwise", "columnwise")])
def test_fp8_tensorwise(fmts, dirs, gen):
    a, b = _pair(Float8Quantizer(fmts[0]), Float8Quantizer(fmts[1]), 256, 384, 512, gen, *dirs)
    check_native_vs_emulated(a, b, "cuda-scaled-mm-tensorwise", 1e-2)
    check_native_vs_emulated(a, b, "cuda-scaled-mm-tensorwise", 1e-2, out_dtype=torch.float32)


def test_fp8_tensorwise_e5m2_pair_is_emulated(gen):
    a, b = _pair(Float8Quantizer("e5m2"), Float8Quantizer("e5m2"), 64, 64, 64, gen)
    assert find_native_gemm(a, b) is None


def test_fp8_tensorwise_odd_shapes_fall_back_with_warning(gen):
    a, b = _pair(Float8Quantizer(), Float8Quantizer(), 64, 40, 72, gen)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert find_native_gemm(a, b) is None
    assert any("[64, 72] x [40, 72]" in str(x.message) for x in w), [str(x.message) for x in w]
    y = gemm(a, b, torch.float32)
    assert torch.equal(y, emulated_gemm(a, b, torch.float32))


# ---- FP8 blockwise ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("b_dim", [2, 1], ids=["1x128_x_128x128", "1x128_x_1x128"])
@pytest.mark.parametrize("mnk", [(256, 384, 512), (128, 8192 // 32, 1024), (272, 400, 640)])
def test_fp8_blockwise(b_dim, mnk, gen):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise FP8 GEMM: sm_90 only")
    m, n, k = mnk
    a, b = _pair(Float8BlockQuantizer(), Float8BlockQuantizer(block_dim=b_dim), m, n, k, gen)
    check_native_vs_emulated(a, b, "cuda-scaled-mm-blockwise", 1e-2)


def test_fp8_blockwise_k_not_multiple_of_128_falls_back(gen):
    a, b = _pair(Float8BlockQuantizer(), Float8BlockQuantizer(block_dim=2), 128, 128, 200, gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert find_native_gemm(a, b) is None


# ---- bf16 emulation of MXFP8 / NVFP4 (and bf16 identity parts) ---------------------------------------------------

@needs_ext
@pytest.mark.parametrize("case", ["mxfp8", "mxfp8_e5m2", "nvfp4", "nvfp4_rht", "nvfp4_2d_x_rht", "mx_x_nvfp4",
                                  "identity"])
def test_bf16_emulation(case, gen):
    q = {"mxfp8": (MXFP8Quantizer(), MXFP8Quantizer(), "rowwise"),
         "mxfp8_e5m2": (MXFP8Quantizer("e5m2"), MXFP8Quantizer(), "rowwise"),
         "nvfp4": (NVFP4Quantizer(), NVFP4Quantizer(block_2d=True), "rowwise"),
         "nvfp4_rht": (NVFP4Quantizer(rht=True), NVFP4Quantizer(rht=True), "columnwise"),
         "nvfp4_2d_x_rht": (NVFP4Quantizer(block_2d=True), NVFP4Quantizer(rht=True), "columnwise"),
         "mx_x_nvfp4": (MXFP8Quantizer(), NVFP4Quantizer(), "rowwise"),
         "identity": (IdentityQuantizer(), IdentityQuantizer(), "columnwise")}[case]
    a, b = _pair(q[0], q[1], 192, 256, 512, gen, q[2], q[2])
    if case == "nvfp4_2d_x_rht":  # one operand rotated, the other not: the transform must be undone (fp32)
        assert find_native_gemm(a, b) is None
        return
    name = "cuda-bf16" if case == "identity" else "cuda-emulated-bf16"
    check_native_vs_emulated(a, b, name, 2e-3)


# ---- Linear forward / backward: native vs emulated ------------------------------------------------------------

# native vs emulated GEMMs: 2e-2 where an FP8 tensor-core GEMM runs (fast accumulation in fprop, bf16 results),
# tighter where the native path is exact bf16 arithmetic; a preset not listed gets the FP8 bound
PRESET_BOUND = {"fp8_tensorwise": 2e-2, "fp8_delayed": 2e-2, "fp8_block": 2e-2, "mxfp8": 5e-3, "nvfp4": 5e-3,
                "mxfp8_fwd_nvfp4_bwd": 5e-3, "fp8_block_fwd_mxfp8_bwd": 2e-2, "fp8_fwd_high_precision_bwd": 2e-2}
DEFAULT_BOUND = 2e-2


def _linear_step(preset, w, bias, x, dy, seed):
    lin = hybridq.Linear(w.shape[1], w.shape[0], bias=True, device="cuda", dtype=torch.bfloat16,
                         recipe=hybridq.recipe(preset))
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(bias)
    xx = x.clone().requires_grad_(True)
    torch.cuda.manual_seed(seed)
    y = lin(xx)
    y.backward(dy)
    return y.detach().float(), xx.grad.float(), lin.weight.grad.float()


@pytest.mark.parametrize("preset", hybridq.preset_names())
def test_linear_native_vs_emulated(preset, gen):
    bound = PRESET_BOUND.get(preset, DEFAULT_BOUND)
    m, k, n = 256, 512, 384
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(2, m // 2, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    dy = torch.randn(2, m // 2, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = _linear_step(preset, w, bias, x, dy, SEED)
    with _native().disabled():
        ref = _linear_step(preset, w, bias, x, dy, SEED)
    for name, g, r in zip(("y", "dx", "dw"), got, ref):
        assert torch.isfinite(g).all(), f"{preset}: non-finite {name}"
        e = rel_err(g, r)
        assert e < bound, f"{preset}: {name} native vs emulated relative error {e:.2e} (bound {bound:g})"


@needs_ext
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"])
def test_linear_gpu_vs_cpu_reference(preset):
    """Forward output on the GPU (kernels + native GEMMs) vs the CPU path (references + emulated GEMM): the
    quantized operands are bit-identical, so only GEMM accumulation differs."""
    g = torch.Generator().manual_seed(SEED)
    m, k, n = 128, 256, 192
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    outs = []
    for dev in ("cpu", "cuda"):
        lin = hybridq.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16, recipe=hybridq.recipe(preset))
        with torch.no_grad():
            lin.weight.copy_(w)
        outs.append(lin(x.to(dev)).float().cpu())
    e = rel_err(outs[1], outs[0])
    assert e < 1e-2, f"{preset}: GPU vs CPU forward relative error {e:.2e}"
