"""Backward passes through the same graph: a second backward (`retain_graph=True`) gives bitwise the first's gradients
(the saved quantized operands are neither freed nor reused in place), and a backward asked for a graph of its
gradients (`create_graph=True`, a double backward) raises NotImplementedError naming the layer
([Note: no double backward through quantized GEMMs], hybridq/nn/first_order.py) -- before the fix it returned
gradients whose second backward was silently zeros or the casts' rounding differentiated."""

import pytest
import torch

import hybridq as hq
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _compare import assert_bitwise
from _format_cases import FORMATS, STATELESS, case_recipe
from _gpu import gpu

DTYPE = torch.bfloat16
IN = OUT = 128
TOKENS = 64
COUNTS = [16, 0, 32, 16]  # (an expert without tokens)
LAYER_CASES = [*FORMATS, "mixed", *hq.preset_names()]
# a second backward casts grad_output again: the same bits where the cast has no state (delayed scaling's history
# moved on) and draws nothing (stochastic rounding with its own generator draws anew)
REPEATABLE = [c for c in STATELESS if not getattr(FORMATS[c](), "stochastic_rounding", False)]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def _linear(case, override=None):
    torch.manual_seed(0)
    recipe = case_recipe(case)
    if override is not None:
        recipe = hq.CustomRecipe(recipe.quantizer, name=recipe.name, backward_override=override)
    return hq.Linear(IN, OUT, dtype=DTYPE, recipe=recipe, name="fc")


def _grouped(case, packed):
    torch.manual_seed(0)
    g = hq.GroupedLinear(len(COUNTS), IN, OUT, dtype=DTYPE, recipe=case_recipe(case), name="experts")
    g.packed_path = packed
    return g


def _input():
    return torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(1)).to(DTYPE).requires_grad_()


def _refused(loss, params, layer_name):
    with pytest.raises(NotImplementedError, match=rf"{layer_name}.*no second derivative.*create_graph=True"):
        torch.autograd.grad(loss, params, create_graph=True)


@pytest.mark.parametrize("case", LAYER_CASES)
def test_linear_refuses_create_graph(case):
    layer, x = _linear(case), _input()
    _refused(layer(x).float().square().sum(), [x, layer.weight, layer.bias], "fc")


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_linear_with_a_backward_override_refuses_create_graph(override):
    layer, x = _linear("fp8_e4m3", override), _input()
    _refused(layer(x).float().square().sum(), [x, layer.weight], "fc")


def test_cached_weight_refuses_create_graph():
    layer, x = _linear("fp8_tensorwise"), _input()
    _refused(layer(x, is_first_microbatch=True).float().square().sum(), [x, layer.weight], "fc")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_expert"])
@pytest.mark.parametrize("case", LAYER_CASES)
def test_grouped_linear_refuses_create_graph(case, packed):
    layer, x = _grouped(case, packed), _input()
    _refused(layer(x, COUNTS).float().square().sum(), [x, layer.weight], "experts")


def test_create_graph_elsewhere_still_runs():
    """create_graph=True on a graph without hybridq layers is untouched (only their backward refuses it)."""
    layer = _linear("fp8_tensorwise")
    x = _input()
    y = layer(x).detach().requires_grad_()
    (g,) = torch.autograd.grad(y.float().pow(3).sum(), [y], create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), [y])
    assert_bitwise(gg, (6 * y.float()).to(gg.dtype), "second derivative of a plain op")


def _grads_twice(loss, params):
    torch.manual_seed(7)  # (stochastic rounding from torch's default generator: the same draws both times)
    first = torch.autograd.grad(loss, params, retain_graph=True)
    torch.manual_seed(7)
    return first, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("case", REPEATABLE)
def test_second_backward_through_a_retained_graph_is_bitwise_the_first(case):
    layer, x = _linear(case), _input()
    first, second = _grads_twice(layer(x).float().square().sum(), [x, layer.weight, layer.bias])
    for name, a, b in zip(("grad_input", "grad_weight", "grad_bias"), first, second):
        assert_bitwise(b, a, f"{case}: second backward's {name}")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_expert"])
@pytest.mark.parametrize("case", REPEATABLE)
def test_grouped_second_backward_through_a_retained_graph_is_bitwise_the_first(case, packed):
    layer, x = _grouped(case, packed), _input()
    first, second = _grads_twice(layer(x, torch.tensor(COUNTS)).float().square().sum(), [x, layer.weight])
    for name, a, b in zip(("grad_input", "grad_weight"), first, second):
        assert_bitwise(b, a, f"{case}: second backward's {name}")


@gpu
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "fp8_delayed", "mxfp8"])
def test_cuda_linear_paths_refuse_create_graph(preset):
    """The eager CUDA paths -- the C++ nodes hybridq::fp8_linear / fp8_block_linear / fp8_linear_delayed (from the
    second step), the Python nodes elsewhere -- refuse create_graph=True as the CPU paths do."""
    torch.manual_seed(0)
    layer = hq.Linear(256, 256, dtype=DTYPE, device="cuda", recipe=preset, name="fc")
    for step in range(2):
        x = torch.randn(128, 256, dtype=DTYPE, device="cuda", requires_grad=True)
        loss = layer(x).float().square().sum()
        if step == 0:
            loss.backward()
    with pytest.raises(NotImplementedError, match=r"no second derivative.*create_graph=True"):
        torch.autograd.grad(loss, [x, layer.weight], create_graph=True)


@gpu
def test_cuda_norm_and_swiglu_kernels_refuse_create_graph():
    """hq.RMSNorm / LayerNorm / SwiGLU run kernels without a derivative on CUDA: their backward refuses
    create_graph=True, naming the kernel (on the CPU their torch reference runs and differentiates twice)."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=DTYPE, device="cuda", requires_grad=True)
    for norm, name in ((hq.RMSNorm(256, dtype=DTYPE, device="cuda"), "RMSNorm"),
                       (hq.LayerNorm(256, dtype=DTYPE, device="cuda"), "LayerNorm")):
        with pytest.raises(NotImplementedError, match=rf"{name} kernel has no second derivative"):
            torch.autograd.grad(norm(x).float().square().sum(), [x], create_graph=True)
    from hybridq.nn.swiglu import swiglu
    b = torch.randn_like(x).requires_grad_()
    with pytest.raises(NotImplementedError, match=r"SwiGLU kernel has no second derivative"):
        torch.autograd.grad(swiglu(x, b).float().square().sum(), [x, b], create_graph=True)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_expert"])
@pytest.mark.parametrize("case", ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4"])
def test_each_node_keeps_its_name(case, packed):
    """The nodes' `name()` (what anomaly mode, graph viewers and the host tests read): a layer name kept on ctx must
    not hide it (on torch 2.11 `ctx.name` replaced the method: `grad_fn.name()` raised or gave None)."""
    x = _input()
    for y in (_linear(case)(x), _grouped(case, packed)(x, COUNTS)):
        name = y.grad_fn.name()
        assert isinstance(name, str) and "Backward" in name, f"{case}: grad_fn.name() gave {name!r}"
