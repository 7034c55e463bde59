"""The cuBLAS loop of GroupedLinear's packed FP8 block path (`hybridq.kernels.grouped_blocks.cublas_mm` /
`cublas_wgrad`, csrc/grouped_block_gemm.cu): one cuBLAS block-scaled GEMM per expert, issued from C++ in one op call
per phase, on views of the slot buffers. Its results are bitwise the per-expert GEMM loop's (the same cuBLAS GEMM on
the same operands: `native_gemm._block_run` per expert); the choice between it and the Triton grouped kernels is the
measured cost model; the weight scales it hands cuBLAS are the per-expert path's, in cuBLAS's layout."""

import pytest
import torch

import hybridq as hq
from _compare import assert_bitwise
from _format_cases import FORMATS
from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.kernels import grouped_blocks, native_gemm
from hybridq.nn.grouped_packed_blocks import ExpertWeights

TOKEN_FORMATS = ["fp8blk_1x128_e4m3", "fp8blk_1x128_e4m3_nopow2"]
WEIGHT_FORMATS = ["fp8blk_128x128_e4m3", "fp8blk_1x128_e4m3"]
# empty experts, fewer than 128 tokens, one token, a long expert
SPLITS = [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 300, 0], [0, 0, 0, 0]]


def _recipe(token: str, weight: str) -> hq.CustomRecipe:
    return hq.CustomRecipe(lambda role: FORMATS[weight if role.tensor_type == "weight" else token](),
                           name=f"{token}/{weight}")


def _fp8_block_quantizers() -> dict:
    return {"input": FORMATS["fp8blk_1x128_e4m3"](), "grad_output": FORMATS["fp8blk_1x128_e4m3"](),
            "weight": FORMATS["fp8blk_128x128_e4m3"]()}


# ---- the cost model (CPU) ----------------------------------------------------------------------------------------

# bench_grouped's configs as measured (one H200, each phase alone: bench_grouped_block_gemms.py): E experts of `rows`
# padded tokens, K, N, and the backend that ran faster per phase (at 64 experts the loop's dgrad on two streams,
# 1.60 vs 1.98 ms; on one stream it was the slower, 2.05)
MEASURED = [
    (16, 4096, 2048, 5632, {"fprop": "cublas", "dgrad": "cublas", "wgrad": "cublas"}),
    (64, 2048, 2048, 3072, {"fprop": "cublas", "dgrad": "cublas", "wgrad": "cublas"}),
    (8, 4096, 4096, 14336, {"fprop": "cublas", "dgrad": "cublas", "wgrad": "cublas"}),
]


@pytest.mark.parametrize("e,rows,k,n,faster", MEASURED, ids=lambda v: str(v) if isinstance(v, int) else None)
def test_cost_model_picks_the_measured_faster_backend(e, rows, k, n, faster, monkeypatch):
    """At each measured config the model picks the backend that ran faster there, phase by phase (wgrad contracts
    the tokens: its GEMM is [n, tokens] x [tokens, k], the same FLOPs)."""
    monkeypatch.setitem(grouped_blocks.FORCE, "backend", None)
    for phase, want in faster.items():
        triton, cublas = grouped_blocks.estimate_us(phase, [rows] * e, k, n)
        got = grouped_blocks.backend(phase, [rows] * e, k, n)
        assert got == want, f"{phase} at {e} x {rows} rows, {k} x {n}: picked {got} (Triton {triton:.0f} us, " \
                            f"cuBLAS loop {cublas:.0f} us estimated), {want} ran faster"


