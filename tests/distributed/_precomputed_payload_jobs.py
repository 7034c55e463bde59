"""Jobs of test_fsdp_precomputed_payloads.py (spawned by _harness.spawn, or run in-process on one rank): the models of
the unit cast's tests (_unit_cast_jobs: per-tensor FP8, one MXFP8 weight per unit; _unit_cast_block_jobs: 128x128
tiles beside per-tensor FP8 weights, a tile split by a shard boundary at two ranks) trained with
`precompute_scales(model, payloads=True)` after every optimizer step, against the per-weight path (no precomputed
payloads, the unit cast off); every gathered rowwise part, loss, gradient and the final parameters recorded for a
bitwise comparison. `between`: what happens after the precompute and before the next forward (an in-place edit of one
weight, a second optimizer step)."""

from __future__ import annotations

import pathlib
import sys

import torch
from torch.distributed.fsdp import FSDPModule
import torch.nn as nn

from hybridq.distributed import precompute_scales, precomputed_payloads, unit_cast

import _unit_cast_block_jobs as block_jobs
import _unit_cast_jobs as tensor_jobs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import assert_training_runs_bitwise  # noqa: E402

COUNTERS = ("payload_precomputed", "payloads_precomputed", "unit_batches", "payload_unit", "payload_reused",
            "stats_allreduce")


def _unsharded_between(device, world_size: int) -> nn.Module:
    """_unit_cast_jobs' model with `reshard_after_forward=False`: no backward unshard re-sends a forward payload."""
    torch.manual_seed(0)
    m = nn.Sequential(tensor_jobs.Block(), tensor_jobs.Block()).to(device)
    return tensor_jobs.shard_blocks(m, tensor_jobs.recipe(False), device, world_size, reshard_after_forward=False)


# model -> (build(device, world_size), input width, the weight edited in place by `between="edit"`)
MODELS = {
    "fp8_tensorwise": (lambda d, ws: tensor_jobs.build(d, ws), tensor_jobs.D, "0.v"),
    "fp8_tensorwise_no_reshard": (_unsharded_between, tensor_jobs.D, "1.q"),
    "fp8_tensorwise_mxfp8_o": (lambda d, ws: tensor_jobs.build(d, ws, mixed=True), tensor_jobs.D, "0.v"),
    "fp8_block_and_tensorwise": (lambda d, ws: block_jobs.build(d, ws, mixed=True), block_jobs.D, "1.up"),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).clone().contiguous().view(torch.uint8).cpu()


def _between(m: nn.Module, opt, how: str | None, edited: str, width: int) -> None:
    if how == "edit":  # a user's in-place edit of one weight (its DTensor parameter: version counters move)
        with torch.no_grad():
            m.get_submodule(edited).weight.mul_(-2.0)
    elif how == "extra_step":  # a second optimizer step on the same gradients: every master changes
        opt.step()
    elif how == "eval":  # an evaluation forward (no backward) between the precompute and the next training step
        with torch.no_grad():
            m(torch.randn(16, width, generator=torch.Generator().manual_seed(7)).to(next(m.parameters()).device))
    elif how == "edit_data":  # through `.data` (a tensor with its own version counter)
        m.get_submodule(edited).weight.data.mul_(-2.0)
    elif how == "load_state_dict":  # the module's load: every parameter copied in place
        sd = {k: v * 0.5 if k == f"{edited}.weight" else v for k, v in m.state_dict().items()}
        m.load_state_dict(sd)
    elif how == "local_copy":  # the DTensor's local shard written directly
        with torch.no_grad():
            m.get_submodule(edited).weight.to_local().mul_(-2.0)
    elif how is not None:
        raise ValueError(how)


