"""hybridq.nn.RMSNorm: torch.nn.RMSNorm's math; convert_linears / apply_hybrid_fsdp swap it in for RMSNorm modules
(sharing the weight); its max|y| reaches the per-tensor cast of the Linear layers that read y, which is then bitwise
the cast without it. CUDA: the kernels against the reference (forward/backward to rounding, max|y| exact)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import hybridq
from hybridq.nn.known_amax import known_amax, remember_amax
from hybridq.nn.linear_function import _quantize_input, shared_input_quantization
from hybridq.nn.norm import RMSNorm, rms_norm_mismatch, rms_norm_reference
from _gpu import gpu

HAVE_CUDA = torch.cuda.is_available()


class LlamaStyleRMSNorm(nn.Module):  # the launch model's / torchtitan's norm
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class GemmaRMSNorm(LlamaStyleRMSNorm):  # (1 + weight): same attributes, other math
    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.float())).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d: int = 64, h: int = 128, norm=LlamaStyleRMSNorm):
        super().__init__()
        self.attention_norm, self.ffn_norm = norm(d), norm(d)
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        a = self.attention_norm(x)
        x = x + self.wq(a) * torch.sigmoid(self.wk(a)) + self.wv(a)
        f = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(f)) * self.w3(f))


def _random_weights(m: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.1)
    return m


# ---- the module --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("source", ["torch", "llama_style"])
def test_swapped_norm_is_bitwise_the_original_on_cpu(source, dtype):
    d = 96
    orig = _random_weights(nn.RMSNorm(d, eps=1e-6) if source == "torch" else LlamaStyleRMSNorm(d)).to(dtype)
    new = RMSNorm.from_module(orig, name="norm")
    x = torch.randn(3, 7, d, dtype=dtype) * 4
    want, got = orig(x), new(x)
    assert torch.equal(got, want), f"{source} {dtype}: max |diff| {(got.float() - want.float()).abs().max()}"


def test_from_module_shares_the_weight_parameter_and_state_dict_keys():
    orig = _random_weights(LlamaStyleRMSNorm(32))
    new = RMSNorm.from_module(orig)
    assert new.weight is orig.weight, "the weight was copied, not shared"
    assert list(new.state_dict()) == list(orig.state_dict()) == ["weight"]


def test_torch_rms_norm_without_weight_and_default_eps():
    orig = nn.RMSNorm(48, elementwise_affine=False)
    new = RMSNorm.from_module(orig)
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    assert new.weight is None and new.eps is None
    assert torch.equal(new(x), orig(x))


@pytest.mark.parametrize("case", ["gemma", "two_dims", "hooked"])
def test_a_norm_that_is_not_plain_rms_norm_is_refused_with_the_reason(case):
    if case == "gemma":
        m, why = GemmaRMSNorm(32), "differs from x * rsqrt"
    elif case == "two_dims":
        m, why = nn.RMSNorm((4, 8)), "normalizes 2 dimensions"
    else:
        m, why = LlamaStyleRMSNorm(32), "has hooks"
        m.register_forward_hook(lambda *a: None)
    got = rms_norm_mismatch(m)
    assert got is not None and why in got, f"{case}: expected a reason containing {why!r}, got {got!r}"
    with pytest.raises(ValueError, match="blocks.0.norm cannot run as hybridq.nn.RMSNorm"):
        RMSNorm.from_module(m, name="blocks.0.norm")


def test_input_of_the_wrong_width_names_the_norm():
    norm = RMSNorm(64, name="layers.3.ffn_norm")
    with pytest.raises(ValueError, match=r"layers\.3\.ffn_norm: its weight of shape \(64,\).*\(2, 48\)"):
        norm(torch.randn(2, 48))


# ---- conversion ------------------------------------------------------------------------------------------------

def test_convert_linears_swaps_the_rms_norms_and_reports_them():
    model = nn.Sequential(Block(), Block(norm=GemmaRMSNorm))
    report = hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    by_name = {r.name: r for r in report.norms}
    assert sorted(by_name) == ["0.attention_norm", "0.ffn_norm", "1.attention_norm", "1.ffn_norm"]
    assert isinstance(model[0].attention_norm, RMSNorm) and isinstance(model[0].ffn_norm, RMSNorm)
    assert not isinstance(model[1].attention_norm, RMSNorm), "a (1 + weight) norm was swapped"
    assert not by_name["1.ffn_norm"].converted and "differs" in by_name["1.ffn_norm"].reason
    assert "hybridq.nn.RMSNorm" in report.table() and "norm kept" in report.table()


def test_norms_false_and_the_filter_keep_norms():
    model = Block()
    hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"), norms=False)
    assert not isinstance(model.attention_norm, RMSNorm)
    model = Block()
    hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"), lambda m, n: n != "ffn_norm")
    assert isinstance(model.attention_norm, RMSNorm) and not isinstance(model.ffn_norm, RMSNorm)


def test_converting_twice_swaps_once():
    model = Block()
    hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    report = hybridq.convert_linears(model, hybridq.recipe("mxfp8"))
    assert report.norms == [], "an already swapped norm was reported again"


# ---- max|y| reaches the next Linear's cast -------------------------------------------------------------------

def test_the_norm_records_the_exact_max_of_its_output():
    norm = _random_weights(RMSNorm(64))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[3, 5] = 30.0
    y = norm(x)
    amax = known_amax(y)
    assert amax is not None, "no max|y| recorded"
    assert torch.equal(amax.reshape(()), y.float().abs().amax()), f"{amax} != {y.float().abs().amax()}"


def test_an_in_place_change_of_the_output_forgets_its_max():
    y = RMSNorm(16)(torch.randn(4, 16))
    y.mul_(2)
    assert known_amax(y) is None, "a stale max|y| survived an in-place change"


def test_inference_mode_runs_and_records_nothing():
    model = _random_weights(Block())
    hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        want = model(x)
    with torch.inference_mode():
        got = model(x)
        y = model.attention_norm(x)
        assert known_amax(y) is None, "an inference tensor (no version counter) got a recorded max"
    assert torch.equal(got, want), "inference mode changed the output"


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "nvfp4", "mxfp8", "fp8_block"])
def test_a_recorded_max_is_what_the_linear_input_cast_uses(preset):
    """Record a max other than the true one: formats whose statistics are the max|x| must quantize with it (the
    hand-off is wired); the others must not depend on it."""
    layer = hybridq.Linear(64, 64, bias=False, recipe=hybridq.recipe(preset))
    y = torch.randn(32, 64)
    true = layer.input_quantizer.quantize(y, rowwise=True, columnwise=True)
    remember_amax(y, y.abs().amax() * 3)  # (not a power of two: that would only shift exponents)
    with shared_input_quantization(False):
        got = _quantize_input(layer.input_quantizer, y, y, True, "input of fc")
    q = layer.input_quantizer
    uses = q.stats_from_amax(torch.ones(1), True, True) is not None
    same = torch.equal(got.dequantize(), true.dequantize())
    assert same != uses, (f"{preset} ({q.describe()}): the recorded max was "
                          f"{'ignored' if same else 'used'}, expected it to be {'used' if uses else 'ignored'}")


@pytest.mark.parametrize("preset", hybridq.preset_names())
def test_statistics_from_a_max_equal_the_statistics_of_the_tensor(preset):
    x = torch.randn(64, 128) * 3
    r = hybridq.recipe(preset)
    from hybridq.recipe import Role
    for role in ("input", "grad_output"):
        q = r.quantizer(Role("linear", role, "fc"))
        for row, col in ((True, False), (False, True), (True, True)):
            got = q.stats_from_amax(x.abs().amax(), row, col)
            if got is None:
                continue
            want = q.global_stats(x, row, col)
            assert torch.equal(got.reshape(-1), want.reshape(-1)), f"{preset} {role} {row}/{col}: {got} != {want}"


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4"])
def test_a_model_with_swapped_norms_trains_bitwise_like_without(preset):
    torch.manual_seed(0)
    base = _random_weights(Block())
    models = []
    for norms in (True, False):
        m = copy.deepcopy(base)
        hybridq.convert_linears(m, hybridq.recipe(preset), norms=norms)
        models.append(m)
    x = torch.randn(2, 16, 64, dtype=torch.float32)
    outs, grads = [], []
    for m in models:
        torch.manual_seed(1)  # (stochastic rounding draws the same numbers in both runs)
        for _ in range(2):  # (delayed scaling: the second step uses the first's amax)
            m.zero_grad()
            y = m(x)
            y.square().mean().backward()
        outs.append(y.detach())
        grads.append([p.grad for p in m.parameters()])
    assert torch.equal(outs[0], outs[1]), f"{preset}: outputs differ with the norms swapped"
    for a, b in zip(*grads):
        assert torch.equal(a, b), f"{preset}: a gradient differs with the norms swapped"


def test_norm_compiles_without_graph_breaks():
    torch._dynamo.reset()
    norm = _random_weights(RMSNorm(32))
    x = torch.randn(4, 32)
    got = torch.compile(norm, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, rms_norm_reference(x, norm.weight, norm.eps or torch.finfo(torch.float32).eps))


def test_apply_hybrid_fsdp_swaps_norms():
    model = Block()
    report = hybridq.apply_hybrid_fsdp(model, hybridq.recipe("fp8_tensorwise"))
    assert isinstance(model.ffn_norm, RMSNorm) and [r.name for r in report.norms] == ["attention_norm", "ffn_norm"]


# ---- CUDA kernels ----------------------------------------------------------------------------------------------

def _ulps(dtype):
    return {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [2048, 200, 77])  # vectorized, partial vector per lane, odd (scalar path)
@pytest.mark.parametrize("weight", ["fp32", "same", "none"])
@gpu
def test_kernel_forward_matches_the_reference_and_its_max_is_exact(dtype, k, weight):
    torch.manual_seed(k)
    x = torch.randn(37, k, device="cuda", dtype=dtype) * 3
    w = None if weight == "none" else (torch.rand(k, device="cuda") + 0.5).to(
        torch.float32 if weight == "fp32" else dtype)
    y = hybridq.nn.rms_norm(x, w, 1e-5)
    want = rms_norm_reference(x, w, 1e-5)
    close = torch.isclose(y.float(), want.float(), rtol=_ulps(dtype), atol=1e-6)
    assert close.all(), f"{dtype} K={k}: {int((~close).sum())} elements off, max |diff| {(y.float() - want.float()).abs().max()}"
    if dtype != torch.float32:  # (fp32 outputs show the row sum's last-bit difference in most elements)
        assert (y == want).float().mean() > 0.97, "more than 3% of the outputs differ from the reference"
    assert torch.equal(known_amax(y).reshape(()), y.float().abs().amax()), "max|y| is not the max of the output"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@gpu
def test_kernel_backward_matches_autograd_of_the_reference(dtype):
    torch.manual_seed(1)
    k = 1024
    x = (torch.randn(300, k, device="cuda", dtype=dtype) * 2).requires_grad_()
    w = (torch.rand(k, device="cuda") + 0.5).requires_grad_()
    dy = torch.randn(300, k, device="cuda", dtype=dtype)
    grads = []
    for fn in (lambda: hybridq.nn.rms_norm(x, w, 1e-5), lambda: rms_norm_reference(x, w, 1e-5)):
        x.grad = w.grad = None
        fn().backward(dy)
        grads.append((x.grad.float(), w.grad.float()))
    (dx, dw), (rdx, rdw) = grads
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(dx, rdx, rtol=tol, atol=tol * rdx.abs().max()), f"dx max |diff| {(dx - rdx).abs().max()}"
    assert torch.allclose(dw, rdw, rtol=1e-3, atol=1e-3 * rdw.abs().max()), f"dw max |diff| {(dw - rdw).abs().max()}"
    x.grad = w.grad = None
    hybridq.nn.rms_norm(x, w, 1e-5).backward(dy)
    assert torch.equal(w.grad.float(), dw), "the weight gradient is not deterministic"


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "nvfp4"])
@pytest.mark.parametrize("special", ["finite", "inf", "nan"])
@gpu
def test_linear_input_cast_from_the_kernel_max_is_bitwise_the_plain_cast(preset, special):
    torch.manual_seed(2)
    norm = RMSNorm(256).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    if special != "finite":
        x[5, 9] = float(special)
    y = norm(x)
    assert known_amax(y) is not None
    q = hybridq.recipe(preset).quantizer(hybridq.Role("linear", "input", "fc"))
    with shared_input_quantization(False):
        fused = _quantize_input(q, y, y, True, "input of fc")
    plain = q.quantize(y.clone(), rowwise=True, columnwise=True)  # (a clone: no recorded max)
    for d in ("rowwise", "columnwise"):
        a, b = fused.part(d).dequantize_2d(), plain.part(d).dequantize_2d()
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{preset} {special} {d}: differs from the plain cast"
