"""The end-to-end report: the main job (launch/train.py under torchrun, FSDP2) at a size that fills the
GPUs, once per recipe -- bf16, every hybridq preset that runs under FSDP2, and torchao float8 (tensorwise,
float8 all-gather) where torchao imports -- and one markdown table: tokens/s, peak GPU memory, loss after the
steps done, loss gap vs bf16, and the exact command that reproduces each row.

    python benchmarks/e2e_report.py                      # 2 GPUs: ~1B-parameter model, seq 4096, fits ~9 minutes
    python benchmarks/e2e_report.py --dry-run            # print the commands only
    python benchmarks/e2e_report.py --device cpu --tiny  # CPU smoke test (2 gloo processes, tiny model)
    python benchmarks/e2e_report.py --compile            # every recipe eager and with train.py --compile, side by side
    python benchmarks/e2e_report.py --parity             # loss parity: ~127M model, 600 steps, every curve in parity.png
    python benchmarks/e2e_report.py --parity --reuse-finished --recipes bf16,nvfp4  # add runs to an earlier report
    python benchmarks/e2e_report.py --parity --no-baseline --recipes nvfp4           # one run, no bf16 (combine later)
    python benchmarks/e2e_report.py --scaling 1,2,4,8    # weak scaling: every recipe on 1, 2, 4 and 8 GPUs
    python benchmarks/e2e_report.py --size 7b            # a Llama-2-7B-shaped model (8 GPUs; sizes below)

Default size (2x H200, 141 GB each): d_model 2048, 20 layers, 16 heads (head_dim 128), SwiGLU hidden 5632
(= 44 x 128), untied byte-level head: 1.03B parameters. seq 4096 x batch 4 sequences per rank = 16,384 tokens per
GPU per step (32,768 per step on 2 GPUs). Every dimension is a multiple of 128, so the 32-blocks of MXFP8 and
NVFP4, the FP8 128-blocks and torchao's multiple-of-16 rule all hold, and the tokens per rank are a multiple of
32. No activation recompute: activations of ~16k tokens x 20 layers plus the sharded fp32 params, grads and
AdamW state (~8 GB per GPU) stay well below 141 GB (batch 8 would likely fit too, but an OOM costs a device
run; raise --batch once the peak memory of a first report is known).

--size 7b: d_model 4096, 32 layers, 32 heads, SwiGLU hidden 11008 (Llama-2-7B's shape; byte vocabulary): 6.48B
parameters, seq 4096 x batch 1 per rank. Per GPU on 8 ranks: ~13 GB of sharded fp32 params, grads and AdamW
state, plus the activations of 4,096 tokens x 32 layers (no recompute; ~30 GB in bf16); every rank first builds
the whole model on the CPU (26 GB of host memory each, ~1 minute) and moves it to its GPU before sharding it
(26 GB there for a moment), hence the longer per-run limit. One GPU cannot hold it (~104 GB of states alone).

--scaling N1,N2,...: weak scaling -- every planned recipe once per world size, the per-rank batch fixed (so tokens
per step grow with the GPUs); a second table gives tokens/s per GPU and the scaling efficiency against the same
recipe at the smallest world size. A world size larger than the GPUs visible is a skipped row, so one command
serves a 2-, 4- or 8-GPU machine. Every row also shows the bytes rank 0 sends in all-gathers per step (FSDP2's
parameter gathers; train.py counts them: launch/comm.py).

Time: each run is a separate torchrun (~20-30 s of start-up: CUDA/NCCL init, 1B-parameter init on the CPU).
A run stops at --steps or at its time limit, whichever comes first: the limit is min(--time-limit-s, the
total budget left / runs left), so the whole report stays inside --total-budget-s (default 510 s, for one
~10-minute device command). A run stopped by its limit is killed; its row then comes from the step records of its
metrics file (train.py --metrics: JSON lines, flushed per step) and says how many steps it did. Losses are compared with
bf16 at the same step (mean of the last 10% of the steps both did), since the lr schedule is that of --steps
for every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

from metrics import fmt_bytes, read_metrics, runs_of  # noqa: E402
BASELINE = "bf16"
TORCHAO = "torchao_float8"
# --norm-baseline: bf16 with hybridq.RMSNorm (train.py --recipe bf16 --norms hybridq), to show how much of a preset's
# speed is the norm kernel that its conversion swaps in, apart from quantization
NORM_BASELINE = "bf16+hybridq_rmsnorm"

# the default (GPU) size and the --tiny (CPU smoke test) size
FULL = {"d_model": 2048, "n_layers": 20, "n_heads": 16, "hidden": 5632, "seq": 4096, "batch": 4, "steps": 30,
        "lr": 1e-3, "eval_batches": 2, "corpus_bytes": 0}
TINY = {"d_model": 64, "n_layers": 1, "n_heads": 2, "hidden": None, "seq": 64, "batch": 2, "steps": 4,
        "lr": 3e-3, "eval_batches": 1, "corpus_bytes": 0}
# --parity: a ~127M-parameter model trained long enough for loss gaps to mean something (600 steps with a 10%
# warm-up, the same data order for every recipe: batches are a pure function of seed, step and rank), on 20 MB of
# generated text: 600 x 16,384 tokens would go ~50 times over the shipped 200 KB corpus and measure memorization
PARITY = {"d_model": 768, "n_layers": 18, "n_heads": 12, "hidden": 2048, "seq": 1024, "batch": 16, "steps": 600,
          "lr": 1e-3, "eval_batches": 16, "corpus_bytes": 20_000_000}
PARITY_LIMITS = {"time_limit_s": 420.0, "total_budget_s": 3600.0}
# --size 7b: Llama-2-7B's shape (see the docstring for its memory)
LLAMA_7B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "hidden": 11008, "seq": 4096, "batch": 1, "steps": 20,
            "lr": 3e-4, "eval_batches": 1, "corpus_bytes": 0}
LLAMA_7B_LIMITS = {"time_limit_s": 240.0, "total_budget_s": 560.0}



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="all",
                   help=f"comma list of {BASELINE}, hybridq presets and {TORCHAO}; 'all' (default): {BASELINE}, "
                        f"every preset, {TORCHAO}. {BASELINE} always runs first (the loss-gap reference)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: the GPUs, else 2 on the CPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="passed to train.py")
    p.add_argument("--tiny", action="store_true", help="tiny model and 4 steps (CPU smoke test)")
    p.add_argument("--size", choices=["1b", "7b"], default=None,
                   help="the model on GPUs: 1b (default, sizes below) or 7b (Llama-2-7B's shape, for 8 GPUs)")
    p.add_argument("--scaling", default=None, metavar="N1,N2,...",
                   help="weak scaling: run every recipe on each of these world sizes (per-rank batch fixed); world "
                        "sizes above the visible GPUs are skipped rows")
    p.add_argument("--parity", action="store_true",
                   help=f"loss parity: a ~127M model for {PARITY['steps']} steps (sizes below), every run's loss curve "
                        f"in parity.png and the final / validation gaps vs bf16 in the table")
    for k in ("d_model", "n_layers", "n_heads", "hidden", "seq", "batch", "steps", "eval_batches", "corpus_bytes"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"default {FULL[k]} (tiny {TINY[k]}, parity {PARITY[k]}, 7b {LLAMA_7B[k]})")
    p.add_argument("--lr", type=float, default=None,
                   help=f"default {FULL['lr']} (tiny {TINY['lr']}, parity {PARITY['lr']}, 7b {LLAMA_7B['lr']})")
    p.add_argument("--train-args", default="", help="more train.py flags for every run (one string)")
    p.add_argument("--time-limit-s", type=float, default=None, help="per run, start-up included (default 90, "
                   f"--parity {PARITY_LIMITS['time_limit_s']:.0f})")
    p.add_argument("--total-budget-s", type=float, default=None, help="all runs together (default 510, --parity "
                   f"{PARITY_LIMITS['total_budget_s']:.0f})")
    p.add_argument("--min-run-s", type=float, default=None,
                   help="skip a run whose limit would be shorter (default 40 s on GPUs, 5 s on the CPU)")
    p.add_argument("--out-dir", default="e2e_report", help="logs, metrics JSON, report.md and report.json")
    p.add_argument("--dry-run", action="store_true", help="print the commands (and skipped rows) and exit")
    p.add_argument("--no-baseline", action="store_true",
                   help=f"do not run {BASELINE} (split a report over invocations, e.g. in parallel on one GPU for "
                        f"losses only: the gaps come from a later --reuse-finished invocation that finds {BASELINE})")
    p.add_argument("--reuse-finished", action="store_true",
                   help="a run whose metrics file in --out-dir holds a finished run of the same recipe and sizes is "
                        "read, not run again (split a long report, e.g. --parity, over several invocations; the "
                        "table then covers every finished run of this plan)")
    p.add_argument("--norm-baseline", action="store_true",
                   help=f"also run {NORM_BASELINE}: {BASELINE} with hybridq.RMSNorm swapped in (train.py --norms "
                        "hybridq), the presets' norm kernel without quantization")
    p.add_argument("--compile", action="store_true",
                   help="also run every recipe with train.py --compile (each block torch.compiled), side by side "
                        "with eager; compiled rows compare with bf16 compiled")
    p.add_argument("--compile-mode", default=None, help="train.py --compile-mode for the compiled runs "
                   "(e.g. reduce-overhead: CUDA graphs)")
    a = p.parse_args(argv)
    chosen = [f for f, on in (("--tiny", a.tiny), ("--parity", a.parity), ("--size", a.size)) if on]
    if len(chosen) > 1:
        p.error(f"{' and '.join(chosen)} choose different sizes: pass one (override sizes with --d-model etc.)")
    a.scaling = parse_world_sizes(p, a.scaling) if a.scaling is not None else None
    big = a.size == "7b"
    base = TINY if a.tiny else PARITY if a.parity else LLAMA_7B if big else FULL
    limits = (PARITY_LIMITS if a.parity else LLAMA_7B_LIMITS if big
              else {"time_limit_s": 90.0, "total_budget_s": 510.0})
    for k, v in {**base, **limits}.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def parse_world_sizes(p: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"--scaling takes world sizes like 1,2,4,8, got {text!r}")
    if not sizes or any(n < 1 for n in sizes):
        p.error(f"--scaling takes world sizes >= 1 like 1,2,4,8, got {text!r}")
    return sorted(set(sizes))


# ---- which recipes run -----------------------------------------------------------------------------

def train_option(train_args: str, flag: str, default: str) -> str:
    """The value of train.py's `flag` in `train_args` (train.py flags, one string), or train.py's default."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(flag, default=default)
    return getattr(p.parse_known_args(shlex.split(train_args))[0], flag.lstrip("-").replace("-", "_"))


