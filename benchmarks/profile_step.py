"""Where the time of one training step goes: the end-to-end job's step (launch/train.py: FSDP2 on one rank, bf16
params / fp32 reduce, AdamW, grad clipping, hybridq.precompute_scales) under torch.profiler, per recipe.

    python benchmarks/profile_step.py                                    # GPU: the 1B e2e config, bf16 vs fp8_tensorwise
    python benchmarks/profile_step.py --recipes bf16,fp8_tensorwise,mxfp8 --json prof.json --trace-dir traces
    python benchmarks/profile_step.py --smoke --device cpu               # tiny model on the CPU (a few seconds)

For each recipe: --warmup steps, then --steps steps under torch.profiler (CPU + CUDA activities), then
--timed-steps steps without the profiler. It prints

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
import collections
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
import train  # noqa: E402
from data import ByteBatches, load_tokens  # noqa: E402
from metrics import Printer  # noqa: E402

BASELINE = config.BASELINE
# e2e_report.py's default size, and a CPU smoke size
FULL = {"d_model": 2048, "n_layers": 20, "n_heads": 16, "hidden": 5632, "seq": 4096, "batch": 4}
SMOKE = {"d_model": 64, "n_layers": 1, "n_heads": 2, "hidden": None, "seq": 64, "batch": 2}
JITTER = 1.3  # a step slower than this x the median is listed

CATEGORIES = ("gemm", "hybridq", "norm", "attention", "optimizer", "collectives", "memcpy", "elementwise", "other")
LABELS = {"gemm": "GEMM", "hybridq": "hybridq quantize/dequantize", "norm": "RMSNorm kernels", "attention": "attention",
          "optimizer": "optimizer (foreach)", "collectives": "NCCL / collectives", "memcpy": "memcpy / memset / copies",
          "elementwise": "elementwise / reduction", "other": "other"}
# an op under one of these (CPU profile) counts for it, unless the op itself is a GEMM or a collective
STICKY = ("hybridq", "attention", "optimizer")


# ---- kernel names -> categories (pure) ------------------------------------------------------------

def categorize(name: str) -> str:
    """The category of a GPU kernel (or, on the CPU, an op) from its name alone. Order matters: FlashAttention
    kernels are cutlass kernels too, FSDP2's copy-in op names contain "all_gather"."""
    n = name.lower()
    if "rms_norm" in n or "rmsnorm" in n:  # hybridq.nn.RMSNorm's kernels (or torch's fused one)
        return "norm"
    if "hybridq" in n:
        return "hybridq"
    # cudnn: torch's cuDNN SDPA backend also launches helper kernels (cudnn::fusion::...); the model has no conv
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn", "cudnn")):
        return "attention"
    if "memcpy" in n or "memset" in n or ("copy" in n and ("fsdp" in n or "multi_tensor_apply" in n)):
        return "memcpy"  # FSDP2's all-gather copy-in/out (a foreach copy on the GPU) is data movement, not optimizer
    if any(k in n for k in ("nccl", "c10d::", "gloo", "record_param_comms", "allgather", "all_gather",
                            "reduce_scatter", "reducescatter", "allreduce", "all_reduce")):
        return "collectives"
    if any(k in n for k in ("multi_tensor", "foreach", "adam", "optimizer.")):
        return "optimizer"
    if any(k in n for k in ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "splitkreduce", "_scaled_mm",
                            "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")):
        return "gemm"
    if any(k in n for k in ("at::native", "elementwise", "reduce_kernel", "reduction", "aten::", "triton", "vectorized", "unrolled")):
        return "elementwise"
    return "other"


COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "other")


def collective_kind(name: str) -> str:
    """Which collective a collectives-category kernel or op is (NCCL kernels: ncclDevKernel_AllGather_RING_LL, ...;
    CPU: c10d::_allgather_base_, FSDP::all_gather, ...)."""
    n = name.lower().replace("_", "")
    for key, kind in (("allgather", "all-gather"), ("reducescatter", "reduce-scatter"), ("allreduce", "all-reduce")):
        if key in n:
            return kind
    return "other"


