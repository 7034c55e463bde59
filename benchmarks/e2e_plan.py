"""Which runs the end-to-end report makes (recipes, skips, world sizes) and the train.py command of each."""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

BASELINE = "bf16"
TORCHAO = "torchao_float8"
TORCHAO_MOE = "torchao_moe"  # with an MoE (--train-args "--moe E"): torchao's MoE training conversion of the experts
# --norm-baseline: bf16 with hybridq.RMSNorm (train.py --recipe bf16 --norms hybridq), to show how much of a preset's
# speed is the norm kernel that its conversion swaps in, apart from quantization
NORM_BASELINE = "bf16+hybridq_rmsnorm"
# --compile: each preset compiled with both weight gathers (train.py's default, quantized, and this row: the
# preset with --weight-gather high_precision), unless --train-args pick one
HIGH_PRECISION_GATHER = "+high_precision_gather"


def glue_train_args(argv: list[str] | None) -> list[str]:
    """argv with a lone `--train-args --flag` written `--train-args=--flag`: argparse takes a value that starts with
    '-' and has no space for a flag of its own (`--train-args "--compile"` failed: "expected one argument")."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "--train-args" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"--train-args={argv[i + 1]}"]
            break
    return argv


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


def torchao_moe_status(a) -> str | None:
    """None when train.py can run the torchao_moe baseline with this report's flags, else why not (the job's own
    check: an MoE model, torchao's moe_training, a CUDA device)."""
    import config as train_config
    problems = train_config.torchao_moe_problems(train_config.parse_args(train_flags(a)))
    return "; ".join(problems) or None


def moe_model(a) -> bool:
    """Whether the report's train.py flags make an MoE model."""
    return int(train_option(a.train_args or "", "--moe", "0")) > 0


def plan(a) -> list[dict]:
    """[{recipe, compiled, skip: reason or None}], bf16 first (eager, then compiled with --compile: each preset
    also with --weight-gather high_precision, unless the train.py flags pick a weight gather; --compiled-only: no
    eager rows)."""
    import hybridq
    presets = hybridq.preset_names()
    known = [BASELINE] + presets + [TORCHAO, TORCHAO_MOE]
    everything = [r for r in known if r != TORCHAO_MOE or moe_model(a)]  # ('all': the MoE baseline with an MoE)
    names = everything if a.recipes == "all" else [r.strip() for r in a.recipes.split(",") if r.strip()]
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
        elif r == TORCHAO_MOE:
            skip = torchao_moe_status(a)
        rows.append({"recipe": r, "compiled": False, "skip": skip})
    if getattr(a, "compile", False):
        both = ("--weight-gather" not in " ".join(shlex.split(a.train_args or "")) and not moe_model(a)
                and train_option(a.train_args or "", "--grad-reduce", "fp32") == "fp32")
        rows = ([] if getattr(a, "compiled_only", False) else rows) + [dict(r, compiled=True) for r in rows] + [
            {"recipe": r["recipe"] + HIGH_PRECISION_GATHER, "compiled": True, "skip": None}
            for r in rows if both and r["recipe"] in presets]
    return rows


def train_recipe(recipe: str) -> tuple[str, list[str]]:
    """The train.py recipe of a row and the flags that make it that row (the name its metrics file records)."""
    if recipe.endswith(HIGH_PRECISION_GATHER):
        return recipe[:-len(HIGH_PRECISION_GATHER)], ["--weight-gather", "high_precision"]
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


# ---- the command of a run ----------------------------------------------------------------------------------------

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
