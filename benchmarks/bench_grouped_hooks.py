"""Host time of hybridq's FSDP2 all-gather hooks for grouped (mixture-of-experts) weights, per weight and unshard
(pre- and post-all-gather, forward and backward unshards apart), and where it goes (cProfile by function), issue 30.

    python benchmarks/bench_grouped_hooks.py                                  # CPU, gloo world 1, both recipes
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_grouped_hooks.py   # gloo world 2
    python benchmarks/bench_grouped_hooks.py --device cuda --dim 2048 --hidden 1024 --steps 20   # one GPU, the MoE job's
    python benchmarks/bench_grouped_hooks.py --profile 25                     # + the hooks' top 25 functions

A unit is an MoE block's three expert weights (gate and up `[E, hidden, dim]`, down `[E, dim, hidden]`: GroupedLinear,
each unit one `fully_shard`, the model another; bf16 param dtype); the tokens are split evenly over the experts. The
defaults keep the expert weights small (16 experts of 128x128: FP8 128x128 tiles need whole 128-row blocks per
expert to take the stacked block payload) so that the CPU's kernels are a small part of what is timed. A `time.perf_counter`
pair around each hook call (on CUDA the hook's host time, kernels queued). `--old` also runs the grouped hooks'
previous path (the switch `grouped_fast.set_grouped_fast(False)`), interleaved with the new one step by step.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn as nn

import hybridq
from fsdp_setup import exit_without_finalization, init_world, shard_units
from hybridq.distributed import GroupedHybridWeight, HybridWeight, grouped_fast
from hybridq.torch_private import in_backward
from torch.utils._python_dispatch import TorchDispatchMode


class _OpCount(TorchDispatchMode):
    """The aten ops each hook dispatches (views included: each is a dispatcher call on the host)."""

    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Unit(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int, preset: str, i: int):
        super().__init__()
        self.experts = experts

        def grouped(n_in, n_out, name):
            return hybridq.GroupedLinear(experts, n_in, n_out, recipe=preset, name=f"units.{i}.{name}")

        self.gate, self.up, self.down = grouped(dim, hidden, "gate"), grouped(dim, hidden, "up"), \
            grouped(hidden, dim, "down")

    def forward(self, x):
        splits = [x.shape[0] // self.experts] * self.experts
        return x + self.down(torch.relu(self.gate(x, splits)) * self.up(x, splits), splits)


class Model(nn.Module):
    def __init__(self, args, preset: str):
        super().__init__()
        self.units = nn.ModuleList(Unit(args.experts, args.dim, args.hidden, preset, i) for i in range(args.units))

    def forward(self, x):
        for u in self.units:
            x = u(x)
        return x


def build(args, preset: str, device, world: int):
    torch.manual_seed(0)
    model = Model(args, preset).to(device)
    return shard_units(model, model.units, preset, device, world)


def run(args, preset: str, world: int) -> dict:
    device = torch.device(args.device)
    settings = ["new", "old"] if args.old else ["new"]
    models = {name: build(args, preset, device, world) for name in settings}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: dict = {(name, hook, phase): [] for name in settings for hook in ("pre", "post") for phase in "FB"}
    current, timing, counting = [None], [False], [None]
    ops: dict = {}
    pyprof: dict = {}
    prof = cProfile.Profile() if args.profile else None
    pre, post = HybridWeight._pre_hook, HybridWeight.fsdp_post_all_gather

    def timed(hook, fn):
        def call(self, *a, **k):
            if not isinstance(self, GroupedHybridWeight):
                return fn(self, *a, **k)
            phase = "B" if in_backward() else "F"
            key = (current[0], hook, phase)
            if counting[0] == "ops":  # (one step's aten ops, another's Python calls; neither timed)
                with _OpCount(ops.setdefault(key, collections.Counter())):
                    return fn(self, *a, **k)
            if counting[0] == "python":
                calls = pyprof.setdefault(key, cProfile.Profile())
                calls.enable()
                try:
                    return fn(self, *a, **k)
                finally:
                    calls.disable()
            on = timing[0] and prof is not None and current[0] == "new"
            if on:
                prof.enable()
            t0 = time.perf_counter()
            result = fn(self, *a, **k)
            dt = time.perf_counter() - t0
            if on:
                prof.disable()
            if timing[0]:
                times[(current[0], hook, phase)].append(dt)
            return result
        return call

    HybridWeight._pre_hook = timed("pre", pre)
    HybridWeight.fsdp_post_all_gather = timed("post", post)
    was = grouped_fast.grouped_fast()
    gc.collect()  # (as the training job runs Python's collector: set-up frozen, no automatic collection in a step)
    gc.freeze()
    gc.disable()
    try:
        g = torch.Generator().manual_seed(1)
        for step in range(args.warmup + args.steps + 2):  # (+2: the hooks' aten ops, their Python calls, untimed)
            timing[0] = args.warmup <= step < args.warmup + args.steps
            counting[0] = {args.warmup + args.steps: "ops", args.warmup + args.steps + 1: "python"}.get(step)
            x = torch.randn(args.experts * args.tokens, args.dim, generator=g).to(device)
            order = settings if step % 2 == 0 else settings[::-1]  # (neither always runs first)
            for name in order:
                current[0] = name
                grouped_fast.set_grouped_fast(name == "new")
                models[name](x).float().square().mean().backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            gc.collect(1)
    finally:
        gc.enable()
        gc.unfreeze()
        HybridWeight._pre_hook, HybridWeight.fsdp_post_all_gather = pre, post
        grouped_fast.set_grouped_fast(was)
    result = {"preset": preset, "us_per_call": {}}
    for (name, hook, phase), ts in times.items():
        us = [t * 1e6 for t in ts]
        if us:
            c = ops.get((name, hook, phase), collections.Counter())
            n = len(us) / args.steps  # (calls per step)
            py = pyprof.get((name, hook, phase))
            result["us_per_call"][f"{name}: {hook} {phase}"] = {
                "mean": statistics.fmean(us), "median": statistics.median(us), "per_step": n,
                "aten_ops": sum(c.values()) / n, "ops": dict(c.most_common()),
                "python_calls": (pstats.Stats(py).total_calls / n) if py is not None else 0}
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        result["profile"] = out.getvalue()
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", default="fp8_tensorwise,fp8_block")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4, help="tokens per expert")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--old", action="store_true", help="also run the previous path (grouped_fast off)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the hooks' top N functions (tottime)")
    ap.add_argument("--ops", action="store_true", help="list the aten ops per hook call")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    world, args.device = init_world(args.device)
    results = [run(args, preset, world) for preset in args.recipes.split(",")]
    if torch.distributed.get_rank() == 0:
        print(f"bench_grouped_hooks.py: {args.units} units of 3 grouped weights, {args.experts} experts, dim "
              f"{args.dim}, hidden {args.hidden}, world {world}, {args.device}, torch {torch.__version__}, "
              f"{args.steps} steps")
        for r in results:
            for key, v in r["us_per_call"].items():
                print(f"{r['preset']:15s} {key:14s} mean {v['mean']:8.1f} us  median {v['median']:8.1f} us  "
                      f"({v['per_step']:g} per step); per call: Python calls {v['python_calls']:.1f}, aten ops {v['aten_ops']:.1f}")
                if args.ops:
                    print("    " + ", ".join(f"{n} {c / v['per_step']:g}" for n, c in v["ops"].items()))
            if "profile" in r:
                print(r["profile"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return {"results": results}


if __name__ == "__main__":
    exit_without_finalization(0 if main() else 1)
