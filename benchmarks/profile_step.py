"""Where the time of one training step goes: the end-to-end job's step (launch/train.py: FSDP2 on one rank, bf16
params / fp32 reduce, AdamW, grad clipping, hybridq.precompute_scales) under torch.profiler, per recipe.

    python benchmarks/profile_step.py                                    # GPU: the 1B e2e config, bf16 vs fp8_tensorwise
    python benchmarks/profile_step.py --recipes bf16,fp8_tensorwise,mxfp8 --json prof.json --trace-dir traces
    python benchmarks/profile_step.py --smoke --device cpu               # tiny model on the CPU (a few seconds)

For each recipe: --warmup steps, then --timed-steps steps without the profiler; then, once every recipe has been
timed (a profiler session leaves each later kernel launch of the process slower on the host: `time_recipe`), each
recipe again from a newly built job: --warmup steps, then --steps steps under torch.profiler (CPU + CUDA
activities). It prints

  1. GPU kernel time per step by category, the recipes side by side (share of the kernel time, ratio vs bf16),
     then the GPU busy time (union of the kernel intervals on all streams), the GPU idle time (step wall minus
     busy), the host time to issue a step, kernel launches per step and the host time inside hybridq's autograd
     Functions (the quantized Linear's forward and backward, kernel launches included);
  2. the top kernels of each recipe by total GPU time;
  3. step-time statistics without the profiler (median, p90, max, the steps > 1.3x the median) and, on CUDA,
     allocator counters before / after those steps (retries, OOMs, cudaMalloc / cudaFree calls, inactive splits).

On the CPU (--device cpu) the "kernels" are the CPU ops (self time); an op inside a hybridq autograd Function,
attention or the optimizer step counts for that category (see `attribute`). On the GPU a kernel's category
comes from its name alone; a second table splits the kernel time launched from inside hybridq's autograd
Functions by category (the quantized Linear's own element-wise work vs the model's). With one rank FSDP2 runs
no all-gathers or reduce-scatters; the collectives row shows what remains (the logged loss's all-reduce, and
precompute_scales' for the quantized recipes).

The model is that of benchmarks/e2e_report.py's default (d_model 2048, 20 layers, 16 heads, hidden 5632, seq 4096 x
batch 4: 1.03B parameters, 16,384 tokens per step), built by train.py's `build` (hybridq.apply_hybrid_fsdp, then
fully_shard per block and root, AdamW) and stepped by train.py's `train_step`. Plain python: a world of one (gloo on
the CPU, NCCL on the GPU). Under torchrun every rank runs the same steps and rank 0 reports; the collectives row is
then also split by kind (FSDP2's all-gathers and reduce-scatters, the all-reduces), which is how the multi-GPU runs
measure the all-gather time:

    torchrun --standalone --nproc-per-node 8 benchmarks/profile_step.py --recipes bf16,fp8_tensorwise
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))  # the job's modules

import config  # noqa: E402
from e2e_plan import glue_train_args  # noqa: E402
import train  # noqa: E402
from data import ByteBatches, load_tokens  # noqa: E402
from metrics import Printer  # noqa: E402
from trainer import GarbageCollection, StepWindow, issue_step  # noqa: E402

BASELINE = config.BASELINE
# e2e_report.py's default size, and a CPU smoke size
FULL = {"d_model": 2048, "n_layers": 20, "n_heads": 16, "hidden": 5632, "seq": 4096, "batch": 4}
SMOKE = {"d_model": 64, "n_layers": 1, "n_heads": 2, "hidden": None, "seq": 64, "batch": 2}

# the attribution and the tables (re-exported: tests/test_profile_step.py reads them from here)
from profile_events import (CATEGORIES, COLLECTIVE_KINDS, LABELS, STEP_MARK, STICKY, attribute,  # noqa: E402,F401
                            categorize, collective_kind, hybridq_function_names, is_device_work, summarize_events,
                            union_us)
from profile_tables import (ALLOC_KEYS, JITTER, category_table, collectives_table, fmt_table,  # noqa: E402,F401
                            inside_table, process_text, timing_lines, top_table)
from fsdp_setup import exit_without_finalization  # noqa: E402


# ---- running the steps ------------------------------------------------------------------------------

def allocator_counters(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {k: s.get(k) for k in ALLOC_KEYS}


def host_counters() -> dict:
    """What the host did and suffered, for `process_summary`: this process's CPU seconds (all its threads), its
    involuntary context switches (preempted: another task wanted its CPU), its minor page faults (first touches of
    memory the C allocator got from the kernel anew: host allocations that are mapped and unmapped each step) and
    the machine's CPU ticks, of which stolen (a virtual machine's CPUs run by the hypervisor for someone else; Linux
    /proc/stat, else absent)."""
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_s": ru.ru_utime + ru.ru_stime, "involuntary_switches": ru.ru_nivcsw, "minor_faults": ru.ru_minflt}
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        out["ticks"], out["steal_ticks"] = sum(ticks), ticks[7] if len(ticks) > 7 else 0
    except (OSError, ValueError):
        pass
    return out


def process_summary(host: dict, allocator: dict, steps: int, wall_s: float) -> dict:
    """Per timed step, from the counters before / after the steps: the process's CPU ms (all threads: above the
    host issue time when other threads -- autograd's, the pin-memory copy -- work too), involuntary context
    switches, minor page faults, the machine's stolen CPU share and, on CUDA, the caching allocator's cudaMalloc / cudaFree calls and
    retries (a free forces a device sync: the host then waits for the GPU). The spread of a host-bound step between
    fresh processes of the same code is what these attribute."""
    b, a = host["before"], host["after"]
    out = {"process_cpu_ms": 1e3 * (a["cpu_s"] - b["cpu_s"]) / steps,
           "involuntary_switches": (a["involuntary_switches"] - b["involuntary_switches"]) / steps,
           "wall_s": wall_s}
    if "minor_faults" in a and "minor_faults" in b:
        out["minor_faults"] = (a["minor_faults"] - b["minor_faults"]) / steps
    if "ticks" in a and "ticks" in b and a["ticks"] > b["ticks"]:
        out["steal_pct"] = 100.0 * (a["steal_ticks"] - b["steal_ticks"]) / (a["ticks"] - b["ticks"])
    if allocator.get("before"):
        for key, name in (("num_device_alloc", "cuda_mallocs"), ("num_device_free", "cuda_frees"),
                          ("num_alloc_retries", "alloc_retries")):
            out[name] = (allocator["after"][key] or 0) - (allocator["before"][key] or 0)
    return out


def step_stats(times: list[float], host: list[float]) -> dict:
    med = statistics.median(times)
    srt = sorted(times)
    p90 = srt[min(len(srt) - 1, math.ceil(0.9 * len(srt)) - 1)]
    return {"n": len(times), "median_ms": med * 1e3, "p90_ms": p90 * 1e3, "max_ms": max(times) * 1e3,
            "min_ms": min(times) * 1e3, "host_median_ms": statistics.median(host) * 1e3,
            "jitter_steps": [{"step": i, "ms": t * 1e3, "x_median": t / med} for i, t in enumerate(times)
                             if t > JITTER * med],
            "step_ms": [t * 1e3 for t in times]}


class _Job:
    """The job of `recipe` built as train.py builds it, after --warmup steps. Python's collector runs as the training
    job runs it (--gc-every): with automatic collection a full pass lands on random steps and made the unprofiled
    medians bimodal (fp8 MoE: 89 vs 106 ms for the same code)."""

    def __init__(self, recipe: str, a, targs, env, tokens: torch.Tensor):
        self.model, self.optimizer = train.build(recipe, targs, env, Printer(False, bar=False))
        self.data = ByteBatches(tokens, targs.seq, targs.batch, dp_rank=env.dp_rank, dp_size=targs.dp, seed=targs.seed)
        self.targs, self.env, self.quantized = targs, env, recipe != BASELINE
        self.collector = GarbageCollection(targs.gc_every)
        self.step = 0
        self.run(a.warmup)

    def run(self, n: int, mark: str | None = None) -> tuple[list[float], list[float]]:
        """n steps as train.py runs them (the losses read in windows of --sync-every steps, each one step late, the
        last at once: trainer.StepWindow): (host seconds to issue each, wall seconds of each: the device's time from the end of the previous step);
        each inside record_function(mark + i)."""
        from torch.profiler import record_function
        host, wall = [], []
        window = StepWindow(self.env)
        for i in range(n):
            with record_function(f"{mark}{i}") if mark is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                loss = issue_step(self.step, self.model, self.optimizer, self.data, self.targs, self.env,
                                  self.quantized)
                host.append(time.perf_counter() - t0)
                for step, loss_val, _, _, dt in window.step_issued(
                        i + 1, loss, 0.0, {}, close=window.due(i + 1, 0, n, self.targs.sync_every),
                        read_now=i + 1 == n):
                    if not math.isfinite(loss_val):
                        raise RuntimeError(f"loss is {loss_val} at step {self.step - (i + 1 - step)}")
                    wall.append(dt)
            self.step += 1
            self.collector.step(self.step)
        return host, wall

    def close(self) -> None:
        self.collector.close()
        del self.model, self.optimizer
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.env.device)


def time_recipe(recipe: str, a, targs, env, tokens: torch.Tensor) -> dict:
    """--timed-steps steps of `recipe` without the profiler: {"timed", "allocator", "peak_memory_bytes"}. Run for
    every recipe BEFORE the process's first profiler session: after one, each kernel launch costs more host time
    for the rest of the process (the CUDA activity tracing stays attached), which inflated the host-bound steps --
    the fp8 MoE job's host time per step 74 ms in a fresh process, 125 ms after a profiled session (one H200)."""
    job = _Job(recipe, a, targs, env, tokens)
    before, host_before, t0 = allocator_counters(env.device), host_counters(), time.perf_counter()
    host, times = job.run(a.timed_steps)
    res = {"timed": step_stats(times, host) if times else None,
           "allocator": {"before": before, "after": allocator_counters(env.device)}}
    res["process"] = process_summary({"before": host_before, "after": host_counters()}, res["allocator"],
                                     max(1, a.timed_steps), time.perf_counter() - t0)
    if env.device.type == "cuda":
        res["peak_memory_bytes"] = torch.cuda.max_memory_allocated(env.device)
    job.close()
    return res


def profile_recipe(recipe: str, a, targs, env, tokens: torch.Tensor, hq_functions: frozenset[str]) -> dict:
    """--steps steps of `recipe` under torch.profiler (after --warmup steps of a newly built job): the tables'
    numbers."""
    from torch.profiler import ProfilerActivity, profile
    job = _Job(recipe, a, targs, env, tokens)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        prof_host, prof_wall = job.run(a.steps, mark=STEP_MARK)
    if a.trace_dir:
        pathlib.Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(pathlib.Path(a.trace_dir) / f"{recipe}.json"))
    res = summarize_events(prof.events(), env.device.type, a.top, hq_functions)
    res["host_top"] = host_top(prof, a.steps, a.top)
    res["profiled_host_ms"] = statistics.fmean(prof_host) * 1e3
    res["profiled_wall_ms_perf_counter"] = statistics.fmean(prof_wall) * 1e3
    res["recipe"] = recipe
    del prof
    job.close()
    return res


