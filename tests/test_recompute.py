"""Activation recompute with hybridq layers: `torch.utils.checkpoint` (non-reentrant and reentrant) and
selective activation checkpointing give the gradients of the run without recompute, bit for bit, for every preset.

- Stochastic rounding replays: torch restores its default generators before recomputing, and
  `hybridq.checkpoint_contexts(module)` restores the generators quantizers were given (`generator=`).
- Delayed scaling: a recomputed cast uses the scale of the forward cast it replays and records no amax, so the
  amax history and scale after each step are those of the run without recompute; a replay whose scale is gone
  raises, naming the tensor.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hybridq as hq
from hybridq.formats import Float8Quantizer

from _compare import assert_bitwise

PRESETS = hq.preset_names()
D, HIDDEN, TOKENS = 64, 96, (2, 32)
aten = torch.ops.aten


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _model(recipe):
    torch.manual_seed(0)
    m = nn.Sequential(_Block(), _Block(), _Block()).to(torch.bfloat16)
    report = hq.convert_linears(m, recipe, on_incompatible="error")
    assert len(report.converted) == 6
    return m


def _sac_policy(ctx, op, *args, **kwargs):
    """torchtitan-style op-level policy: keep the matrix products, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in (aten.mm.default, aten.addmm.default, aten._scaled_mm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


def _run_block(block, h, how):
    if how == "none":
        return block(h)
    if how == "reentrant":
        return checkpoint(block, h, use_reentrant=True)
    if how == "non_reentrant":
        return checkpoint(block, h, use_reentrant=False, context_fn=lambda: hq.checkpoint_contexts(block))
    if how == "selective":
        return checkpoint(block, h, use_reentrant=False,
                          context_fn=lambda: hq.checkpoint_contexts(block, _sac_policy))
    if how == "selective_torch":  # torch's own contexts, no hybridq helper
        return checkpoint(block, h, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy))
    raise ValueError(how)


def _steps(model, how, n_steps=2):
    """Losses and gradients of `n_steps` steps (fresh inputs per step, no optimizer: delayed scaling state carries
    over between steps)."""
    out = []
    torch.manual_seed(7)  # stochastic rounding on the default generator: the same stream in every run
    for step in range(n_steps):
        model.zero_grad(set_to_none=True)
        x = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        x.requires_grad_()
        h = x
        for block in model:
            h = _run_block(block, h, how)
        loss = h.float().square().mean()
        loss.backward()
        out.append([loss.detach(), x.grad] + [p.grad.clone() for p in model.parameters()])
    return out


def _assert_same_steps(got, want, what):
    for step, (g, w) in enumerate(zip(got, want)):
        names = ["loss", "grad_input"] + [f"grad of parameter {i}" for i in range(len(w) - 2)]
        for n, a, b in zip(names, g, w):
            assert_bitwise(a, b, f"{what}, step {step}: {n}")


