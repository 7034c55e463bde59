"""GroupedLinear's delayed-scaling state (per expert amax history, scale, pending update) is part of the state_dict
as plain tensors, for a standalone GroupedLinear and for an expert module converted by `convert_experts` (whose
GroupedLinears are not submodules: the expert module carries their state). A run resumed from a saved state_dict,
loaded with `torch.load(weights_only=True)`, is bit for bit the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq
from hybridq.nn.delayed_state import delayed_quantizers

from _compare import assert_bitwise

E, DIM, HIDDEN = 3, 64, 32
SPLITS = [40, 0, 24]  # a zero-token expert: its state stays as it was, and still round-trips
FIELDS = ("amax_history", "scale", "update_pending")


class SwiGLUExperts(nn.Module):
    """A user's expert module (the hybridq expert protocol)."""

    hybridq_grouped_weights = ("w1", "w3", "w2")

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, HIDDEN, DIM) / DIM ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, HIDDEN, DIM) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, DIM, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x, m_splits):
        h = F.silu(hq.grouped_mm(self, "w1", x, m_splits)) * hq.grouped_mm(self, "w3", x, m_splits)
        return hq.grouped_mm(self, "w2", h, m_splits)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = SwiGLUExperts()

    def forward(self, x, m_splits):
        return x + self.experts(self.norm(x), m_splits)


class Grouped(nn.Module):
    """A standalone GroupedLinear as a submodule."""

    def __init__(self, recipe):
        super().__init__()
        self.moe = hq.GroupedLinear(E, DIM, DIM, bias=True, recipe=recipe, name="moe")

    def forward(self, x, m_splits):
        return self.moe(x, m_splits)


def _model(kind: str, preset: str = "fp8_delayed") -> nn.Module:
    torch.manual_seed(0)
    if kind == "grouped_linear":
        return Grouped(hq.recipe(preset))
    m = MoEBlock()
    hq.convert_experts(m, hq.recipe(preset))
    return m


def _train(model, opt, steps, first_step=0):
    losses = []
    for step in range(first_step, first_step + steps):
        x = torch.randn(sum(SPLITS), DIM, generator=torch.Generator().manual_seed(step))
        loss = model(x, SPLITS).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


KINDS = ["grouped_linear", "expert_module"]
STEMS = {"grouped_linear": "moe.delayed_scaling.experts.{e}.{t}",
         "expert_module": "experts.delayed_scaling.w2.experts.{e}.{t}"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_experts_delayed_state_is_in_the_models_state_dict_as_tensors(kind):
    sd = _model(kind).state_dict()
    for e in range(E):
        for t in ("input", "weight", "grad_output"):
            for f in FIELDS:
                key = f"{STEMS[kind].format(e=e, t=t)}.{f}"
                assert isinstance(sd.get(key), torch.Tensor), f"{key} missing; delayed keys: " + \
                    ", ".join(k for k in sd if "delayed" in k)[:400]


@pytest.mark.parametrize("kind", KINDS)
def test_without_delayed_scaling_the_state_dict_keys_are_the_unconverted_models(kind):
    converted = _model(kind, "mxfp8").state_dict()
    plain = {"grouped_linear": lambda: {"moe.weight": 0, "moe.bias": 0}, "expert_module": lambda: MoEBlock().state_dict()}
    assert sorted(converted) == sorted(plain[kind]()), sorted(converted)


@pytest.mark.parametrize("kind", KINDS)
def test_resumed_run_is_bitwise_the_uninterrupted_one(kind, tmp_path):
    """N steps, torch.save, load with weights_only=True into a fresh model and optimizer, M more steps: losses,
    parameters and every expert's delayed-scaling state equal those of N + M uninterrupted steps."""
    n, m = 3, 2
    full = _model(kind)
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    want = _train(full, full_opt, n + m)

    part = _model(kind)
    part_opt = torch.optim.AdamW(part.parameters(), lr=1e-2)
    got = _train(part, part_opt, n)
    torch.save({"model": part.state_dict(), "optim": part_opt.state_dict()}, tmp_path / "ck.pt")

    resumed = _model(kind)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    st = torch.load(tmp_path / "ck.pt", weights_only=True)
    resumed.load_state_dict(st["model"])
    resumed_opt.load_state_dict(st["optim"])
    got += _train(resumed, resumed_opt, m, first_step=n)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"{kind}: loss of step {i} (resumed after step {n})")
    want_sd = full.state_dict()
    assert list(resumed.state_dict()) == list(want_sd)
    for name, a in resumed.state_dict().items():
        assert_bitwise(a, want_sd[name], f"{kind}: {name} after the resumed run")


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_restores_every_experts_state(kind):
    trained = _model(kind)
    _train(trained, torch.optim.SGD(trained.parameters(), lr=1e-2), 2)
    sd = trained.state_dict()
    fresh = _model(kind)
    fresh.load_state_dict(sd)
    got = fresh.state_dict()
    for name, want in sd.items():
        assert_bitwise(got[name], want, f"{kind}: {name} after load_state_dict")
    layer = fresh.moe if kind == "grouped_linear" else fresh.experts
    assert any(q.update_pending for q in delayed_quantizers(layer).values()), \
        "saved between steps: the last step's amax update is pending, and the load restores that"


def test_a_delayed_state_of_another_expert_count_is_refused_naming_the_key():
    layer = _model("expert_module")
    sd = layer.state_dict()
    sd["experts.delayed_scaling.w1.experts.3.input.scale"] = torch.ones(1)  # there are 3 experts: 0..2
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*delayed_scaling\.w1\.experts\.3\.input\.scale"):
        layer.load_state_dict(sd)
