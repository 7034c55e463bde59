"""Jobs of test_dcp_manifest.py (spawned; not a test module): a user script's DCP save of an FSDP2 hybridq model
with hybridq.checkpoint's manifest, a byte flipped on disk, then verify_manifest and a plain dcp.load."""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

import hybridq
from hybridq.checkpoint import CheckpointIntegrityError

import _dcp_jobs


def job_flipped_byte(rank, world_size, device, folder):
    """Save (every rank), manifest (rank 0); rank 0 flips one byte of rank 1's shard file; every rank verifies
    (the refusal it raises) and then loads anyway with DCP (what a script without the manifest gets)."""
    ck = pathlib.Path(folder) / "ck"
    model, opt = _dcp_jobs.sharded_model(world_size, seed=0)
    _dcp_jobs.step(model, opt, 0, world_size, rank)
    _dcp_jobs.save(model, opt, str(ck))
    dist.barrier()
    if rank == 0:
        hybridq.checkpoint.write_manifest(ck)
    dist.barrier()
    hybridq.checkpoint.verify_manifest(ck)  # intact: passes on every rank
    saved = _dcp_jobs.full_state(model, opt)
    target = ck / "__1_0.distcp"
    if rank == 0:
        data = bytearray(target.read_bytes())
        at = len(data) // 2
        data[at] ^= 0x40  # one bit of a stored value
        target.write_bytes(bytes(data))
    dist.barrier()
    try:
        hybridq.checkpoint.verify_manifest(ck)
        refused = None
    except CheckpointIntegrityError as e:
        refused = {"message": str(e), "file": e.file, "problem": e.problem}
    fresh, fresh_opt = _dcp_jobs.sharded_model(world_size, seed=1)
    _dcp_jobs.load(fresh, fresh_opt, str(ck))  # DCP itself: no error
    loaded = _dcp_jobs.full_state(fresh, fresh_opt)
    changed = [k for k, v in saved["model"].items() if not torch.equal(v, loaded["model"][k])]
    changed += [f"optim.{k}" for k, v in saved["optim"]["state"].items()
                if any(not torch.equal(a, loaded["optim"]["state"][k][n]) for n, a in v.items()
                       if isinstance(a, torch.Tensor))]
    return {"refused": refused, "target": target.name, "dcp_load_changed": changed}