def attribute(name: str, ancestors: list[str], hybridq_functions: frozenset[str] | set[str]) -> str:
    """The category of a CPU op given its enclosing ops (outermost first): the first sticky enclosing category
    (a hybridq autograd Function, attention, the optimizer step), so the reference quantization's element-wise
    ops count as hybridq and attention's math fallback as attention; but a collective stays a collective and a
    GEMM stays a GEMM unless it is attention's (a quantized Linear's GEMMs are GEMMs)."""
    own = categorize(name)
    if own == "collectives":
        return own
    for a in ancestors:
        c = "hybridq" if a in hybridq_functions else categorize(a)
        if c in STICKY and (own != "gemm" or c == "attention"):
            return c
    return "hybridq" if name in hybridq_functions else own


def hybridq_function_names() -> frozenset[str]:
    """Profiler event names of hybridq's autograd Functions (`Cls` for forward, `ClsBackward`) and of the custom
    ops a compiled Linear runs as (`hybridq::linear_forward`, `hybridq::linear_backward`)."""
    import hybridq  # noqa: F401  (imports every module that defines one)
    names, todo = set(), list(torch.autograd.Function.__subclasses__())
    while todo:
        c = todo.pop()
        todo += c.__subclasses__()
        if c.__module__.startswith("hybridq") and not c.__name__.endswith("Backward"):
            names |= {c.__name__, c.__name__ + "Backward"}
    return frozenset(names | {"hybridq::linear_forward", "hybridq::linear_backward"})


# ---- profile events -> per-step numbers ------------------------------------------------------------

STEP_MARK = "profile_step#"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def is_device_work(name: str) -> bool:
    """False for the device-side events that are not kernels, copies or sets: the GPU copies of record_function
    ranges (also filtered by name) and synchronization records, which would count waiting as work."""
    return not name.startswith((STEP_MARK, "Context Sync", "Stream Sync", "Event Sync", "Stream Wait",
                                "Device Sync"))


def _ancestors(e) -> list[str]:
    out, p = [], e.cpu_parent
    while p is not None:
        out.append(p.name)
        p = p.cpu_parent
    return out[::-1]


