"""The training job's checkpoints: layout, manifest, verification, the choice of the one to resume, pruning.

Layout of one recipe's checkpoints, `DIR/<recipe>/`:

    step_000040/          one complete checkpoint: DCP files (every rank writes its own), meta.json (the
                          configuration), train_state.json (step, loss history), manifest.json (every other
                          file's name, size and SHA-256)
    step_000050.tmp/      a save in progress (or one interrupted): never resumed from, removed by the next save
    latest                the newest complete checkpoint's folder name (informational: resume scans the folders)

A checkpoint becomes visible only when complete: all ranks write into `step_N.tmp`, then rank 0 writes the
JSON files and the manifest, renames the folder to `step_N` and atomically replaces `latest`. DCP has no
checksums, so the manifest is what catches damaged bytes: resume verifies it and refuses a damaged
checkpoint, naming the file.

The files' side (layout, manifest, JSON files, resume choice, pruning, the plan: pure functions of the files, so
the pre-flight and the workers reach the same verdict) is checkpoint_files.py, re-exported here; this file has the
collective parts every rank calls (save, load, the full-state dumps).
"""

from __future__ import annotations

import os
import pathlib
import shutil

from checkpoint_files import (CheckpointError, LATEST, MANIFEST, META, NOTED_KEYS, REFUSED_KEYS, TRAIN_STATE,
                              begin_save, check_folder, check_writable, choose_resume, clear_for_fresh_run,
                              compare_config, finish_save, holds_checkpoints, plan, prune, read_meta,
                              read_train_state, step_dir, step_folders, verify, write_manifest)  # noqa: F401 (the job's API)


# ---- the collective parts (every rank calls these) ----------------------------------------------

def save(run_dir: pathlib.Path, step: int, model, optimizer, train_state: dict, meta: dict, main: bool,
         keep_last: int) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """Write step `step` as described in the module docstring; return (its folder, the pruned folders).

    A save that fails (a full disk, a folder that became read-only, any writer error) raises CheckpointError on
    every rank with one message naming the checkpoint, the cause and the space it needs; the older checkpoints stay
    and the partial `step_N.tmp` is removed. No rank waits for a failed one: each stage (rank 0 prepares, every rank
    writes its DCP files, rank 0 finishes) ends in a collective that carries every rank's outcome."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    msd, osd = get_state_dict(model, optimizer)
    need = checkpoint_bytes(run_dir, {"model": msd, "optim": osd})

    def agree(error: str | None, every_rank: bool) -> None:
        """Every rank's outcome (or rank 0's) on every rank; all raise the first failure, after rank 0 removed the
        partial folder."""
        if every_rank:
            errors: list = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        else:
            errors = [error]
            dist.broadcast_object_list(errors, src=0)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(first)

    def attempt(fn) -> str | None:
        try:
            fn()
            return None
        except CheckpointError as e:  # a refusal (e.g. the step exists already): its own message
            return str(e)
        except BaseException as e:  # noqa: BLE001 (DCP raises CheckpointException, a BaseException)
            if isinstance(e, KeyboardInterrupt):
                raise
            return not_written(run_dir, step, e, need)

    agree(attempt(lambda: begin_save(run_dir, step)) if main else None, every_rank=False)
    agree(attempt(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))), every_rank=True)
    removed: list[pathlib.Path] = []

    def finish() -> None:  # one train_state.json for the whole job: nothing in it depends on the rank or world size
        finish_save(run_dir, step, train_state, meta)
        removed.extend(prune(run_dir, keep_last))

    agree(attempt(finish) if main else None, every_rank=False)
    return final, removed


def checkpoint_bytes(run_dir: pathlib.Path, state: dict) -> int:
    """About what one checkpoint takes on disk: the newest complete one's files, else the state dict's tensors
    (global sizes: a DTensor counts whole)."""
    done = [p for _, p in step_folders(run_dir) if (p / MANIFEST).is_file()]
    if done:
        return sum(f.stat().st_size for f in done[-1].rglob("*") if f.is_file())
    import torch

    def walk(v) -> int:
        if isinstance(v, torch.Tensor):
            return v.numel() * v.element_size()
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x) for x in v)
        return 0
    return walk(state)


def not_written(run_dir: pathlib.Path, step: int, error: BaseException, need: int) -> str:
    """The one-line message for a save that failed with `error`: the checkpoint, the cause (the OS error behind it
    where there is one: DCP wraps each rank's), the space it needs and has, what is kept."""
    where = run_dir
    while not where.exists() and where.parent != where:
        where = where.parent
    free = shutil.disk_usage(where).free
    cause = _os_error(error)
    if cause is None:
        inner = _innermost(error)
        cause = ("no space left on device" if free < need else
                 f"{type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner).strip() else ''}")
    name = step_dir(run_dir, step).name
    kept = [p.name for _, p in step_folders(run_dir) if (p / MANIFEST).is_file() and p.name != name]
    if cause == "file too large":
        cause += " (a limit on the size of one file: ulimit -f, or the filesystem's)"
    fix = "free space" if "space" in cause else "lift that"
    return (f"checkpoint {name} not written: {cause} (needs ~{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free in "
            f"{where}); " + (f"the older checkpoints are kept ({', '.join(kept)}): {fix} (or pick another "
                             f"--checkpoint-dir) and --resume to continue from {kept[-1]}" if kept else
                             f"no earlier checkpoint of this run: {fix} or pick another --checkpoint-dir"))


def _chain(error: BaseException):
    """`error`, its causes and contexts, and the per-rank exceptions a DCP CheckpointException carries."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple) and f]


def _os_error(error: BaseException) -> str | None:
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno:
            text = os.strerror(e.errno)
            return text[:1].lower() + text[1:]
    return None


def _innermost(error: BaseException) -> BaseException:
    """The first exception of the chain that is not DCP's wrapper."""
    return next((e for e in _chain(error) if not hasattr(e, "failures")), error)


def load(folder: pathlib.Path, model, optimizer) -> None:
    """Load a verified checkpoint's model and optimizer state (DCP reshards to this world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except CheckpointException as e:  # a BaseException: turn it into the job's clean refusal
        raise CheckpointError(f"loading {folder} failed: {e}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state(model, optimizer) -> dict:
    """The gathered (unsharded) model and optimizer state dicts on the CPU; a collective on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def dump_full_state(folder: pathlib.Path, name: str, step: int, losses: list[float], model, optimizer,
                    world: int, main: bool) -> None:
    """--dump-state: the gathered full state as one torch.save file (a collective on every rank)."""
    import torch
    import torch.distributed as dist
    st = full_state(model, optimizer)
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({**st, "step": step, "losses": list(losses), "world": world}, folder / f"{name}_step_{step:06d}.pt")
    dist.barrier()


def init_from_full_state(path: pathlib.Path, model, optimizer) -> dict:
    """--init-state: set model and optimizer from a --dump-state file (no DCP resharding involved)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    st = torch.load(path, weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=st["model"], optim_state_dict=st["optim"],
                   options=StateDictOptions(full_state_dict=True))
    return st
