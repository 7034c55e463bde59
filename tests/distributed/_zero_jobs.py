"""Jobs for test_zero_adamw.py: ZeroAdamW against torch.optim.AdamW (its oracle: the same fp32 model, one process)
on spawned gloo ranks. Every rank trains on the same batch, so the mean of the ranks' gradients is each rank's
gradient exactly and the masters must equal torch's parameters bit for bit. Each job returns failure messages."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hybridq

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


class Net(nn.Module):
    """`unused` never takes part in the forward (its .grad stays None); `late` is frozen at first."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.late = nn.Linear(24, 24)
        self.fc2 = nn.Linear(24, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.late(torch.relu(self.fc1(x)))))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + step))


def _pair(seed: int = 0, frozen: bool = False):
    """(ZeroAdamW's model and optimizer, torch's model and AdamW), both from the same initial weights; with
    `frozen`, `late` does not require grad when the optimizers are built."""
    torch.manual_seed(seed)
    model = Net()
    ref = copy.deepcopy(model)
    model.late.requires_grad_(not frozen)
    ref.late.requires_grad_(not frozen)
    opt = hybridq.distributed.ZeroAdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    return model, opt, ref, ref_opt


def _train(model, opt, step, backward=True):
    if backward:
        model(_batch(step)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _compare(model, opt, ref, what: str) -> list[str]:
    fails = []
    masters = opt.full_masters()
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if not torch.equal(p, r):
            fails.append(f"{what}: {n} differs from torch AdamW's (max {(p - r).abs().max().item():.3e})")
        if not torch.equal(masters[n], r):
            fails.append(f"{what}: master of {n} differs from torch AdamW's parameter")
    return fails


def _snapshot(model, opt) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": opt.full_masters(), "state": opt.consolidated_state_dict(),
            "hyper": {k: v for k, v in opt.param_groups[0].items() if k != "params"}}


def _same(a: dict, b: dict, what: str) -> list[str]:
    fails = [f"{what}: parameter {n} changed" for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    fails += [f"{what}: master {n} changed" for n in a["masters"] if not torch.equal(a["masters"][n], b["masters"][n])]
    for key in ("exp_avg", "exp_avg_sq"):
        fails += [f"{what}: {key} of {n} changed" for n in a["state"][key]
                  if not torch.equal(a["state"][key][n], b["state"][key][n])]
    if a["state"].get("steps") != b["state"].get("steps"):
        fails.append(f"{what}: step counts {a['state'].get('steps')} -> {b['state'].get('steps')}")
    if a["hyper"] != b["hyper"]:
        fails.append(f"{what}: hyperparameters {a['hyper']} -> {b['hyper']}")
    return fails


def _run_against_torch(steps: int, frozen_until: int | None = None, schedules: bool = False) -> list[str]:
    """`steps` training steps of ZeroAdamW and of torch's AdamW, compared bitwise after each: `late` frozen at
    construction and unfrozen before step `frozen_until` (None: trainable throughout), `unused` never has a
    gradient; with `schedules`, LambdaLR from the start and CosineAnnealingLR chained on top from step 2."""
    fails = []
    model, opt, ref, ref_opt = _pair(frozen=frozen_until is not None)
    make = [lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s)] if schedules else []
    schedulers = [(f(opt), f(ref_opt)) for f in make]
    unused_before = {n: p.detach().clone() for n, p in model.unused.named_parameters()}
    late_before = {n: p.detach().clone() for n, p in model.late.named_parameters()}
    for step in range(steps):
        if step == frozen_until:  # torch's AdamW trains what it was given, from its first gradient on
            model.late.requires_grad_(True)
            ref.late.requires_grad_(True)
        if schedules and step == 2:
            schedulers.append((torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
                               torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=4)))
        _train(model, opt, step)
        _train(ref, ref_opt, step)
        for s, r in schedulers:
            s.step()
            r.step()
        if opt.param_groups[0]["lr"] != ref_opt.param_groups[0]["lr"]:
            fails.append(f"step {step}: lr {opt.param_groups[0]['lr']} != torch's {ref_opt.param_groups[0]['lr']}")
        fails += _compare(model, opt, ref, f"step {step}")
    fails += [f"unused.{n} (its .grad is None) changed" for n, p in model.unused.named_parameters()
              if not torch.equal(p, unused_before[n])]
    if frozen_until is not None and all(torch.equal(p, late_before[n]) for n, p in model.late.named_parameters()):
        fails.append(f"late (frozen at construction, unfrozen at step {frozen_until}) was never trained")
    return fails


def check_grad_none(rank, world_size, folder):
    """A parameter whose .grad is None is skipped: no weight decay, no moments, weights untouched."""
    fails = _run_against_torch(3)
    if fails:
        return fails
    model, opt, _, _ = _pair()
    _train(model, opt, 0)
    steps = opt.consolidated_state_dict()["steps"]
    if steps["unused.weight"] != 0 or steps["fc1.weight"] != 1:
        fails.append(f"AdamW step counts {steps}: expected unused 0 (never had a gradient), fc1 1")
    return fails


def check_no_backward(rank, world_size, folder):
    """A step without a backward changes nothing (parameters, masters, moments, step counts): first, then after
    a real step."""
    fails = []
    model, opt, _, _ = _pair()
    for what in ("a first step without backward", "a step without backward after a real one"):
        before = _snapshot(model, opt)
        opt.step()
        fails += _same(before, _snapshot(model, opt), what)
        _train(model, opt, 0)
    return fails


