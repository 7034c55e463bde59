"""The training job's checkpoint folders as files (no collective, no torch): the layout, the manifest, the JSON
files, the choice of the checkpoint to resume, the local steps of a save (begin, finish, prune) and the plan of one
invocation. checkpoint.py has the collective parts and the module docstring's whole story.

Everything here that decides (which checkpoint, whether it verifies, whether the configuration fits) is a pure
function of the files, so the pre-flight (`train.py --check-only`, run by run.sh before torchrun) and the workers
reach the same verdict.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Callable

import lock

MANIFEST = "manifest.json"  # (hybridq.checkpoint.MANIFEST)
META = "meta.json"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")

# What a resume refuses to change: the saved state would not fit (model shape, quantization recipe, param
# dtype) or the data stream would not continue (seq, batch per rank and seed define the batches; dp is free:
# DCP reshards and the data is a function of (seed, step, rank, dp)).
REFUSED_KEYS = ("recipe", "model", "param_dtype", "quantize_head", "seq", "batch", "seed")
# What a resume may change, saying so: the schedule and optimizer hyperparameters act from the next step on.
NOTED_KEYS = ("steps", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip")


class CheckpointError(Exception):
    """A checkpoint folder that cannot be used (or written) as asked; the message says what and where."""


# ---- layout --------------------------------------------------------------------------------------

def step_dir(run_dir: pathlib.Path, step: int) -> pathlib.Path:
    return run_dir / f"step_{step:06d}"


def step_folders(run_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(step, folder) of every `step_N` folder (complete or not, `.tmp` excluded), oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def holds_checkpoints(run_dir: pathlib.Path) -> bool:
    return run_dir.is_dir() and (bool(step_folders(run_dir)) or (run_dir / LATEST).exists()
                                 or any(_TMP_DIR.match(p.name) for p in run_dir.iterdir()))


def check_folder(path: pathlib.Path, what: str) -> None:
    """`path` must be a folder or not exist (then it is created when the first checkpoint is saved)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{what} {path} is a file, not a folder")


# ---- manifest (hybridq.checkpoint: the library function user scripts call around dcp.save / dcp.load) --------

def write_manifest(folder: pathlib.Path) -> None:
    from hybridq.checkpoint import write_manifest as write
    write(folder)


def verify(folder: pathlib.Path) -> None:
    """Raise CheckpointError naming the first file that is missing, added, of another size or other content than
    the manifest says (or the manifest itself when it is missing or unreadable)."""
    from hybridq.checkpoint import CheckpointIntegrityError, verify_manifest
    try:
        verify_manifest(folder)
    except CheckpointIntegrityError as e:
        raise CheckpointError(str(e)) from None


# ---- the JSON files ------------------------------------------------------------------------------

def _read_json(p: pathlib.Path, missing: str):
    """The JSON value in `p`; CheckpointError naming the file when it is missing (`missing` says what is then
    unknown) or not JSON."""
    if not p.is_file():
        raise CheckpointError(f"{p} is missing: {missing}")
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e})") from None


def read_meta(folder: pathlib.Path) -> dict:
    p = folder / META
    meta = _read_json(p, "the checkpoint's configuration is unknown")
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict) or "recipe" not in meta:
        raise CheckpointError(f"{p} is malformed: expected an object with 'recipe' and 'model'")
    return meta


def read_train_state(folder: pathlib.Path, step: int) -> dict:
    p = folder / TRAIN_STATE
    st = _read_json(p, "the step and loss history are unknown")
    if not isinstance(st, dict):
        raise CheckpointError(f"{p} is malformed: expected an object with 'step' and 'losses'")
    s, losses = st.get("step"), st.get("losses")
    if not isinstance(s, int) or isinstance(s, bool) or s != step:
        raise CheckpointError(f"{p} is malformed: 'step' is {s!r}, the folder is step {step}")
    if (not isinstance(losses, list) or len(losses) != step
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in losses)):
        raise CheckpointError(f"{p} is malformed: 'losses' must be a list of {step} numbers (one per step)")
    return st


# ---- choosing the checkpoint to resume -----------------------------------------------------------

def compare_config(folder: pathlib.Path, saved: dict, meta: dict) -> list[str]:
    """Refuse (CheckpointError naming each difference) what the saved state cannot continue under; return one
    line per allowed change (the schedule, optimizer hyperparameters) for the run to print."""
    diffs = []
    for k in REFUSED_KEYS:
        a, b = saved.get(k), meta.get(k)
        if k == "model" and isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"model {f}: saved {a.get(f)!r}, now {b.get(f)!r}"
                      for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
        elif a != b:
            diffs.append(f"{k}: saved {a!r}, now {b!r}")
    if diffs:
        raise CheckpointError(f"cannot resume from {folder}: it was written by a different configuration ("
                              + "; ".join(diffs) + "). A resume keeps " + ", ".join(REFUSED_KEYS)
                              + "; start a fresh run (another --checkpoint-dir, or --overwrite) to change them")
    notes = []
    for k in NOTED_KEYS:
        if k in saved and saved[k] != meta.get(k):
            notes.append(f"{k}: saved {saved[k]!r}, now {meta.get(k)!r}")
    if notes:
        notes.append("the learning-rate schedule is recomputed for the new values from the next step on")
    return notes


