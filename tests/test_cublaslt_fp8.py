"""FP8 GEMMs through cuBLASLt with cached plans (csrc/cublaslt_fp8.{h,cpp}; issues 30 and 33): the extension's
per-tensor GEMMs (`hybridq::fp8_linear*`, csrc/linear_fp8.cpp) and the grouped block-scaled loop
(`hybridq::grouped_block_cublas_*`, csrc/grouped_block_gemm.cu) call cuBLASLt directly with the descriptors and the
heuristic's algorithm made once per problem. Results are bitwise `torch._scaled_mm` / `F.scaled_mm` (the same
cuBLASLt call) for every operand dtype pair, fast accumulation on and off, each out dtype, odd row counts, the
smallest K, non-finite values, and both block pairings (with offsets into the operands); a second call of the same
problem does not query the heuristic again, a new problem makes a new plan; HYBRIDQ_CUBLASLT_DIRECT=0 turns the
direct path off (same results); what it does not cover (E5M2 x E5M2) still raises torch's error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _compare import assert_bitwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _cuda_ready(capability) -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.kernels import _ext
    return _ext.available_for(torch.device("cuda")) and capability(torch.cuda.get_device_capability())


_TENSORWISE = pytest.mark.skipif(not _cuda_ready(lambda c: c >= (8, 9)),
                                 reason="needs a CUDA device with FP8 tensor cores and the extension")
_BLOCKS = pytest.mark.skipif(not _cuda_ready(lambda c: c == (9, 0)),
                             reason="needs CUDA sm_90 (cuBLAS block-scaled FP8) and the extension")
pytestmark = pytest.mark.gpu

# the experts' GEMMs on the current stream only, or alternately on it and a side stream (csrc/expert_streams.h)
STREAMS, STREAM_IDS = [1, 2], ["one-stream", "two-streams"]


def _ops():
    return torch.ops.hybridq


def _stats() -> dict:
    from hybridq import _C
    return _C.cublaslt_stats()


def _quantize(x: torch.Tensor, dtype: torch.dtype):
    """x's rowwise per-tensor FP8 data and scale_inv (the cast fp8_linear_fprop runs on its input)."""
    row, _, scale_inv, _ = _ops().fp8_tensor_quantize(x, dtype, None, None, 0.0, False, True, False, False)
    return row, scale_inv


