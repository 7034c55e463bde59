"""hybridq.nn.SwiGLU: a feed-forward following the SwiGLU protocol (children w1, w2, w3; forward w2(silu(w1 x) * w3 x))
is swapped for hybridq's module holding the same Linears; its silu * mul step records max|y| and writes w2's rowwise
block-format input once w2 registered its quantizer ([Note: pre-quantized norm outputs]): bitwise the unswapped model
for every format. CUDA: the kernel against torch's ops (to rounding, max|y| exact), its part bitwise the format's
kernel on y."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq
from hybridq.enums import ROWWISE
from hybridq.nn.fused_input import prequantized_input
from hybridq.nn.known_amax import known_amax
from hybridq.nn.linear_function import shared_input_quantization
from hybridq.nn.swiglu import SwiGLU, swiglu, swiglu_mismatch, swiglu_reference

from _compare import assert_parts_bitwise
from _format_cases import FORMATS
from _conversion_models import SwiGLU as FeedForward  # the launch model's / torchtitan's (without init_weights)
from _gpu import gpu

FUSED = ("fp8blk_1x128_e4m3", "fp8blk_1x128_e5m2", "fp8blk_1x128_e4m3_nopow2", "mxfp8_e4m3", "mxfp8_e5m2")


class GeluFeedForward(FeedForward):
    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


class InitFeedForward(FeedForward):
    def init_weights(self, std: float) -> None:
        for m in (self.w1, self.w2, self.w3):
            nn.init.normal_(m.weight, std=std)


class Block(nn.Module):
    def __init__(self, ff=FeedForward):
        super().__init__()
        self.ff = ff()

    def forward(self, x):
        return x + self.ff(x)


def _pair(make, device="cpu", dtype=torch.float32):
    """(the block with its feed-forward swapped, unfused): unfused keeps the module on the CPU (bitwise torch's ops)
    and runs hybridq's module without readers on CUDA (the same kernel)."""
    torch.manual_seed(0)
    base = Block().to(device=device, dtype=dtype)
    models = []
    for fused in (True, False):
        m = copy.deepcopy(base)
        hybridq.convert_linears(m, hybridq.CustomRecipe(lambda role: make(), name="case"),
                                norms=fused or device != "cpu")
        if not fused and device != "cpu":
            m.ff._readers = None
        models.append(m)
    return models


def _assert_same_steps(fused, plain, x, steps, what):
    for step in range(steps):
        res = []
        for m in (fused, plain):
            torch.manual_seed(1)
            m.zero_grad()
            y = m(x)
            y.float().square().mean().backward()
            res.append((y.detach(), {n: p.grad for n, p in m.named_parameters()}))
        (y0, g0), (y1, g1) = res
        assert torch.equal(y0.nan_to_num(7.0), y1.nan_to_num(7.0)), f"{what} step {step}: outputs differ"
        for n in g0:
            assert torch.equal(g0[n].nan_to_num(7.0), g1[n].nan_to_num(7.0)), f"{what} step {step}: grad of {n} differs"


# ---- the swap ---------------------------------------------------------------------------------------------------

def test_a_swiglu_feed_forward_is_swapped_keeping_its_weights_and_state_dict():
    model = Block()
    keys = list(model.state_dict())
    weights = [model.ff.w1.weight, model.ff.w2.weight, model.ff.w3.weight]
    report = hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    assert isinstance(model.ff, SwiGLU)
    assert all(a is b for a, b in zip([model.ff.w1.weight, model.ff.w2.weight, model.ff.w3.weight], weights)), \
        "the weights were not kept"
    assert list(model.state_dict()) == keys, "the state_dict keys or their order changed"
    assert [(r.name, r.replacement) for r in report.norms] == [("ff", "hybridq.nn.SwiGLU")]
    assert "hybridq.nn.SwiGLU" in report.table()


@pytest.mark.parametrize("case, why", [("gelu", "differs from w2(silu(w1 x) * w3 x)"),
                                       ("method", "defines init_weights"), ("hook", "forward hooks"),
                                       ("param", "owns scale"), ("shapes", "do not chain")])
def test_a_feed_forward_that_is_not_the_protocol_is_kept_with_the_reason(case, why):
    m = {"gelu": GeluFeedForward, "method": InitFeedForward}.get(case, FeedForward)()
    if case == "hook":
        m.register_forward_hook(lambda *a: None)
    elif case == "param":
        m.scale = nn.Parameter(torch.ones(1))
    elif case == "shapes":
        m.w3 = nn.Linear(128, 64, bias=False)
    got = swiglu_mismatch(m)
    assert got is not None and why in got, f"{case}: expected a reason containing {why!r}, got {got!r}"
    model = nn.Sequential(m)
    report = hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"))
    assert not isinstance(model[0], SwiGLU) and why in report.norms[0].reason


def test_norms_false_keeps_the_feed_forward():
    model = Block()
    hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise"), norms=False)
    assert type(model.ff) is FeedForward


def test_the_step_records_the_exact_max_of_its_output():
    a, b = torch.randn(8, 64), torch.randn(8, 64)
    a[2, 3] = 40.0
    y = swiglu(a, b)
    assert torch.equal(y, swiglu_reference(a, b))
    assert torch.equal(known_amax(y).reshape(()), y.abs().amax()), "max|y| is not the max of the output"


# ---- w2's pre-quantized input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(FORMATS))
def test_a_swapped_feed_forward_trains_bitwise_like_the_original(case):
    fused, plain = _pair(FORMATS[case])
    _assert_same_steps(fused, plain, torch.randn(2, 32, 128), 3, case)
    r = fused.ff._readers
    wrote = r.quantizer is not None and r.produced and r.taken
    assert wrote == (case in FUSED), f"{case}: w2's rowwise part {'was' if wrote else 'was not'} written"


# ---- CUDA ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [2048, 200, 77])
@gpu
def test_kernel_matches_torch_and_its_max_is_exact(dtype, k):
    torch.manual_seed(k)
    a = (torch.randn(37, k, device="cuda") * 4).to(dtype).requires_grad_()
    b = (torch.randn(37, k, device="cuda") * 2).to(dtype).requires_grad_()
    dy = torch.randn(37, k, device="cuda", dtype=dtype)
    y = swiglu(a, b)
    want = swiglu_reference(a, b)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(y.float(), want.float(), rtol=tol, atol=1e-5), f"max |diff| {(y - want).abs().max()}"
    assert torch.equal(known_amax(y).reshape(()), y.float().abs().amax()), "max|y| is not the max of the output"
    got = torch.autograd.grad(y, [a, b], dy)
    ref = torch.autograd.grad(want, [a, b], dy)
    for what, g, r in zip(("da", "db"), got, ref):
        assert torch.allclose(g.float(), r.float(), rtol=2 * tol, atol=1e-4 * r.abs().max().item()), \
            f"{what}: max |diff| {(g.float() - r.float()).abs().max()}"


@pytest.mark.parametrize("case", FUSED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [4096, 160])
@pytest.mark.parametrize("special", ["finite", "nonfinite"])
@gpu
def test_kernel_part_is_bitwise_the_formats_kernel_on_y(special, k, dtype, case):
    from hybridq.nn.fused_input import NormReaders

    q = FORMATS[case]()
    readers = NormReaders()
    readers.quantizer = q
    a = (torch.randn(33, k, device="cuda") * 4).to(dtype)
    b = (torch.randn(33, k, device="cuda") * 2).to(dtype)
    if special == "nonfinite":
        a[1, 2], b[5, 7], a[9, k - 1] = float("inf"), float("nan"), -float("inf")
    y = swiglu(a, b, readers)
    with shared_input_quantization(False):
        got = prequantized_input(q, y, y, False, "input of w2")
    if k % (128 if "fp8blk" in case else 32):
        assert got is None, f"{case} K={k}: a part for a width that is not whole blocks"
        return
    assert got is not None, f"{case} {dtype} K={k}: the kernel wrote no part"
    want = q.quantize(y.clone(), rowwise=True, columnwise=False)
    assert_parts_bitwise(got.part(ROWWISE), want.part(ROWWISE), f"{case} {dtype} K={k} {special}", nan_payload=True)


@pytest.mark.parametrize("case", ["fp8blk_1x128_e4m3", "mxfp8_e4m3", "fp8_e4m3"])
@gpu
def test_a_swapped_feed_forward_trains_bitwise_like_the_unfused_one_on_cuda(case):
    fused, plain = _pair(FORMATS[case], device="cuda", dtype=torch.bfloat16)
    _assert_same_steps(fused, plain, torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16), 3, case)
    assert fused.ff._readers.taken == (case in FUSED)
