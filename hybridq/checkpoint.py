"""Checksums for checkpoint folders: catch changed, missing or added bytes before a checkpoint is loaded.

`torch.distributed.checkpoint` (DCP) stores no checksums: a checkpoint whose bytes changed on disk (a bad disk, a
partial copy, a file from another save) loads without complaint. A manifest closes that gap: after a save, one
process records the name, size and SHA-256 of every file of the folder; before a load, `verify_manifest` reads them
again and raises `CheckpointIntegrityError` naming the first file that differs.

    dcp.save(state, checkpoint_id=path)
    dist.barrier()                                  # every rank has written its files
    if dist.get_rank() == 0:
        hybridq.checkpoint.write_manifest(path)
    ...
    hybridq.checkpoint.verify_manifest(path)        # before dcp.load, on every rank that loads
    dcp.load(state, checkpoint_id=path)

The manifest covers every file under the folder (subfolders included) but itself, so write it last. The training
job (launch/train.py) writes and verifies its checkpoints with these functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

__all__ = ["MANIFEST", "CheckpointIntegrityError", "write_manifest", "verify_manifest", "file_sha256"]

MANIFEST = "manifest.json"
_FORMAT = 1


class CheckpointIntegrityError(ValueError):
    """A checkpoint folder whose files are not those its manifest records (or that has no readable manifest).
    `folder` is the checkpoint, `file` the file that differs (the manifest itself when it is missing or
    unreadable), `problem` what differs."""

    def __init__(self, folder: pathlib.Path, file: str, problem: str, message: str):
        super().__init__(message)
        self.folder, self.file, self.problem = folder, file, problem


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: pathlib.Path) -> list[str]:
    """Every file under `folder` but the manifest (and an unfinished manifest write), as POSIX relative paths."""
    skip = {MANIFEST, MANIFEST + ".tmp"}
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def write_manifest(folder: str | os.PathLike) -> pathlib.Path:
    """Record the name, size and SHA-256 of every file under `folder` in `folder/manifest.json` (written to a
    temporary file, then atomically renamed over any earlier one); return its path. Call it once, after every rank
    finished writing (e.g. after `dcp.save` and a barrier, on rank 0)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"write_manifest: {folder} is not a folder")
    files = {name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
             for name in _files(folder)}
    if not files:
        raise ValueError(f"write_manifest: {folder} holds no file to record")
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "files": files}, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def verify_manifest(folder: str | os.PathLike) -> dict:
    """Check every file under `folder` against `folder/manifest.json`; return the manifest. Raises
    CheckpointIntegrityError naming the first file that is missing, of another size, of other content, or not
    listed (added after the manifest was written), or the manifest itself when it is missing or unreadable."""
    folder = pathlib.Path(folder)
    mf = folder / MANIFEST

    def fail(file: str, problem: str, message: str):
        raise CheckpointIntegrityError(folder, file, problem, message)

    if not mf.is_file():
        fail(MANIFEST, "missing", f"{folder} has no {MANIFEST}: it is incomplete (a save that did not finish) or was "
             "not written with hybridq.checkpoint.write_manifest, so its contents cannot be verified")
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not files or not all(
                isinstance(v, dict) and {"size", "sha256"} <= set(v) for v in files.values()):
            raise ValueError("'files' must map each file name to its size and sha256")
    except Exception as e:  # noqa: BLE001 (any damage to the manifest is the same refusal)
        fail(MANIFEST, "unreadable", f"{mf} is unreadable ({type(e).__name__}: {e})")
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            fail(name, "missing", f"checkpoint {folder} is damaged: {name} is missing (listed in {MANIFEST})")
        size = p.stat().st_size
        if size != want["size"]:
            fail(name, "size", f"checkpoint {folder} is damaged: {name} has {size} bytes, the manifest says "
                 f"{want['size']}")
        if file_sha256(p) != want["sha256"]:
            fail(name, "content", f"checkpoint {folder} is damaged: {name} has other content than the SHA-256 "
                 f"recorded in {MANIFEST} says (same size, changed bytes)")
    extra = [n for n in _files(folder) if n not in files]
    if extra:
        fail(extra[0], "extra", f"checkpoint {folder} is damaged: {extra[0]} is not listed in {MANIFEST} (a file "
             "added after the save" + (f"; {len(extra) - 1} more" if len(extra) > 1 else "") + ")")
    return manifest