def test_cost_model_counts_the_host_time_of_every_used_expert_only(monkeypatch):
    """Empty experts launch no GEMM: they add no host time to the cuBLAS loop's estimate; many short experts make it
    host-bound (then the Triton kernels, one launch, win)."""
    monkeypatch.setitem(grouped_blocks.FORCE, "backend", None)
    _, with_empties = grouped_blocks.estimate_us("fprop", [256, 0, 0, 256], 2048, 2048)
    _, without = grouped_blocks.estimate_us("fprop", [256, 256], 2048, 2048)
    assert with_empties == without, f"empty experts changed the estimate: {with_empties} vs {without} us"
    assert grouped_blocks.backend("fprop", [128] * 256, 1024, 1024) == grouped_blocks.TRITON, \
        "256 experts of 128 rows: the host-bound loop was picked"


@pytest.mark.parametrize("force", [grouped_blocks.TRITON, grouped_blocks.CUBLAS_LOOP])
def test_forced_backend_overrides_the_cost_model(force, monkeypatch):
    monkeypatch.setitem(grouped_blocks.FORCE, "backend", force)
    for phase in ("fprop", "dgrad", "wgrad"):
        for rows in ([128] * 256, [4096] * 8):
            assert grouped_blocks.backend(phase, rows, 4096, 4096) == force, f"{phase}, {len(rows)} experts"


@pytest.mark.parametrize("weight", WEIGHT_FORMATS)
@pytest.mark.parametrize("token", TOKEN_FORMATS)
def test_cublas_loop_takes_e4m3_blocks_in_every_role(token, weight):
    qs = {"input": FORMATS[token](), "grad_output": FORMATS[token](), "weight": FORMATS[weight]()}
    assert grouped_blocks.cublas_formats(qs), f"{token} tokens x {weight} weights not taken"
    assert not grouped_blocks.cublas_takes(qs, torch.device("cpu")), "taken on the CPU"


@pytest.mark.parametrize("role,fmt", [(r, f) for r in ("input", "grad_output", "weight")
                                      for f in ("fp8blk_1x128_e5m2", "mxfp8_e4m3", "fp8blk_128x128_e4m3")
                                      if (r, f) != ("weight", "fp8blk_128x128_e4m3")])
def test_cublas_loop_takes_only_e4m3_blocks_in_every_role(role, fmt):
    """E5M2, another format, or 128x128 tiles for a token operand: not the loop (cuBLAS's block-scaled GEMM is E4M3 x
    E4M3; the loop's token operands are 1x128 blocks)."""
    qs = _fp8_block_quantizers()
    qs[role] = FORMATS[fmt]()
    assert not grouped_blocks.cublas_formats(qs), f"{fmt} as {role} taken"


# ---- the weight scales in cuBLAS's layout (CPU: pure tensor layout) ---------------------------------------------

