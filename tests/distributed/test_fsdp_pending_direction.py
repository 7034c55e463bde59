"""A direction of an FSDP2-gathered weight that the backward unshard fills (the gather plan defers it: e.g.
columnwise, dgrad's form) has, before that unshard, its own tensors over FSDP2's freed (size-0) storage. Read with
autograd off (an eval forward: no backward will fill it) it read freed memory -- a segfault, not an error. Now the
grouped weight's accessors that the grouped paths read at once (`ensure_direction`, `stacked_part`; stacked block
gather on and off) raise hybridq's error naming the weight and the direction before anything reads the memory
([Note: a direction pending the backward unshard], distributed/gathered.py); the directions the forward unshard
gathered read as before, and train / eval / train runs on after the error.

The jobs run in spawned processes (_harness.spawn): a segfault fails the test instead of killing pytest."""

from __future__ import annotations

import pytest

from _harness import spawn
import _pending_direction_jobs as jobs

pytestmark = pytest.mark.distributed

BLOCK = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]  # (the stacked block gather's presets)
CASES = ([dict(layer="grouped", preset=p, how="stacked", direction="columnwise", stacked=s)
          for p in BLOCK + ["fp8_tensorwise", "nvfp4"] for s in (True, False)]
         + [dict(layer="grouped", preset=p, how="stacked", direction="rowwise") for p in ("fp8_block", "mxfp8")])
IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request):  # (one spawn per world size for every case: a segfault in any case fails them all)
    return spawn(jobs.job_pending_reads, request.param, "gloo", cases=CASES)


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_eval_read_of_a_direction(runs, i):
    case = CASES[i]
    for rank, out in enumerate(runs):
        got = out[i]["eval"]
        if case["direction"] == "rowwise":  # gathered by the forward unshard: read as before
            assert got == "read", f"rank {rank}: the eval read of rowwise raised: {got}"
            continue
        name = "moe.w1.weight expert 0"
        assert got.startswith(f"hybridq FSDP: the columnwise form of {name} is gathered by FSDP2's backward "
                              f"unshard"), f"rank {rank}: the eval read of the pending columnwise gave: {got}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_train_eval_train_runs_on(runs, i):
    for rank, out in enumerate(runs):
        assert out[i]["finite"] == [True, True, True], \
            f"rank {rank}: train / eval / train outputs finite: {out[i]['finite']}"
