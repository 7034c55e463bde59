"""The grouped FP8 block-scaled GEMMs of GroupedLinear's packed path (hybridq/kernels/triton_grouped_blocks.py,
grouped_blocks.py): one launch per phase (fprop, dgrad, wgrad) for all experts on the packed quantized parts.

Oracle: one `hybridq.gemm.gemm` per expert on that expert's slice of the same quantized parts (what the packed path
runs without the grouped kernels). The grouped kernels sum the same exact products in another order (scales applied
per 128-element block, fp32 promotion): each expert's result agrees within 1e-3 of its largest magnitude
(fp32 outputs), on random inputs and adversarial ones (empty experts, one token, non-finite values, which stay in
their expert, scales near the ends of the fp32 range).

The kernels run on a CUDA sm_90 device (tests marked gpu) and, to check their logic without a GPU, on the CPU under
Triton's interpreter (`TRITON_INTERPRET=1` with a Triton install; skipped otherwise, e.g. in CI).
"""

import os

import pytest
import torch

import hybridq as hq
from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.formats import Float8BlockQuantizer, MXFP8Quantizer
from hybridq.gemm import gemm
from hybridq.kernels import grouped_blocks, grouped_emulated, triton_grouped_blocks
from hybridq.nn.grouped_packed import TokenLayout
from hybridq.nn.grouped_packed_blocks import ExpertWeights, _bounds

from _triton_aot import compile_sm90

INTERPRETER = triton_grouped_blocks.available() and os.environ.get("TRITON_INTERPRET") == "1"


def _sm90() -> bool:
    if not (torch.cuda.is_available() and triton_grouped_blocks.available()):
        return False
    from hybridq.kernels import extension_available
    return torch.cuda.get_device_capability() == (9, 0) and extension_available()


DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 and Triton")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _sm90(), reason="needs CUDA sm_90, "
                                                                             "Triton and the built extension")])]
E, N = 4, 256
SPLITS = [[5, 0, 130, 1], [1, 0, 0, 0], [0, 300, 0, 17], [37, 128, 129, 256]]
KS = [256, 200]  # 200: a partial last 1x128 block along K
WEIGHT_BLOCKS = {"tiles": 2, "rows": 1}  # the weight's 128x128 tiles (the fp8_block preset) or 1x128 blocks
TOL = 1e-3


@pytest.fixture(autouse=True)
def _interpreter_numpy():
    """Triton 3.6's interpreter takes `int()` of a 1-element array for a loop bound, which numpy >= 2.4 refuses: give
    it the element (the interpreter only; compiled kernels are untouched)."""
    if not INTERPRETER:
        yield
        return
    import triton.runtime.interpreter as ti
    orig = ti._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    yield
    ti._patch_lang_tensor = orig


class Operands:
    """The packed quantized operands of one grouped projection, as GroupedLinear's packed path makes them: tokens x
    `[T, K]`, gradient dy `[T, N]` (1x128 blocks, E4M3) in zero-padded slots of whole 128-token blocks, weight
    `[E, N, K]` quantized in one call."""

    def __init__(self, splits, k, device, weight_blocks=2, x=None, dy=None, w=None):
        gen = torch.Generator().manual_seed(3)
        t = sum(splits)
        x = torch.randn(t, k, generator=gen) if x is None else x
        dy = torch.randn(t, N, generator=gen) if dy is None else dy
        w = torch.randn(E, N, k, generator=gen) if w is None else w
        self.splits = splits
        self.layout = TokenLayout.build(splits, splits, torch.device(device), 128)
        qa = Float8BlockQuantizer(block_dim=1)
        self.x = qa.quantize_groups(self.layout.pack(x.to(device)), self.layout.slots, rowwise=True, columnwise=True,
                                    name="x")
        self.dy = qa.quantize_groups(self.layout.pack(dy.to(device)), self.layout.slots, rowwise=True,
                                     columnwise=True, name="dy")
        self.w = ExpertWeights.quantize(Float8BlockQuantizer(block_dim=weight_blocks), w.to(device), True, "w")
        assert self.w.packed
        self.bounds = _bounds(self.layout, torch.device(device))

    def used(self):
        return [(g, o, m) for g, (o, m) in enumerate(zip(self.layout.offsets, self.splits)) if m]

    def fprop(self):
        got = grouped_blocks.mm(self.x.part(ROWWISE), self.w.tensors[0].part(ROWWISE), E, self.bounds, torch.float32)
        want = [gemm(self.x.part(ROWWISE).row_slice(o, o + m), self.w.part(g, ROWWISE), torch.float32)
                for g, o, m in self.used()]
        return got, want

    def dgrad(self):
        got = grouped_blocks.mm(self.dy.part(ROWWISE), self.w.tensors[0].part(COLUMNWISE), E, self.bounds,
                                torch.float32)
        want = [gemm(self.dy.part(ROWWISE).row_slice(o, o + m), self.w.part(g, COLUMNWISE), torch.float32)
                for g, o, m in self.used()]
        return got, want

    def wgrad(self):
        dy_col, x_col = self.dy.part(COLUMNWISE), self.x.part(COLUMNWISE)
        got = grouped_blocks.wgrad(dy_col, x_col, self.bounds, torch.float32)
        want = {g: gemm(dy_col.row_slice(o, o + m), x_col.row_slice(o, o + m), torch.float32)
                for g, o, m in self.used()}
        return got, [want.get(g, torch.zeros_like(got[g])) for g in range(E)]


