"""Where a profiled step's GPU waits for the host: the idle gaps between kernels of a torch.profiler chrome trace
(`profile_step.py --trace-dir`), each split by what the host thread that ended it was doing during the gap.

A gap before kernel K is the host's doing when K started within `--slack-us` of its launch (the GPU had nothing
queued: it waited for the launch); otherwise K waited on something else (a stream wait, a collective) and the gap is
counted as "queued". A host-caused gap's time is split over the profiler ranges (cpu ops, record_function ranges) of
the launching thread that were running during it, down to `--level` levels of nesting (time in a range's children
below that level counts as the range's; time in no range is Python between ops). The main thread runs forward and the
optimizer, the autograd engine's thread backward. The table says which host work the GPU waited on, per step.

    python benchmarks/idle_gaps.py TRACE.json [--steps-mark profile_step#] [--slack-us 20] [--level 2] [--top 25]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re

_LAYER = re.compile(r"\(layers\.\d+\)")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                 "cudaMemsetAsync", "cudaLaunchCooperativeKernel")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _ranges_by_thread(events: list[dict], skip: tuple[str, ...]) -> dict:
    """Per (pid, tid): CPU ranges (cpu_op / user_annotation) as (start, end, path), sorted by start, where path is
    the names of the range and its enclosing ranges, outermost first (names starting with `skip` left out)."""
    by = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            by[(e["pid"], e["tid"])].append((float(e["ts"]), -float(e["dur"]), e["name"]))
    out = {}
    for key, v in by.items():
        v.sort()  # (start, then the longer range first: a parent before its children)
        stack, ranges = [], []
        for s, neg, name in v:
            e = s - neg
            while stack and stack[-1][1] <= s:
                stack.pop()
            path = (stack[-1][2] if stack else ()) + (() if name.startswith(skip) else (name,))
            stack.append((s, e, path))
            ranges.append((s, e, path))
        out[key] = ranges
    return out


def _split(ranges: list, starts: list, lo: float, hi: float, level: int) -> dict:
    """The window [lo, hi] of one thread split by the path (at most `level` names) of the innermost range running at
    each moment; () where none ran."""
    # the ranges overlapping the window with a path of <= level names (deeper ones count as their ancestor's)
    i = bisect.bisect_right(starts, hi)
    spans = [(max(s, lo), min(e, hi), path[:level]) for s, e, path in ranges[:i] if e > lo and s < hi]
    # sweep: at each moment the deepest (longest path, latest start) of the overlapping spans
    points = sorted({lo, hi, *(p for s, e, _ in spans for p in (s, e))})
    share = collections.Counter()
    for t0, t1 in zip(points, points[1:]):
        mid = (t0 + t1) / 2
        best = ()
        for s, e, path in spans:
            if s <= mid < e and len(path) >= len(best):
                best = path
        share[best] += t1 - t0
    return share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--slack-us", type=float, default=20.0, help="K started within this of its launch: host-bound gap")
    p.add_argument("--min-gap-us", type=float, default=2.0, help="gaps shorter than this are not counted")
    p.add_argument("--steps-mark", default="profile_step#", help="user_annotation name prefix of a profiled step")
    p.add_argument("--level", type=int, default=2, help="how many enclosing range names make an attribution key")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--per-layer", dest="by_layer_kind", action="store_false",
                   help="keep FSDP's per-layer ranges apart (default: summed over layers)")
    a = p.parse_args()

    events = _load(a.trace)
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(a.steps_mark)
                   and "dur" in e)
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and e["name"].startswith(_LAUNCH_NAMES):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS and "dur" in e),
                 key=lambda e: float(e["ts"]))
    skip = (a.steps_mark, "ProfilerStep", "## ", "Torch-Compiled Region", "TorchDynamo")
    ranges = _ranges_by_thread(events, skip)
    starts = {k: [r[0] for r in v] for k, v in ranges.items()}
    main_tid = collections.Counter((e["pid"], e["tid"]) for e in launches.values()).most_common(1)
    threads = {}

    def thread_name(key) -> str:
        if key not in threads:
            threads[key] = f"thread {len(threads)}"
        return threads[key]

    if main_tid:
        thread_name(main_tid[0][0])

    host_idle = collections.Counter()
    queued_idle = collections.Counter()
    by_thread = collections.Counter()
    busy = idle = 0.0
    n_steps = max(1, len(steps))
    prev_end = None
    for k in gpu:
        ts, te = float(k["ts"]), float(k["ts"]) + float(k["dur"])
        if steps and not any(s <= ts <= e for s, e in steps):
            prev_end = None
            continue
        if prev_end is not None and ts - prev_end > a.min_gap_us:
            gap = ts - prev_end
            idle += gap
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and ts - (float(launch["ts"]) + float(launch["dur"])) <= a.slack_us:
                key_t = (launch["pid"], launch["tid"])
                for path, t in _split(ranges.get(key_t, []), starts.get(key_t, []), prev_end, ts, a.level).items():
                    where = _LAYER.sub("(layers.*)", " > ".join(path)) if a.by_layer_kind else " > ".join(path)
                    host_idle[(thread_name(key_t), where or "(between ops: Python)")] += t
                by_thread[thread_name(key_t)] += gap
            else:
                queued_idle[k["name"][:60]] += gap
        busy += te - ts if prev_end is None or ts >= prev_end else max(0.0, te - prev_end)
        prev_end = te if prev_end is None else max(prev_end, te)

    print(f"{a.trace}: {len(steps)} step(s); per step: GPU busy {busy / n_steps / 1e3:.2f} ms, idle between kernels "
          f"{idle / n_steps / 1e3:.2f} ms, of which waiting for a launch {sum(host_idle.values()) / n_steps / 1e3:.2f}"
          f" ms ({', '.join(f'{t} {v / n_steps / 1e3:.2f}' for t, v in by_thread.most_common())}; thread 0 = the "
          f"thread that launched most kernels)")
    print("\n| thread | host work during the gap (ranges, outermost first) | idle ms/step |\n|---|---|---|")
    for (t, where), v in host_idle.most_common(a.top):
        print(f"| {t} | {where[:110]} | {v / n_steps / 1e3:.2f} |")
    print("\n| queued gaps: kernel that ended the gap | idle ms/step |\n|---|---|")
    for name, v in queued_idle.most_common(8):
        print(f"| {name} | {v / n_steps / 1e3:.2f} |")


if __name__ == "__main__":
    main()