def summarize_events(events, device_type: str, top: int, hq_functions: frozenset[str]) -> dict:
    """Per-step numbers from torch.profiler's FunctionEvents of the profiled steps (each inside a
    `profile_step#i` range): kernel (CPU: op self) time per category and per name, busy / idle / launches."""
    from torch.autograd import DeviceType
    # the host-side ranges only: on CUDA the profiler also records each range's GPU copy (a user annotation on the
    # device timeline), which counted as a second step once and halved every per-step number
    steps = sorted((e for e in events if e.name.startswith(STEP_MARK) and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    n = max(len(steps), 1)
    windows = [(s.time_range.start, s.time_range.end) for s in steps]
    annotations = {e.name for e in events if getattr(e, "is_user_annotation", False)}

    def step_of(t: float) -> int | None:
        for i, (a, b) in enumerate(windows):
            if a <= t <= b:
                return i
        return None

    by_cat = collections.Counter()
    by_coll = collections.Counter()  # collectives by kind
    by_name: dict[str, list] = {}  # name -> [total us, calls, category]
    busy = [[] for _ in windows]
    launches = 0
    if device_type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and is_device_work(e.name)
                   and e.name not in annotations and not getattr(e, "is_user_annotation", False)]
        for k in kernels:
            i = step_of(k.time_range.start)
            if i is None:
                continue
            dur, cat = k.time_range.end - k.time_range.start, categorize(k.name)
            busy[i].append((k.time_range.start, k.time_range.end))
            launches += 1
            by_cat[cat] += dur
            if cat == "collectives":
                by_coll[collective_kind(k.name)] += dur
            row = by_name.setdefault(k.name, [0.0, 0, cat])
            row[0] += dur
            row[1] += 1
    else:  # CPU ops: self time, so nested ops count once; the step ranges themselves are left out
        for e in events:
            if e.device_type != DeviceType.CPU or e.name.startswith(STEP_MARK):
                continue
            i = step_of(e.time_range.start)
            if i is None:
                continue
            cat = attribute(e.name, [a for a in _ancestors(e) if not a.startswith(STEP_MARK)], hq_functions)
            dur = e.self_cpu_time_total
            launches += e.name.startswith("aten::")
            by_cat[cat] += dur
            if cat == "collectives":
                by_coll[collective_kind(e.name)] += dur
            row = by_name.setdefault(e.name, [0.0, 0, cat])
            row[0] += dur
            row[1] += 1
        for i, (a, b) in enumerate(windows):  # the CPU is never idle within its own step
            busy[i].append((a, b))
    # GPU time of the kernels launched from inside hybridq's autograd Functions (torch.profiler links each
    # kernel to the op that launched it): separates hybridq's own element-wise work from the model's
    inside = collections.Counter()
    if device_type == "cuda":
        for e in events:
            # ops only ("ns::name"): the profiler also hangs a kernel on its own records (Activity Buffer Request)
            if e.device_type == DeviceType.CPU and e.kernels and "::" in e.name \
                    and step_of(e.time_range.start) is not None \
                    and (e.name in hq_functions or any(a in hq_functions for a in _ancestors(e))):
                for k in e.kernels:
                    inside[categorize(k.name)] += k.duration
    # host time inside hybridq's autograd Functions: the outermost ones only (inclusive: their ops and launches)
    hq_host = sum(e.time_range.end - e.time_range.start for e in events
                  if e.name in hq_functions and step_of(e.time_range.start) is not None
                  and not any(a in hq_functions for a in _ancestors(e)))
    hq_calls = sum(1 for e in events if e.name in hq_functions and step_of(e.time_range.start) is not None)
    wall = [b - a for a, b in windows]
    busy_us = [union_us(iv) for iv in busy]
    kernel_total = sum(by_cat.values())
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "profiled_steps": len(steps),
        "categories_ms": {c: by_cat.get(c, 0.0) / n / 1e3 for c in CATEGORIES},
        "collectives_ms": {c: by_coll.get(c, 0.0) / n / 1e3 for c in COLLECTIVE_KINDS},
        "kernel_total_ms": kernel_total / n / 1e3,
        "step_wall_ms": statistics.fmean(wall) / 1e3 if wall else float("nan"),
        "busy_ms": statistics.fmean(busy_us) / 1e3 if busy_us else float("nan"),
        "idle_ms": statistics.fmean(w - b for w, b in zip(wall, busy_us)) / 1e3 if wall else float("nan"),
        "launches_per_step": launches / n,
        "inside_hybridq_functions_ms": {c: inside.get(c, 0.0) / n / 1e3 for c in CATEGORIES},
        "hybridq_host_ms": hq_host / n / 1e3,
        "hybridq_function_calls_per_step": hq_calls / n,
        "top": [{"name": k, "category": v[2], "total_ms_per_step": v[0] / n / 1e3, "calls_per_step": v[1] / n,
                 "avg_us": v[0] / max(v[1], 1)} for k, v in tops],
    }


# ---- running the steps ------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: int, model, optimizer, data: ByteBatches, targs, env, quantized: bool) -> tuple[float, float]:
    """One train.py step; (host seconds to issue it, wall seconds until the device finished it)."""
    torch.manual_seed((targs.seed * 1_000_003 + step) * 4099 + env.dp_rank)  # as train.py: stochastic rounding
    x, y = data.get(step)
    t0 = time.perf_counter()
    x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
    loss = train.train_step(model, optimizer, x, y, targs, quantized)
    t1 = time.perf_counter()
    loss_val = train.all_mean(loss, env)  # as train.py: the logged loss's all-reduce, a sync point
    sync(env.device)
    t2 = time.perf_counter()
    if not math.isfinite(loss_val):
        raise RuntimeError(f"loss is {loss_val} at step {step}")
    return t1 - t0, t2 - t0


