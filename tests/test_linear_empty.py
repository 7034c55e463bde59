"""hybridq.nn.Linear with an empty dimension behaves as nn.Linear, forward and backward, bit for bit:
in_features 0 (the output is the bias), out_features 0 (no output columns; the input gradient is zeros) and
0 tokens, for every preset, with and without bias, 2-D and 3-D inputs."""

import pytest
import torch
import torch.nn as nn

import hybridq as hq

from _compare import assert_bitwise

PRESETS = hq.preset_names()
SHAPES = {  # (in_features, out_features, input shape)
    "in_features 0": (0, 64, (32, 0)),
    "in_features 0, 3-D input": (0, 64, (2, 32, 0)),
    "out_features 0": (96, 0, (32, 96)),
    "in and out 0": (0, 0, (32, 0)),
    "0 tokens": (96, 64, (0, 96)),
    "0 tokens, in_features 0": (0, 64, (0, 0)),
}


def _devices():
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_empty_dimension_matches_nn_linear(preset, shape, bias, device):
    k, n, x_shape = SHAPES[shape]
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=bias, device=device)
    q = hq.Linear(k, n, bias=bias, device=device, recipe=hq.recipe(preset), name="fc")
    with torch.no_grad():
        q.weight.copy_(ref.weight)
        if bias:
            q.bias.copy_(ref.bias)
    x = torch.randn(x_shape, device=device)
    gy = torch.randn(*x_shape[:-1], n, device=device)
    results = []
    for layer in (q, ref):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(gy)
        results.append((y, xi.grad, layer.weight.grad, layer.bias.grad if bias else None))
    for what, got, want in zip(("output", "grad input", "grad weight", "grad bias"), *results):
        if want is not None:
            assert_bitwise(got, want, f"{preset}, {shape}: {what} of hq.Linear vs nn.Linear")
    with torch.no_grad():
        assert_bitwise(q(x), ref(x), f"{preset}, {shape}: no-grad output")


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_in_features_0_with_a_quantized_parameter_gives_the_bias():
    with hq.quantized_model_init():
        q = hq.Linear(0, 64, recipe=hq.recipe("mxfp8"), name="fc")
    x = torch.randn(32, 0, requires_grad=True)
    y = q(x)
    y.sum().backward()
    assert torch.equal(y, q.bias.detach().expand(32, 64)), "in_features 0: the output is not the bias"
    assert torch.equal(q.bias.grad, torch.full((64,), 32.0)), "the bias gradient is not the summed output gradient"
    assert x.grad.shape == (32, 0)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("shape", ["in_features 0", "out_features 0"])
def test_empty_dimension_under_torch_compile(shape):
    k, n, x_shape = SHAPES[shape]
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    q = hq.Linear(k, n, recipe=hq.recipe("mxfp8"), name="fc")
    q.load_state_dict(ref.state_dict())
    x = torch.randn(x_shape)
    xq, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = torch.compile(q)(xq)
    y.sum().backward()
    yr = ref(xr)
    yr.sum().backward()
    assert_bitwise(y, yr, f"{shape}: compiled output")
    assert_bitwise(xq.grad, xr.grad, f"{shape}: compiled grad input")
    assert_bitwise(q.bias.grad, ref.bias.grad, f"{shape}: compiled grad bias")
