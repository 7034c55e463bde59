"""The persistent gloo rank pool of the distributed tests (_pool.py, [Note: the rank pool]): a job on the pool
starts from what a freshly spawned rank starts from, a failing job fails its test with the rank's traceback and
the next job runs on new ranks, and a changed environment starts new ranks.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.multiprocessing.spawn import ProcessRaisedException

from _harness import spawn

pytestmark = pytest.mark.distributed

SWITCH_ENV = "HYBRIDQ_EAGER_FAST_PATH"  # (a switch that is on by default; its module is imported by `import hybridq`)
JOB_ENV = "HYBRIDQ_TEST_POOL_MARK"  # (read by no library code)


def job_state(rank, world_size, device):
    """What a job starts with: every piece of process state a previous job on the same rank could leave changed."""
    import torch._dynamo

    import hybridq
    from hybridq.switches import switches

    return {"pid": os.getpid(), "env": os.environ.get(JOB_ENV), "switches": {k: s.on for k, s in switches().items()},
            "default_dtype": str(torch.get_default_dtype()), "seeded_by_hand": torch.initial_seed() == 0,
            "deterministic": [torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()],
            "grad": torch.is_grad_enabled(), "threads": torch.get_num_threads(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "filters": [repr(f) for f in warnings.filters],
            "dynamo_counters": {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v},
            "cache_size_limit": torch._dynamo.config.cache_size_limit, "hybridq": hybridq.__name__}


def job_dirty(rank, world_size, device):
    """Changes each piece of state `job_state` reports, restoring none of it."""
    import torch._dynamo

    from hybridq.switches import switches

    os.environ[JOB_ENV] = "left by a previous job"
    switches()[SWITCH_ENV].set(False)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("medium")
    warnings.simplefilter("error")
    torch._dynamo.utils.counters["graph_break"]["left by a previous job"] += 1
    torch._dynamo.config.cache_size_limit = 1
    return {"pid": os.getpid()}


def job_fails_on_rank_1(rank, world_size, device):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    torch.distributed.all_reduce(torch.ones(1))  # rank 0 waits in a collective for its failed peer
    return {}


def job_sum(rank, world_size, device):
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    return {"pid": os.getpid(), "sum": t.item()}


def _without_pid(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "pid"}


def test_a_job_starts_from_the_state_of_fresh_ranks():
    fresh = spawn(job_state, 2, "gloo", fresh_processes=True)
    dirty = spawn(job_dirty, 2, "gloo")
    pooled = spawn(job_state, 2, "gloo")
    assert [r["pid"] for r in pooled] == [r["pid"] for r in dirty], "the two jobs did not run on the same pooled ranks"
    for rank, (f, p) in enumerate(zip(fresh, pooled)):
        shared = f["switches"].keys() & p["switches"].keys()
        assert SWITCH_ENV in shared, (rank, sorted(shared))
        f["switches"] = {k: f["switches"][k] for k in shared}
        p["switches"] = {k: p["switches"][k] for k in shared}
        differ = {k: (f[k], p[k]) for k in _without_pid(f) if f[k] != p[k]}
        assert not differ, f"rank {rank}: a pooled job started with other state than fresh ranks (fresh, pooled): {differ}"


def test_a_failing_job_fails_with_the_ranks_traceback_and_the_next_runs_on_new_ranks():
    before = spawn(job_sum, 2, "gloo")
    with pytest.raises(ProcessRaisedException, match="rank 1 fails on purpose"):
        spawn(job_fails_on_rank_1, 2, "gloo")
    after = spawn(job_sum, 2, "gloo")
    assert [r["sum"] for r in after] == [3.0, 3.0], after
    assert not {r["pid"] for r in before} & {r["pid"] for r in after}, "ranks reused after a failed job"


def test_a_changed_environment_starts_new_ranks_that_read_it(monkeypatch):
    before = spawn(job_state, 2, "gloo")
    assert all(r["switches"][SWITCH_ENV] for r in before), before
    monkeypatch.setenv(SWITCH_ENV, "0")
    monkeypatch.setenv(JOB_ENV, "set by the test")
    after = spawn(job_state, 2, "gloo")
    assert not {r["pid"] for r in before} & {r["pid"] for r in after}, "ranks of another environment reused"
    for r in after:
        assert r["env"] == "set by the test" and r["switches"][SWITCH_ENV] is False, r