def _rows_per_expert(got, ops):
    """The grouped result `[T, n]` cut into the experts with tokens (token order)."""
    return list(got.split([m for m in ops.splits if m]))


def _assert_close(got, want, what):
    _assert_close_to(got, want, TOL, what)


def _assert_close_to(got, want, tol, what):
    """Same non-finite positions; finite elements within `tol` of the largest finite magnitude of `want`."""
    got = got.float().cpu()
    want = want.float().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    fin = torch.isfinite(want)
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), (f"{what}: NaN positions differ: {int(gn.sum())} NaN vs {int(wn.sum())} per expert, "
                                 f"first at {(gn != wn).nonzero()[0].tolist()}")
    assert torch.equal(got[~fin & ~torch.isnan(want)], want[~fin & ~torch.isnan(want)]), f"{what}: infinities differ"
    scale = want[fin].abs().max() if fin.any() else torch.tensor(0.0)
    err = (got[fin] - want[fin]).abs().max() if fin.any() else torch.tensor(0.0)
    assert err <= tol * scale, f"{what}: max |grouped - per-expert| {float(err):.3e} > {tol} x {float(scale):.3e}"


@pytest.mark.parametrize("weight", WEIGHT_BLOCKS)
@pytest.mark.parametrize("k", KS, ids=lambda k: f"K{k}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_fprop_and_dgrad_match_one_gemm_per_expert(device, splits, k, weight):
    ops = Operands(splits, k, device, WEIGHT_BLOCKS[weight])
    for phase in ("fprop", "dgrad"):
        got, want = getattr(ops, phase)()
        assert got.shape == (sum(splits), N if phase == "fprop" else k)
        for (g, _, _), gg, w in zip(ops.used(), _rows_per_expert(got, ops), want):
            _assert_close(gg, w, f"{phase} of expert {g}, splits {splits}, K={k}, {weight} weight")


@pytest.mark.parametrize("k", KS, ids=lambda k: f"K{k}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_wgrad_matches_one_gemm_per_expert_and_zero_for_empty_experts(device, splits, k):
    ops = Operands(splits, k, device)
    got, want = ops.wgrad()
    assert got.shape == (E, N, k)
    for g in range(E):
        if splits[g] == 0:
            assert not got[g].any(), f"wgrad of expert {g} (no tokens) is not zero"
        _assert_close(got[g], want[g], f"wgrad of expert {g}, splits {splits}, K={k}")


@pytest.mark.parametrize("device", [pytest.param(DEVICES[0].values[0], marks=pytest.mark.skip(
    reason="Triton 3.6's interpreter reads E4M3's NaN byte 0x7F as 480")), DEVICES[1]])
def test_non_finite_values_stay_in_their_expert(device):
    """A NaN / inf token of expert 2 (and an inf in expert 0's weight) reach only that expert's outputs: the other
    experts' results are finite and as the per-expert GEMMs give them."""
    splits, k = [40, 0, 130, 90], 256
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(splits), k, generator=gen)
    dy = torch.randn(sum(splits), N, generator=gen)
    w = torch.randn(E, N, k, generator=gen)
    x[40 + 3, 7] = float("nan")
    x[40 + 129, 200] = float("inf")
    dy[40 + 5, 100] = float("-inf")
    w[0, 17, 33] = float("inf")
    ops = Operands(splits, k, device, x=x, dy=dy, w=w)
    for phase in ("fprop", "dgrad", "wgrad"):
        got, want = getattr(ops, phase)()
        pieces = list(got) if phase == "wgrad" else _rows_per_expert(got, ops)
        experts = range(E) if phase == "wgrad" else [g for g, _, _ in ops.used()]
        for g, gg, w_ in zip(experts, pieces, want):
            if g not in (0, 2):
                assert torch.isfinite(gg).all(), f"{phase}: expert {g} got a non-finite value from another expert"
            _assert_close(gg, w_, f"{phase} of expert {g} with non-finite inputs")


@pytest.mark.parametrize("device", DEVICES)
def test_scales_near_the_ends_of_the_fp32_range(device):
    """Experts whose tokens are ~2^-100 and ~2^90 (and gradients the other way round): their block scales are tiny
    and huge powers of two; each expert's results keep their relative accuracy (the product of two blocks' scales
    stays a normal fp32 number here: see the kernel module's docstring)."""
    splits, k = [128, 3, 200, 64], 256
    gen = torch.Generator().manual_seed(5)
    mags = torch.tensor([2.0 ** -100, 2.0 ** 90, 1.0, 2.0 ** -60])
    rows = torch.cat([torch.full((m,), float(mags[g])) for g, m in enumerate(splits)])[:, None]
    x = torch.randn(sum(splits), k, generator=gen) * rows
    dy = torch.randn(sum(splits), N, generator=gen) / rows
    ops = Operands(splits, k, device, x=x, dy=dy)
    for phase in ("fprop", "dgrad", "wgrad"):
        got, want = getattr(ops, phase)()
        pieces = list(got) if phase == "wgrad" else _rows_per_expert(got, ops)
        for g, (gg, w_) in enumerate(zip(pieces, want)):
            assert torch.isfinite(w_).all(), f"{phase} of expert {g}: the reference itself overflowed"
            _assert_close(gg, w_, f"{phase} of expert {g}, magnitude {float(mags[g]):.1e}")


# ---- the packed path with the grouped GEMMs (GPU) ----------------------------------------------------------------

def _layer_step(splits, k, out, grouped: bool, monkeypatch, preset="fp8_block"):
    monkeypatch.setattr(grouped_blocks.ENABLED, "on", grouped)
    monkeypatch.setattr(grouped_emulated.ENABLED, "on", grouped)
    torch.manual_seed(1)
    m = hq.GroupedLinear(E, k, out, recipe=hq.recipe(preset), dtype=torch.bfloat16, device="cuda", name="moe")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(splits), k, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(sum(splits), out, generator=gen).to("cuda", torch.bfloat16)
    y = m(x, splits)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW": m.weight.grad}


def _assert_layer_close(got, want, splits, what):
    """y, dx and dW per expert within 1e-2 of the expert's largest magnitude (bf16 results: one bf16 rounding plus the
    summation order)."""
    for name in ("y", "dx"):
        for g, (a, b) in enumerate(zip(got[name].split(splits), want[name].split(splits))):
            if len(b):
                _assert_close_to(a, b, 1e-2, f"{what}: {name} of expert {g}")
    for g in range(E):
        _assert_close_to(got["dW"][g], want["dW"][g], 1e-2, f"{what}: dW of expert {g}")


def _spy_per_expert_gemms(monkeypatch) -> list:
    """The phases ("fprop", "dgrad", "wgrad") of every per-expert `gemm` the packed path runs from now on."""
    import hybridq.nn.grouped_packed_blocks as pb
    calls = []
    monkeypatch.setattr(pb, "gemm", lambda *a, **kw: calls.append(a[-1].split()[0]) or gemm(*a, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs CUDA sm_90, Triton and the built extension")
@pytest.mark.parametrize("out", [256, 96], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("k", [256, 200], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 300, 0]], ids=str)
def test_gpu_fp8_block_experts_run_one_grouped_gemm_per_phase(splits, k, out, monkeypatch):
    """GroupedLinear with fp8_block on sm_90 runs no per-expert GEMM (with N = 96 the weight's 128x128 tiles would
    straddle experts: it is quantized per expert, and fprop / dgrad run per expert, wgrad grouped), and its output, dx
    and dW agree per expert with the per-expert GEMM loop (bf16 results: within 1e-2 of each expert's largest
    magnitude, a bf16 rounding plus the summation order)."""
    calls = _spy_per_expert_gemms(monkeypatch)
    got = _layer_step(splits, k, out, True, monkeypatch)
    want_phases = set() if out % 128 == 0 else {"fprop", "dgrad"}
    assert set(calls) == want_phases, f"per-expert GEMMs ran for {sorted(set(calls))}, expected {sorted(want_phases)}"
    calls.clear()
    want = _layer_step(splits, k, out, False, monkeypatch)
    assert set(calls) == {"fprop", "dgrad", "wgrad"}, "the per-expert loop did not run with the grouped GEMMs off"
    _assert_layer_close(got, want, splits, f"fp8_block, splits {splits}, K={k}, N={out}")


def test_per_expert_gemms_are_chosen_for_long_expert_gemms_only():
    """The measured rule: few experts with long GEMMs (8 experts of ~4096 tokens, 4096 x 14336) take one cuBLAS GEMM
    per expert; many short ones (64 experts of ~2048 tokens, 2048 x 3072) the grouped kernel; no tokens: grouped."""
    assert grouped_blocks.prefers_per_expert_gemms([4096] * 8, 4096, 14336)
    assert not grouped_blocks.prefers_per_expert_gemms([2048] * 64, 2048, 3072)
    assert not grouped_blocks.prefers_per_expert_gemms([0, 0], 4096, 14336)


@pytest.mark.skipif(not triton_grouped_blocks.available(), reason="needs Triton")
@pytest.mark.parametrize("weight", WEIGHT_BLOCKS)
def test_kernels_compile_for_sm90_to_pipelined_wgmma(weight):
    """The default configs of both kernels compile for sm_90 (no GPU needed) to wgmma with pipelined loads."""
    t = triton_grouped_blocks
    ptrs = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16"}
    bm, bn, gm, w, st = t.CONFIGS["mm"]
    sig = {**ptrs, "bounds_ptr": "*i32", **{n: "i32" for n in ("N", "K", "E", "stride_am", "stride_sam", "stride_bg",
                                                                 "stride_bn", "stride_sbg", "stride_sbn", "stride_sbk",
                                                                 "stride_cm")}}
    row_block = 128 if weight == "tiles" else 1
    mm = compile_sm90(t._grouped_block_mm_kernel, sig,
                   dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=t.BLOCK, GROUP_M=gm, EP=16, B_ROW_BLOCK=row_block,
                        EVEN_K=True, SB_SCALAR=row_block % bn == 0),
                   (*ptrs, "bounds_ptr", "stride_am", "stride_bn", "stride_cm"), w, st)
    bm, bn, gm, w, st = t.CONFIGS["wgrad"]
    sig = {**ptrs, "starts_ptr": "*i32", "sizes_ptr": "*i32",
           **{n: "i32" for n in ("M", "N", "pitch_a", "pitch_sa", "pitch_b", "pitch_sb", "stride_cg", "stride_cm")}}
    wg = compile_sm90(t._grouped_block_wgrad_kernel, sig,
                   dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=t.BLOCK, GROUP_M=gm, EVEN=True),
                   (*ptrs, "starts_ptr", "sizes_ptr", "pitch_a", "pitch_b", "stride_cm"), w, st)
    for name, k in (("grouped mm", mm), ("grouped wgrad", wg)):
        assert "wgmma.mma_async" in k.asm["ptx"], f"{name}: no wgmma in the PTX"
        assert "async_copy_global_to_local" in k.asm["ttgir"], f"{name}: the loads are not pipelined"


