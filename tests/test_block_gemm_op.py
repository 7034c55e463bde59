"""The dense FP8 block GEMM as one extension op (`hybridq::fp8_block_mm`, csrc/block_gemm.cu, [Note: the dense block
GEMM op]; issue 33: the eager fp8_block Linear's host time). Specification:

- the scale operands cuBLAS reads, from a part's stored scales (`block_scale_operands`: 1x128 scales outer-dim-major,
  128x128 tile scales with the K blocks zero-padded to a multiple of 4, transposed), on the CPU;
- which stored scales the op takes (`block_op_takes_scales`) and its switch (HYBRIDQ_BLOCK_GEMM_OP,
  `set_block_gemm_op`), on the CPU;
- on sm_90 (marked gpu): the op is bitwise `F.scaled_mm` on `block_scale_operands` for both pairings, K of 1 to 5
  blocks (the tile scales' padding), N not a multiple of 128, each out dtype, non-finite values; through the direct
  cuBLASLt path and, with HYBRIDQ_CUBLASLT_DIRECT=0, through its `_scaled_mm_v2_out` fallback; `gemm` of real parts
  and a whole fp8_block Linear step are bitwise the same with the op on and off; bad arguments raise naming the
  tensor and the rule."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from _compare import assert_bitwise
from _nvcc_host import NVCC, build_host_driver
from hybridq.formats import Float8BlockQuantizer
from hybridq.kernels import native_gemm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the scale operands (CPU) -------------------------------------------------------------------------------

# (rows of a, K blocks, rows of b): one K block (padded to 4), three (padded), four (none), five; N not a multiple of
# 128 (a partial tile row)
SCALE_CASES = [(16, 1, 128), (48, 3, 144), (32, 4, 256), (16, 5, 16)]


def _want_tiles(b_scales: torch.Tensor) -> torch.Tensor:
    """[round_up(kb, 4), nb]: element (c, t) is tile (t, c)'s scale for c < kb, zero in the padding (F.pad's value)."""
    nb, kb = b_scales.shape
    out = torch.zeros(-(-kb // 4) * 4, nb)
    for t in range(nb):
        for c in range(kb):
            out[c, t] = b_scales[t, c]
    return out


@pytest.mark.parametrize("m,kb,n", SCALE_CASES, ids=str)
def test_tile_scales_are_padded_with_zeros_and_transposed(m, kb, n):
    """b's 128x128 tile scales: [round_up(K/128, 4), ceil(N/128)] with strides (1, round_up(K/128, 4)) -- the
    memory of a row-major [ceil(N/128), round_up(K/128, 4)] -- zeros past the K blocks."""
    a_s, b_s = torch.rand(m, kb) + 0.5, torch.rand(-(-n // 128), kb) + 0.5
    _, sb = native_gemm.block_scale_operands(a_s, b_s, True)
    kb4 = -(-kb // 4) * 4
    assert sb.stride() == (1, kb4), f"tile scale strides {sb.stride()}, want (1, {kb4})"
    assert_bitwise(sb, _want_tiles(b_s), f"tile scales m={m} kb={kb} n={n}")


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "rows"])
@pytest.mark.parametrize("m,kb,n", SCALE_CASES, ids=str)
def test_block_scales_are_outer_dim_major(m, kb, n, tiles):
    """a's 1x128 scales (and b's where b has 1x128 blocks): the stored [rows, kb] values with strides (1, rows) --
    column c's rows at c * rows in memory (torch ignores the stride of a size-1 dim: kb 1 is any column)."""
    a_s, b_s = torch.rand(m, kb) + 0.5, torch.rand(-(-n // 128) if tiles else n, kb) + 0.5
    sa, sb = native_gemm.block_scale_operands(a_s, b_s, tiles)
    checks = [("a", sa, a_s)] + ([] if tiles else [("b", sb, b_s)])
    for name, got, stored in checks:
        assert got.stride()[0] == 1 and (kb == 1 or got.stride()[1] == stored.shape[0]), \
            f"{name}'s scale strides {got.stride()}, want (1, {stored.shape[0]})"
        assert_bitwise(got, stored, f"{name}'s scales m={m} kb={kb} n={n}")


# ---- the op's scale kernel, element by element, compiled for the host (CPU, needs nvcc) -------------------------

_DRIVER = r"""
#include <cstdio>
#include <vector>
#include "block_gemm_scales.cuh"
int main() {
  long long m, nb, kb, tiles;
  while (scanf("%lld %lld %lld %lld", &m, &nb, &kb, &tiles) == 4) {
    std::vector<float> a(m * kb), b(nb * kb);
    for (size_t j = 0; j < a.size(); ++j) a[j] = 0.5f * (j + 1);
    for (size_t j = 0; j < b.size(); ++j) b[j] = -1.0f * (j + 1);
    const hybridq::BlockGemmScales s{m, nb, kb, (kb + 3) / 4 * 4, tiles != 0};
    for (long long i = 0; i < s.n_a() + s.n_b(); ++i) printf("%.9g ", hybridq::block_gemm_scale(a.data(), b.data(), s, i));
    printf("\n");
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def scales_bin(tmp_path_factory) -> str:
    return build_host_driver(tmp_path_factory.mktemp("block_gemm_scales"), _DRIVER, "block_gemm_scales.cuh")


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (host compile of csrc/block_gemm_scales.cuh)")
def test_scale_kernel_writes_the_memory_of_the_scaled_mm_scale_operands(scales_bin):
    """The op's scale kernel (csrc/block_gemm_scales.cuh, run on the host) writes, region by region, the memory of the
    scale operands F.scaled_mm was given (`block_scale_operands`: a's outer-dim-major scales, then b's padded tile
    scales or outer-dim-major 1x128 scales), for every case of SCALE_CASES and both pairings."""
    cases = [(m, kb, n, tiles) for m, kb, n in SCALE_CASES for tiles in (True, False)]
    lines = [f"{m} {-(-n // 128) if tiles else n} {kb} {int(tiles)}" for m, kb, n, tiles in cases]
    r = subprocess.run([scales_bin], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    for (m, kb, n, tiles), out in zip(cases, r.stdout.splitlines(), strict=True):
        nb = -(-n // 128) if tiles else n
        a_s = (torch.arange(m * kb, dtype=torch.float32) + 1).mul(0.5).reshape(m, kb)
        b_s = (torch.arange(nb * kb, dtype=torch.float32) + 1).neg().reshape(nb, kb)
        sa, sb = native_gemm.block_scale_operands(a_s, b_s, tiles)
        want = torch.cat([sa.t().contiguous().flatten(), sb.t().contiguous().flatten()])  # (their memory, in order)
        got = torch.tensor([float(v) for v in out.split()], dtype=torch.float32)
        assert_bitwise(got, want, f"scale buffer m={m} kb={kb} n={n} tiles={tiles}")


# ---- which scales the op takes, and its switch (CPU) --------------------------------------------------------

def _takes_cases():
    m, n = 32, 144  # (K = 384: three 128-blocks, the scales' second dim)
    a, t, r = torch.rand(m, 3), torch.rand(2, 3), torch.rand(n, 3)
    return [
        ("tiles as the quantize kernel writes them", a, t, True, True),
        ("1x128 b as the quantize kernel writes them", a, r, False, True),
        ("a's scales a strided view (the reference's columnwise)", torch.rand(3, m).t(), t, True, False),
        ("tile scales of the wrong grid", a, torch.rand(1, 3), True, False),
        ("tile scales given for 1x128 b", a, t, False, False),
        ("float64 scales", a.double(), t, True, False),
        ("a's scales of another K", torch.rand(m, 2), t, True, False),
    ]


@pytest.mark.parametrize("what,a_s,b_s,tiles,want", _takes_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_op_takes_only_the_scales_the_quantize_kernels_write(what, a_s, b_s, tiles, want):
    got = native_gemm.block_op_takes_scales(a_s, b_s, 32, 384, 144, tiles)
    assert got == want, f"{what}: block_op_takes_scales -> {got}, want {want}"


def test_set_block_gemm_op_switches_and_returns_the_previous_setting():
    prev = native_gemm.set_block_gemm_op(False)
    try:
        assert native_gemm.BLOCK_GEMM_OP.on is False
        assert native_gemm.set_block_gemm_op(True) is False, "set_block_gemm_op must return the previous setting"
        assert native_gemm.BLOCK_GEMM_OP.on is True
    finally:
        native_gemm.set_block_gemm_op(prev)


def test_the_environment_variable_is_the_switch_s():
    """HYBRIDQ_BLOCK_GEMM_OP=0 starts a process with the op off (a default-on switch: the rule,
    tests/test_switches.py)."""
    s = native_gemm.BLOCK_GEMM_OP
    assert (s.env, s.default) == ("HYBRIDQ_BLOCK_GEMM_OP", True), f"{s!r}: not the default-on switch of that variable"


# ---- the op on sm_90 (gpu) -----------------------------------------------------------------------------------

def _sm90_ready() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from hybridq.kernels import _ext
    return _ext.available_for(torch.device("cuda")) and hasattr(torch.nn.functional, "scaled_mm")


SM90 = pytest.mark.skipif(not _sm90_ready(), reason="needs CUDA sm_90 (cuBLAS block-scaled FP8) and the extension")
E4M3 = torch.float8_e4m3fn


def _operands(m, k, n, tiles, seed, poison=False):
    """Random E4M3 a [m, k], b [n, k] and positive fp32 scales as the quantize kernels store them; `poison`: a NaN
    element in a and an inf scale in b."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=gen) * 4, torch.randn(n, k, generator=gen) * 4
    a_s = torch.rand(m, k // 128, generator=gen) + 0.25
    b_s = torch.rand(-(-n // 128) if tiles else n, k // 128, generator=gen) + 0.25
    if poison:
        a[1, 3] = float("nan")
        b_s[0, 0] = float("inf")
    return [a.to(E4M3).cuda(), a_s.cuda(), b.to(E4M3).cuda(), b_s.cuda()]


def _scaled_mm(a, a_s, b, b_s, tiles, out):
    """What native_gemm._block_run ran before the op: F.scaled_mm on block_scale_operands."""
    F = torch.nn.functional
    sa, sb = native_gemm.block_scale_operands(a_s, b_s, tiles)
    od = out if out in (torch.bfloat16, torch.float32) else torch.float32
    rb = F.ScalingType.BlockWise128x128 if tiles else F.ScalingType.BlockWise1x128
    y = F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb, rb, output_dtype=od)
    return y if od == out else y.to(out)


def _calls() -> int:
    from hybridq import _C
    return _C.cublaslt_stats()["calls"]


# (M, K, N): one K block, three (tile scales padded), five; N 144 (partial tile row), 16; M 16 and 48
OP_SHAPES = [(16, 128, 128), (48, 384, 144), (32, 640, 256), (16, 256, 16), (64, 512, 384)]
OUTS = [torch.bfloat16, torch.float32, torch.float16]


@SM90
@pytest.mark.gpu
@pytest.mark.parametrize("out", OUTS, ids=str)
@pytest.mark.parametrize("tiles", [True, False], ids=["1x128_x_128x128", "1x128_x_1x128"])
@pytest.mark.parametrize("m,k,n", OP_SHAPES, ids=str)
def test_gpu_op_is_bitwise_scaled_mm(m, k, n, tiles, out):
    """fp8_block_mm (scales relaid in one kernel, cuBLASLt with a cached plan) equals F.scaled_mm on the scale
    operands _block_run built, bit for bit, and the direct path ran it."""
    ops = _operands(m, k, n, tiles, seed=m + k + n)
    before = _calls()
    y = torch.ops.hybridq.fp8_block_mm(*ops, tiles, out)
    direct = os.environ.get("HYBRIDQ_CUBLASLT_DIRECT", "1") != "0"
    assert _calls() == before + direct, "the direct cuBLASLt path did not run the GEMM"
    assert_bitwise(y, _scaled_mm(*ops, tiles, out), f"{m}x{k}x{n} tiles={tiles} -> {out}")


@SM90
@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [True, False], ids=["1x128_x_128x128", "1x128_x_1x128"])
def test_gpu_op_keeps_non_finite_values_as_scaled_mm(tiles):
    """A NaN element and an inf scale: the result is non-finite where F.scaled_mm's is, bitwise (NaN payloads
    aside)."""
    ops = _operands(32, 256, 128, tiles, seed=7, poison=True)
    want = _scaled_mm(*ops, tiles, torch.float32)
    assert not torch.isfinite(want).all(), "the poisoned reference is all finite"
    assert_bitwise(torch.ops.hybridq.fp8_block_mm(*ops, tiles, torch.float32), want, f"non-finite, tiles={tiles}",
                   nan_payload=True)


_FALLBACK = r"""
import sys
sys.path.insert(0, "tests")
import torch
from hybridq import _C
from _compare import assert_bitwise
from test_block_gemm_op import _operands, _scaled_mm, OP_SHAPES
assert not _C.cublaslt_enabled(), "HYBRIDQ_CUBLASLT_DIRECT=0 left the direct path on"
for m, k, n in OP_SHAPES:
    for tiles in (True, False):
        for out in (torch.bfloat16, torch.float16):
            ops = _operands(m, k, n, tiles, seed=m + k + n)
            y = torch.ops.hybridq.fp8_block_mm(*ops, tiles, out)
            assert_bitwise(y, _scaled_mm(*ops, tiles, out), f"fallback {m}x{k}x{n} tiles={tiles} -> {out}")
s = _C.cublaslt_stats()
assert s["calls"] == 0 and s["declined"] > 0, s
print("OK")
"""


@SM90
@pytest.mark.gpu
def test_gpu_op_fallback_without_the_direct_path_is_bitwise_scaled_mm():
    """HYBRIDQ_CUBLASLT_DIRECT=0: the op runs `_scaled_mm_v2_out` on views of its scale buffer (the shapes and
    strides F.scaled_mm was given); same results."""
    env = dict(os.environ, HYBRIDQ_CUBLASLT_DIRECT="0")
    r = subprocess.run([sys.executable, "-c", _FALLBACK], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def _bad_args():
    def ok():
        return _operands(16, 256, 128, True, seed=1)

    def with_(i, t):
        ops = ok()
        ops[i] = t
        return ops

    a, a_s, b, b_s = ok()
    return [
        ("b", with_(2, b.float().to(torch.float8_e5m2)), "b must be torch.float8_e4m3fn"),
        ("a", with_(0, a[:, :128]), "a must be a contiguous 2-D tensor"),
        ("a_scale", with_(1, a_s[:, :1]), r"a_scale must be contiguous float32 of shape \[16, 2\]"),
        ("b_scale", with_(3, b_s.double()), r"b_scale must be contiguous float32 of shape \[1, 2\]"),
        ("K", [a[:, :16].contiguous(), a_s, b[:, :16].contiguous(), b_s], "positive multiple of 128"),
    ]


@SM90
@pytest.mark.gpu
@pytest.mark.parametrize("case", range(5), ids=["b_dtype", "a_strided", "a_scale_shape", "b_scale_dtype", "K"])
def test_gpu_op_rejects_bad_arguments_naming_them(case):
    what, ops, message = _bad_args()[case]
    before = _calls()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.hybridq.fp8_block_mm(*ops, True, torch.bfloat16)
    assert _calls() == before, f"{what}: a GEMM ran before the error"


# ---- through gemm() and a Linear: the op on and off (gpu) ------------------------------------------------------

def _part(q, x, direction):
    return q.quantize(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise").part(direction)


# (the Linear's three GEMMs: fprop x.row x W.row, dgrad dy.row x W.col -- 128x128 tiles --, wgrad dy.col x x.col)
PHASES = {"fprop": ("rowwise", 2, "rowwise"), "dgrad": ("rowwise", 2, "columnwise"),
          "wgrad": ("columnwise", 1, "columnwise")}
# (M, K, N) of the GEMM: K a multiple of 128 (the op), N not (partial tiles); K not a multiple of 128 (emulated either
# way: the op is not called)
GEMM_SHAPES = [(64, 256, 384), (48, 384, 144), (32, 200, 128)]


@SM90
@pytest.mark.gpu
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("m,k,n", GEMM_SHAPES, ids=str)
def test_gpu_gemm_of_block_parts_is_bitwise_with_the_op_off(m, k, n, phase, out):
    """gemm() of CUDA-quantized FP8 block parts: the op path equals the F.scaled_mm path bit for bit; the op runs
    exactly where K is whole 1x128 blocks."""
    from hybridq.formats import Float8BlockQuantizer
    from hybridq.gemm import gemm
    da, b_dim, db = PHASES[phase]
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    xa = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    xb = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    xa[0, 0] = float("inf")
    a = _part(Float8BlockQuantizer(), xa if da == "rowwise" else xa.t().contiguous(), da)
    b = _part(Float8BlockQuantizer(block_dim=b_dim), xb if db == "rowwise" else xb.t().contiguous(), db)
    prev = native_gemm.set_block_gemm_op(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (K % 128: the emulated GEMM's one-time warning)
            before = _calls()
            y = gemm(a, b, out, "op on")
            ran = _calls() - before
            native_gemm.set_block_gemm_op(False)
            want = gemm(a, b, out, "op off")
    finally:
        native_gemm.set_block_gemm_op(prev)
    direct = os.environ.get("HYBRIDQ_CUBLASLT_DIRECT", "1") != "0"
    assert ran == (direct and k % 128 == 0), f"direct GEMMs run: {ran}"
    assert_bitwise(y, want, f"{phase} {m}x{k}x{n} -> {out}", nan_payload=True)


@SM90
@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(256, 384), (384, 144)], ids=str)
def test_gpu_fp8_block_linear_step_is_bitwise_with_the_op_off(k, n):
    """A whole fp8_block Linear forward and backward (y, dx, dW) with the op and with F.scaled_mm: bitwise."""
    import hybridq
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to("cuda", torch.bfloat16)
    x = torch.randn(128, k, generator=g).to("cuda", torch.bfloat16)
    dy = torch.randn(128, n, generator=g).to("cuda", torch.bfloat16)

    def step():
        lin = hybridq.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, recipe=hybridq.recipe("fp8_block"))
        with torch.no_grad():
            lin.weight.copy_(w)
        xx = x.clone().requires_grad_(True)
        y = lin(xx)
        y.backward(dy)
        return y.detach(), xx.grad, lin.weight.grad

    direct = os.environ.get("HYBRIDQ_CUBLASLT_DIRECT", "1") != "0"
    prev = native_gemm.set_block_gemm_op(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (dgrad's K = N % 128: the emulated GEMM's warning)
            before = _calls()
            got = step()
            ran = _calls() - before
            native_gemm.set_block_gemm_op(False)
            want = step()
    finally:
        native_gemm.set_block_gemm_op(prev)
    # fprop and wgrad contract whole 1x128 blocks (K, 128 tokens); dgrad contracts N
    assert ran == direct * (2 + (n % 128 == 0)), f"GEMMs through the op's direct path: {ran}"
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        assert_bitwise(a, b, f"fp8_block Linear {name} (K={k}, N={n})")


@SM90
@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [True, False], ids=["1x128_x_128x128", "1x128_x_1x128"])
def test_gpu_op_issues_no_host_sync(tiles):
    """The op (allocation, scale kernel, GEMM) never waits for the device: a step that issues it stays asynchronous
    (a plan's first call included)."""
    from _gpu import no_host_sync
    from hybridq import _C
    ops = _operands(48, 384, 256, tiles, seed=3)
    torch.ops.hybridq.fp8_block_mm(*ops, tiles, torch.bfloat16)  # (torch's cuBLASLt workspace exists)
    _C.cublaslt_clear_plans()
    with no_host_sync():
        torch.ops.hybridq.fp8_block_mm(*ops, tiles, torch.bfloat16)


def test_out_of_memory_in_the_block_gemm_propagates_and_keeps_the_kernel(monkeypatch):
    """Any other failure of the block GEMM in torch turns it off for the shape (one warning, the emulated GEMM after);
    running out of memory is not the kernel's failure: it reaches the caller and the shape keeps its kernel."""
    q = Float8BlockQuantizer()
    a, b = (q.quantize(torch.randn(m, 256, generator=torch.Generator().manual_seed(m)), rowwise=True,
                       columnwise=False).rowwise for m in (32, 48))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(native_gemm, "_block_op_takes", lambda *args: False)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", oom)
    failed = set(native_gemm._failed)
    with pytest.raises(torch.OutOfMemoryError):
        native_gemm._block_run(a, b, torch.bfloat16)
    assert native_gemm._failed == failed, f"out of memory turned the kernel off for a shape: {native_gemm._failed - failed}"
