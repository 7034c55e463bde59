"""Delayed-scaling state (amax history, scale, pending update) is part of a layer's state_dict, as plain tensors:
a run resumed from a saved state_dict is bit for bit the uninterrupted one, and `torch.load(weights_only=True)`
reads it. Layers without delayed scaling keep nn.Linear's state_dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hybridq as hq

from _compare import assert_bitwise

D, HIDDEN = 64, 96


def _model(preset="fp8_delayed"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
    hq.convert_linears(m, hq.recipe(preset), on_incompatible="error")
    return m


def _train(model, opt, steps, first_step=0):
    losses = []
    for step in range(first_step, first_step + steps):
        x = torch.randn(64, D, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


KEYS = ["amax_history", "scale", "update_pending"]


def test_delayed_scaling_state_is_in_the_state_dict_as_tensors():
    sd = _model()[0].state_dict()
    for role in ("input", "weight", "grad_output"):
        for f in KEYS:
            assert isinstance(sd.get(f"delayed_scaling.{role}.{f}"), torch.Tensor), (role, f, sorted(sd))
    assert sd["delayed_scaling.input.amax_history"].shape == (1024,)


def test_layers_without_delayed_scaling_keep_nn_linears_state_dict():
    assert sorted(_model("fp8_tensorwise").state_dict()) == sorted(nn.Sequential(
        nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D)).state_dict())


def test_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path):
    """N steps, save (torch.save), load with weights_only=True into fresh objects, M more steps == N + M steps."""
    n, m = 3, 2
    full = _model()
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
    want = _train(full, full_opt, n + m)

    part = _model()
    part_opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
    got = _train(part, part_opt, n)
    torch.save({"model": part.state_dict(), "optim": part_opt.state_dict()}, tmp_path / "ck.pt")
    pending = [q.update_pending for q in hq.nn.delayed_state.delayed_quantizers(part[0]).values()]
    assert all(pending), "saved between steps: the last step's amax is recorded, its update pending"

    resumed = _model()
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    st = torch.load(tmp_path / "ck.pt", weights_only=True)
    resumed.load_state_dict(st["model"])
    resumed_opt.load_state_dict(st["optim"])
    got += _train(resumed, resumed_opt, m, first_step=n)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"loss of step {i} (resumed after step {n})")
    for (name, a), b in zip(resumed.state_dict().items(), full.state_dict().values()):
        assert_bitwise(a, b, f"{name} after the resumed run")


def test_loading_a_history_of_another_length_raises_naming_the_key_and_changes_nothing():
    layer = _model()[0]
    sd = layer.state_dict()
    sd["delayed_scaling.input.amax_history"] = torch.zeros(16)
    before = layer.input_quantizer.amax_history.clone()
    with pytest.raises(RuntimeError, match=r"delayed_scaling\.input\.amax_history: expected a tensor of shape "
                                           r"\(1024,\).*got \(16,\)"):
        layer.load_state_dict(sd)
    assert_bitwise(layer.input_quantizer.amax_history, before, "history after a refused load")


@pytest.mark.parametrize("bad", [-1.5, -0.0])
def test_loading_a_history_with_a_negative_entry_raises_naming_the_key_and_changes_nothing(bad):
    """Histories hold amaxes; the cast kernels max-combine into them by bit pattern, where a set sign bit (-0.0
    too) would win over every amax."""
    layer = _model()[0]
    sd = layer.state_dict()
    sd["delayed_scaling.weight.amax_history"][5] = bad
    before = layer.weight_quantizer.amax_history.clone()
    with pytest.raises(RuntimeError, match=rf"delayed_scaling\.weight\.amax_history: an amax history holds amaxes "
                                           rf"\(sign bit clear.*got {bad!r} at index 5"):
        layer.load_state_dict(sd)
    assert_bitwise(layer.weight_quantizer.amax_history, before, "history after a refused load")


def test_a_plain_linear_state_dict_loads_and_keeps_the_layers_delayed_state():
    """Weights only (nn.Linear's keys): loads strictly; the layer's own delayed-scaling state stays."""
    layer = _model()[0]
    layer(torch.randn(8, D)).sum().backward()
    before = layer.input_quantizer.amax_history.clone()
    layer.load_state_dict(nn.Linear(D, HIDDEN).state_dict())
    assert_bitwise(layer.input_quantizer.amax_history, before, "input amax history after loading weights only")


def test_a_state_dict_with_part_of_the_delayed_state_reports_the_rest_missing():
    layer = _model()[0]
    sd = layer.state_dict()
    del sd["delayed_scaling.grad_output.scale"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*delayed_scaling\.grad_output\.scale"):
        layer.load_state_dict(sd)