def check_unfrozen(rank, world_size, folder):
    """A parameter frozen at construction is in the optimizer's group and is trained once unfrozen (torch's AdamW
    semantics), bitwise."""
    fails = _run_against_torch(4, frozen_until=2)
    model, opt, _, _ = _pair(frozen=True)
    if not any(p is model.late.weight for p in opt.param_groups[0]["params"]):
        fails.append("the frozen parameter late.weight is not in the param group")
    return fails


def check_schedulers(rank, world_size, folder):
    """torch's LR schedulers take ZeroAdamW (a torch.optim.Optimizer) and the step uses the lr they set."""
    fails = [] if isinstance(_pair()[1], torch.optim.Optimizer) else ["ZeroAdamW is not a torch.optim.Optimizer"]
    return fails + _run_against_torch(5, schedules=True)


def _other_state(rank, world_size):
    """A per-rank state dict of a model with other shapes but as many parameters."""
    torch.manual_seed(3)
    other = nn.Sequential(nn.Linear(16, 20), nn.Linear(20, 24), nn.Linear(24, 8), nn.Linear(8, 9))
    o = hybridq.distributed.ZeroAdamW(other, lr=LR)
    other(_batch(0)).sum().backward()
    o.step()
    return o.state_dict()


def _mutated(sd: dict, rank: int, change) -> dict:
    """A deep copy of a per-rank state dict with `change(entry)` applied to this rank's fragment of the first
    parameter it owns."""
    sd = copy.deepcopy(sd)
    for entry in sd["state"].values():
        mine = entry.get(f"rank{rank}")
        if mine:
            change(mine)
            break
    return sd


def _trained():
    model, opt, _, _ = _pair(frozen=True)  # (a frozen parameter: torch's set_state_dict passes no state for it)
    for step in range(2):
        _train(model, opt, step)
    return model, opt


def check_load_refusals(rank, world_size, folder):
    """load_state_dict checks everything before changing anything, on every rank: another model's state, a
    1-element master that would broadcast (on one rank only), a short moment, a negative step count, another world
    size."""
    fails = []
    model, opt = _trained()
    sd = opt.state_dict()
    other = _other_state(rank, world_size)
    bad = {
        "another model's state": (other, "another model"),
        # (on rank 1 only: rank 0, whose state is valid, must refuse too rather than go on alone)
        "a 1-element master on rank 1": (
            _mutated(sd, rank, lambda e: e.__setitem__("master", e["master"][:1].clone())) if rank == 1 else sd,
            "master fragment" if rank == 1 else "rank(s) [1] refused"),
        "a short exp_avg": (_mutated(sd, rank, lambda e: e.__setitem__("exp_avg", e["exp_avg"][1:].clone())),
                            "exp_avg fragment"),
        "a negative step": (_mutated(sd, rank, lambda e: e.__setitem__("step", torch.tensor(-1.0))), "step count"),
        "another world size": ({**sd, "param_groups": [{**sd["param_groups"][0], "zero_world": world_size + 1}]},
                               "consolidated_state_dict"),
    }
    for what, (state, match) in bad.items():
        before = _snapshot(model, opt)
        try:
            opt.load_state_dict(state)
            fails.append(f"{what}: loaded")
        except ValueError as e:
            if match not in str(e):
                fails.append(f"{what}: the error does not say {match!r}: {e}")
        fails += _same(before, _snapshot(model, opt), f"refused {what}")
    return fails


def check_round_trips(rank, world_size, folder):
    """A per-rank state, in memory or saved and loaded with torch.distributed.checkpoint (directly or through its
    get_state_dict / set_state_dict helpers), loads into an optimizer of another initialisation: the same masters,
    then the same next step, bitwise."""
    fails = []
    model, opt = _trained()
    sd = opt.state_dict()
    want_after, want_masters = None, opt.full_masters()
    path = os.path.join(folder, "zero_dcp")
    dcp.save({"optim": sd}, checkpoint_id=path)
    helpers_path = os.path.join(folder, "zero_dcp_helpers")  # (torch's state_dict helpers: model + optimizer)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=helpers_path)
    for how in ("in memory", "DCP", "DCP with get_state_dict / set_state_dict"):
        m2, o2, _, _ = _pair(seed=7, frozen=True)
        if how == "in memory":
            o2.load_state_dict(copy.deepcopy(sd))
        elif how == "DCP":
            template = {"optim": o2.state_dict()}
            dcp.load(template, checkpoint_id=path)
            o2.load_state_dict(template["optim"])
        else:
            msd2, osd2 = get_state_dict(m2, o2)
            template = {"model": msd2, "optim": osd2}
            dcp.load(template, checkpoint_id=helpers_path)
            set_state_dict(m2, o2, model_state_dict=template["model"], optim_state_dict=template["optim"])
        got_masters = o2.full_masters()
        fails += [f"{how}: master {n} after loading differs" for n, t in want_masters.items()
                  if not torch.equal(got_masters[n], t)]
        _train(m2, o2, 2)
        after = {n: p.detach().clone() for n, p in m2.named_parameters()}
        if want_after is None:
            _train(model, opt, 2)
            want_after = {n: p.detach().clone() for n, p in model.named_parameters()}
        fails += [f"{how}: {n} after the resumed step differs" for n in want_after
                  if not torch.equal(after[n], want_after[n])]
    return fails


CHECKS = {f.__name__[len("check_"):]: f for f in (check_grad_none, check_no_backward, check_unfrozen,
                                                  check_schedulers, check_load_refusals, check_round_trips)}


def job_checks(rank, world_size, device, folder):
    """Every check in one spawn: {name: failures}; an exception is that check's failure."""
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check(rank, world_size, os.path.join(folder, name))
        except (Exception, CheckpointException) as e:  # (DCP's is a BaseException) the check's failure; the next
            out[name] = [f"raised {type(e).__name__}: {e}"]  # checks still run
    return out