def weight_gather(train_args: str) -> str:
    """The --weight-gather mode that `train_args` select (train.py's default: quantized)."""
    return train_option(train_args, "--weight-gather", "quantized")


def fsdp_rejection(preset: str) -> str | None:
    """apply_hybrid_fsdp's reason for refusing `preset` (on a one-Linear model), or None when it converts."""
    import torch.nn as nn

    import hybridq
    try:
        hybridq.apply_hybrid_fsdp(nn.Sequential(nn.Linear(64, 64, bias=False)), hybridq.recipe(preset),
                                  on_incompatible="skip")
    except ValueError as e:
        return f"rejected by hybridq.apply_hybrid_fsdp: {e}"
    return None


def torchao_status() -> str | None:
    """None when torchao.float8 imports, else why not."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:
        return f"torchao not installed ({type(e).__name__}: {e})"
    return None


def plan(a) -> list[dict]:
    """[{recipe, compiled, skip: reason or None}], bf16 first (eager, then compiled with --compile)."""
    import hybridq
    presets = hybridq.preset_names()
    known = [BASELINE] + presets + [TORCHAO]
    names = known if a.recipes == "all" else [r.strip() for r in a.recipes.split(",") if r.strip()]
    bad = [r for r in names if r not in known]
    if bad:
        raise SystemExit(f"e2e_report.py: unknown recipe(s) {', '.join(bad)}; known: {', '.join(known)}")
    names = ([] if a.no_baseline else [BASELINE]) + [r for r in dict.fromkeys(names) if r != BASELINE]
    if getattr(a, "norm_baseline", False):
        names.insert(0 if a.no_baseline else 1, NORM_BASELINE)
    # train.py converts with apply_hybrid_fsdp unless --weight-gather high_precision (then convert_linears, which
    # takes every preset): only the former's refusals are known in advance
    quantized_gather = weight_gather(a.train_args or "") == "quantized"
    rows = []
    for r in names:
        skip = None
        if r in presets and quantized_gather:
            skip = fsdp_rejection(r)
        elif r == TORCHAO:
            skip = torchao_status()
        rows.append({"recipe": r, "compiled": False, "skip": skip})
    if getattr(a, "compile", False):
        rows += [dict(r, compiled=True) for r in rows]
    return rows


def train_recipe(recipe: str) -> tuple[str, list[str]]:
    """The train.py recipe of a row and the flags that make it that row (the name its metrics file records)."""
    return (BASELINE, ["--norms", "hybridq"]) if recipe == NORM_BASELINE else (recipe, [])


def label(recipe: str, compiled: bool, nproc: int | None = None) -> str:
    """A run's name in the table and its files: the recipe, `.compiled` for train.py --compile, `@N` for N processes
    (--scaling)."""
    return (f"{recipe}.compiled" if compiled else recipe) + (f"@{nproc}" if nproc is not None else "")


def run_name(a, recipe: str, compiled: bool, nproc: int) -> str:
    """label() of a run of this report: the world size is part of the name under --scaling only."""
    return label(recipe, compiled, nproc if a.scaling else None)


def schedule(a, nproc: int, gpus: int | None) -> list[dict]:
    """plan(a) with each row's world size: once per --scaling size, else once at `nproc`. A world size above `gpus`
    (the CUDA devices visible; None on the CPU) is a skipped row, so one command serves any machine size."""
    rows = []
    base = plan(a)
    for n in a.scaling or [nproc]:
        for t in base:
            t = dict(t, nproc=n)
            if not t["skip"] and gpus is not None and n > gpus:
                t["skip"] = f"needs {n} GPUs, {gpus} visible"
            rows.append(t)
    return rows


# ---- one run ----------------------------------------------------------------------------------------

def launcher(nproc: int) -> list[str]:
    # torchrun of this interpreter: a `torchrun` on PATH may belong to another environment without hybridq
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def train_flags(a) -> list[str]:
    f = ["--d-model", a.d_model, "--n-layers", a.n_layers, "--n-heads", a.n_heads]
    if a.hidden:
        f += ["--hidden", a.hidden]
    f += ["--seq", a.seq, "--batch", a.batch, "--steps", a.steps, "--lr", a.lr, "--eval-batches", a.eval_batches,
          "--device", a.device, "--log-every", 1, "--no-progress"]
    if a.corpus_bytes:
        f += ["--corpus-bytes", a.corpus_bytes]
    return [str(x) for x in f] + shlex.split(a.train_args)


def command(a, recipe: str, nproc: int, out_dir: pathlib.Path, compiled: bool = False) -> list[str]:
    mode = ["--compile-mode", a.compile_mode] if a.compile_mode else []
    base, extra = train_recipe(recipe)
    return (launcher(nproc) + ["launch/train.py", "--recipe", base] + extra + train_flags(a)
            + (["--compile"] + mode if compiled else [])
            + ["--metrics", rel(out_dir / f"{run_name(a, recipe, compiled, nproc)}.jsonl")])


def rel(p: pathlib.Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def show(cmd: list[str]) -> str:
    """The command as one would type it (`python -m torch.distributed.run` shown as torchrun)."""
    c = list(cmd)
    if c[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        c[:3] = ["torchrun"]
    return "OMP_NUM_THREADS=1 " + shlex.join(c)


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
            "corpus_bytes")


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
    got = {k: config["args"].get(k) for k in want}
    if got != want or config.get("world_size") != nproc:
        return None
    return {"recipe": name, "base": recipe, "compiled": compiled, "nproc": nproc, "command": show(cmd), "rc": 0,
            "wall_s": 0.0, "allgather_bytes": summary.get("allgather_bytes_per_step"),
            "log": str(out_dir / f"{name}.log"), "status": "ok (reused)", "metrics": str(js),
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
           "peak_memory_bytes": None, "memory_kind": None, "val_loss": None, "allgather_bytes": None}
    summary = runs_of(read_metrics(js)).get(train_recipe(recipe)[0]) if js.exists() else None
    if summary is not None and rc == 0:
        m = summary
        res.update(steps_done=m["start_step"] + m["steps_run"], losses=m["losses"],
                   tokens_per_s=m["median_tokens_per_s"], peak_memory_bytes=m["peak_memory_bytes"],
                   memory_kind=m["peak_memory_kind"], val_loss=m["val_loss"], status="ok", metrics=str(js),
                   allgather_bytes=m.get("allgather_bytes_per_step"))
    else:
        if steps:
            tps = [s["tokens_per_s"] for s in steps[1:]] or [steps[0]["tokens_per_s"]]  # step 1 includes warm-up
            res.update(steps_done=steps[-1]["step"], losses=[s["loss"] for s in steps],
                       tokens_per_s=statistics.median(tps), peak_memory_bytes=max(s["peak_memory_bytes"] for s in steps),
                       memory_kind=steps[-1]["peak_memory_kind"],
                       allgather_bytes=median_or_none([s.get("allgather_bytes") for s in steps]))
        if timed_out:
            res["status"] = f"time limit ({limit_s:.0f} s) after {res['steps_done']} of {a.steps} steps"
        else:
            res["status"] = f"failed (exit {rc}: {last_error(text)})"
    print(f"--> {res['status']}, {res['steps_done']} steps, {wall:.0f} s", flush=True)
    return res


def median_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


# ---- the table ----------------------------------------------------------------------------------------

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
                      "loss (last 10% of steps) | gap vs bf16 (same steps) | val loss | command |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skip"):
            lines.append(f"| {r['recipe']} | skipped: {r['skip'].replace('|', '/')} | - | - | - | - | - | - | - | - | - |")
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
                     f"| {fmt_mem(r.get('allgather_bytes'))} | {loss} | {gap} | {val} | `{r['command']}` |")
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
    sys.path.insert(0, str(ROOT / "launch"))
    import config
    cfg = config.model_config(config.parse_args(train_flags(a)))  # the shape train.py builds from these very flags
    cuda = a.device != "cpu" and torch.cuda.is_available()
    sizes = ",".join(map(str, a.scaling)) if a.scaling else str(nproc)
    dev = f"{sizes}x {torch.cuda.get_device_name(0)} (NCCL)" if cuda else f"{sizes} CPU processes (gloo)"
    ao = torchao_status()
    if ao is None:
        import torchao
        ao = f"torchao {getattr(torchao, '__version__', '?')}"
    return [f"End-to-end report, {datetime.date.today().isoformat()}: {dev}, torch {torch.__version__}, {ao}.",
            f"Model: {cfg.n_layers} layers, d_model {cfg.d_model}, hidden {cfg.hidden}"
            + (f" per expert, MoE {cfg.moe_experts} experts top-{cfg.moe_top_k}" if cfg.moe_experts else "")
            + f", {cfg.n_heads} heads" + (f" ({cfg.n_kv_heads} kv)" if cfg.n_kv_heads != cfg.n_heads else "")
            + f", {cfg.num_params() / 1e6:,.1f}M parameters" + (" (all experts)" if cfg.moe_experts else "")
            + f"; seq {a.seq} x batch {a.batch} per rank x {sizes} ranks = "
            f"{'/'.join(f'{a.seq * a.batch * n:,}' for n in a.scaling or [nproc])} tokens/step; {a.steps} steps "
            f"(lr {a.lr}, cosine), "
            f"{'corpus.txt' if not a.corpus_bytes else f'{a.corpus_bytes:,} generated bytes'}, FSDP2 bf16 params / fp32 "
            "reduce. tokens/s: median after step 1; peak mem: rank 0 (GPU: max allocated); all-gather: bytes rank 0 "
            "sends per step (median); loss: mean of the last 10% of the steps done; gap: vs bf16 over the same "
            "steps.",
            {"auto": f"RMSNorm: hybridq.RMSNorm in the hybridq presets' runs (their conversion swaps it in), the model's "
                     f"own in {BASELINE} and {TORCHAO}" + (f" ({NORM_BASELINE}: {BASELINE} with hybridq.RMSNorm)"
                                                          if getattr(a, "norm_baseline", False) else "") + ".",
             "hybridq": "RMSNorm: hybridq.RMSNorm in every run (--norms hybridq).",
             "model": "RMSNorm: the model's own in every run (--norms model)."}[
                train_option(a.train_args or "", "--norms", "auto")]]


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    cuda = a.device != "cpu" and torch.cuda.is_available()
    nproc = a.nproc or (torch.cuda.device_count() if cuda else 2)
    min_run = a.min_run_s if a.min_run_s is not None else (40.0 if cuda else 5.0)
    out_dir = pathlib.Path(a.out_dir)
    if not out_dir.is_absolute():
        out_dir = ROOT / out_dir
    todo = schedule(a, nproc, torch.cuda.device_count() if cuda else None)
    header = describe(a, nproc)
    if a.dry_run:
        print("\n".join(header))
        for t in todo:
            name = run_name(a, t["recipe"], t["compiled"], t["nproc"])
            print(f"\n# {name}: skipped: {t['skip']}" if t["skip"] else
                  f"\n# {name}\n{show(command(a, t['recipe'], t['nproc'], out_dir, t['compiled']))}")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    print("\n".join(header), flush=True)
    t_start = time.perf_counter()
    results = []
    runnable = [t for t in todo if not t["skip"]]
    runnable_names = {run_name(a, t["recipe"], t["compiled"], t["nproc"]) for t in runnable}
    for t in todo:
        n = t["nproc"]
        name = run_name(a, t["recipe"], t["compiled"], n)
        if t["skip"]:
            results.append({"recipe": name, "skip": t["skip"], "nproc": n})
            continue
        done = finished_run(a, t["recipe"], n, out_dir, t["compiled"]) if a.reuse_finished else None
        if done is not None:
            print(f"\n=== {name}: reusing the finished run in {rel(out_dir / (name + '.jsonl'))}", flush=True)
            results.append(done)
            continue
        left = a.total_budget_s - (time.perf_counter() - t_start)
        runs_left = len(runnable) - sum(1 for r in results if r["recipe"] in runnable_names)  # this one included
        limit = min(a.time_limit_s, left / max(runs_left, 1))
        if limit < min_run:
            results.append({"recipe": name, "skip": f"total budget ({a.total_budget_s:.0f} s) spent", "nproc": n,
                            "command": show(command(a, t["recipe"], n, out_dir, t["compiled"]))})
            continue
        results.append(run_one(a, t["recipe"], n, out_dir, limit, t["compiled"]))
    rows = rows_for(results)
    ran = [r for r in results if not r.get("skip")]
    reused = sorted({f"{r['device_name']}, torch {r['torch']}" for r in ran if r.get("status") == "ok (reused)"})
    if reused and all(r.get("status") == "ok (reused)" for r in ran):  # nothing ran here: name where they ran
        header[0] = (f"End-to-end report, {datetime.date.today().isoformat()}: every row read from earlier runs "
                     f"({nproc} process(es) each) on {'; '.join(reused)}.")
    elif reused:
        header.append(f"Rows marked 'ok (reused)' were measured by an earlier invocation on: {'; '.join(reused)}.")
    header.append(f"Total wall time {time.perf_counter() - t_start:.0f} s (budget {a.total_budget_s:.0f} s, "
                  f"per run {a.time_limit_s:.0f} s); logs and metrics JSON in {out_dir}.")
    if a.parity:
        header.append(write_parity_plot([r for r in results if not r.get("skip")], out_dir / "parity.png"))
    md = markdown(rows, header)
    if a.scaling:
        md += "\n\nWeak scaling (per-rank batch fixed):\n\n" + scaling_markdown(rows)
    (out_dir / "report.md").write_text(md + "\n")
    (out_dir / "report.json").write_text(json.dumps({"args": vars(a), "nproc": nproc, "rows": rows}, indent=1))
    print("\n" + md + f"\n\nwrote {out_dir / 'report.md'} and {out_dir / 'report.json'}", flush=True)
    return 0 if all(r.get("skip") or r.get("status", "").startswith("ok") or r["status"].startswith("time limit")
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
