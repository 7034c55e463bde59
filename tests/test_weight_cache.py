"""The is_first_microbatch weight cache never computes with a stale weight: a write the cache key cannot see
(through `.data`, which has a version counter of its own) is caught by the weight's fingerprint. On the CPU the
call re-quantizes with a warning; on a GPU (checked asynchronously, no host sync per call) StaleWeightError is
raised at a later call. Linear and GroupedLinear's per-expert caches alike."""

import logging

import pytest
import torch

import hybridq as hq
from hybridq import StaleWeightError

from _compare import assert_bitwise

PRESETS = [p for p in hq.preset_names() if p != "fp8_delayed"]  # (delayed scaling: each quantization moves state)
IN, OUT, M = 96, 64, 32
E, SPLITS = 3, [32, 0, 64]
WARNING = "weight changed since it was quantized"


def _linear(preset, device="cpu"):
    torch.manual_seed(0)
    return hq.Linear(IN, OUT, recipe=hq.recipe(preset), name="fc", device=device)


def _grouped(preset):
    torch.manual_seed(0)
    return hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe(preset), name="moe")


def _fresh_copy(layer):
    """A layer of the same kind and recipe holding the current weights, without a cache."""
    new = (_grouped if isinstance(layer, hq.GroupedLinear) else _linear)(layer.recipe.name)
    new.load_state_dict(layer.state_dict())
    return new


def _step(layer, x, gy, *args, **kw):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(5)  # stochastic rounding of grad_output draws alike
    y = layer(x, *args, **kw)
    y.backward(gy)
    return y.detach(), x.grad, layer.weight.grad


def _data(tokens, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return torch.randn(tokens, IN, generator=g).to(device), torch.randn(tokens, OUT, generator=g).to(device)


@pytest.mark.parametrize("write", ["data.mul_", "data.copy_"])
@pytest.mark.parametrize("preset", PRESETS)
def test_linear_weight_written_through_data_is_quantized_again(preset, write, caplog):
    layer = _linear(preset)
    x, gy = _data(M)
    _step(layer, x, gy, is_first_microbatch=True)
    with torch.no_grad():
        if write == "data.mul_":
            layer.weight.data.mul_(2)
        else:
            layer.weight.data.copy_(torch.randn(OUT, IN))
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        got = _step(layer, x, gy, is_first_microbatch=False)
    assert WARNING in caplog.text, f"{preset}: no warning for a weight written through .{write}"
    want = _step(_fresh_copy(layer), x, gy)
    for what, a, b in zip(("output", "grad input", "grad weight"), got, want):
        assert_bitwise(a, b, f"{preset}: {what} after .{write} (the cached weight was stale)")


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8", "nvfp4"])
def test_grouped_expert_weight_written_through_data_is_quantized_again(preset, caplog):
    layer = _grouped(preset)
    x, gy = _data(sum(SPLITS))
    _step(layer, x, gy, SPLITS, is_first_microbatch=True)
    layer.weight.data[2].mul_(-0.5)  # expert 2's slice only
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        got = _step(layer, x, gy, SPLITS, is_first_microbatch=False)
    assert "moe.experts.2" in caplog.text and WARNING in caplog.text, f"{preset}: expert 2's change not reported"
    assert "moe.experts.0" not in caplog.text, f"{preset}: expert 0 did not change but was reported"
    fresh = _fresh_copy(layer)
    fresh.packed_path = False
    want = _step(fresh, x, gy, SPLITS)
    for what, a, b in zip(("output", "grad input", "grad weight"), got, want):
        assert_bitwise(a, b, f"{preset}: {what} after expert 2's .data write")


def test_unchanged_weight_keeps_its_cached_quantization(caplog):
    layer = _linear("mxfp8")
    x, gy = _data(M)
    _step(layer, x, gy, is_first_microbatch=True)
    cached = layer._weight_cache[1]
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        _step(layer, x, gy, is_first_microbatch=False)
        with torch.no_grad():
            layer(x, is_first_microbatch=False)
    assert layer._weight_cache[1] is cached, "an unchanged weight was quantized again"
    assert WARNING not in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8"])
def test_gpu_data_write_raises_at_a_later_call(preset):
    """On a GPU the fingerprint comparison is asynchronous: the stale call is reported by StaleWeightError at the
    latest on the next is_first_microbatch=True call, naming the layer; the cache is then refreshed."""
    layer = _linear(preset, "cuda")
    x, _ = _data(M, "cuda")
    with torch.no_grad():
        layer(x, is_first_microbatch=True)
        layer.weight.data.mul_(2)
        layer(x, is_first_microbatch=False)
        with pytest.raises(StaleWeightError, match="fc: the weight changed") as err:
            for first in (False, False, True):
                layer(x, is_first_microbatch=first)
        assert ".data" in str(err.value)
        y = layer(x, is_first_microbatch=True)  # reported once: the next first micro-batch quantizes it again
        assert_bitwise(y, _fresh_copy(layer).to("cuda")(x), f"{preset}: output after the refresh")
        layer(x, is_first_microbatch=False)
        torch.cuda.synchronize()
        layer(x, is_first_microbatch=True)  # an unchanged weight raises nothing
