"""The spawning helper itself (_harness.spawn): every job runs in new processes, one per rank, whichever way they
start ([Note: gloo ranks forked from a preloaded server]), and the ranks see the environment of the test that
spawned them -- hybridq's switches included, which are read from it at import."""

from __future__ import annotations

import os

import pytest
import torch

from _harness import spawn, start_method
import _harness_jobs

pytestmark = pytest.mark.distributed

PROBE = "HYBRIDQ_TEST_HARNESS_PROBE"
SWITCH = "HYBRIDQ_EAGER_FAST_PATH"  # a switch that is on by default


def test_gloo_ranks_fork_from_the_preloaded_server_on_a_machine_without_cuda():
    want = "spawn" if torch.cuda.is_available() else "forkserver"
    assert start_method("gloo") == want, f"gloo ranks start with {start_method('gloo')!r}, expected {want!r}"
    assert start_method("nccl") == "spawn"


def test_every_job_runs_in_new_processes_one_per_rank():
    first = spawn(_harness_jobs.process_state, 2, "gloo", probe=PROBE)
    second = spawn(_harness_jobs.process_state, 2, "gloo", probe=PROBE)
    for rank, (a, b) in enumerate(zip(first, second)):
        assert a["jobs_run"] == b["jobs_run"] == 1, f"rank {rank}: the second job ran in a process of the first"
        assert a["pids"] == [r["pid"] for r in first] and len(set(a["pids"])) == 2, f"rank {rank}: {a['pids']}"
    pids = [r["pid"] for r in first + second]
    assert len(set(pids)) == 4 and os.getpid() not in pids, f"processes reused: {pids} (pytest's {os.getpid()})"


def test_the_ranks_see_the_environment_the_test_set(monkeypatch):
    """A variable set by the test reaches the ranks, and so does a switch's setting, read at hybridq's import: the
    ranks cannot be forks of a server that imported hybridq under the environment before."""
    spawn(_harness_jobs.process_state, 2, "gloo", probe=PROBE)  # (a server, where there is one, started before)
    monkeypatch.setenv(PROBE, "set by the test")
    monkeypatch.setenv(SWITCH, "0")
    assert start_method("gloo") == "spawn"
    for rank, r in enumerate(spawn(_harness_jobs.process_state, 2, "gloo", probe=PROBE)):
        assert r["probe"] == "set by the test", f"rank {rank}: {PROBE}={r['probe']!r}"
        assert r["switches"][SWITCH] is False, f"rank {rank}: {SWITCH}=0 at the spawn, the rank's switch is on"
