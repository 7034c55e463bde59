"""One run of the end-to-end report: train.py under torchrun with a time limit, its result read from the metrics
file (or from an earlier finished run's)."""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

from e2e_plan import command, run_name, show, train_recipe  # noqa: E402
from metrics import read_metrics, runs_of  # noqa: E402


def step_records(path: pathlib.Path, recipe: str) -> list[dict]:
    """The step records of `recipe` in a train.py metrics file (none when the file is missing)."""
    if not path.exists():
        return []
    return [r for r in read_metrics(path) if r.get("kind") == "step" and r.get("recipe") == recipe]


def last_error(text: str) -> str:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    for l in reversed(lines):
        if "OutOfMemoryError" in l or "out of memory" in l.lower():
            return "CUDA out of memory"
    for l in reversed(lines):
        if l.startswith("train.py:") or "Error" in l:
            return l[:200]
    return lines[-1][:200] if lines else "no output"


# the train.py flags that must match for a finished run to stand for the one asked for
SAME_RUN = ("d_model", "n_layers", "n_heads", "hidden", "seq", "batch", "steps", "lr", "eval_batches", "compile",
            "corpus_bytes", "grad_reduce")
FLAG_SINCE = {"grad_reduce": "fp32"}  # a flag newer than some metrics files: what their runs did
WIRES = ("allgather", "reduce_scatter", "tp")  # train.py's bytes per step and wire (launch/comm.py)


def summary_bytes(summary: dict) -> dict:
    """A run's bytes per step and wire from its summary record: {"allgather_bytes": ..., ...} (None: not counted)."""
    return {f"{w}_bytes": summary.get(f"{w}_bytes_per_step") for w in WIRES}


def steps_bytes(steps: list[dict]) -> dict:
    """The same from the step records of a run cut short: the median of each wire's bytes over its steps."""
    return {f"{w}_bytes": median_or_none([s.get(f"{w}_bytes") for s in steps]) for w in WIRES}


def finished_status(summary: dict) -> str:
    """"ok", or "ok, N graph break(s)" for a compiled run whose blocks broke (they ran partly eagerly: the summary's
    counts from launch/compile_report.py)."""
    return f"ok, {summary['graph_breaks']} graph break(s)" if summary.get("graph_breaks") else "ok"


def finished_run(a, recipe: str, nproc: int, out_dir: pathlib.Path, compiled: bool = False) -> dict | None:
    """The result of an earlier finished run of `recipe` with this plan's sizes, read from its metrics file in
    `out_dir`, or None (no file, a run cut short, other sizes or world size)."""
    cmd = command(a, recipe, nproc, out_dir, compiled)
    name = run_name(a, recipe, compiled, nproc)
    js = out_dir / f"{name}.jsonl"
    if not js.exists():
        return None
    records = read_metrics(js)
    config = next((r for r in records if r.get("kind") == "config"), None)
    summary = runs_of(records).get(train_recipe(recipe)[0])
    if config is None or summary is None or summary["start_step"] + summary["steps_run"] != a.steps:
        return None
    want = {k: v for k, v in vars(parse_args_for_train(cmd)).items() if k in SAME_RUN}
    got = {k: config["args"].get(k, FLAG_SINCE.get(k)) for k in want}
    if got != want or config.get("world_size") != nproc:
        return None
    return {"recipe": name, "base": recipe, "compiled": compiled, "nproc": nproc, "command": show(cmd), "rc": 0,
            "wall_s": 0.0, **summary_bytes(summary),
            "log": str(out_dir / f"{name}.log"), "status": finished_status(summary) + " (reused)", "metrics": str(js),
            "steps_done": a.steps, "losses": summary["losses"], "tokens_per_s": summary["median_tokens_per_s"],
            "peak_memory_bytes": summary["peak_memory_bytes"], "memory_kind": summary["peak_memory_kind"],
            "val_loss": summary["val_loss"], "device_name": config.get("device_name"), "torch": config.get("torch")}


def parse_args_for_train(cmd: list[str]) -> argparse.Namespace:
    """train.py's parsed flags for one of our commands (to compare with a metrics file's config record)."""
    import config as train_config
    return train_config.parse_args(cmd[cmd.index("launch/train.py") + 1:])


def run_one(a, recipe: str, nproc: int, out_dir: pathlib.Path, limit_s: float, compiled: bool = False) -> dict:
    cmd = command(a, recipe, nproc, out_dir, compiled)
    name = run_name(a, recipe, compiled, nproc)
    log = out_dir / f"{name}.log"
    js = out_dir / f"{name}.jsonl"
    js.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    print(f"\n=== {name}: limit {limit_s:.0f} s\n{show(cmd)}", flush=True)
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):  # torchrun and its workers
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    steps = step_records(js, train_recipe(recipe)[0])
    res = {"recipe": name, "base": recipe, "compiled": compiled, "nproc": nproc, "command": show(cmd), "rc": rc,
           "wall_s": wall, "log": str(log), "steps_done": 0, "losses": [], "tokens_per_s": None,
           "peak_memory_bytes": None, "memory_kind": None, "val_loss": None, **dict.fromkeys(summary_bytes({}))}
    summary = runs_of(read_metrics(js)).get(train_recipe(recipe)[0]) if js.exists() else None
    if summary is not None and rc == 0:
        m = summary
        res.update(steps_done=m["start_step"] + m["steps_run"], losses=m["losses"],
                   tokens_per_s=m["median_tokens_per_s"], peak_memory_bytes=m["peak_memory_bytes"],
                   memory_kind=m["peak_memory_kind"], val_loss=m["val_loss"], metrics=str(js),
                   status=finished_status(m),
                   **summary_bytes(m))
    else:
        if steps:
            tps = [s["tokens_per_s"] for s in steps[1:]] or [steps[0]["tokens_per_s"]]  # step 1 includes warm-up
            res.update(steps_done=steps[-1]["step"], losses=[s["loss"] for s in steps],
                       tokens_per_s=statistics.median(tps), peak_memory_bytes=max(s["peak_memory_bytes"] for s in steps),
                       memory_kind=steps[-1]["peak_memory_kind"], **steps_bytes(steps))
        if timed_out:
            res["status"] = f"time limit ({limit_s:.0f} s) after {res['steps_done']} of {a.steps} steps"
        else:
            res["status"] = f"failed (exit {rc}: {last_error(text)})"
    print(f"--> {res['status']}, {res['steps_done']} steps, {wall:.0f} s", flush=True)
    return res


def median_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