# ---- MXFP8 on sm_90: the grouped bf16 emulation ------------------------------------------------------------------

def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([16], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


EMULATED_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not _cpu_grouped_mm(), reason="torch._grouped_mm has no CPU kernel")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not _sm90(), reason="needs CUDA sm_90, Triton and the extension")])]


@pytest.mark.parametrize("gather", ["output_rows", "token_rows"])
@pytest.mark.parametrize("out", [256, 96], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("device", EMULATED_DEVICES)
def test_grouped_mxfp8_emulation_matches_one_gemm_per_expert(device, splits, out, gather):
    """fprop, dgrad and wgrad of the grouped emulation (one dequantize per packed operand, one `torch._grouped_mm` per
    phase) against one `gemm` per expert of the same parts, per expert within 1e-2 of its largest magnitude (the
    grouped GEMM rounds to bf16); a NaN token of expert 2 stays in expert 2; an expert without tokens gets zero dW.
    fprop / dgrad either on the slots, then the tokens' output rows gathered, or on the tokens' fp8 rows gathered
    first (`token_ends`)."""
    k = 256
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(splits), k, generator=gen)
    if splits[2]:
        x[sum(splits[:2]), 5] = float("nan")
    dy = torch.randn(sum(splits), out, generator=gen)
    w = torch.randn(E, out, k, generator=gen)
    dev = torch.device(device)
    layout = TokenLayout.build(splits, [-(-m // 32) * 32 for m in splits], dev, 32)  # (MXFP8: whole 32-row blocks)
    q = MXFP8Quantizer()
    xq = q.quantize_groups(layout.pack(x.to(dev)), layout.slots, rowwise=True, columnwise=True, name="x")
    dyq = q.quantize_groups(layout.pack(dy.to(dev)), layout.slots, rowwise=True, columnwise=True, name="dy")
    wq = ExpertWeights.quantize(q, w.to(dev), True, "w")
    assert wq.packed
    ends = torch.tensor(layout.slots).cumsum(0).to(dev, torch.int32)
    used = [(g, o, p, m) for g, (o, p, m) in enumerate(zip(layout.offsets, layout.padded, splits)) if m]
    for phase, a, direction in (("fprop", xq.part(ROWWISE), ROWWISE), ("dgrad", dyq.part(ROWWISE), COLUMNWISE)):
        b = wq.tensors[0].part(direction)
        token_ends = torch.tensor(splits).cumsum(0).to(dev, torch.int32) if gather == "token_rows" else None
        got = grouped_emulated.mm(a, b, E, ends, layout.rows, torch.float32, token_ends=token_ends)
        want = [gemm(a.row_slice(o, o + p), wq.part(g, direction), torch.float32)[:m] for g, o, p, m in used]
        for (g, *_), gg, ww in zip(used, got.split([m for m in splits if m]), want):
            _assert_close_to(gg, ww, 1e-2, f"{phase} of expert {g}, splits {splits}, N={out}")
            if phase == "fprop" and g != 2:
                assert torch.isfinite(gg).all(), f"fprop of expert {g} got expert 2's NaN"
    dy_col, x_col = dyq.part(COLUMNWISE), xq.part(COLUMNWISE)
    got = grouped_emulated.wgrad(dy_col, x_col, ends, [g for g, m in enumerate(splits) if not m], torch.float32)
    for g, o, p, _ in used:
        want = gemm(dy_col.row_slice(o, o + p), x_col.row_slice(o, o + p), torch.float32)
        _assert_close_to(got[g], want, 1e-2, f"wgrad of expert {g}, splits {splits}, N={out}")
    for g, m in enumerate(splits):
        if not m:
            assert not got[g].any(), f"wgrad of expert {g} (no tokens) is not zero"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs CUDA sm_90, Triton and the built extension")
@pytest.mark.parametrize("out", [256, 96], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 300, 0]], ids=str)
def test_gpu_mxfp8_experts_run_one_grouped_gemm_per_phase(splits, out, monkeypatch):
    """GroupedLinear with mxfp8 on sm_90 runs no per-expert GEMM, and agrees per expert with the per-expert GEMM loop
    (the same bf16 operands; 1e-2 of each expert's largest magnitude)."""
    calls = _spy_per_expert_gemms(monkeypatch)
    got = _layer_step(splits, 256, out, True, monkeypatch, preset="mxfp8")
    assert not calls, f"per-expert GEMMs ran for {sorted(set(calls))}"
    want = _layer_step(splits, 256, out, False, monkeypatch, preset="mxfp8")
    assert set(calls) == {"fprop", "dgrad", "wgrad"}, "the per-expert loop did not run with the grouped GEMMs off"
    _assert_layer_close(got, want, splits, f"mxfp8, splits {splits}, N={out}")


def test_a_failing_grouped_gemm_is_turned_off_with_a_warning(monkeypatch):
    """A grouped GEMM that fails (a Triton compile error, a torch refusal) returns None -- the caller runs the
    per-expert GEMMs -- turns its kernel family off for the process and says so once."""
    flag = grouped_blocks.ENABLED
    monkeypatch.setattr(flag, "on", True)

    def fails():
        raise RuntimeError("no kernel image")

    with pytest.warns(RuntimeWarning, match="grouped test GEMM failed .*no kernel image.*one GEMM per expert"):
        assert grouped_blocks.run_or_none(flag, "grouped test GEMM", fails) is None
    assert flag.on is False, "the failing family was not turned off"
    assert grouped_blocks.run_or_none(flag, "grouped test GEMM", lambda: 7) == 7