ALLOC_KEYS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
              "inactive_split_bytes.all.current", "inactive_split_bytes.all.peak", "reserved_bytes.all.current")


def allocator_counters(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {k: s.get(k) for k in ALLOC_KEYS}


def step_stats(times: list[float], host: list[float]) -> dict:
    med = statistics.median(times)
    srt = sorted(times)
    p90 = srt[min(len(srt) - 1, math.ceil(0.9 * len(srt)) - 1)]
    return {"n": len(times), "median_ms": med * 1e3, "p90_ms": p90 * 1e3, "max_ms": max(times) * 1e3,
            "min_ms": min(times) * 1e3, "host_median_ms": statistics.median(host) * 1e3,
            "jitter_steps": [{"step": i, "ms": t * 1e3, "x_median": t / med} for i, t in enumerate(times)
                             if t > JITTER * med],
            "step_ms": [t * 1e3 for t in times]}


def profile_recipe(recipe: str, a, targs, env, tokens: torch.Tensor, hq_functions: frozenset[str]) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function
    quiet = Printer(False, bar=False)
    model, optimizer = train.build(recipe, targs, env, quiet)
    data = ByteBatches(tokens, targs.seq, targs.batch, dp_rank=env.dp_rank, dp_size=targs.dp, seed=targs.seed)
    quantized = recipe != BASELINE
    step = 0
    for _ in range(a.warmup):
        timed_step(step, model, optimizer, data, targs, env, quantized)
        step += 1
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    prof_host, prof_wall = [], []
    with profile(activities=acts) as prof:
        for i in range(a.steps):
            with record_function(f"{STEP_MARK}{i}"):
                h, w = timed_step(step, model, optimizer, data, targs, env, quantized)
            prof_host.append(h)
            prof_wall.append(w)
            step += 1
    if a.trace_dir:
        pathlib.Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(pathlib.Path(a.trace_dir) / f"{recipe}.json"))
    res = summarize_events(prof.events(), env.device.type, a.top, hq_functions)
    res["host_top"] = host_top(prof, a.steps, a.top)
    res["profiled_host_ms"] = statistics.fmean(prof_host) * 1e3
    res["profiled_wall_ms_perf_counter"] = statistics.fmean(prof_wall) * 1e3
    del prof
    before = allocator_counters(env.device)
    times, host = [], []
    for _ in range(a.timed_steps):
        h, w = timed_step(step, model, optimizer, data, targs, env, quantized)
        host.append(h)
        times.append(w)
        step += 1
    after = allocator_counters(env.device)
    res["timed"] = step_stats(times, host) if times else None
    res["allocator"] = {"before": before, "after": after}
    if env.device.type == "cuda":
        res["peak_memory_bytes"] = torch.cuda.max_memory_allocated(env.device)
    res["recipe"] = recipe
    del model, optimizer
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)
    return res


