"""Host time of hybridq's FSDP2 all-gather hooks per weight (pre- and post-all-gather, forward and backward unshards
apart) with the per-unit paths on and off: the unit cast ([Note: unit cast]) and the unit fill ([Note: unit fill]).
One model per setting (same weights, same steps), their steps interleaved; a pair of clock reads (--clock thread:
this thread's CPU time, `time.thread_time`, so other processes on a loaded machine do not count; wall) around each
hook call (on CUDA the hook's host time, kernels queued), summed per step and divided by the weights (a unit's first
hook does the unit's work: per call the hooks differ); the median over the steps.

    python benchmarks/bench_gather_hooks.py                          # CPU, gloo world 1: 4 units of 7 Linears, dim 64
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_gather_hooks.py   # gloo world 2
    python benchmarks/bench_gather_hooks.py --device cuda --dim 2048 --units 16 --steps 20   # one GPU (NCCL)
    python benchmarks/bench_gather_hooks.py --compare data_writes --precompute   # the data-write check on / off

`--compare data_writes`: the two settings are the data-write check ([Note: data-write check], HYBRIDQ_CHECK_DATA_WRITES)
on and off instead of the unit fill; `--precompute`: precompute_scales(model, payloads=True) after each optimizer step
(counted in the step's host time).

A unit is a transformer block's seven Linears (q, k, v, o, gate, up, down: shapes of a Llama block with 4x fewer
k/v heads and a 2.75x hidden), each unit one `fully_shard`, the model another; bf16 param dtype. Prints (and writes
with --json) per setting and (hook, phase): us per weight and step; FSDP2's whole unshard
(`FSDPParamGroup.unshard` + `wait_for_unshard`, the hooks inside, and at world 1 FSDP2's copy of each input into its
output) per weight alike; and the step's host time."""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import hybridq
from fsdp_setup import exit_without_finalization, init_world, shard_units
from hybridq.data_writes import CHECK
from hybridq.distributed import HybridWeight, precompute_scales, unit_cast, unit_fill
from hybridq.torch_private import in_backward

SETTINGS = {"unit fill on": dict(fill=True), "unit fill off": dict(fill=False)}
COMPARE = {"unit_fill": SETTINGS,
           "data_writes": {"data-write check on": dict(fill=True, check=True),
                           "data-write check off": dict(fill=True, check=False)}}


class Block(nn.Module):
    def __init__(self, dim: int, preset: str, i: int):
        super().__init__()
        kv, hidden = dim // 4, (dim * 11 // 4 + 15) // 16 * 16

        def lin(n_in, n_out, name):
            return hybridq.Linear(n_in, n_out, bias=False, recipe=preset, name=f"blocks.{i}.{name}")

        self.q, self.k, self.v, self.o = lin(dim, dim, "q"), lin(dim, kv, "k"), lin(dim, kv, "v"), lin(dim, dim, "o")
        self.gate, self.up, self.down = lin(dim, hidden, "gate"), lin(dim, hidden, "up"), lin(hidden, dim, "down")

    def forward(self, x):
        a = self.q(x) + torch.cat([self.k(x), self.v(x), self.k(x), self.v(x)], -1)
        x = x + self.o(torch.relu(a))
        return x + self.down(torch.relu(self.gate(x)) * self.up(x))


class Model(nn.Module):
    def __init__(self, dim: int, units: int, preset: str):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, preset, i) for i in range(units))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build(args, device, world: int):
    torch.manual_seed(0)
    model = Model(args.dim, args.units, args.preset).to(device)
    return shard_units(model, model.blocks, args.preset, device, world)


class _OpCount(TorchDispatchMode):
    """aten ops dispatched (a kernel launch each on a GPU; views and storage swaps apart)."""

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket in (torch.ops.aten.set_, torch.ops.aten.detach,
                                                        torch.ops.aten.alias)):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _counted(counting, name, fn, a, k):
    mode, prof, counts = counting
    c = counts.setdefault(name, {"aten ops": 0, "python calls": 0})
    before = mode.kernels
    prof.enable()
    try:
        with mode:
            return fn(*a, **k)
    finally:
        prof.disable()
        c["aten ops"] += mode.kernels - before
        stats = pstats.Stats(prof)
        c["python calls"] += stats.total_calls
        prof.clear()


def _step(model, opt, x, precompute: bool) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if precompute:
        precompute_scales(model, payloads=True)


