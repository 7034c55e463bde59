"""Eager GroupedLinears reading one input tensor on the jagged FP8 path (an MoE layer's w1 and w3 on the dispatched
tokens) quantize it once ([Note: shared jagged input], hybridq/nn/grouped_jagged.py): outputs and gradients are
bitwise those of each layer quantizing it alone (`shared_input_quantization(False)`), and an input changed in
place, other token groups or a columnwise form the first quantization lacks are quantized again."""

from __future__ import annotations

import pytest
import torch

import hybridq as hq
import hybridq.nn.grouped as grouped_mod
from _compare import assert_results_bitwise
from hybridq.gemm import JaggedFP8Kernels
from hybridq.nn.linear import shared_input_quantization

E, IN, HID = 4, 64, 32
SPLITS = [[5, 0, 17, 40], [16, 16, 16, 14], [0, 0, 3, 0]]


class _CountingInputs(JaggedFP8Kernels):
    """The reference kernels, counting the input quantizations (the name says which tensor)."""

    def __init__(self):
        self.inputs = 0

    def quantize(self, q, x2d, groups, columnwise, name):
        self.inputs += name.startswith("input of")
        return super().quantize(q, x2d, groups, columnwise, name)


def _layers():
    torch.manual_seed(3)
    recipe = hq.recipe("fp8_tensorwise")
    return [hq.GroupedLinear(E, i, o, recipe=recipe, name=n) for n, i, o in
            (("w1", IN, HID), ("w3", IN, HID), ("w2", HID, IN))]


def _swiglu_experts(share: bool, splits, as_tensor: bool, kernels, monkeypatch) -> dict:
    """y = w2(silu(w1 x) * w3 x) on the jagged path, backward from a fixed dy: every result and gradient."""
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: kernels)
    w1, w3, w2 = _layers()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(splits), IN, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(sum(splits), IN, generator=gen, dtype=torch.bfloat16)
    m = torch.tensor(splits) if as_tensor else list(splits)
    with shared_input_quantization(share):
        y = w2(torch.nn.functional.silu(w1(x, m)) * w3(x, m), m)
        y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW1": w1.weight.grad, "dW3": w3.weight.grad, "dW2": w2.weight.grad}


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("splits", SPLITS, ids=[str(s) for s in SPLITS])
def test_w1_and_w3_quantize_their_input_once_and_match_each_quantizing_it_alone(splits, as_tensor, monkeypatch):
    on, off = _CountingInputs(), _CountingInputs()
    shared = _swiglu_experts(True, splits, as_tensor, on, monkeypatch)
    alone = _swiglu_experts(False, splits, as_tensor, off, monkeypatch)
    assert_results_bitwise(shared, alone, f"splits {splits} ({'tensor' if as_tensor else 'list'})")
    assert (on.inputs, off.inputs) == (2, 3), (
        f"input quantizations with / without sharing: {on.inputs} / {off.inputs} (want x once for w1 and w3, h once)")


def _two_calls(share: bool, between, monkeypatch, splits2=None, w_grads=(True, True)) -> tuple[dict, int]:
    """w1(x) then `between(x)` then w3(x) (or w3 on other counts `splits2`); (results, input quantizations)."""
    kernels = _CountingInputs()
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: kernels)
    w1, w3, _ = _layers()
    for w, g in zip((w1, w3), w_grads):
        w.weight.requires_grad_(g)
    splits = [5, 0, 17, 40]
    x = torch.randn(sum(splits), IN, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    x.requires_grad_(True)
    with shared_input_quantization(share):
        y1 = w1(x, torch.tensor(splits))
        between(x)
        y3 = w3(x, torch.tensor(splits2 or splits))
        (y1.float().square().sum() + y3.float().sum()).backward()
    return {"y1": y1.detach(), "y3": y3.detach(), "dx": x.grad, "dW1": w1.weight.grad, "dW3": w3.weight.grad}, \
        kernels.inputs


def _add_in_place(x):
    with torch.no_grad():
        x.add_(0.5)


CHANGES = {
    "x changed in place": dict(between=_add_in_place),
    "other token groups": dict(between=lambda x: None, splits2=[40, 17, 0, 5]),
    "w1 without a weight gradient (no columnwise x)": dict(between=lambda x: None, w_grads=(False, True)),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_an_input_the_first_quantization_does_not_fit_is_quantized_again(case, monkeypatch):
    shared, n_shared = _two_calls(True, monkeypatch=monkeypatch, **CHANGES[case])
    alone, n_alone = _two_calls(False, monkeypatch=monkeypatch, **CHANGES[case])
    assert_results_bitwise(shared, alone, case)
    assert n_shared == n_alone == 2, f"{case}: input quantizations {n_shared} with sharing, {n_alone} without"


def test_the_shared_quantization_dies_with_its_input(monkeypatch):
    from hybridq.nn.grouped_jagged import _SHARED_INPUTS
    _SHARED_INPUTS.clear()
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: JaggedFP8Kernels())
    w1, _, _ = _layers()
    x = torch.randn(30, IN, dtype=torch.bfloat16, requires_grad=True)
    w1(x, torch.tensor([10, 0, 20, 0])).sum().backward()
    assert len(_SHARED_INPUTS.entries) == 1, _SHARED_INPUTS.entries
    del x
    assert _SHARED_INPUTS.entries == (), f"an entry outlived its input: {_SHARED_INPUTS.entries}"
