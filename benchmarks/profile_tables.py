"""profile_step.py's tables: time per category side by side per recipe, the collectives by kind, the time inside
hybridq's Functions, the top kernels and the step-time lines."""

from __future__ import annotations

from profile_events import CATEGORIES, COLLECTIVE_KINDS, LABELS

from config import BASELINE  # noqa: E402 (launch/config.py: the reference column)
JITTER = 1.3  # a step slower than this x the median is listed
ALLOC_KEYS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
              "inactive_split_bytes.all.current", "inactive_split_bytes.all.peak", "reserved_bytes.all.current")


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


def process_text(p: dict) -> str:
    """profile_step.process_summary in words, per timed step."""
    parts = [f"process CPU {p['process_cpu_ms']:.1f} ms", f"{p['involuntary_switches']:.1f} involuntary switches"]
    if "minor_faults" in p:
        parts[1] += f", {p['minor_faults']:.0f} minor page faults"
    if "steal_pct" in p:
        parts.append(f"machine CPU stolen {p['steal_pct']:.1f}%")
    if "cuda_mallocs" in p:
        parts.append(f"cudaMalloc {p['cuda_mallocs']} / cudaFree {p['cuda_frees']} / retries {p['alloc_retries']} "
                     "over the steps")
    return "per step: " + ", ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else "")


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
    if r.get("process"):
        out.append(f"[{r['recipe']}] {process_text(r['process'])}")
    return out
