"""Jobs of test_fsdp_data_writes.py (spawned by _harness.spawn, or run in-process on one rank): writes through `.data`
(no version counter moves) between the call that derives data from a weight and the call that reuses it, against the
same write made through the parameter under `torch.no_grad()` (its version counters move: every cache is derived
anew), for each of hybridq's FSDP2 caches of weight-derived data ([Note: data-write check], hybridq/data_writes.py)."""

from __future__ import annotations

import pathlib
import sys

import torch

from hybridq.distributed import apply_hybrid_fsdp, precompute_scales
from hybridq.errors import StaleWeightError

import _grouped_jobs as grouped_jobs
import _precomputed_payload_jobs as payload_jobs
import _unit_cast_jobs as tensor_jobs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import assert_training_runs_bitwise  # noqa: E402


def _write(p: torch.Tensor, how: str, scale: float) -> None:
    if how == "data":  # no version counter moves
        p.data.mul_(scale)
    elif how == "param":  # the parameter itself under no_grad: its version counter moves
        with torch.no_grad():
            p.mul_(scale)
    else:
        raise ValueError(how)


def kept_payload(rank, world_size, device, how: str, when: str = "between_forward_and_backward",
                 reshard_after_forward: bool = True) -> dict:
    """`_grouped_jobs._KeptPayloadModel` (a Linear and a GroupedLinear, per-tensor FP8, each its own FSDP2 unit
    resharding after forward: the backward unshard re-sends the forward's kept payload), one forward + backward
    with both weights written `how` (`data` / `param`) by x2 `when`: between the forward and the backward (the kept
    payload), or after a first step's precompute_scales and before the forward (the reduced statistics of a grouped
    weight and a Linear's). Then an optimizer step and precompute_scales. Returns the input gradient, the weights'
    gradients (bytes) and the StaleWeightError message of that precompute_scales (None: none).
    `reshard_after_forward=False`: the units stay gathered from forward to backward (FSDP2's own unsharded weight, no
    payload sent again)."""
    fully_shard, mp = grouped_jobs._fsdp(device, world_size, 0)
    torch.manual_seed(0)
    experts = 4
    model = grouped_jobs._KeptPayloadModel(experts).to(device)
    with torch.no_grad():
        model.experts.weight.mul_(torch.logspace(-2, 2, experts, device=device).view(experts, 1, 1))
    apply_hybrid_fsdp(model, "fp8_tensorwise")
    fully_shard(model.lin, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model.experts, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    splits = [3 * e + 5 for e in range(experts)]
    g = torch.Generator().manual_seed(1 + rank)
    weights = (model.lin.weight, model.experts.weight)
    if when == "after_precompute":
        model(torch.randn(sum(splits), 32, generator=g).to(device), splits).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        precompute_scales(model)
        for p in weights:
            _write(p, how, 2.0)
    x = torch.randn(sum(splits), 32, generator=g).to(device).requires_grad_(True)
    y = model(x, splits)
    if when == "between_forward_and_backward":
        for p in weights:
            _write(p, how, 2.0)
    y.float().square().sum().backward()
    out = {"dx": x.grad.detach().cpu(), "grads": [p.grad.full_tensor().detach().cpu() for p in weights],
           "error": None}
    opt.step()
    try:
        precompute_scales(model)
    except StaleWeightError as e:
        out["error"] = str(e)
    return out


def between_steps(rank, world_size, device, model: str) -> None:
    """A write through `.data` between optimizer steps (after the step, with no precompute_scales: the next forward
    reduces and quantizes from the values it reads) trains bitwise like the same write through the parameter: the
    lanes, the unit cast, the fill replay and the gathered views re-read the values (no cache of them to go stale)."""
    import unittest.mock as um

    with um.patch.object(payload_jobs, "precompute_scales", lambda m, **kw: None):
        want = payload_jobs.train(model, device, world_size, 3, payloads=False, between="edit")
        got = payload_jobs.train(model, device, world_size, 3, payloads=False, between="edit_data")
    assert_training_runs_bitwise(got, want, f"rank {rank} of {world_size}, {model}",
                                 "with writes through .data between the steps")


def no_false_positive(rank, world_size, device, model: str, between: str | None, payloads: bool = True,
                      steps: int = 3, ckpt: str | None = None) -> dict:
    """Training with precompute_scales after every step and `between` after it (changes whose version counters
    move, or none): the StaleWeightErrors raised (none expected)."""
    if model == "nonfinite":  # (one weight with an inf, another with a NaN)
        build, width, edited = (lambda d, ws: tensor_jobs.build(d, ws, nonfinite=True)), tensor_jobs.D, "0.v"
    else:
        build, width, edited = payload_jobs.MODELS[model]
    m = build(device, world_size)

    def after(step, opt):
        if between == "dcp_load":  # the first step's checkpoint loaded back by DCP after each later step
            _dcp_round(m, ckpt, step)
        else:
            payload_jobs._between(m, opt, between, edited, width)

    return {"raised": [msg for _, msg in payload_jobs.train_with_precompute(m, device, width, steps, payloads, after)]}


def _dcp_round(m, ckpt: str, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    if step == 0:
        dcp.save(m.state_dict(), checkpoint_id=ckpt)
        return
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)  # (in place into the parameters' local shards)
    m.load_state_dict(sd)


def kept_payload_pair(rank, world_size, device, when: str, check: bool = True) -> dict:
    """`kept_payload` with the write through `.data` and under no_grad (the data-write check on or off): whether the
    gradients are bitwise equal, and each run's StaleWeightError message (JSON)."""
    from hybridq.data_writes import CHECK

    with CHECK.turned(check):
        got = kept_payload(rank, world_size, device, "data", when)
        want = kept_payload(rank, world_size, device, "param", when)
    same = torch.equal(got["dx"], want["dx"]) and all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"]))
    return {"same": same, "data": got["error"], "param": want["error"]}


def stale_on_cuda(rank, world_size, device, steps: int = 4) -> dict:
    """CUDA: `_precomputed_payload_jobs.stale_at_precompute`'s run (a write through `.data` after every
    precompute_scales), the first StaleWeightError raised anywhere in a step (None: none)."""
    build, width, edited = payload_jobs.MODELS["fp8_tensorwise"]
    m = build(device, world_size)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        try:
            m(torch.randn(16, width, generator=g).to(device)).float().square().mean().backward()
            opt.step()
            precompute_scales(m, payloads=True)
        except StaleWeightError as e:
            return {"raised": str(e)}
        payload_jobs._between(m, opt, "edit_data", edited, width)
        opt.zero_grad()
    return {"raised": None}


def _fp8_model(device, world_size):
    """The precomputed-payload jobs' fp8_tensorwise model with AdamW: (model, optimizer, input width, the name of the
    weight the jobs edit, `step()`: one forward + backward + optimizer step on a fresh batch, and `batch()`: that
    batch)."""
    build, width, edited = payload_jobs.MODELS["fp8_tensorwise"]
    m = build(device, world_size)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)

    def batch():
        return torch.randn(16, width, generator=g).to(device)

    def step():
        m(batch()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    return m, opt, edited, step, batch


def queued_checks_per_step(rank, world_size, device) -> dict:
    """Precomputed payloads at world > 1 (checks queued, not decided at once), units resharding after forward: after a
    step's forward and backward, the number of data-write checks each weight queued (the forward's use of its
    precomputed payload leaves its check to the backward's kept-payload check: one per weight and step), and whether
    a write through `.data` after the precompute is still reported by the next precompute_scales."""
    m, opt, edited, step, batch = _fp8_model(device, world_size)

    step()
    precompute_scales(m, payloads=True)
    m(batch()).float().square().mean().backward()
    from hybridq.torch_private import local_tensor

    counts = {n: local_tensor(p)._hq.data_checks.count for n, p in m.named_parameters()
              if hasattr(local_tensor(p), "_hq") and local_tensor(p)._hq.counters["payload_precomputed"]}
    opt.step()
    opt.zero_grad()
    precompute_scales(m, payloads=True)  # (reports the queued checks: none stale)
    p = dict(m.named_parameters())[f"{edited}.weight"]
    p.data.mul_(2)
    step()
    try:
        precompute_scales(m, payloads=True)
        raised = None
    except StaleWeightError as e:
        raised = str(e)
    return {"counts": counts, "raised": raised, "edited": f"{edited}.weight"}


def nan_beside_a_flag(rank, world_size, device) -> dict:
    """World 2: the weight `edited` written through `.data` on rank 0 only after a precompute_scales, a step, then a
    NaN put into another weight's local shard on rank 1 only: the next precompute_scales all-reduces rank 1's NaN
    statistic and rank 0's stale flag in one vector. Returns its StaleWeightError message and whether the NaN
    weight's reduced statistics are non-finite on this rank."""
    from hybridq.torch_private import local_tensor

    m, _, edited, step, _ = _fp8_model(device, world_size)

    step()
    precompute_scales(m, payloads=True)
    if rank == 0:
        m.get_submodule(edited).weight.to_local().data.mul_(2)
    step()
    nan_weight = m.get_submodule("1.q").weight
    if rank == 1:
        with torch.no_grad():
            nan_weight.to_local()[0, 0] = float("nan")
    try:
        precompute_scales(m, payloads=True)
        raised = None
    except StaleWeightError as e:
        raised = str(e)
    stats = local_tensor(nan_weight)._hq.stats
    return {"raised": raised, "edited": f"{edited}.weight",
            "nan_kept": stats is not None and not bool(torch.isfinite(stats).all())}
