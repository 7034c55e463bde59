"""hybridq.nn.LayerNorm: torch.nn.LayerNorm's math (torch's layer_norm contract: fp32 computation, one rounding);
convert_linears / apply_hybrid_fsdp swap it in for LayerNorm modules (sharing weight and bias); its max|y| reaches
the per-tensor casts of the Linear layers reading y. CUDA: the kernels against the reference (forward / backward to
rounding, max|y| exact); compiled, the same kernels as custom ops (test_compiled_norms.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hybridq
from hybridq.nn.known_amax import known_amax
from hybridq.nn.layer_norm import LayerNorm, layer_norm_mismatch, layer_norm_reference
from hybridq.nn.norm import RMSNorm
from _gpu import gpu

HAVE_CUDA = torch.cuda.is_available()


class ManualLayerNorm(nn.Module):  # a model's own LayerNorm (the protocol)
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        xf = x.float()
        mu = xf.mean(-1, keepdim=True)
        y = (xf - mu) * torch.rsqrt((xf - mu).pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class ScaleOnlyLayerNorm(ManualLayerNorm):  # same attributes, no centering: another norm
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


class Block(nn.Module):
    def __init__(self, d: int = 64, norm=nn.LayerNorm):
        super().__init__()
        self.ln1, self.ln2 = norm(d), norm(d)
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        a = self.ln1(x)
        x = x + self.wq(a) * torch.sigmoid(self.wk(a))
        return x + self.w2(nn.functional.gelu(self.w1(self.ln2(x))))


def _random_params(m: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 if name.endswith("bias") else
                        torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


# ---- the module --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["affine", "no_bias", "no_affine"])
def test_swapped_norm_is_bitwise_torch_layer_norm_on_cpu(kind, dtype):
    d = 96
    orig = nn.LayerNorm(d, eps=1e-6, elementwise_affine=kind != "no_affine", bias=kind == "affine")
    orig = _random_params(orig).to(dtype)
    new = LayerNorm.from_module(orig, name="norm")
    x = (torch.randn(3, 7, d) * 4 + 1).to(dtype).requires_grad_()
    want, got = orig(x), new(x)
    assert torch.equal(got, want), f"{kind} {dtype}: max |diff| {(got.float() - want.float()).abs().max()}"
    dy = torch.randn_like(want)
    grads = [torch.autograd.grad(y, [x, *m.parameters()], dy) for y, m in ((got, new), (want, orig))]
    for a, b in zip(*grads):
        assert torch.equal(a, b), f"{kind} {dtype}: a gradient differs from torch's LayerNorm"


def test_from_module_shares_weight_and_bias_and_state_dict_keys():
    orig = _random_params(nn.LayerNorm(32))
    new = LayerNorm.from_module(orig)
    assert new.weight is orig.weight and new.bias is orig.bias, "a parameter was copied, not shared"
    assert list(new.state_dict()) == list(orig.state_dict()) == ["weight", "bias"]


@pytest.mark.parametrize("bias", [True, False])
def test_a_protocol_layer_norm_is_swapped(bias):
    orig = _random_params(ManualLayerNorm(48, bias=bias))
    assert layer_norm_mismatch(orig) is None
    new = LayerNorm.from_module(orig)
    x = torch.randn(5, 48)
    assert torch.allclose(new(x), orig(x), rtol=1e-5, atol=1e-6)
    assert (new.bias is orig.bias) if bias else new.bias is None


@pytest.mark.parametrize("case", ["scale_only", "two_dims", "hooked", "bias_shape"])
def test_a_norm_that_is_not_plain_layer_norm_is_refused_with_the_reason(case):
    if case == "scale_only":
        m, why = ScaleOnlyLayerNorm(32), "differs from (x - mean(x))"
    elif case == "two_dims":
        m, why = nn.LayerNorm((4, 8)), "normalizes 2 dimensions"
    elif case == "hooked":
        m, why = ManualLayerNorm(32), "has hooks"
        m.register_forward_hook(lambda *a: None)
    else:
        m, why = ManualLayerNorm(32), "bias is not a parameter of the weight's shape"
        m.bias = nn.Parameter(torch.zeros(16))
    got = layer_norm_mismatch(m)
    assert got is not None and why in got, f"{case}: expected a reason containing {why!r}, got {got!r}"
    with pytest.raises(ValueError, match="blocks.0.ln cannot run as hybridq.nn.LayerNorm"):
        LayerNorm.from_module(m, name="blocks.0.ln")


def test_input_of_the_wrong_width_names_the_norm():
    norm = LayerNorm(64, name="layers.3.ln")
    with pytest.raises(ValueError, match=r"layers\.3\.ln: its weight of shape \(64,\).*\(2, 48\)"):
        norm(torch.randn(2, 48))


def test_norm_records_the_exact_max_of_its_output():
    norm = _random_params(LayerNorm(64))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[3, 5] = 30.0
    y = norm(x)
    assert torch.equal(known_amax(y).reshape(()), y.float().abs().amax()), "max|y| is not the max of the output"


def test_norm_compiles_without_graph_breaks():
    torch._dynamo.reset()
    norm = _random_params(LayerNorm(32))
    x = torch.randn(4, 32)
    got = torch.compile(norm, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, layer_norm_reference(x, norm.weight, norm.bias, norm.eps))


# ---- conversion ------------------------------------------------------------------------------------------------

def test_convert_linears_swaps_layer_norms_and_reports_them():
    model = nn.Sequential(Block(), Block(norm=ScaleOnlyLayerNorm))
    report = hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    by_name = {r.name: r for r in report.norms}
    assert sorted(by_name) == ["0.ln1", "0.ln2", "1.ln1", "1.ln2"]
    assert isinstance(model[0].ln1, LayerNorm) and not isinstance(model[1].ln1, LayerNorm)
    assert not by_name["1.ln2"].converted and "differs" in by_name["1.ln2"].reason
    table = report.table()
    assert "hybridq.nn.LayerNorm" in table and "norm kept" in table and "hybridq.nn.RMSNorm" not in table


def test_rms_and_layer_norms_are_reported_by_their_own_class():
    model = nn.Sequential(nn.LayerNorm(16), nn.RMSNorm(16), nn.Linear(16, 16))
    report = hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    assert isinstance(model[0], LayerNorm) and isinstance(model[1], RMSNorm)
    assert [(r.name, r.replacement) for r in report.norms] == [("1", "hybridq.nn.RMSNorm"), ("0", "hybridq.nn.LayerNorm")]


def test_apply_hybrid_fsdp_swaps_layer_norms():
    model = Block()
    report = hybridq.apply_hybrid_fsdp(model, hybridq.recipe("fp8_tensorwise"))
    assert isinstance(model.ln2, LayerNorm) and [r.name for r in report.norms] == ["ln1", "ln2"]


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_delayed", "nvfp4"])
def test_a_model_with_swapped_layer_norms_trains_bitwise_like_without(preset):
    base = _random_params(Block())
    models = []
    for norms in (True, False):
        m = copy.deepcopy(base)
        hybridq.convert_linears(m, hybridq.recipe(preset), norms=norms)
        models.append(m)
    x = torch.randn(2, 16, 64)
    results = []
    for m in models:
        torch.manual_seed(1)
        for _ in range(2):  # (delayed scaling: the second step uses the first's amax)
            m.zero_grad()
            y = m(x)
            y.square().mean().backward()
        results.append((y.detach(), [p.grad for p in m.parameters()]))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0, y1), f"{preset}: outputs differ with the LayerNorms swapped"
    for (name, _), a, b in zip(models[0].named_parameters(), g0, g1):
        assert torch.equal(a, b), f"{preset}: the gradient of {name} differs with the LayerNorms swapped"


# ---- CUDA kernels ----------------------------------------------------------------------------------------------

def _tol(dtype):
    return {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [2048, 200, 77])  # vectorized, partial vector per lane, odd (scalar path)
@pytest.mark.parametrize("params", ["fp32", "same", "weight_only", "none"])
@gpu
def test_kernel_forward_matches_the_reference_and_its_max_is_exact(dtype, k, params):
    torch.manual_seed(k)
    x = torch.randn(37, k, device="cuda", dtype=dtype) * 3 + 2
    pd = torch.float32 if params == "fp32" else dtype
    w = None if params == "none" else (torch.rand(k, device="cuda") + 0.5).to(pd)
    b = (torch.randn(k, device="cuda") * 0.5).to(pd) if params in ("fp32", "same") else None
    y = hybridq.nn.layer_norm(x, w, b, 1e-5)
    want = layer_norm_reference(x, w, b, 1e-5)
    close = torch.isclose(y.float(), want.float(), rtol=_tol(dtype), atol=1e-5)
    assert close.all(), (f"{dtype} K={k}: {int((~close).sum())} elements off, max |diff| "
                         f"{(y.float() - want.float()).abs().max()}")
    assert torch.equal(known_amax(y).reshape(()), y.float().abs().amax()), "max|y| is not the max of the output"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@gpu
def test_kernel_backward_matches_autograd_of_the_reference(dtype):
    torch.manual_seed(1)
    k = 1024
    x = (torch.randn(300, k, device="cuda", dtype=dtype) * 2 + 1).requires_grad_()
    w = (torch.rand(k, device="cuda") + 0.5).requires_grad_()
    b = (torch.randn(k, device="cuda") * 0.5).requires_grad_()
    dy = torch.randn(300, k, device="cuda", dtype=dtype)
    grads = []
    for fn in (lambda: hybridq.nn.layer_norm(x, w, b, 1e-5), lambda: layer_norm_reference(x, w, b, 1e-5)):
        x.grad = w.grad = b.grad = None
        fn().backward(dy)
        grads.append((x.grad.float(), w.grad.float(), b.grad.float()))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for what, got, want, t in zip(("dx", "dw", "db"), grads[0], grads[1], (tol, 1e-3, 1e-3)):
        assert torch.allclose(got, want, rtol=t, atol=t * want.abs().max()), f"{what}: max |diff| {(got - want).abs().max()}"
    x.grad = w.grad = b.grad = None
    hybridq.nn.layer_norm(x, w, b, 1e-5).backward(dy)
    assert torch.equal(w.grad.float(), grads[0][1]) and torch.equal(b.grad.float(), grads[0][2]), \
        "the weight / bias gradients are not deterministic"

