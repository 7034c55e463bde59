"""Host time of hybridq's FSDP2 post-all-gather hook per weight, forward and backward unshards apart, with the
backward unshard's derived columnwise form replayed in place (buffers.py [Note: replayed fill]) and as before
(every backward unshard fills as usual: a fresh transpose adopted with `set_`). One process, FSDP2 on a world of
one (gloo on the CPU, NCCL on a GPU); the two models (same weights, same steps) take their steps interleaved;
a `time.perf_counter` pair around each `fsdp_post_all_gather` call (on CUDA the hook's host time, kernels queued).

    python benchmarks/bench_post_hook.py                         # CPU: 8 Linears 256x256, 30 steps
    python benchmarks/bench_post_hook.py --dim 2048 --steps 10   # the 1B model's d_model (the CPU transpose inside)
    python benchmarks/bench_post_hook.py --device cuda --preset fp8_block --json out.json

Prints (and writes with --json) the median and mean us per call of each (phase, mode), the calls timed and the
replay counters (fill_replayed, derived_in_place) each model's weights counted."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn

import hybridq
from fsdp_setup import exit_without_finalization, init_world, shard_units
from hybridq.distributed import HybridWeight
from hybridq.formats import COLUMNWISE

MODES = ("in_place", "before")


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int, preset: str):
        super().__init__()
        self.layers = nn.ModuleList(hybridq.Linear(dim, dim, recipe=preset, name=f"layers.{i}") for i in range(layers))

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(lin(x))
        return x


def _states(model) -> list:
    return [lin.weight._local_tensor._hq for lin in model.layers]


def _as_before(model) -> None:
    """No derived direction is recorded (the code before: a plan that derives is never replayed)."""
    for st in _states(model):
        record = st.record_fill

        def skip_derived(meta, plan, *args, _record=record, **kwargs):
            if not plan.derive:
                _record(meta, plan, *args, **kwargs)

        st.record_fill = skip_derived


def build(args, device, mode: str):
    torch.manual_seed(0)
    model = Stack(args.dim, args.layers, args.preset).to(device)
    shard_units(model, model.layers, args.preset, device, 1)
    if mode == "before":
        _as_before(model)
    return model


def run(args) -> dict:
    device = torch.device(args.device)
    models = {mode: build(args, device, mode) for mode in MODES}
    opts = {mode: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for mode, m in models.items()}
    owner = {id(st): mode for mode, m in models.items() for st in _states(m)}
    times: dict = {(p, m): [] for p in ("forward", "backward") for m in MODES}
    timing = [False]
    orig = HybridWeight.fsdp_post_all_gather

    def timed(weight, outputs, metadata, param_dtype, *, out=None):
        t0 = time.perf_counter()
        result = orig(weight, outputs, metadata, param_dtype, out=out)
        dt = time.perf_counter() - t0
        if timing[0]:
            phase = "backward" if metadata.plan.materialize == (COLUMNWISE,) else "forward"
            times[(phase, owner[id(weight._hq)])].append(dt)
        return result

    HybridWeight.fsdp_post_all_gather = timed
    try:
        g = torch.Generator().manual_seed(1)
        for step in range(args.warmup + args.steps):
            timing[0] = step >= args.warmup
            x = torch.randn(args.rows, args.dim, generator=g).to(device)
            order = MODES if step % 2 == 0 else MODES[::-1]  # (interleaved: neither always runs first)
            for mode in order:
                models[mode](x).float().square().mean().backward()
                opts[mode].step()
                opts[mode].zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        HybridWeight.fsdp_post_all_gather = orig
    result = {"preset": args.preset, "dim": args.dim, "layers": args.layers, "device": str(device),
              "torch": torch.__version__, "steps": args.steps, "us_per_call": {}, "counters": {}}
    for (phase, mode), ts in times.items():
        us = [t * 1e6 for t in ts]
        result["us_per_call"][f"{phase} {mode}"] = {"median": statistics.median(us), "mean": statistics.fmean(us),
                                                    "calls": len(us)}
    for mode, m in models.items():
        total: dict = {}
        for st in _states(m):
            for k in ("fill_replayed", "derived_in_place", "adopted"):
                total[k] = total.get(k, 0) + st.counters[k]
        result["counters"][mode] = total
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="fp8_tensorwise")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    _, args.device = init_world(args.device)
    result = run(args)
    for key, v in result["us_per_call"].items():
        print(f"{key:22s} median {v['median']:8.1f} us  mean {v['mean']:8.1f} us  ({v['calls']} calls)")
    print("counters:", json.dumps(result["counters"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    exit_without_finalization(0 if main() else 1)