def choose_resume(run_dir: pathlib.Path, meta: dict) -> tuple[pathlib.Path, dict, list[str]]:
    """The newest complete checkpoint of `run_dir`, verified: (folder, train_state, notes). Raises
    CheckpointError when there is none, when the newest one fails verification (naming the file), or when
    its configuration does not fit. Interrupted saves (`step_N.tmp`) are never candidates."""
    check_folder(run_dir, "checkpoint folder")
    folders = step_folders(run_dir)
    if not folders:
        raise CheckpointError(f"--resume: no checkpoint in {run_dir} (drop --resume to start a fresh run)")
    step, folder = folders[-1]
    verify(folder)  # the newest one or none: resuming an older one would drop (and later overwrite) this one
    saved = read_meta(folder)
    state = read_train_state(folder, step)
    notes = compare_config(folder, saved, meta)
    return folder, state, notes


# ---- saving ------------------------------------------------------------------------------------

def begin_save(run_dir: pathlib.Path, step: int) -> pathlib.Path:
    """Rank 0, before the ranks write: a fresh `step_N.tmp` (an interrupted save's leftover is removed; it
    was never a checkpoint). Refuses to replace a complete `step_N`."""
    final = step_dir(run_dir, step)
    if final.exists():
        raise CheckpointError(f"{final} exists already; the job does not write over a checkpoint")
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_save(run_dir: pathlib.Path, step: int, train_state: dict, meta: dict) -> pathlib.Path:
    """Rank 0, after every rank has written its DCP files into `step_N.tmp`: the JSON files, the manifest,
    then the rename and the atomic replace of `latest` (in this order, so a crash leaves a `.tmp`)."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    (tmp / TRAIN_STATE).write_text(json.dumps(train_state))
    (tmp / META).write_text(json.dumps(meta, indent=1))
    write_manifest(tmp)
    os.rename(tmp, final)
    pointer = run_dir / (LATEST + ".tmp")
    pointer.write_text(final.name)
    os.replace(pointer, run_dir / LATEST)
    return final


def prune(run_dir: pathlib.Path, keep_last: int) -> list[pathlib.Path]:
    """Remove all but the newest `keep_last` complete checkpoints (0: keep all); return the removed ones.
    Only folders with a manifest count: a foreign or incomplete folder is left alone."""
    if keep_last <= 0:
        return []
    complete = [p for _, p in step_folders(run_dir) if (p / MANIFEST).is_file()]
    removed = complete[:-keep_last] if len(complete) > keep_last else []
    for p in removed:
        shutil.rmtree(p)
    return removed


def clear_for_fresh_run(run_dir: pathlib.Path) -> None:
    """--overwrite: remove the checkpoints of an earlier run of this recipe (the user asked for it)."""
    for _, p in step_folders(run_dir):
        shutil.rmtree(p)
    for p in run_dir.iterdir() if run_dir.is_dir() else []:
        if _TMP_DIR.match(p.name):
            shutil.rmtree(p)
        elif p.name in (LATEST, LATEST + ".tmp"):
            p.unlink()


# ---- the plan for one invocation -------------------------------------------------------------------

def check_writable(run_dir: pathlib.Path) -> None:
    """Refuse (CheckpointError) a checkpoint folder this process cannot write: a probe file is created and deleted in
    `run_dir`, or in its nearest existing parent when it does not exist yet (then the save creates it there). A real
    write, not a permission check: it also sees read-only mounts, full disks' refusals of new files, ACLs."""
    import tempfile
    where = run_dir
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {run_dir}: creating a file in {where} failed "
                              f"({e.strerror or e}); pick a writable --checkpoint-dir (or drop --save-every)") from None


def plan(checkpoint_dir: str | None, recipes: list[str], resume: bool, overwrite: bool,
         meta_for: Callable[[str], dict], writes: bool = False) -> dict[str, dict]:
    """Per recipe: {"run_dir", "resume_from", "train_state", "notes"}; every refusal as CheckpointError before
    anything is written or deleted (a probe file is created and deleted when `writes`: the run will save or
    delete checkpoints). Refuses a folder another live job holds (lock.py). `meta_for(recipe)` is this run's
    configuration record."""
    out: dict[str, dict] = {}
    if checkpoint_dir is None:
        return {r: {"run_dir": None, "resume_from": None, "train_state": None, "notes": []} for r in recipes}
    root = pathlib.Path(checkpoint_dir)
    check_folder(root, "--checkpoint-dir")
    for r in recipes:
        run_dir = root / r
        entry = {"run_dir": run_dir, "resume_from": None, "train_state": None, "notes": []}
        busy = lock.refusal(run_dir)
        if busy:
            raise CheckpointError(busy)
        if resume:
            try:
                entry["resume_from"], entry["train_state"], entry["notes"] = choose_resume(run_dir, meta_for(r))
            except CheckpointError:
                others = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in recipes
                                and step_folders(p)) if root.is_dir() else []
                if not step_folders(run_dir) and others:
                    raise CheckpointError(
                        f"--resume with recipe {r}, but {root} holds checkpoints of recipe(s) {', '.join(others)} "
                        f"only (recipe mismatch: pass --recipe {others[0]}, or drop --resume to start a fresh "
                        "run)") from None
                raise
        else:
            check_folder(run_dir, "checkpoint folder")
            if holds_checkpoints(run_dir) and not overwrite:
                raise CheckpointError(
                    f"{run_dir} holds checkpoints of an earlier run: pass --resume to continue it, or --overwrite "
                    "to delete them and start a fresh run (or pick another --checkpoint-dir)")
        if writes:
            check_writable(run_dir)
        out[r] = entry
    return out