def train(model: str, device, world_size: int, steps: int, payloads: bool, per_unit: bool = True,
          between: str | None = None) -> dict:
    """`steps` AdamW steps, `precompute_scales(m, payloads=payloads)` after each, then `between`: every forward's
    gathered rowwise parts, the losses, the gradients and the final parameters (bytes), the counters, and what each
    precompute prepared."""
    build, width, edited = MODELS[model]
    m = build(device, world_size)
    gathered: list = []
    handles = tensor_jobs.record_gathered(m, gathered)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, grads, prepared = [], [], []
    for _ in range(steps):
        loss = m(torch.randn(16, width, generator=g).to(device)).float().square().mean()
        loss.backward()
        losses.append(_bits(loss))
        grads.append([_bits(p.grad.full_tensor()) for p in m.parameters()])
        opt.step()
        pre = precompute_scales(m, payloads=payloads, per_unit=per_unit)
        prepared.append(getattr(pre, "payloads", None))  # (a PrecomputedScalesAndPayloads where asked)
        _between(m, opt, between, edited, width)
        opt.zero_grad()
    for h in handles:
        h.remove()
    for unit in m.modules():  # (an evaluation forward last leaves reshard_after_forward=False units gathered)
        if isinstance(unit, FSDPModule):
            unit.reshard()
    params = [_bits(p.full_tensor()) for p in m.parameters()]
    return {"gathered": gathered, "losses": losses, "grads": grads, "params": params, "prepared": prepared,
            "counters": {k: tensor_jobs.counters(m, k) for k in COUNTERS}}


def compare(got: dict, want: dict, where: str) -> None:
    assert_training_runs_bitwise(got, want, where, "with the precomputed payloads")


def parity(rank, world_size, device, model: str, steps: int = 3, per_unit: bool = True,
           between: str | None = None) -> dict:
    """Training with precomputed payloads is bitwise the per-weight path (no precomputed payloads, the unit cast
    off), with the same `between`; returns the counters and what each precompute prepared (JSON)."""
    was = unit_cast.set_unit_cast(False)
    try:
        want = train(model, device, world_size, steps, payloads=False, between=between)
    finally:
        unit_cast.set_unit_cast(was)
    got = train(model, device, world_size, steps, payloads=True, per_unit=per_unit, between=between)
    compare(got, want, f"rank {rank} of {world_size}, {model}, per_unit={per_unit}, between={between}")
    assert all(p is None for p in want["prepared"]), f"payloads=False prepared payloads: {want['prepared']}"
    return {"counters": got["counters"], "reference": want["counters"],
            "prepared": [dict(weights=p.weights, batches=p.batches, bytes=p.bytes) for p in got["prepared"]]}


def switched_off(rank, world_size, device, model: str, steps: int = 2) -> dict:
    """`HYBRIDQ_PRECOMPUTED_PAYLOADS` off: `payloads=True` prepares nothing; training bitwise the per-weight path."""
    was = precomputed_payloads.set_precomputed_payloads(False)
    try:
        return parity(rank, world_size, device, model, steps)
    finally:
        precomputed_payloads.set_precomputed_payloads(was)



def scales_against_none(rank, world_size, device, between: str) -> None:
    """`precompute_scales` (scales only) after every step against no precompute at all (each forward hook reduces
    its weight's statistics itself), with the same `between`: bitwise."""
    import unittest.mock as um
    was = unit_cast.set_unit_cast(False)
    try:
        with um.patch.object(sys.modules[__name__], "precompute_scales", lambda m, **kw: None):
            want = train("fp8_tensorwise", device, world_size, 3, payloads=False, between=between)
    finally:
        unit_cast.set_unit_cast(was)
    got = train("fp8_tensorwise", device, world_size, 3, payloads=False, between=between)
    assert_training_runs_bitwise(got, want, f"rank {rank} of {world_size}, between={between}",
                                 "with precompute_scales")


def stale_at_precompute(rank, world_size, device, payloads: bool, between: str = "edit_data", steps: int = 3) -> dict:
    """Training as `train` does, `between` after every precompute_scales: the step whose precompute_scales raised
    StaleWeightError (None: none did) and its message; after the error the run goes on (the statistics and payloads
    that call made are the current values')."""
    build, width, edited = MODELS["fp8_tensorwise"]
    m = build(device, world_size)
    raised = train_with_precompute(m, device, width, steps, payloads, lambda step, opt: _between(m, opt, between, edited, width))
    return {"raised": raised, "edited": f"{edited}.weight"}


def train_with_precompute(m: nn.Module, device, width: int, steps: int, payloads: bool, after) -> list[tuple[int, str]]:
    """`steps` training steps of `m` (AdamW), each followed by precompute_scales and then `after(step, optimizer)`:
    the (step, message) of every StaleWeightError that precompute_scales raised (the run goes on after one)."""
    from hybridq.errors import StaleWeightError

    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    raised = []
    for step in range(steps):
        m(torch.randn(16, width, generator=g).to(device)).float().square().mean().backward()
        opt.step()
        try:
            precompute_scales(m, payloads=payloads)
        except StaleWeightError as e:
            raised.append((step, str(e)))
        after(step, opt)
        opt.zero_grad()
    return raised

