"""The end-to-end report's tables (rows against bf16, weak scaling), its parity plot and its header."""

from __future__ import annotations

import datetime
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

from e2e_plan import (BASELINE, NORM_BASELINE, TORCHAO, label, torchao_status, train_flags,  # noqa: E402
                      train_option)
from metrics import fmt_bytes  # noqa: E402


def window_mean(losses: list[float], n: int) -> float:
    w = max(1, n // 10)
    return statistics.fmean(losses[n - w:n])


def fmt_mem(b) -> str:
    return fmt_bytes(b, gib_digits=1)


def rows_for(results: list[dict]) -> list[dict]:
    """Each run's row with its loss gap and speed against bf16 run the same way (eager / compiled, same world
    size)."""
    out = []
    for r in results:
        row = dict(r)
        if r.get("skip"):
            out.append(row)
            continue
        ref = next((x for x in results if x.get("base", x["recipe"]) == BASELINE and x.get("losses")
                    and x.get("compiled", False) == r.get("compiled", False) and x.get("nproc") == r.get("nproc")),
                   None)
        n = len(r["losses"])
        row["loss"] = window_mean(r["losses"], n) if n else None
        row["loss_at"] = n
        if ref is not None and n and r is not ref:
            k = min(n, len(ref["losses"]))
            a, b = window_mean(r["losses"], k), window_mean(ref["losses"], k)
            row["gap"], row["gap_rel"], row["gap_at"] = a - b, a / b - 1, k
        if ref is not None and r["tokens_per_s"] and ref["tokens_per_s"]:
            row["speed_vs_bf16"] = r["tokens_per_s"] / ref["tokens_per_s"]
        vals = (r.get("val_loss"), ref.get("val_loss") if ref is not None else None)
        if r is not ref and all(isinstance(v, float) and v == v for v in vals):
            row["val_gap_rel"] = vals[0] / vals[1] - 1
        out.append(row)
    return out


def markdown(rows: list[dict], header: list[str]) -> str:
    lines = header + ["",
                      "| recipe | status | steps | tokens/s | vs bf16 | peak mem | all-gather/rank/step | "
                      "reduce-scatter/rank/step | TP gathers/rank/step | loss (last 10% of steps) | "
                      "gap vs bf16 (same steps) | val loss | command |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skip"):
            lines.append(f"| {r['recipe']} | skipped: {r['skip'].replace('|', '/')} |" + " - |" * 11)
            continue
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        vs = f"{r['speed_vs_bf16']:.2f}x" if r.get("speed_vs_bf16") else "-"
        loss = f"{r['loss']:.4f} @ {r['loss_at']}" if r.get("loss") is not None else "-"
        gap = (f"{r['gap']:+.4f} ({r['gap_rel']:+.2%}) @ {r['gap_at']}" if r.get("gap") is not None
               else ("(reference)" if r.get("base", r["recipe"]) == BASELINE else "-"))
        val = f"{r['val_loss']:.4f}" if isinstance(r.get("val_loss"), float) and r["val_loss"] == r["val_loss"] else "-"
        if r.get("val_gap_rel") is not None:
            val += f" ({r['val_gap_rel']:+.2%})"
        status = r["status"].replace("|", "/")
        lines.append(f"| {r['recipe']} | {status} | {r['steps_done']} | {tps} | {vs} | {fmt_mem(r['peak_memory_bytes'])} "
                     f"| {fmt_mem(r.get('allgather_bytes'))} | {fmt_mem(r.get('reduce_scatter_bytes'))} "
                     f"| {fmt_mem(r.get('tp_bytes'))} | {loss} | {gap} | {val} | `{r['command']}` |")
    return "\n".join(lines)


def scaling_rows(rows: list[dict]) -> list[dict]:
    """Weak scaling per recipe: tokens/s per process and its efficiency against the same recipe (eager / compiled)
    at the smallest world size that produced a speed."""
    out = []
    for r in rows:
        if r.get("skip") or not r.get("tokens_per_s") or r.get("nproc") is None:
            continue
        same = [x for x in rows if not x.get("skip") and x.get("tokens_per_s") and x.get("base") == r.get("base")
                and x.get("compiled", False) == r.get("compiled", False) and x.get("nproc") is not None]
        first = min(same, key=lambda x: x["nproc"])
        per = r["tokens_per_s"] / r["nproc"]
        out.append({"recipe": label(r["base"], r.get("compiled", False)), "nproc": r["nproc"],
                    "tokens_per_s": r["tokens_per_s"], "per_process": per,
                    "efficiency": per / (first["tokens_per_s"] / first["nproc"]), "from_nproc": first["nproc"],
                    "speed_vs_bf16": r.get("speed_vs_bf16"), "peak_memory_bytes": r.get("peak_memory_bytes"),
                    "allgather_bytes": r.get("allgather_bytes")})
    return sorted(out, key=lambda x: (x["recipe"] != BASELINE, x["recipe"], x["nproc"]))


def scaling_markdown(rows: list[dict]) -> str:
    lines = ["| recipe | processes | tokens/s | tokens/s per process | scaling efficiency | vs bf16 (same size) | "
             "peak mem | all-gather/rank/step |", "|---|---|---|---|---|---|---|---|"]
    for r in scaling_rows(rows):
        vs = f"{r['speed_vs_bf16']:.2f}x" if r.get("speed_vs_bf16") else "-"
        lines.append(f"| {r['recipe']} | {r['nproc']} | {r['tokens_per_s']:,.0f} | {r['per_process']:,.0f} | "
                     f"{r['efficiency']:.0%} (vs {r['from_nproc']}) | {vs} | {fmt_mem(r['peak_memory_bytes'])} | "
                     f"{fmt_mem(r['allgather_bytes'])} |")
    return "\n".join(lines)


def write_parity_plot(results: list[dict], png: pathlib.Path) -> str:
    """Every run's training-loss curve (moving mean over 10 steps, log scale) and, beside it, each run's relative
    gap to bf16's curve at the same step (the curves overlap at loss scale); returns what was done."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install -e '.[launch]'); {png.name} not written"

    def smooth(losses: list[float]) -> list[float]:
        w = min(10, len(losses))
        return [statistics.fmean(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]

    ref = next((smooth(r["losses"]) for r in results if r.get("base", r["recipe"]) == BASELINE and r.get("losses")),
               None)
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in results:
        losses = r.get("losses") or []
        if not losses:
            continue
        sm = smooth(losses)
        (line,) = ax.plot(range(1, len(sm) + 1), sm, lw=1.2, label=r["recipe"])
        if ref is not None and r.get("base", r["recipe"]) != BASELINE:
            n = min(len(sm), len(ref))
            gx.plot(range(1, n + 1), [100 * (sm[i] / ref[i] - 1) for i in range(n)], lw=1.0, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, mean of 10 steps)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    gx.axhline(0, color="k", lw=0.8)
    gx.set_ylim(-5, 5)
    gx.set_xlabel("step")
    gx.set_ylabel(f"gap to {BASELINE} at the same step (%, 10-step means)")
    gx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"wrote {png}"


def describe(a, nproc: int) -> list[str]:
    """The report's header; under --scaling `nproc` stands for each world size of a.scaling."""
    import torch
    import config
    cfg = config.model_config(config.parse_args(train_flags(a)))  # the shape train.py builds from these very flags
    cuda = a.device != "cpu" and torch.cuda.is_available()
    sizes = ",".join(map(str, a.scaling)) if a.scaling else str(nproc)
    dev = f"{sizes}x {torch.cuda.get_device_name(0)} (NCCL)" if cuda else f"{sizes} CPU processes (gloo)"
    grad_wire = train_option(a.train_args or "", "--grad-reduce", "fp32")
    grad_wire = "fp32" if grad_wire == "fp32" else f"{grad_wire} (hybridq presets; fp32 in the baselines)"
    ao = torchao_status()
    if ao is None:
        import torchao
        ao = f"torchao {getattr(torchao, '__version__', '?')}"
    return [f"End-to-end report, {datetime.date.today().isoformat()}: {dev}, torch {torch.__version__}, {ao}.",
            f"Model: {cfg.shape_line()}; seq {a.seq} x batch {a.batch} per rank x {sizes} ranks = "
            f"{'/'.join(f'{a.seq * a.batch * n:,}' for n in a.scaling or [nproc])} tokens/step; {a.steps} steps "
            f"(lr {a.lr}, cosine), "
            f"{'corpus.txt' if not a.corpus_bytes else f'{a.corpus_bytes:,} generated bytes'}, FSDP2 bf16 params / "
            f"{grad_wire} gradient reduce-scatter. tokens/s: median after step 1; peak mem: rank 0 (GPU: max "
            "allocated); all-gather (FSDP2's parameters), reduce-scatter (its gradients) and TP gathers (sequence "
            "parallelism, both directions; '-' without --tp): the bytes rank 0 hands to each per step (median; "
            "launch/comm.py); loss: mean of the last 10% of the steps done; gap: vs bf16 over the same "
            "steps.",
            {"auto": f"RMSNorm: hybridq.RMSNorm in the hybridq presets' runs (their conversion swaps it in), the model's "
                     f"own in {BASELINE} and {TORCHAO}" + (f" ({NORM_BASELINE}: {BASELINE} with hybridq.RMSNorm)"
                                                          if getattr(a, "norm_baseline", False) else "") + ".",
             "hybridq": "RMSNorm: hybridq.RMSNorm in every run (--norms hybridq).",
             "model": "RMSNorm: the model's own in every run (--norms model)."}[
                train_option(a.train_args or "", "--norms", "auto")]]
