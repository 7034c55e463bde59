"""The sm_100+ block-scaled GEMM path (MXFP8 x MXFP8, NVFP4 x NVFP4 through torch.nn.functional.scaled_mm):
never tried below sm_100, self-checked against the emulated GEMM on first use, off (one warning) when the check
fails. No sm_100 GPU is available to us: these CPU tests patch the device checks and stand in for torch's
scaled_mm with a function that computes what its documented arguments mean (1x32 E8M0 / 1x16 E4M3 block scales
in the swizzled 128x4-tile layout, a tensorwise global scale for NVFP4, mat_b column-major). They pin the gating,
the fallback and the argument plumbing, not the hardware."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridq.kernels.native_gemm as ng
from hybridq.formats import MXFP8Part, MXFP8Quantizer, NVFP4Quantizer
from hybridq.formats._numerics import e2m1_decode, e8m0_to_pow2, expand_blocks, unpack_nibbles
from hybridq.gemm import find_native_gemm, gemm

NATIVE = "cuda-scaled-mm-blockscaled"
QUANTIZERS = {"mxfp8": MXFP8Quantizer, "nvfp4": NVFP4Quantizer}


def _parts(fmt: str, m: int = 64, n: int = 48, k: int = 128):
    g = torch.Generator().manual_seed(7)
    q = QUANTIZERS[fmt]()
    return tuple(q.quantize_parts(torch.randn(r, k, generator=g).to(torch.bfloat16), True, False)[0] for r in (m, n))


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Compact [rows, cols] scales back from the 128x4-tile layout (the permutation is its own inverse)."""
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    s = flat.view(torch.uint8).view(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return s[:rows, :cols]


def _decode(mat: torch.Tensor, scales, recipes, swizzles) -> torch.Tensor:
    scales, recipes, swizzles = (v if isinstance(v, list) else [v] for v in (scales, recipes, swizzles))
    assert swizzles[0] == F.SwizzleType.SWIZZLE_32_4_4, f"block scales must be swizzled, got {swizzles}"
    if mat.dtype == torch.float4_e2m1fn_x2:
        assert recipes == [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise], recipes
        assert scales[0].dtype == torch.float8_e4m3fn and scales[1].numel() == 1, [s.dtype for s in scales]
        vals = e2m1_decode(unpack_nibbles(mat.view(torch.uint8)))
        rows, k = vals.shape
        block = _unswizzle(scales[0], rows, k // 16).view(torch.float8_e4m3fn).float()
        return vals * expand_blocks(block, 16, k) * scales[1].float()
    assert recipes == [F.ScalingType.BlockWise1x32], recipes
    assert scales[0].dtype == torch.float8_e8m0fnu, scales[0].dtype
    rows, k = mat.shape
    return mat.float() * expand_blocks(e8m0_to_pow2(_unswizzle(scales[0], rows, k // 32)), 32, k)


class FakeScaledMM:
    """Stands in for torch.nn.functional.scaled_mm: `result` "correct" computes the documented product."""

    def __init__(self, result: str = "correct"):
        self.result, self.calls = result, 0

    def __call__(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                 swizzle_b=None, bias=None, output_dtype=torch.bfloat16, **_):
        self.calls += 1
        assert mat_b.stride(0) == 1, f"mat_b must be column-major, strides {mat_b.stride()}"
        a = _decode(mat_a, scale_a, scale_recipe_a, swizzle_a)
        b = _decode(mat_b.t(), scale_b, scale_recipe_b, swizzle_b)
        y = a @ b.t()
        return (torch.zeros_like(y) if self.result == "zeros" else y).to(output_dtype)


@pytest.fixture
def device(monkeypatch):
    """Pretend the CPU tensors live on a GPU of the given capability; fresh self-check state and warnings."""
    monkeypatch.setattr(ng, "_on_cuda", lambda a, b: True)
    monkeypatch.setattr(ng, "_blockscaled_ok", {})
    monkeypatch.setattr(ng, "_warned", set())

    def set_capability(cap):
        monkeypatch.setattr(ng, "_cap", lambda t: cap)
    return set_capability


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_never_tried_below_sm100(fmt, device, monkeypatch):
    device((9, 0))
    fake = FakeScaledMM()
    monkeypatch.setattr(F, "scaled_mm", fake)
    a, b = _parts(fmt)
    impl = find_native_gemm(a, b)
    assert impl is None or impl.name != NATIVE, f"{fmt} on sm_90 picked {impl.name}"
    gemm(a, b, torch.float32)
    assert fake.calls == 0, f"scaled_mm was called {fake.calls} times on sm_90"


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_sm100_runs_scaled_mm_with_the_documented_layout(fmt, device, monkeypatch):
    device((10, 0))
    fake = FakeScaledMM()
    monkeypatch.setattr(F, "scaled_mm", fake)
    a, b = _parts(fmt)
    assert find_native_gemm(a, b).name == NATIVE
    got = gemm(a, b, torch.float32)
    want = ng._emulated_fp32(a, b, torch.float32)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, f"{fmt}: native path differs from the emulated GEMM by {err:.2e} (relative)"
    assert fake.calls == 2, f"expected the self-check call and the GEMM, got {fake.calls} calls"
    assert ng._blockscaled_ok[(type(a), a.device.index)] is True
    gemm(a, b, torch.float32)
    assert fake.calls == 3, "the self-check must run only on first use"


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_sm100_failed_self_check_turns_the_path_off_with_one_warning(fmt, device, monkeypatch):
    device((10, 0))
    fake = FakeScaledMM("zeros")
    monkeypatch.setattr(F, "scaled_mm", fake)
    a, b = _parts(fmt)
    with pytest.warns(RuntimeWarning, match="disagrees with the emulated GEMM"):
        got = gemm(a, b, torch.float32)
    assert torch.equal(got, ng._emulated_fp32(a, b, torch.float32)), "the fallback must be the emulated GEMM"
    impl = find_native_gemm(a, b)
    assert impl is None or impl.name != NATIVE, "a failed self-check must turn the native path off"
    gemm(a, b, torch.float32)
    assert fake.calls == 1, f"scaled_mm called {fake.calls} times after a failed self-check"


def test_sm100_declines_unaligned_rows_with_a_warning(device, monkeypatch):
    device((10, 0))
    monkeypatch.setattr(F, "scaled_mm", FakeScaledMM())
    a, b = _parts("mxfp8", m=40)
    with pytest.warns(RuntimeWarning, match="M, N % 16 == 0"):
        impl = find_native_gemm(a, b)
    assert impl is None or impl.name != NATIVE


def test_sm100_declines_mixed_hadamard_domains(device, monkeypatch):
    """An NVFP4 operand in the Hadamard domain times one that is not: the emulation undoes the transform."""
    device((10, 0))
    monkeypatch.setattr(F, "scaled_mm", FakeScaledMM())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    _, rotated = NVFP4Quantizer(rht=True).quantize_parts(x, False, True)  # columnwise [128, 64], rotated
    plain = NVFP4Quantizer().quantize_parts(torch.randn(32, 64, generator=g).to(torch.bfloat16), True, False)[0]
    assert rotated.transform == "rht16" and plain.transform is None
    impl = find_native_gemm(plain, rotated)
    assert impl is None or impl.name != NATIVE
    assert isinstance(_parts("mxfp8")[0], MXFP8Part)
