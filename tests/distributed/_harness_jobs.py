"""Jobs of test_harness.py: what a spawned rank sees of its process (tests/distributed/_harness.py)."""

from __future__ import annotations

import os

import torch

import hybridq.switches

# how many jobs this process has run: a rank that ran an earlier job (a reused process) counts more than one
JOBS_RUN = 0


def process_state(rank: int, world_size: int, device, probe: str) -> dict:
    """This rank's process id, the jobs run in it (this one included), the environment variable `probe` and every
    hybridq switch's setting; the ranks' ids all-gathered (each rank its own process)."""
    global JOBS_RUN
    JOBS_RUN += 1
    pids = [None] * world_size
    torch.distributed.all_gather_object(pids, os.getpid())
    return {"pid": os.getpid(), "pids": pids, "jobs_run": JOBS_RUN, "probe": os.environ.get(probe),
            "switches": {env: s.on for env, s in hybridq.switches.switches().items()}}
