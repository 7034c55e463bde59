"""Spawning helpers for the distributed tests (CPU gloo and multi-GPU NCCL).

Each spawned job runs several checks, since a 2-process spawn costs ~3 s on the CI machine. gloo jobs of 1, 2 or
4 ranks run on the session's persistent rank pool (_pool.py, [Note: the rank pool]); NCCL jobs, other world
sizes, callers that ask for `fresh_processes` and every job under HYBRIDQ_TEST_SPAWN_EACH=1 get processes of
their own. A rank that fails raises, which is reported with the worker's traceback; the process group has a
short timeout so a rank waiting in a collective for a failed peer does not hang the suite.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import warnings

import pytest
import torch

TIMEOUT_S = 120
POOLED_WORLD_SIZES = (1, 2, 4)


def backends(needs_extension: bool = False) -> list:
    """gloo always; nccl when two CUDA devices are visible (the GPU machine) -- and, for a test of what the CUDA
    extension's kernels do (`needs_extension`), the extension is built: without it CUDA runs the references and such
    a test would fail on a missing kernel path, not on a bug."""
    if not nccl_devices(2):
        return ["gloo", pytest.param("nccl", marks=pytest.mark.skip(reason="needs 2 CUDA devices + NCCL"))]
    if needs_extension:
        from hybridq.kernels import extension_available
        if not extension_available():
            return ["gloo", pytest.param("nccl", marks=pytest.mark.skip(reason="needs the built extension on CUDA"))]
    return ["gloo", "nccl"]


def nccl_devices(n: int) -> bool:
    """Whether an n-rank NCCL job can run here (n CUDA devices visible, NCCL built in)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= n and torch.distributed.is_nccl_available()


def job_several(rank, world_size, device, jobs: dict):
    """Several jobs in one spawn (8 processes take ~10 s to start): {name: job(...)} for name, (job, kwargs)."""
    return {name: job(rank=rank, world_size=world_size, device=device, **kw) for name, (job, kw) in jobs.items()}


def _entry(rank, world_size, backend, job, kwargs, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    if backend == "nccl":
        # bitwise comparisons against single-process replays: deterministic cuBLAS / kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(  # a file store: no port to race for
        backend, init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        result = job(rank=rank, world_size=world_size, device=device, **kwargs)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result if result is not None else {}, f)
        torch.distributed.barrier()  # nobody tears the group down while a peer still uses it
    finally:
        torch.distributed.destroy_process_group()
    # Results are written: leave without the interpreter's teardown, where gloo's background threads were seen to
    # abort the process once in CI ("terminate called without an active exception") after a passing job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(job, world_size: int, backend: str, *, fresh_processes: bool = False, **kwargs) -> list[dict]:
    """Run `job(rank=, world_size=, device=, **kwargs)` on `world_size` processes; returns each rank's
    JSON-serialisable result. `fresh_processes`: new processes for this job even where the pool could run it."""
    import torch.multiprocessing as mp

    if (backend == "gloo" and world_size in POOLED_WORLD_SIZES and not fresh_processes
            and os.environ.get("HYBRIDQ_TEST_SPAWN_EACH") != "1"):
        import _pool
        return _pool.pool(world_size, TIMEOUT_S).run(job, kwargs)

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world_size, backend, job, kwargs, out_dir), nprocs=world_size, join=True)
        out = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out
