"""One job per checkpoint folder: a lock file in each recipe's folder while a job writes there.

Two jobs saving into (or resuming from) the same `DIR/<recipe>/` would interleave their checkpoints and prune or
clean up each other's files. A job that will write there (`--save-every`, `--overwrite`) creates
`DIR/<recipe>/.lock` atomically (O_CREAT | O_EXCL: of two jobs starting together, exactly one gets it) holding its
pid, host and start time, and removes it when it ends. A lock whose process is gone (same host, no such pid, or the
pid now belongs to a later process) is stale: the next job takes it over and says so. A lock of another host cannot
be checked from here: the job refuses, naming the file to delete if that job is not running.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket

LOCK = ".lock"


class LockError(Exception):
    """The folder is locked by another job (the message names it and the lock file)."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid apart."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(owner: dict) -> bool:
    """Whether the lock's process still runs (a lock of this host only)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    ticks = _start_ticks(pid)
    return owner.get("start_ticks") is None or ticks is None or ticks == owner["start_ticks"]


def _read(path: pathlib.Path) -> dict | None:
    """The lock's owner record; {} when unreadable (a lock being written, or damaged); None when absent."""
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _describe(owner: dict) -> str:
    return (f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} since {owner.get('started', '?')}"
            + (f" ({owner['command']})" if owner.get("command") else ""))


def holder(folder: pathlib.Path) -> dict | None:
    """The record of a live job holding `folder`'s lock, else None (no lock, or a stale one of this host)."""
    owner = _read(folder / LOCK)
    if owner is None:
        return None
    if owner.get("host") == socket.gethostname() and not _alive(owner):
        return None
    return owner


def refusal(folder: pathlib.Path) -> str | None:
    """The refusal message when another live job holds `folder`'s lock (None when free or stale)."""
    owner = holder(folder)
    if owner is None:
        return None
    here = owner.get("host") == socket.gethostname()
    return (f"{folder} is in use by another training job ({_describe(owner)}): two jobs writing one checkpoint "
            f"folder would overwrite and prune each other's checkpoints; wait for it, or pick another "
            f"--checkpoint-dir" + ("" if here else f" (if that job is no longer running, delete {folder / LOCK})"))


def acquire(folder: pathlib.Path, command: str = "") -> str | None:
    """Take `folder`'s lock for this process (creating the folder); return a note when a stale lock was taken
    over, else None. Raises LockError when another live job holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    note = None
    for _ in range(3):  # (a stale lock removed by a job starting at the same time: try again)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _start_ticks(os.getpid()),
                  "started": datetime.datetime.now().isoformat(timespec="seconds"), "command": command}
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            msg = refusal(folder)
            if msg is not None:
                raise LockError(msg) from None
            owner = _read(path) or {}
            note = (f"took over the stale lock {path} of a job that is no longer running ({_describe(owner)})")
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return note
    raise LockError(f"could not take the lock {path}: other jobs keep creating it")


def release(folder: pathlib.Path) -> None:
    """Remove `folder`'s lock if this process holds it."""
    path = folder / LOCK
    owner = _read(path)
    if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
