"""The training job's pre-flight: everything that can be refused before a process group exists (the flags, the
conversion of every quantized recipe on a meta-device model, the layout rules, the checkpoint folder) and the
locks of the folders a run writes. A refusal (`REFUSALS`) is one message and exit 1, no traceback."""

from __future__ import annotations

import pathlib
import sys
import warnings

import torch

import checkpoint
import lock
from checkpoint import CheckpointError
from config import BASELINE, TORCHAO_RECIPES, ConfigError, check_args, model_config, run_meta, runs
from convert import convert
from model import Transformer
from parallel import layout_problems

REFUSALS = (ConfigError, CheckpointError)  # known refusals: one message, exit 1, no traceback


def preflight(args, world: int) -> dict[str, dict]:
    """Check the flags for `world` processes; convert the model for every quantized recipe of the invocation (on a
    meta-device model: no memory, no time), refusing one that converts no layer and every layout rule the run would
    meet later (format x tensor-parallel splits, sequence parallelism: parallel.layout_problems); check the
    checkpoint folder (verified resume, writable when the run will save, not locked by another live job). Return
    checkpoint.plan's result. Raises ConfigError / CheckpointError; writes nothing (but a probe file it deletes)."""
    check_args(args, world)
    problems = []
    for name in runs(args):
        if name not in (BASELINE, *TORCHAO_RECIPES):
            with torch.device("meta"):
                model = Transformer(model_config(args))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                convert_refusing(model, name, args)
            problems += layout_problems(model, name, args)
    if problems:
        raise ConfigError("\n  ".join(["invalid layout:"] + problems))
    return checkpoint.plan(args.checkpoint_dir, runs(args), args.resume, args.overwrite,
                           lambda r: run_meta(r, args), writes=bool(args.save_every or args.overwrite))


def convert_refusing(model, recipe_name: str, args):
    """convert.convert, with what hybridq refuses (delayed scaling under FSDP2, a bad override) as the job's refusal:
    raised identically on every rank, before any collective."""
    try:
        return convert(model, recipe_name, args)
    except ValueError as e:
        raise ConfigError(f"recipe {recipe_name}: {e}") from None


def describe_plan(args, world: int, plan: dict[str, dict]) -> str:
    lines = [f"train.py --check-only: the flags are valid for {world} process(es) (dp={args.dp}, tp={args.tp})"]
    for name, e in plan.items():
        if e["resume_from"] is not None:
            lines.append(f"[{name}] would resume from {e['resume_from']} (verified) at step "
                         f"{e['train_state']['step']} of {args.steps}")
            lines += [f"[{name}]   changed: {n}" for n in e["notes"]]
        elif e["run_dir"] is not None and args.overwrite and checkpoint.holds_checkpoints(e["run_dir"]):
            lines.append(f"[{name}] would delete the checkpoints in {e['run_dir']} (--overwrite) and start at step 0")
        else:
            lines.append(f"[{name}] would start at step 0" + (f", checkpoints to {e['run_dir']}"
                                                              if e["run_dir"] is not None and args.save_every else ""))
    return "\n".join(lines)


def take_locks(plan: dict[str, dict], held: list[pathlib.Path]) -> list[str]:
    """Rank 0: the lock of every recipe folder this run writes (lock.py), appended to `held`; the notes of stale
    locks taken over. CheckpointError (after releasing what it took) when another live job holds one."""
    notes = []
    try:
        for e in plan.values():
            if e["run_dir"] is not None:
                note = lock.acquire(e["run_dir"], command=" ".join(["train.py", *sys.argv[1:]]))
                held.append(e["run_dir"])
                if note:
                    notes.append(note)
    except (lock.LockError, OSError) as e:
        release_locks(held)
        raise CheckpointError(str(e)) from None
    return notes


def release_locks(locked: list[pathlib.Path]) -> None:
    for d in locked:
        lock.release(d)
    locked.clear()