def host_top(prof, steps: int, top: int) -> list[dict]:
    """The ops with the most self CPU time (where the host time of a step goes), per step."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps, "calls": e.count / steps}
            for e in rows[:top] if not e.key.startswith(STEP_MARK)]


# ---- main -------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=f"{BASELINE},fp8_tensorwise", help=f"comma list: {BASELINE} and hybridq presets")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 warm-up, 2 profiled, 3 timed steps")
    for k in FULL:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {FULL[k]} (smoke {SMOKE[k]})")
    p.add_argument("--warmup", type=int, default=None, help="steps before profiling (default 3, smoke 1)")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (default 3, smoke 2)")
    p.add_argument("--timed-steps", type=int, default=None, help="steps timed without the profiler (default 20, smoke 3)")
    p.add_argument("--top", type=int, default=15, help="kernels listed per recipe")
    p.add_argument("--train-args", default="", help="more train.py flags (one string), e.g. '--quantize-head'")
    p.add_argument("--json", default=None, metavar="FILE", help="write everything to FILE")
    p.add_argument("--trace-dir", default=None, metavar="DIR", help="export a chrome trace per recipe to DIR")
    a = p.parse_args(glue_train_args(argv))
    base = SMOKE if a.smoke else FULL
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k, full, smoke in (("warmup", 3, 1), ("steps", 3, 2), ("timed_steps", 20, 3)):
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    a.recipe_list = [r.strip() for r in a.recipes.split(",") if r.strip()]
    if a.steps < 1:
        p.error("--steps must be >= 1")
    return a


def train_args(a, world: int) -> argparse.Namespace:
    """train.py's flags for this size (lr and schedule do not matter here: a constant lr)."""
    import shlex
    flags = ["--d-model", a.d_model, "--n-layers", a.n_layers, "--n-heads", a.n_heads, "--seq", a.seq,
             "--batch", a.batch, "--device", a.device, "--steps", 10**6, "--lr", 1e-4]
    if a.hidden:
        flags += ["--hidden", a.hidden]
    targs = config.parse_args([str(f) for f in flags] + shlex.split(a.train_args))
    config.check_args(targs, world)
    return targs


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    a = parse_args(argv)
    import hybridq
    known = [BASELINE] + hybridq.preset_names()
    bad = [r for r in a.recipe_list if r not in known]
    if bad:
        print(f"profile_step.py: unknown recipe(s) {', '.join(bad)}; known: {', '.join(known)}", file=sys.stderr)
        return 1
    world = train.world_from_environment()
    targs = train_args(a, world)
    env = train.init_distributed(targs, world)
    if not env.main:  # under torchrun every rank profiles the same steps (they share the collectives); rank 0 reports
        sys.stdout = open(os.devnull, "w")
        a.json = None
    try:
        hq = hybridq_function_names()
        tokens = load_tokens()
        cfg = config.model_config(targs)
        dev = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU (gloo)"
        print(f"profile_step.py: hybridq {hybridq.__version__}, torch {torch.__version__}, {dev}; model "
              f"{cfg.n_layers} layers, d_model {cfg.d_model}, hidden {cfg.hidden}, {cfg.n_heads} heads, "
              f"{cfg.num_params() / 1e6:,.1f}M params; seq {targs.seq} x batch {targs.batch}; FSDP2 world {world}; "
              f"{a.warmup} warm-up, {a.steps} profiled, {a.timed_steps} timed steps", flush=True)
        # every recipe's unprofiled steps first (see time_recipe), then every recipe's profiled steps
        timed = {}
        for r in a.recipe_list:
            t0 = time.perf_counter()
            timed[r] = time_recipe(r, a, targs, env, tokens)
            print(f"[{r}] timed in {time.perf_counter() - t0:.1f} s", flush=True)
        results = []
        for r in a.recipe_list:
            t0 = time.perf_counter()
            results.append({**profile_recipe(r, a, targs, env, tokens, hq), **timed[r]})
            print(f"[{r}] profiled in {time.perf_counter() - t0:.1f} s", flush=True)
        unit = "GPU kernel time" if env.device.type == "cuda" else "CPU op self time"
        print(f"\n## {unit} per step by category (mean of {a.steps} profiled steps)\n")
        print(category_table(results, env.device.type))
        if any(v for r in results for v in r["collectives_ms"].values()):
            print(f"\n## {unit} per step in collectives, by kind (NCCL kernels run until the slowest rank arrives: "
                  "waiting for a peer counts)\n")
            print(collectives_table(results))
        quantized = [r for r in results if r["recipe"] != BASELINE]
        if env.device.type == "cuda" and quantized:
            print("\n## of which launched inside hybridq's autograd Functions (GPU ms/step)\n")
            print(inside_table(quantized))
        for r in results:
            print(f"\n## top {a.top} {'kernels' if env.device.type == 'cuda' else 'CPU ops (self time)'}: "
                  f"{r['recipe']}\n")
            print(top_table(r))
        for r in results:
            print(f"\n## top {a.top} host ops by self CPU time: {r['recipe']}\n")
            print(fmt_table([["op", "self CPU ms/step", "calls/step"]]
                            + [[h["name"][:90], f"{h['self_cpu_ms']:.2f}", f"{h['calls']:.0f}"]
                               for h in r["host_top"]]))
        print("\n## step times without the profiler\n")
        for r in results:
            print("\n".join(timing_lines(r)))
        if a.json:
            doc = {"args": {k: v for k, v in vars(a).items()}, "device": dev, "torch": torch.__version__,
                   "hybridq": hybridq.__version__, "world": world, "params": cfg.num_params(),
                   "categories": list(CATEGORIES), "labels": LABELS, "results": results}
            pathlib.Path(a.json).write_text(json.dumps(doc, indent=1))
            print(f"\nwrote {a.json}")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalization(main())
