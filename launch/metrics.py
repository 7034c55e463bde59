"""The training job's output: the console (rank 0), the metrics file (JSON lines), the summary and the plot.

The metrics file has one JSON object per line, each with a "kind":

    {"kind": "config", ...}                      the flags, world size, backend, device, torch version
    {"kind": "step", "recipe", "step", "steps", "loss", "lr", "tokens_per_s", "step_ms", "peak_memory_bytes",
     "peak_memory_kind", "allgather_bytes",      one per logged step (what the step line prints; the bytes this
     "reduce_scatter_bytes"[, "tp_bytes"]}       rank handed to FSDP2's parameter all-gathers, to its gradient
                                                 reduce-scatters and, with --tp, to the tensor-parallel gathers and
                                                 reduce-scatters of both directions during the step: launch/comm.py)
    {"kind": "summary", "recipe", ...}           one per finished run: every loss, the medians, val loss
    {"kind": "gap", ...}                         with --compare: recipe minus compare

Lines are flushed as they are written, so a run that is killed leaves its steps readable. benchmarks/e2e_report.py
and the plot read this file; nothing parses the console text.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import sys


class Printer:
    """Rank 0 prints; on a terminal a progress bar stays on the last line under the per-step lines."""

    def __init__(self, main: bool, bar: bool):
        self.on = main
        self.bar = bar and main and sys.stdout.isatty()
        self._bar_shown = False

    def __call__(self, *msg) -> None:
        if not self.on:
            return
        if self._bar_shown:
            sys.stdout.write("\r\033[K")
            self._bar_shown = False
        print(*msg, flush=True)

    def progress(self, name: str, done: int, total: int, eta_s: float) -> None:
        if not self.bar:
            return
        width = 30
        fill = int(width * done / max(total, 1))
        eta = str(datetime.timedelta(seconds=int(eta_s)))
        sys.stdout.write(f"\r\033[K{name} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} eta {eta}")
        sys.stdout.flush()
        self._bar_shown = True

    def end_progress(self) -> None:
        if self._bar_shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self._bar_shown = False


class MetricsFile:
    """Rank 0 appends JSON lines to `path` (None: nothing is written). The file is truncated at start."""

    def __init__(self, path: str | None, main: bool):
        self.path = pathlib.Path(path) if path and main else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "w")

    def write(self, kind: str, **record) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps({"kind": kind, **record}, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The records of a metrics file; a last line cut short by a kill is ignored."""
    records = []
    for line in pathlib.Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def runs_of(records: list[dict]) -> dict[str, dict]:
    """recipe -> its summary record."""
    return {r["recipe"]: r for r in records if r.get("kind") == "summary"}


def fmt_bytes(n: float | None, gib_digits: int = 2) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.{gib_digits}f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def summarize(results: list[dict], out: Printer) -> dict:
    """Print the summary table, the loss curve and (two runs) the gap; return the gap record ({} if none).
    A run that trained no step this invocation (resumed at its last step) shows '-' for its speed."""
    tp = any(r.get("tp_bytes_per_step") is not None for r in results)
    rows = [["run", "steps", "first loss", "final loss", "val loss", "tokens/s", "step ms", "peak mem",
             "all-gather/step", "reduce-scatter/step"] + (["TP/step"] if tp else []) + ["wall s"]]
    for r in results:
        first = f"{r['losses'][0]:.4f}" if r["losses"] else "-"
        rows.append([r["recipe"], f"{r['start_step'] + r['steps_run']}", first, _num(r["final_loss"], ".4f"),
                     _num(r["val_loss"], ".4f"), _num(r["median_tokens_per_s"], ",.0f"),
                     _num(r["median_step_s"] and r["median_step_s"] * 1e3, ".1f"),
                     fmt_bytes(r["peak_memory_bytes"]), fmt_bytes(r.get("allgather_bytes_per_step")),
                     fmt_bytes(r.get("reduce_scatter_bytes_per_step"))]
                    + ([fmt_bytes(r.get("tp_bytes_per_step"))] if tp else []) + [f"{r['wall_s']:.1f}"])
    out("\nsummary (final loss: mean of the last 10% of steps; tokens/s and step ms: medians after step 1; "
        f"{results[0]['peak_memory_kind']} and the bytes rank 0 hands to each kind of collective per step, "
        "launch/comm.py):")
    out(table(rows, right=set(range(1, len(rows[0])))))
    n = max(len(r["losses"]) for r in results)
    if n:
        marks = sorted({max(1, round(n * k / 10)) for k in range(1, 11)} | {1})
        curve = [["step"] + [str(m) for m in marks]]
        for r in results:
            curve.append([r["recipe"]] + [f"{r['losses'][m - 1]:.3f}" if m <= len(r["losses"]) else "-"
                                          for m in marks])
        out("\nloss curve:")
        out(table(curve, right=set(range(1, len(marks) + 1))))
    gap: dict = {}
    if len(results) == 2:
        a, b = results
        gap = {"recipe": a["recipe"], "compare": b["recipe"],
               "final_loss": a["final_loss"] - b["final_loss"], "val_loss": a["val_loss"] - b["val_loss"],
               "final_loss_rel": a["final_loss"] / b["final_loss"] - 1,
               "val_loss_rel": a["val_loss"] / b["val_loss"] - 1}
        line = (f"\nloss gap {a['recipe']} - {b['recipe']}: final {gap['final_loss']:+.4f} "
                f"({gap['final_loss_rel']:+.2%}), val {_num(gap['val_loss'], '+.4f')} "
                f"({_num(gap['val_loss_rel'], '+.2%')})")
        if a["median_tokens_per_s"] is not None and b["median_tokens_per_s"] is not None:
            gap["speed_ratio"] = a["median_tokens_per_s"] / b["median_tokens_per_s"]
            line += f"; tokens/s ratio {gap['speed_ratio']:.2f}x"
            if a["peak_memory_kind"] == "peak RSS":
                line += " (CPU: quantization is emulated in PyTorch, so slower than bf16 here)"
        else:
            line += "; no tokens/s ratio (a run trained no step in this invocation)"
        out(line)
    return gap


def write_plot(png: str, metrics_path: pathlib.Path, out: Printer) -> None:
    """Loss curves of the runs in the metrics file, to `png` (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out(f"no plot: matplotlib is not installed (pip install matplotlib, or pip install -e '.[launch]') -- "
            f"{png} was not written; the metrics are in {metrics_path}")
        return
    records = read_metrics(metrics_path)
    cfg = next(r for r in records if r["kind"] == "config")
    gap = next((r for r in records if r["kind"] == "gap"), None)
    p = pathlib.Path(png)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in runs_of(records).items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, lw=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    a = cfg["args"]
    title = f"{a['n_layers']}x{a['d_model']} decoder, seq {a['seq']}, {cfg['world_size']} x {cfg['backend']}"
    if gap:
        title += f"; final gap {gap['final_loss']:+.3f}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    out(f"wrote {p} (metrics: {metrics_path})")