@pytest.mark.parametrize("k,n", [(256, 384), (512, 256), (384, 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("weight", WEIGHT_FORMATS)
def test_weight_scales_are_the_per_expert_scales_in_cublas_layout(weight, direction, k, n):
    """Expert g's scale operand `_cublas_weight_scales(b, E)[g].t()` holds the values and has the strides
    `native_gemm._block_run` hands cuBLAS for the per-expert path's weight part of expert g (128x128 tiles: K blocks
    fastest, padded with zeros to a multiple of 4; 1x128 rows: the rows fastest); K and N of 2, 3 and 4 blocks."""
    e = 3
    w = torch.randn(e, n, k, generator=torch.Generator().manual_seed(3))
    weights = ExpertWeights.quantize(FORMATS[weight](), w, True, "w")
    assert weights.packed
    b = weights.tensors[0].part(direction)
    got = grouped_blocks._cublas_weight_scales(b, e)
    for g in range(e):
        part = weights.part(g, direction)
        if part.block_shape == (128, 128):
            kb = part.scales.shape[1]
            want = torch.nn.functional.pad(part.scales, (0, -kb % 4)).t()
            strides = (1, want.shape[0])
        else:
            want = native_gemm._outer_major(part.scales)
            strides = (1, want.shape[0])
        sg = got[g].t()
        assert sg.shape == want.shape, f"expert {g} ({direction}): scales {tuple(sg.shape)}, want {tuple(want.shape)}"
        assert sg.stride() == strides, f"expert {g} ({direction}): strides {sg.stride()}, cuBLAS reads {strides}"
        assert_bitwise(sg, want, f"{weight} {direction} expert {g} scales")


# ---- GPU: bitwise the per-expert GEMM loop ----------------------------------------------------------------------

def _sm90_ext() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from hybridq.kernels import extension_available
    return extension_available() and hasattr(torch.ops.hybridq, "grouped_block_cublas_mm") and \
        grouped_blocks._triton() is not None


def _step(recipe, splits, k, n, cublas: bool, monkeypatch, poison: bool = False):
    monkeypatch.setattr(grouped_blocks.ENABLED, "on", cublas)
    monkeypatch.setattr(grouped_blocks.CUBLAS, "on", cublas)
    monkeypatch.setitem(grouped_blocks.FORCE, "backend", grouped_blocks.CUBLAS_LOOP if cublas else None)
    torch.manual_seed(1)
    m = hq.GroupedLinear(len(splits), k, n, recipe=recipe, dtype=torch.bfloat16, device="cuda", name="moe")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(splits), k, generator=gen)
    dy = torch.randn(sum(splits), n, generator=gen)
    if poison and sum(splits):  # non-finite tokens and gradients in the first expert with tokens
        x[0, 3], x[0, 130 % k] = float("nan"), float("inf")
        dy[0, 1] = float("-inf")
    x = x.to("cuda", torch.bfloat16).requires_grad_()
    y = m(x, splits)
    y.backward(dy.to("cuda", torch.bfloat16))
    return {"y": y.detach(), "dx": x.grad, "dW": m.weight.grad}


def _spy(monkeypatch) -> list:
    """The cuBLAS-loop phases that run from now on."""
    calls = []
    mm, wg = grouped_blocks.cublas_mm, grouped_blocks.cublas_wgrad
    monkeypatch.setattr(grouped_blocks, "cublas_mm", lambda a, b, *r: calls.append(
        "dgrad" if b.columnwise else "fprop") or mm(a, b, *r))
    monkeypatch.setattr(grouped_blocks, "cublas_wgrad", lambda *r: calls.append("wgrad") or wg(*r))
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_ext(), reason="needs CUDA sm_90, Triton and the built extension")
@pytest.mark.parametrize("k,n", [(256, 256), (384, 384)], ids=lambda v: str(v))
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("weight", WEIGHT_FORMATS)
@pytest.mark.parametrize("token", TOKEN_FORMATS)
def test_gpu_cublas_loop_is_bitwise_the_per_expert_gemms(token, weight, splits, k, n, monkeypatch):
    """y, dx and dW with the cuBLAS loop in all three phases equal bitwise those of the per-expert GEMM loop (one
    `gemm` per expert: the same cuBLAS block-scaled GEMM on copies of the same operands), with empty experts, experts
    of fewer than 128 tokens, and K / N of 3 blocks (the tile scales' padding to 4)."""
    recipe = _recipe(token, weight)
    calls = _spy(monkeypatch)
    got = _step(recipe, splits, k, n, True, monkeypatch)
    want_calls = {"fprop", "dgrad", "wgrad"} if sum(splits) else set()
    assert set(calls) == want_calls, f"cuBLAS loop ran {sorted(set(calls))}, expected {sorted(want_calls)}"
    want = _step(recipe, splits, k, n, False, monkeypatch)
    for name in ("y", "dx", "dW"):
        assert_bitwise(got[name], want[name], f"{token}/{weight}, splits {splits}, K={k}, N={n}: {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_ext(), reason="needs CUDA sm_90, Triton and the built extension")
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127]], ids=str)
def test_gpu_cublas_loop_keeps_non_finite_values_as_the_per_expert_gemms(splits, monkeypatch):
    """NaN / inf tokens and gradients: the results (NaNs and infinities where they land) are bitwise the per-expert
    GEMMs'; no non-finite value becomes finite."""
    recipe = _recipe("fp8blk_1x128_e4m3", "fp8blk_128x128_e4m3")
    got = _step(recipe, splits, 256, 256, True, monkeypatch, poison=True)
    want = _step(recipe, splits, 256, 256, False, monkeypatch, poison=True)
    for name in ("y", "dx", "dW"):
        assert not torch.isfinite(want[name]).all(), f"{name}: the poisoned reference is all finite"
        assert_bitwise(got[name], want[name], f"non-finite, splits {splits}: {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_ext(), reason="needs CUDA sm_90, Triton and the built extension")
def test_gpu_cublas_ops_reject_bad_arguments_by_name():
    """Counts that do not fit the slot buffer, a wrong dtype or scale shape: a RuntimeError naming the op and the
    argument, before anything runs."""
    ops = torch.ops.hybridq
    a = torch.zeros(256, 256, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(256, 2, device="cuda")
    b = torch.zeros(2 * 128, 256, device="cuda").to(torch.float8_e4m3fn)
    sb = torch.ones(2, 1, 4, device="cuda")
    t = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    r = torch.tensor([128, 128], dtype=torch.int32, device="cuda")
    out = ops.grouped_block_cublas_mm(a, sa, b, sb, True, 0, [0, 128], [128, 128], [100, 128], t, r, torch.bfloat16)
    assert out.shape == (228, 128)
    with pytest.raises(RuntimeError, match="grouped_block_cublas_mm: expert 1's slot"):
        ops.grouped_block_cublas_mm(a, sa, b, sb, True, 0, [0, 192], [128, 128], [100, 128], t, r, torch.bfloat16)
    with pytest.raises(RuntimeError, match="grouped_block_cublas_mm: expert 0 has 130 tokens in 128 rows"):
        ops.grouped_block_cublas_mm(a, sa, b, sb, True, 0, [0, 128], [128, 128], [130, 1], t, r, torch.bfloat16)
    with pytest.raises(RuntimeError, match="grouped_block_cublas_mm: b_scale must be"):
        ops.grouped_block_cublas_mm(a, sa, b, sb[:, :, :2].contiguous(), True, 0, [0, 128], [128, 128], [1, 1], t, r,
                                    torch.bfloat16)
    with pytest.raises(RuntimeError, match="grouped_block_cublas_wgrad: a_t must be torch.float8_e4m3fn"):
        ops.grouped_block_cublas_wgrad(a.float(), sa, a, sa, [0], [128], torch.bfloat16)


# ---- the packed path's choice with the cuBLAS loop ---------------------------------------------------------------

@pytest.mark.parametrize("loop", [True, False], ids=["loop available", "no loop"])
def test_long_experts_stay_packed_where_the_cublas_loop_runs(loop, monkeypatch):
    """Long experts (8 x 4096 tokens, 4096 x 14336) leave the packed path for the per-expert path only where the
    cuBLAS loop cannot run their GEMMs: with it, the packed path runs the same per-expert GEMMs without Python per
    expert."""
    from hybridq.nn.grouped_packed import BLOCKS
    from hybridq.nn.grouped_packed_blocks import packed_path_pays
    seen = []
    monkeypatch.setattr(grouped_blocks, "cublas_takes", lambda qs, dev: seen.append(dev.type) or loop)
    qs = _fp8_block_quantizers()
    assert packed_path_pays(BLOCKS, [4096] * 8, 4096, 14336, torch.device("cuda"), qs) == loop, \
        f"cuBLAS loop {'available' if loop else 'unavailable'}: wrong path for long experts"
    assert seen == ["cuda"], f"cublas_takes asked for {seen}"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_ext(), reason="needs CUDA sm_90, Triton and the built extension")
def test_gpu_cublas_loop_is_available_for_fp8_block_experts():
    """On sm_90 with the built extension the fp8_block roles are taken (long experts then stay packed)."""
    assert grouped_blocks.cublas_takes(_fp8_block_quantizers(), torch.device("cuda"))