def host_top(prof, steps: int, top: int) -> list[dict]:
    """The ops with the most self CPU time (where the host time of a step goes), per step."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps, "calls": e.count / steps}
            for e in rows[:top] if not e.key.startswith(STEP_MARK)]


# ---- printing ---------------------------------------------------------------------------------------

def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]])


def category_table(results: list[dict], device_type: str) -> str:
    unit = "GPU kernel ms/step" if device_type == "cuda" else "CPU op self ms/step"
    ref = next((r for r in results if r["recipe"] == BASELINE), None)
    head = ["category"] + [f"{r['recipe']} ({unit})" for r in results] + [f"{r['recipe']} vs {BASELINE}"
                                                                          for r in results if ref and r is not ref]
    rows = [head]

    def ratio(r, v, rv) -> str:
        return f"{v / rv:.2f}x" if rv > 0 else ("-" if v == 0 else "new")

    for c in CATEGORIES:
        row = [LABELS[c]]
        for r in results:
            v, tot = r["categories_ms"][c], r["kernel_total_ms"]
            row.append(f"{v:8.2f} ({v / tot:5.1%})" if tot > 0 else f"{v:8.2f}")
        row += [ratio(r, r["categories_ms"][c], ref["categories_ms"][c]) for r in results if ref and r is not ref]
        rows.append(row)
    extra = [("total kernel time", "kernel_total_ms"), ("busy (union of kernels)" if device_type == "cuda"
                                                        else "busy (step wall)", "busy_ms"),
             ("idle (wall - busy)", "idle_ms"), ("step wall (profiled)", "step_wall_ms"),
             ("host time to issue a step", "profiled_host_ms"), ("hybridq Functions host ms", "hybridq_host_ms")]
    for label, key in extra:
        rows.append([label] + [f"{r[key]:8.2f}" for r in results]
                    + [ratio(r, r[key], ref[key]) for r in results if ref and r is not ref])
    for label, key in (("kernel launches / step" if device_type == "cuda" else "aten ops / step",
                        "launches_per_step"), ("hybridq Function calls / step", "hybridq_function_calls_per_step")):
        rows.append([label] + [f"{r[key]:.0f}" for r in results] + ["" for r in results if ref and r is not ref])
    return fmt_table(rows)


def collectives_table(results: list[dict]) -> str:
    """The collectives row split by kind: FSDP2's parameter all-gathers and gradient reduce-scatters, the loss's and
    precompute_scales' all-reduces."""
    rows = [["collective"] + [r["recipe"] for r in results]]
    for c in COLLECTIVE_KINDS:
        if any(r["collectives_ms"][c] for r in results):
            rows.append([c] + [f"{r['collectives_ms'][c]:8.2f}" for r in results])
    return fmt_table(rows)


def inside_table(results: list[dict]) -> str:
    """Kernel time launched from inside hybridq's autograd Functions, per category (quantized recipes)."""
    rows = [["category"] + [r["recipe"] for r in results]]
    for c in CATEGORIES:
        if any(r["inside_hybridq_functions_ms"][c] for r in results):
            rows.append([LABELS[c]] + [f"{r['inside_hybridq_functions_ms'][c]:8.2f}" for r in results])
    rows.append(["total"] + [f"{sum(r['inside_hybridq_functions_ms'].values()):8.2f}" for r in results])
    return fmt_table(rows)


def top_table(r: dict, width: int = 110) -> str:
    rows = [["kernel", "category", "ms/step", "calls/step", "avg us"]]
    for t in r["top"]:
        name = t["name"] if len(t["name"]) <= width else t["name"][:width - 3] + "..."
        rows.append([name, t["category"], f"{t['total_ms_per_step']:.2f}", f"{t['calls_per_step']:.0f}",
                     f"{t['avg_us']:.1f}"])
    return fmt_table(rows)


def timing_lines(r: dict) -> list[str]:
    t = r["timed"]
    if t is None:
        return [f"[{r['recipe']}] no timed steps"]
    out = [f"[{r['recipe']}] {t['n']} steps without the profiler: median {t['median_ms']:.1f} ms, p90 {t['p90_ms']:.1f}"
           f", max {t['max_ms']:.1f}, min {t['min_ms']:.1f}; host issue time median {t['host_median_ms']:.1f} ms"]
    js = t["jitter_steps"]
    out.append(f"[{r['recipe']}] steps > {JITTER}x median: "
               + (", ".join(f"#{j['step']} {j['ms']:.1f} ms ({j['x_median']:.2f}x)" for j in js) if js else "none"))
    al = r["allocator"]
    if al["before"]:
        out.append(f"[{r['recipe']}] allocator before -> after the timed steps: "
                   + ", ".join(f"{k} {al['before'][k]} -> {al['after'][k]}" for k in ALLOC_KEYS))
    return out


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
    a = p.parse_args(argv)
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
        results = []
        for r in a.recipe_list:
            t0 = time.perf_counter()
            results.append(profile_recipe(r, a, targs, env, tokens, hq))
            print(f"[{r}] done in {time.perf_counter() - t0:.1f} s", flush=True)
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
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as train.py: no interpreter finalization with gloo worker threads still alive
