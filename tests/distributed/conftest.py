"""Fixtures of the FSDP2 tests that run in the test process itself (the spawned worlds: _harness.spawn)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank (this process) for the test, torn down after it; yields the CPU device."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield torch.device("cpu")
    finally:
        dist.destroy_process_group()