HOW = ["non_reentrant", "reentrant", "selective", "selective_torch"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("preset", PRESETS)
def test_recompute_gives_the_gradients_of_the_run_without_it(preset, how):
    want = _steps(_model(hq.recipe(preset)), "none")
    got = _steps(_model(hq.recipe(preset)), how)
    _assert_same_steps(got, want, f"{preset} with {how} recompute")


def _sr_forward_recipe(generator_seed=None):
    """Stochastic rounding in forward (the input's NVFP4 cast), where recompute must replay it."""
    gen = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None

    def qf(role):
        if role.tensor_type == "input":
            return hq.NVFP4Quantizer(stochastic_rounding=True, generator=gen)
        return hq.NVFP4Quantizer(rht=role.tensor_type != "weight", stochastic_rounding=role.tensor_type != "weight")
    return hq.CustomRecipe(qf, name="sr_forward")


@pytest.mark.parametrize("how", ["non_reentrant", "selective", "selective_torch"])
def test_recompute_replays_stochastic_rounding_of_the_default_generator(how):
    want = _steps(_model(_sr_forward_recipe()), "none")
    got = _steps(_model(_sr_forward_recipe()), how)
    _assert_same_steps(got, want, f"forward stochastic rounding (default generator) with {how} recompute")


@pytest.mark.parametrize("how", ["non_reentrant", "selective"])
def test_checkpoint_contexts_replay_a_quantizers_own_generator(how):
    want = _steps(_model(_sr_forward_recipe(generator_seed=11)), "none")
    got = _steps(_model(_sr_forward_recipe(generator_seed=11)), how)
    _assert_same_steps(got, want, f"forward stochastic rounding (own generator) with {how} + checkpoint_contexts")


def test_quantizer_generators_lists_each_own_generator_once():
    m = _model(_sr_forward_recipe(generator_seed=11))
    gens = hq.recompute.quantizer_generators(m)
    assert len(gens) == 1 and isinstance(gens[0], torch.Generator)
    assert hq.recompute.quantizer_generators(_model(_sr_forward_recipe())) == []


def _delayed_states(model):
    return [(n, t, q.amax_history.clone(), q.scale.clone()) for n, mod in model.named_modules()
            if isinstance(mod, hq.Linear) for t, q in mod.quantizers().items()]


@pytest.mark.parametrize("how", HOW)
def test_delayed_scaling_state_after_recompute_is_that_of_the_run_without_it(how):
    """A recomputed cast records no amax: history and scale after 3 steps equal the run without recompute."""
    plain, rec = _model(hq.recipe("fp8_delayed")), _model(hq.recipe("fp8_delayed"))
    _steps(plain, "none", n_steps=3)
    _steps(rec, how, n_steps=3)
    for (n, t, h, s), (_, _, h0, s0) in zip(_delayed_states(rec), _delayed_states(plain)):
        assert_bitwise(h, h0, f"{n} {t} amax history after {how} recompute")
        assert_bitwise(s, s0, f"{n} {t} scale after {how} recompute")


def test_delayed_scaling_replay_of_a_layer_called_twice_raises_naming_the_tensor():
    layer = hq.Linear(D, D, recipe=hq.recipe("fp8_delayed"), name="shared").to(torch.bfloat16)
    x = torch.randn(32, D, dtype=torch.bfloat16, requires_grad=True)
    y = checkpoint(lambda t: layer(layer(t)), x, use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"input of shared.*cast 2 tensors in that forward"):
        y.float().sum().backward()


def _devices():
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


@pytest.mark.parametrize("device", _devices())
def test_delayed_scaling_replay_uses_the_forward_scale_even_after_an_update(device):
    """An update between forward and backward (update_delayed_scaling) changes the live scale (on CUDA in place);
    the recomputed cast still uses the one its forward used, so the gradients are those of the run without
    recompute."""
    def grads(recompute):
        torch.manual_seed(0)
        layer = hq.Linear(D, D, recipe=hq.recipe("fp8_delayed"), name="fc").to(device, torch.bfloat16)
        out = []
        for step in range(3):  # from step 1 on, the update changes the scale
            x = torch.randn(32, D, generator=torch.Generator().manual_seed(step)).to(device, torch.bfloat16)
            x.requires_grad_()
            y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
            hq.update_delayed_scaling(layer.quantizers().values())
            y.float().square().sum().backward()
            out.append([x.grad, layer.weight.grad.clone()])
            layer.zero_grad()
        return out

    for step, (g, w) in enumerate(zip(grads(True), grads(False))):
        assert_bitwise(g[0], w[0], f"step {step}: grad_input with recompute after an update")
        assert_bitwise(g[1], w[1], f"step {step}: grad_weight with recompute after an update")


def test_delayed_scaling_replay_is_only_for_quantizers_that_cast_in_forward():
    """grad_output's quantizer casts only in backward: its casts there are ordinary (update + record)."""
    layer = hq.Linear(D, D, recipe=hq.recipe("fp8_delayed"), name="fc").to(torch.bfloat16)
    gq: Float8Quantizer = layer.grad_output_quantizer
    for step in range(2):
        x = torch.randn(32, D, dtype=torch.bfloat16, requires_grad=True)
        checkpoint(layer, x, use_reentrant=False).float().sum().backward()
        assert gq.update_pending and not gq.replaying(), f"step {step}: grad_output cast was not recorded"
    assert float(gq.amax_history[-1]) > 0, "the second step's cast rolled the first amax into the history"