def run(args, world: int) -> dict:
    global SETTINGS
    SETTINGS = COMPARE[args.compare]
    device = torch.device(args.device)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    models = {name: build(args, device, world) for name in SETTINGS}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    hooks = ("pre", "post", "unshard")
    times: dict = {(name, hook, phase): [] for name in SETTINGS for hook in hooks for phase in "FB"}
    steps: dict = {name: [] for name in SETTINGS}
    current, timing = [None], [False]
    pre, post = HybridWeight._pre_hook, HybridWeight.fsdp_post_all_gather

    counting: list = []  # (during the counting steps: [dispatch mode, cProfile, {setting: counts}])

    def timed(hook, fn):
        def call(*a, **k):
            if counting and hook == "unshard":  # (FSDP2's unshard calls: the hooks inside them)
                return _counted(counting, current[0], fn, a, k)
            t0 = clock()
            result = fn(*a, **k)
            dt = clock() - t0
            if timing[0]:
                times[(current[0], hook, "B" if in_backward() else "F")][-1] += dt
            return result
        return call

    unshard, wait = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard
    HybridWeight._pre_hook = timed("pre", pre)
    HybridWeight.fsdp_post_all_gather = timed("post", post)
    FSDPParamGroup.unshard = timed("unshard", unshard)  # (FSDP2's whole unshard of a unit: the hooks included)
    FSDPParamGroup.wait_for_unshard = timed("unshard", wait)
    fill_was = unit_fill.set_unit_fill(True)
    check_was = CHECK.on
    try:
        g = torch.Generator().manual_seed(1)
        for step in range(args.warmup + args.steps):
            timing[0] = step >= args.warmup
            if timing[0]:
                for ts in times.values():
                    ts.append(0.0)
            x = torch.randn(args.rows, args.dim, generator=g).to(device)
            order = list(SETTINGS) if step % 2 == 0 else list(SETTINGS)[::-1]  # (neither always runs first)
            for name in order:
                current[0] = name
                unit_fill.set_unit_fill(SETTINGS[name]["fill"])
                CHECK.set(SETTINGS[name].get("check", check_was))
                t0 = clock()
                _step(models[name], opts[name], x, args.precompute)
                if timing[0]:
                    steps[name].append(clock() - t0)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        counting[:] = [_OpCount(), cProfile.Profile(), {}]
        for name in SETTINGS:  # (deterministic: aten ops and Python calls inside FSDP2's unshards, per weight)
            unit_fill.set_unit_fill(SETTINGS[name]["fill"])
            CHECK.set(SETTINGS[name].get("check", check_was))
            for _ in range(args.count_steps):
                current[0] = name
                _step(models[name], opts[name], x, args.precompute)
        counts = counting[2]
        counting.clear()
    finally:
        HybridWeight._pre_hook, HybridWeight.fsdp_post_all_gather = pre, post
        FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard = unshard, wait
        unit_fill.set_unit_fill(fill_was)
        CHECK.set(check_was)
    result = {"preset": args.preset, "dim": args.dim, "units": args.units, "world": world, "device": str(device),
              "torch": torch.__version__, "steps": args.steps, "clock": args.clock, "unit_cast": unit_cast.unit_cast_enabled(),
              "us_per_call": {}, "step_host_ms": {}, "unit_filled": {}}
    weights = 7 * args.units
    for (name, hook, phase), per_step in times.items():
        if not any(per_step):
            continue
        us = [t * 1e6 / weights for t in per_step]  # (per weight: each step's sum over the unit's calls)
        result["us_per_call"][f"{name}: {hook} {phase}"] = {"median": statistics.median(us),
                                                            "mean": statistics.fmean(us)}
    div = weights * args.count_steps
    result["per_weight_and_unshard"] = {name: {k: v / div for k, v in c.items()} for name, c in counts.items()}
    for name, ts in steps.items():
        result["step_host_ms"][name] = statistics.median(ts) * 1e3
        result["unit_filled"][name] = sum(p._local_tensor._hq.counters["unit_filled"]
                                          for p in models[name].parameters())
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="fp8_tensorwise")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--count-steps", type=int, default=2)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread: this thread's CPU time (a loaded machine's other processes do not count); wall")
    ap.add_argument("--compare", choices=tuple(COMPARE), default="unit_fill",
                    help="the two settings compared: the unit fill on / off, or the data-write check on / off")
    ap.add_argument("--precompute", action="store_true",
                    help="precompute_scales(model, payloads=True) after each optimizer step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    world, args.device = init_world(args.device)
    result = run(args, world)
    if torch.distributed.get_rank() == 0:
        print(f"bench_gather_hooks.py: {result['preset']}, dim {args.dim}, {args.units} units of 7, world {world}, "
              f"{result['device']}, torch {result['torch']}, unit cast {'on' if result['unit_cast'] else 'off'}, "
              f"{args.steps} steps, clock {args.clock}")
        for key, v in result["us_per_call"].items():
            print(f"{key:26s} {v['median']:8.1f} us per weight (median of the steps; mean {v['mean']:.1f})")
        for name, c in result["per_weight_and_unshard"].items():
            print(f"{name}: per weight and step, inside FSDP2's unshards: " +
                  ", ".join(f"{v:.1f} {k}" for k, v in c.items()))
        for name, ms in result["step_host_ms"].items():
            print(f"{name}: step host {ms:.2f} ms (median), unit-filled weights {result['unit_filled'][name]}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    exit_without_finalization(0 if main() else 1)
