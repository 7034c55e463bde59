"""ZeroAdamW is a torch optimizer with torch.optim.AdamW's semantics: 2 gloo ranks against torch's AdamW on the
same fp32 model, bitwise (checks in _zero_jobs.py, all run in one spawn)."""

from __future__ import annotations

import pytest

import _zero_jobs
from _harness import spawn

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_zero_jobs.job_checks, 2, "gloo", folder=str(tmp_path_factory.mktemp("zero")))


def _check(results, name: str) -> None:
    fails = [f"rank {r}: {m}" for r, out in enumerate(results) for m in out[name][:8]]
    assert not fails, "\n".join(fails)


def test_a_parameter_without_grad_is_skipped(results):
    """No weight decay, no moments and no rewrite for a parameter whose .grad is None (every step bitwise torch
    AdamW's; its step count stays 0)."""
    _check(results, "grad_none")


def test_a_step_without_backward_changes_nothing(results):
    _check(results, "no_backward")


def test_a_parameter_frozen_at_construction_is_trained_once_unfrozen(results):
    _check(results, "unfrozen")


def test_lr_schedulers_drive_the_step(results):
    """LambdaLR, then CosineAnnealingLR chained on top: the lr torch's schedulers set is the one the step uses."""
    _check(results, "schedulers")


def test_load_state_dict_refuses_before_changing_anything(results):
    """Another model's state, a 1-element master on one rank, a short moment, a negative step count, another
    world size: ValueError on every rank, nothing changed."""
    _check(results, "load_refusals")


def test_state_dict_round_trips_in_memory_and_through_dcp(results):
    _check(results, "round_trips")


def test_params_limits_what_it_optimizes():
    """`params=` (the torch idiom `[p for p in model.parameters() if p.requires_grad]`) keeps no master for the
    others, which a step then leaves alone; a tensor that is not a parameter of the model is refused."""
    import torch

    import hybridq

    model = _zero_jobs.Net()
    model.late.requires_grad_(False)
    opt = hybridq.distributed.ZeroAdamW(model, params=[p for p in model.parameters() if p.requires_grad])
    assert "late.weight" not in opt.names and "fc1.weight" in opt.names
    late = model.late.weight.detach().clone()
    model.late.requires_grad_(True)
    model(_zero_jobs._batch(0)).sum().backward()
    opt.step()
    assert torch.equal(model.late.weight, late), "a parameter left out of params= was stepped"
    with pytest.raises(ValueError, match="not parameters of the model"):
        hybridq.distributed.ZeroAdamW(model, params=[torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(NotImplementedError, match="one param group"):
        opt.add_param_group({"params": [model.late.weight]})