def _fprop_case(m, k, n, x_dtype, a_dtype, b_dtype, fast, poison=False, seed=0):
    """(fp8_linear_fprop's y, torch._scaled_mm's y) of x [m, k] @ w [n, k]^T: the op quantizes x to a_dtype; w is
    given quantized to b_dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    if poison:
        x[0, 1], x[m - 1, k - 1] = float("inf"), float("nan")
    x = x.to("cuda", x_dtype)
    w_row, w_sinv = _quantize(torch.randn(n, k, generator=gen).to("cuda", x_dtype), b_dtype)
    y = _ops().fp8_linear_fprop(x, w_row, w_sinv, None, a_dtype, 0.0, False, False, False, fast)[0]
    x_row, x_sinv = _quantize(x, a_dtype)
    want = torch._scaled_mm(x_row, w_row.t(), x_sinv.reshape(()), w_sinv.reshape(()), out_dtype=x_dtype,
                            use_fast_accum=fast)
    return y, want


# (m, k, n): one row, the smallest K and N; rows not a multiple of 16; K of 6 x 16; a larger GEMM
SHAPES = [(1, 16, 16), (13, 256, 128), (200, 96, 48), (512, 1024, 256)]
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]


@_TENSORWISE
@pytest.mark.parametrize("fast", [False, True], ids=["exact_accum", "fast_accum"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=str)
def test_gpu_tensorwise_gemm_is_bitwise_scaled_mm(m, k, n, a_dtype, b_dtype, out, fast):
    """The per-tensor GEMM of fp8_linear_fprop (cuBLASLt, cached plan) equals torch._scaled_mm on the same FP8
    operands bit for bit, and the direct path ran it."""
    before = _stats()["calls"]
    y, want = _fprop_case(m, k, n, out, a_dtype, b_dtype, fast)
    assert _stats()["calls"] == before + 1, "the direct cuBLASLt path did not run the GEMM"
    assert_bitwise(y, want, f"{m}x{k}x{n} {a_dtype} x {b_dtype} -> {out}, fast_accum={fast}")


@_TENSORWISE
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS, ids=lambda d: str(d).split(".")[-1])
def test_gpu_tensorwise_gemm_keeps_non_finite_values_as_scaled_mm(a_dtype, b_dtype):
    """inf / NaN in the input: the result (non-finite where torch's is) is bitwise torch._scaled_mm's."""
    y, want = _fprop_case(40, 128, 64, torch.bfloat16, a_dtype, b_dtype, False, poison=True)
    assert not torch.isfinite(want).all(), "the poisoned reference is all finite"
    assert_bitwise(y, want, f"non-finite {a_dtype} x {b_dtype}")


@_TENSORWISE
def test_gpu_uncovered_dtype_pair_raises_torchs_error():
    """E5M2 x E5M2 (no cuBLASLt GEMM): the direct path declines, nothing runs, torch's error is raised."""
    x = torch.randn(16, 32, device="cuda")
    w_row, w_sinv = _quantize(torch.randn(16, 32, device="cuda"), E5M2)
    before = _stats()
    with pytest.raises(ValueError, match="two Float8_e5m2"):
        _ops().fp8_linear_fprop(x, w_row, w_sinv, None, E5M2, 0.0, False, False, False, False)
    after = _stats()
    assert after["calls"] == before["calls"], "the direct path ran an E5M2 x E5M2 GEMM"
    assert after["declined"] > before["declined"], "the direct path did not decline"


@_TENSORWISE
def test_gpu_second_call_of_a_problem_reuses_its_plan():
    """The first call of a problem queries cuBLASLt's heuristic and caches the plan; the same problem again (new
    tensors, same shapes and dtypes) runs without a query; another row count is another plan."""
    from hybridq import _C
    _C.cublaslt_clear_plans()
    s0 = _stats()
    assert s0["plans"] == 0, f"plans after clear: {s0['plans']}"
    _fprop_case(64, 256, 128, torch.bfloat16, E4M3, E4M3, False, seed=1)
    s1 = _stats()
    assert (s1["heuristic_queries"] - s0["heuristic_queries"], s1["plans"]) == (1, 1), f"first call: {s0} -> {s1}"
    _fprop_case(64, 256, 128, torch.bfloat16, E4M3, E4M3, False, seed=2)
    s2 = _stats()
    assert s2["heuristic_queries"] == s1["heuristic_queries"], f"the same problem queried again: {s1} -> {s2}"
    assert (s2["calls"] - s1["calls"], s2["plans"]) == (1, 1), f"second call: {s1} -> {s2}"
    _fprop_case(80, 256, 128, torch.bfloat16, E4M3, E4M3, False, seed=3)
    _fprop_case(64, 256, 128, torch.bfloat16, E4M3, E4M3, True, seed=3)
    s3 = _stats()
    assert (s3["heuristic_queries"] - s2["heuristic_queries"], s3["plans"]) == (2, 3), \
        f"another row count and fast accumulation must be new plans: {s2} -> {s3}"


_SWITCH_OFF = r"""
import sys
sys.path.insert(0, "tests")
import torch
from hybridq import _C
from test_cublaslt_fp8 import _fprop_case, E4M3, E5M2
from _compare import assert_bitwise
assert not _C.cublaslt_enabled(), "HYBRIDQ_CUBLASLT_DIRECT=0 left the direct path on"
y, want = _fprop_case(13, 256, 128, torch.bfloat16, E4M3, E5M2, True)
assert_bitwise(y, want, "switched off")
s = _C.cublaslt_stats()
assert s["calls"] == 0 and s["declined"] >= 1, s
print("OK")
"""


@_TENSORWISE
def test_gpu_switch_off_runs_torchs_scaled_mm():
    """HYBRIDQ_CUBLASLT_DIRECT=0 (read once per process): no GEMM runs through the direct path, the results are
    torch._scaled_mm's."""
    from hybridq import _C
    assert _C.cublaslt_enabled() == (os.environ.get("HYBRIDQ_CUBLASLT_DIRECT", "1") != "0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HYBRIDQ_CUBLASLT_DIRECT="0")
    r = subprocess.run([sys.executable, "-c", _SWITCH_OFF], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ---- block-scaled: the grouped loop's GEMMs vs F.scaled_mm -------------------------------------------------------

def _fp8(shape, gen):
    return (torch.randn(*shape, generator=gen) * 4).to(E4M3).cuda()


def _scales(shape, gen):
    return (torch.rand(*shape, generator=gen) + 0.25).cuda()


def _outer(s: torch.Tensor) -> torch.Tensor:
    """s [rows, kb] outer-dim-major: strides (1, rows) even where kb is 1 (F.scaled_mm checks the strides)."""
    return torch.empty_strided(s.shape, (1, s.shape[0]), dtype=s.dtype, device=s.device).copy_(s)


# (rows per expert, K, N): K of 3 blocks (the tile scales' padding to 4), N not a multiple of 128 (1x128 rows only)
BLOCK_SHAPES = [([16, 48], 384, 256), ([32, 160], 256, 128), ([64, 16], 128, 144)]


@_BLOCKS
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tiles", [True, False], ids=["1x128_x_128x128", "1x128_x_1x128"])
@pytest.mark.parametrize("rows,k,n", BLOCK_SHAPES, ids=str)
def test_gpu_block_gemms_are_bitwise_scaled_mm(rows, k, n, tiles, out):
    """grouped_block_cublas_mm's per-expert GEMMs (direct cuBLASLt, from pointers into the packed operands) equal
    F.scaled_mm on each expert's views bit for bit."""
    if tiles and n % 128:
        pytest.skip("128x128 weight tiles need N a multiple of 128")
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(5)
    e, s, kb = len(rows), sum(rows), k // 128
    a, a_scale, b = _fp8((s, k), gen), _scales((s, kb), gen), _fp8((e * n, k), gen)
    b_scale = _scales((e, n // 128, -(-kb // 4) * 4) if tiles else (e, kb, n), gen)
    offsets = [sum(rows[:g]) for g in range(e)]
    i32 = dict(dtype=torch.int32, device="cuda")
    before = _stats()["calls"]
    y = _ops().grouped_block_cublas_mm(a, a_scale, b, b_scale, tiles, 0, offsets, rows, rows,
                                       torch.tensor(offsets, **i32), torch.tensor(rows, **i32), out)
    assert _stats()["calls"] == before + e, "the direct cuBLASLt path did not run every expert's GEMM"
    rb = F.ScalingType.BlockWise128x128 if tiles else F.ScalingType.BlockWise1x128
    for g, (o, r) in enumerate(zip(offsets, rows)):
        want = F.scaled_mm(a[o:o + r], b[g * n:(g + 1) * n].t(), _outer(a_scale[o:o + r]), F.ScalingType.BlockWise1x128,
                           b_scale[g].t(), rb, output_dtype=out)
        assert_bitwise(y[o:o + r], want, f"expert {g} ({r} rows), K={k}, N={n}, tiles={tiles}, {out}")


# (padded rows, tokens) per expert: each expert's GEMM runs on its padded rows, whose rows past its tokens reach the
# next experts' (the first expert's 127 over the second's 5 tokens into the third's); an expert without tokens
PADDED_EXPERTS = [([128, 16, 0, 128, 128], [1, 5, 0, 100, 128]), ([16, 32, 48, 16], [16, 17, 40, 9])]


@_BLOCKS
@pytest.mark.parametrize("streams", STREAMS, ids=STREAM_IDS)
@pytest.mark.parametrize("rows,tokens", PADDED_EXPERTS, ids=str)
def test_gpu_block_gemms_keep_each_experts_tokens_of_its_padded_gemm(rows, tokens, streams):
    """grouped_block_cublas_mm on padded slots: expert g's output rows are the first tokens[g] rows of F.scaled_mm
    on its padded rows, bit for bit, on one stream or two -- whatever the padded rows of the experts before it (on
    two streams a first-run expert whose padded rows reach the second run's writes them aside)."""
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(7)
    e, s, k, n = len(rows), sum(rows), 256, 128
    a, a_scale, b = _fp8((s, k), gen), _scales((s, k // 128), gen), _fp8((e * n, k), gen)
    b_scale = _scales((e, n // 128, 4), gen)
    offsets = [sum(rows[:g]) for g in range(e)]
    i32 = dict(dtype=torch.int32, device="cuda")
    y = _ops().grouped_block_cublas_mm(a, a_scale, b, b_scale, True, 0, offsets, rows, tokens,
                                       torch.tensor(offsets, **i32), torch.tensor(rows, **i32), torch.bfloat16,
                                       streams)
    assert y.shape == (sum(tokens), n), f"output shape {tuple(y.shape)}, want {(sum(tokens), n)}"
    one, tile = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    first = 0
    for g, (o, r, m) in enumerate(zip(offsets, rows, tokens)):
        if m == 0:
            continue
        want = F.scaled_mm(a[o:o + r], b[g * n:(g + 1) * n].t(), _outer(a_scale[o:o + r]), one, b_scale[g].t(), tile,
                           output_dtype=torch.bfloat16)
        assert_bitwise(y[first:first + m], want[:m], f"expert {g} ({m} tokens of {r} rows), {streams} stream(s)")
        first += m


@_BLOCKS
@pytest.mark.parametrize("streams", STREAMS, ids=STREAM_IDS)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_block_wgrad_gemms_are_bitwise_scaled_mm(out, streams):
    """grouped_block_cublas_wgrad's per-expert GEMMs (1x128 x 1x128 over each expert's slot) equal F.scaled_mm on the
    slot views bit for bit, on one stream or two; an expert without rows is zeros."""
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(6)
    m, n, rows = 48, 32, [128, 0, 256]
    s = sum(rows)
    a_t, b_t = _fp8((m, s), gen), _fp8((n, s), gen)
    a_scale, b_scale = _scales((m, s // 128), gen), _scales((n, s // 128), gen)
    offsets = [sum(rows[:g]) for g in range(len(rows))]
    before = _stats()["calls"]
    y = _ops().grouped_block_cublas_wgrad(a_t, a_scale, b_t, b_scale, offsets, rows, out, streams)
    assert _stats()["calls"] == before + 2, "the direct cuBLASLt path did not run every expert's GEMM"
    one = F.ScalingType.BlockWise1x128
    for g, (o, p) in enumerate(zip(offsets, rows)):
        if p == 0:
            assert_bitwise(y[g], torch.zeros_like(y[g]), f"expert {g} without rows")
            continue
        q = slice(o // 128, (o + p) // 128)
        want = F.scaled_mm(a_t[:, o:o + p], b_t[:, o:o + p].t(), _outer(a_scale[:, q]), one, _outer(b_scale[:, q]),
                           one, output_dtype=out)
        assert_bitwise(y[g], want, f"wgrad expert {g} ({p} rows), {out}")


def _fp8_of(shape, dtype, gen, poison=False):
    x = torch.randn(*shape, generator=gen) * 4
    if poison:
        x[0, 1], x[-1, -1] = float("inf"), float("nan")
    return x.to(dtype).cuda()


def _per_expert_scales(e: int, gen, aligned: bool) -> torch.Tensor:
    """[E] fp32 per-expert scales: a column of an `[E, 4]` buffer (each 16-byte aligned, read in place) or a plain
    `[E]` tensor (4-byte aligned: the op makes an aligned copy)."""
    s = _scales((e,), gen)
    if not aligned:
        return s
    buf = torch.zeros(e, 4, device="cuda")
    buf[:, 0] = s
    return buf[:, 0]


# (tokens per expert, K, N): an expert without tokens, odd counts, a count > 16 not a multiple of 16
TENSOR_GROUPS = [([16, 0, 37, 100], 64, 96), ([1, 3, 250], 128, 32)]
FP8_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


@_TENSORWISE
@pytest.mark.parametrize("streams", STREAMS, ids=STREAM_IDS)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-scales", "packed-scales"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast-accum", "precise"])
@pytest.mark.parametrize("a_dtype,b_dtype", FP8_PAIRS, ids=str)
@pytest.mark.parametrize("sizes,k,n", TENSOR_GROUPS, ids=str)
def test_gpu_tensorwise_grouped_gemms_are_bitwise_scaled_mm(sizes, k, n, a_dtype, b_dtype, fast, aligned, streams):
    """grouped_fp8_tensor_cublas_mm's per-expert GEMMs (direct cuBLASLt from pointers into the operands: the experts'
    rows of `a`, each expert's `[N, K]` of a strided weight) equal torch._scaled_mm on each expert's views bit for bit,
    non-finite values included, on one stream or two."""
    gen = torch.Generator().manual_seed(11)
    e, t = len(sizes), sum(sizes)
    a = _fp8_of((t, k), a_dtype, gen, poison=True)
    pitch = k + 32  # (the weight's rows further apart than K: strided experts, as the columnwise dgrad operand)
    b = _fp8_of((e * n, pitch), b_dtype, gen)
    sa, sb = _per_expert_scales(e, gen, aligned), _per_expert_scales(e, gen, aligned)
    before = _stats()["calls"]
    y = _ops().grouped_fp8_tensor_cublas_mm(a, sa, b, n * pitch, pitch, n, sb, sizes, torch.bfloat16, fast, streams)
    assert _stats()["calls"] == before + sum(1 for m in sizes if m), "the direct path did not run every expert's GEMM"
    o = 0
    for g, m in enumerate(sizes):
        bg = b[g * n:(g + 1) * n, :k]
        want = torch._scaled_mm(a[o:o + m], bg.t(), sa[g:g + 1].clone(), sb[g:g + 1].clone(),
                                out_dtype=torch.bfloat16, use_fast_accum=fast) if m else y[o:o]
        assert_bitwise(y[o:o + m], want, f"expert {g} ({m} tokens), {a_dtype} x {b_dtype}, fast={fast}")
        o += m


@_TENSORWISE
@pytest.mark.parametrize("streams", STREAMS, ids=STREAM_IDS)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-scales", "packed-scales"])
def test_gpu_tensorwise_grouped_wgrad_gemms_are_bitwise_scaled_mm(aligned, out, streams):
    """grouped_fp8_tensor_cublas_wgrad contracts each expert's slot of the padded columnwise forms (E5M2 gradients x
    E4M3 inputs, no fast accumulation): bitwise torch._scaled_mm on the slot views, on one stream or two; an expert
    without tokens is zeros."""
    gen = torch.Generator().manual_seed(12)
    m, n, rows = 96, 64, [32, 0, 16, 256]
    w = sum(rows) + 16  # (columns after the last slot: the padded layout's upper bound)
    a_t, b_t = _fp8_of((m, w), E5M2, gen, poison=True), _fp8_of((n, w), E4M3, gen)
    sa, sb = _per_expert_scales(len(rows), gen, aligned), _per_expert_scales(len(rows), gen, aligned)
    offsets = [sum(rows[:g]) for g in range(len(rows))]
    before = _stats()["calls"]
    y = _ops().grouped_fp8_tensor_cublas_wgrad(a_t, sa, b_t, sb, offsets, rows, out, streams)
    assert _stats()["calls"] == before + 3, "the direct path did not run every expert's GEMM"
    for g, (o, p) in enumerate(zip(offsets, rows)):
        want = torch._scaled_mm(a_t[:, o:o + p], b_t[:, o:o + p].t(), sa[g:g + 1].clone(), sb[g:g + 1].clone(),
                                out_dtype=out) if p else torch.zeros_like(y[g])
        assert_bitwise(y[g], want, f"wgrad expert {g} ({p} slot columns), {out}")


@_TENSORWISE
def test_gpu_tensorwise_grouped_gemms_refuse_bad_groups_before_running():
    """Token counts that do not sum to the rows, or a wgrad slot off the 16-column grid, raise naming the op and the
    rule, before any GEMM runs."""
    gen = torch.Generator().manual_seed(13)
    a, b = _fp8_of((40, 64), E4M3, gen), _fp8_of((2 * 32, 64), E4M3, gen)
    s = _scales((2,), gen)
    before = _stats()["calls"]
    with pytest.raises(RuntimeError, match="grouped_fp8_tensor_cublas_mm: the experts' token counts sum to 39"):
        _ops().grouped_fp8_tensor_cublas_mm(a, s, b, 32 * 64, 64, 32, s, [20, 19], torch.bfloat16, True)
    a_t, b_t = _fp8_of((32, 64), E5M2, gen), _fp8_of((32, 64), E4M3, gen)
    with pytest.raises(RuntimeError, match="grouped_fp8_tensor_cublas_wgrad: expert 1's slot \\[24, 40\\)"):
        _ops().grouped_fp8_tensor_cublas_wgrad(a_t, s, b_t, s, [0, 24], [16, 16], torch.bfloat16)
    assert _stats()["calls"] == before, "a GEMM ran before the check"


@_TENSORWISE
def test_gpu_grouped_gemms_refuse_a_stream_count_other_than_one_or_two():
    """streams must be 1 or 2: anything else raises naming the op and the rule, before any GEMM runs."""
    gen = torch.Generator().manual_seed(14)
    a, b, s = _fp8_of((32, 64), E4M3, gen), _fp8_of((2 * 32, 64), E4M3, gen), _scales((2,), gen)
    before = _stats()["calls"]
    for streams in (0, 3):
        with pytest.raises(RuntimeError, match="grouped_fp8_tensor_cublas_mm: streams must be 1 or 2, got"):
            _ops().grouped_fp8_tensor_cublas_mm(a, s, b, 32 * 64, 64, 32, s, [16, 16], torch.bfloat16, True, streams)
        with pytest.raises(RuntimeError, match="grouped_fp8_tensor_cublas_wgrad: streams must be 1 or 2, got"):
            _ops().grouped_fp8_tensor_cublas_wgrad(a.t().contiguous(), s, b.t().contiguous()[:, :32], s, [0, 16],
                                                   [16, 16], torch.bfloat16, streams)
    assert _stats()["calls"] == before, "a GEMM ran before the check"


@_TENSORWISE
def test_gpu_two_stream_grouped_gemms_capture_in_a_cuda_graph():
    """Captured in a CUDA graph, the two-stream grouped GEMMs (the side stream joins and leaves the capture) replay
    to the one-stream results of the inputs copied in before the replay."""
    gen = torch.Generator().manual_seed(15)
    sizes, k, n = [256, 16, 0, 512, 128], 256, 384
    e, t = len(sizes), sum(sizes)
    rows = [-(-m // 16) * 16 for m in sizes]
    slots = [sum(rows[:g]) for g in range(e)]
    a, b = _fp8_of((t, k), E4M3, gen), _fp8_of((e * n, k), E4M3, gen)
    a_t, b_t = _fp8_of((k, sum(rows)), E5M2, gen), _fp8_of((n, sum(rows)), E4M3, gen)
    sa, sb = _per_expert_scales(e, gen, True), _per_expert_scales(e, gen, True)

    def step(streams):
        return (_ops().grouped_fp8_tensor_cublas_mm(a, sa, b, n * k, k, n, sb, sizes, torch.bfloat16, False, streams),
                _ops().grouped_fp8_tensor_cublas_wgrad(a_t, sa, b_t, sb, slots, rows, torch.bfloat16, streams))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up off the capture: plans, workspaces)
        step(2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(2)
    new_a, new_a_t = _fp8_of((t, k), E4M3, gen), _fp8_of((k, sum(rows)), E5M2, gen)
    a.copy_(new_a)
    a_t.copy_(new_a_t)
    graph.replay()
    want = step(1)
    for name, got, ref in zip(("fprop", "wgrad"), captured, want):
        assert_bitwise(got, ref, f"the replayed two-stream {name} differs from the one-stream GEMMs of the new inputs")


def _padded_block_experts(gen):
    """Block mm operands of PADDED_EXPERTS[0] (slots that reach past the next expert's tokens): (op args, the tensor
    of the tokens)."""
    rows, tokens = PADDED_EXPERTS[0]
    e, s, k, n = len(rows), sum(rows), 256, 128
    a = _fp8((s, k), gen)
    offsets = [sum(rows[:g]) for g in range(e)]
    i32 = dict(dtype=torch.int32, device="cuda")
    args = [a, _scales((s, k // 128), gen), _fp8((e * n, k), gen), _scales((e, n // 128, 4), gen), True, 0, offsets,
            rows, tokens, torch.tensor(offsets, **i32), torch.tensor(rows, **i32), torch.bfloat16]
    return args, a


@_BLOCKS
def test_gpu_block_gemms_refuse_a_stream_count_other_than_one_or_two():
    """grouped_block_cublas_mm's streams must be 1 or 2: anything else raises naming the op and the rule, before any
    GEMM runs."""
    args, _ = _padded_block_experts(torch.Generator().manual_seed(16))
    before = _stats()["calls"]
    for streams in (0, 3):
        with pytest.raises(RuntimeError, match="grouped_block_cublas_mm: streams must be 1 or 2, got"):
            _ops().grouped_block_cublas_mm(*args, streams)
    assert _stats()["calls"] == before, "a GEMM ran before the check"


@_BLOCKS
def test_gpu_two_stream_block_gemms_capture_in_a_cuda_graph():
    """Captured in a CUDA graph, the two-stream block fprop (its scratch rows and their copy included) replays to the
    one-stream result of the tokens copied in before the replay."""
    gen = torch.Generator().manual_seed(17)
    args, a = _padded_block_experts(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up off the capture: plans, workspaces)
        _ops().grouped_block_cublas_mm(*args, 2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _ops().grouped_block_cublas_mm(*args, 2)
    a.copy_(_fp8(tuple(a.shape), gen))
    graph.replay()
    assert_bitwise(captured, _ops().grouped_block_cublas_mm(*args, 1),
                   "the replayed two-stream block fprop differs from the one-stream GEMMs of the new tokens")
