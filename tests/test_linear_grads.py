"""Which of (input, weight, bias) need gradients: every combination, every preset, every backward override.

A requested gradient is bitwise the one the same layer computes when all three require grad; an unrequested one
is None; the output does not depend on the combination.
"""

import itertools

import pytest
import torch

import hybridq as hq
from hybridq.gemm import gemm
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

IN, OUT, TOKENS = 96, 64, (2, 32)
DTYPE = torch.bfloat16
OVERRIDES = [None, "high_precision", "dequantized"]
COMBOS = list(itertools.product([False, True], repeat=3))  # requires_grad of (input, weight, bias)
CASES = [(p, o) for p in hq.preset_names() for o in OVERRIDES
         if not (o is not None and hq.recipe(p).quantizer(hq.Role("linear", "weight")).is_stateful)]
NAMES = ("grad_input", "grad_weight", "grad_bias")


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def _layer(preset, override):
    torch.manual_seed(0)
    return hq.Linear(IN, OUT, dtype=DTYPE, recipe=hq.recipe(preset, backward_override=override), name="fc")


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(*TOKENS, IN, generator=g).to(DTYPE), torch.randn(*TOKENS, OUT, generator=g).to(DTYPE)


def _step(layer, x, gy, wants):
    """Forward (+ backward when anything requires grad) with the given requires_grad of (input, weight, bias);
    returns (output, (grad_input, grad_weight, grad_bias))."""
    x = x.detach().clone().requires_grad_(wants[0])
    layer.weight.requires_grad_(wants[1])
    layer.bias.requires_grad_(wants[2])
    torch.manual_seed(4)  # stochastic rounding draws from torch's default generator
    y = layer(x)
    if any(wants):
        y.backward(gy)
    else:
        assert not y.requires_grad, "output requires grad although nothing does"
    return y.detach(), (x.grad, layer.weight.grad, layer.bias.grad)


def _wgrad_without_dgrad(layer, x, gy):
    """dW when dgrad is not computed: grad_output quantized columnwise only. With stochastic rounding its draws
    are not those of a rowwise + columnwise cast (that one draws the rowwise values first), so this is the
    oracle for that cell instead of the all-grads run."""
    torch.manual_seed(4)
    dyq = layer.grad_output_quantizer.quantize(gy.reshape(-1, OUT), rowwise=False, columnwise=True)
    xq = layer.input_quantizer.quantize(x.reshape(-1, IN), rowwise=False, columnwise=True)
    return gemm(dyq.part("columnwise"), xq.part("columnwise"), DTYPE).to(layer.weight.dtype)


@pytest.mark.parametrize("wants", COMBOS, ids=lambda w: "".join("xwb"[i] if on else "-" for i, on in enumerate(w)))
@pytest.mark.parametrize("preset, override", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_requested_gradients_equal_the_all_gradients_run(preset, override, wants):
    x, gy = _data()
    y_all, grads_all = _step(_layer(preset, override), x, gy, (True, True, True))
    layer = _layer(preset, override)
    y, grads = _step(layer, x, gy, wants)
    what = f"{preset}, override={override}, requires_grad(input, weight, bias)={wants}"
    assert torch.equal(y, y_all), f"{what}: output differs from the all-gradients run"
    want = list(grads_all)
    if (wants[1] and not wants[0] and override is None
            and not layer.grad_output_quantizer.is_deterministic):
        want[1] = _wgrad_without_dgrad(_layer(preset, override), x, gy)
    for name, on, got, ref in zip(NAMES, wants, grads, want):
        if not on:
            assert got is None, f"{what}: {name} was computed although not requested"
            continue
        assert got is not None, f"{what}: {name} is missing"
        diff = (got.float() - ref.float()).abs().max().item()
        assert torch.equal(got, ref), f"{what}: {name} differs from the all-gradients run (max abs diff {diff:g})"
