"""A direction of an FSDP2-gathered weight that the backward unshard fills (the gather plan defers it: columnwise,
dgrad's form; the high-precision weight under backward_override="high_precision") has, before that unshard, its own
tensors over FSDP2's freed (size-0) storage. Read in an eval forward (autograd off: no backward will fill it) or in a
training forward before its backward, it read freed memory -- a segfault, not an error. Every way in now raises
hybridq's error naming the weight and the direction before anything reads the memory ([Note: a direction pending
the backward unshard], distributed/gathered.py): a dense weight's `part`, `dequantize`, `columnwise` property,
copies (`clone`, `.to`) and `high_precision`; one expert's `part`; a grouped weight's `stacked_part` (stacked block
gather on and off). The forms the forward unshard gathered read as before; the training step that holds the
columnwise part for its backward (`held_part`) runs on, bitwise the same as a run without the read.

The jobs run in spawned processes (_harness.spawn): a segfault fails the test instead of killing pytest.
Before the fix (26f3c24) the dense, expert and copy cases and the training-forward reads segfaulted
(ProcessExitedException, SIGSEGV); only the grouped eval reads through `stacked_part` raised."""

from __future__ import annotations

import pytest

import hybridq

from _harness import nccl_devices, spawn
import _pending_direction_jobs as jobs

pytestmark = pytest.mark.distributed

# every preset whose forward unshard defers the columnwise form (not fp8_delayed: apply_hybrid_fsdp refuses delayed
# scaling; not fp8_fwd_high_precision_bwd: its backward reads the high-precision weight, the HP cases below)
DENSE = [p for p in hybridq.preset_names() if p not in ("fp8_delayed", "fp8_fwd_high_precision_bwd")]
BLOCK = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]  # (the stacked block gather's presets)
COL, ROW, HP = "columnwise", "rowwise", "high_precision"


def _dense(preset, how, direction, when="eval", **kw):
    return dict(layer="dense", preset=preset, how=how, direction=direction, when=when, **kw)


CASES = (
    # a dense Linear's weight: every way in to the pending columnwise form, in eval and before a training backward
    [c for p in DENSE for c in (
        _dense(p, "part", COL), _dense(p, "part", ROW), _dense(p, "dequantize", COL), _dense(p, "property", COL),
        _dense(p, "clone", COL), _dense(p, "part", COL, when="train", compare=True))]
    + [_dense("fp8_tensorwise", "to", COL), _dense("fp8_tensorwise", "dequantize", ROW),
       _dense("fp8_tensorwise", "property", ROW, when="train", compare=True)]
    # backward_override="high_precision": the high-precision weight is the deferred form
    + [_dense("fp8_tensorwise", HP, HP, override=HP), _dense("mxfp8", HP, HP, override=HP),
       _dense("fp8_tensorwise", HP, HP, when="train", override=HP, compare=True)]
    # grouped weights: the stacked buffers (gather on and off), one expert's part, a training forward
    + [dict(layer="grouped", preset=p, how="stacked", direction=COL, stacked=s)
       for p in BLOCK + ["fp8_tensorwise", "nvfp4"] for s in (True, False)]
    + [dict(layer="grouped", preset=p, how="stacked", direction=ROW) for p in ("fp8_block", "mxfp8")]
    + [dict(layer="grouped", preset=p, how="expert", direction=COL) for p in ("fp8_tensorwise", "fp8_block")]
    + [dict(layer="grouped", preset=p, how="stacked", direction=COL, when="train", compare=True)
       for p in ("fp8_tensorwise", "fp8_block")]
)
IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES]
NAMES = {"dense": "lin.weight", "grouped": "lin.weight expert 0"}


# on a GPU (NCCL, world 1): the eager FP8 Linear's one extension op holds the columnwise part in its C++ node
WORLDS = [pytest.param((1, "gloo"), id="world1"), pytest.param((2, "gloo"), id="world2"),
          pytest.param((1, "nccl"), id="world1-nccl", marks=[
              pytest.mark.gpu, pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device + NCCL")])]


@pytest.fixture(scope="module", params=WORLDS)
def runs(request):  # (one spawn per world for every case: a segfault in any case fails them all)
    world_size, backend = request.param
    return spawn(jobs.job_pending_reads, world_size, backend, cases=CASES)


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_read_of_a_direction(runs, i):
    case = CASES[i]
    for rank, out in enumerate(runs):
        got = out[i]["outcome"]
        if case["direction"] == ROW:  # gathered by the forward unshard: read as before
            assert got == "read", f"rank {rank}: the {case['when']} read of rowwise ({case['how']}) gave: {got}"
            continue
        want = (f"hybridq FSDP: the {case['direction']} form of {NAMES[case['layer']]} is gathered by FSDP2's "
                f"backward unshard")
        assert got.startswith(want), \
            f"rank {rank}: the {case.get('when', 'eval')} read of the pending {case['direction']} ({case['how']}) " \
            f"gave: {got}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_train_eval_train_runs_on(runs, i):
    for rank, out in enumerate(runs):
        assert out[i]["finite"] == [True, True, True], \
            f"rank {rank}: train / eval / train outputs finite: {out[i]['finite']}"


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c.get("compare")],
                         ids=[IDS[i] for i, c in enumerate(CASES) if c.get("compare")])
def test_refused_read_changes_nothing(runs, i):
    """The training steps (the held columnwise form read by dgrad after the backward unshard) are bitwise those of
    the same run without the read: the error left no state behind."""
    for rank, out in enumerate(runs):
        assert out[i]["same_as_without_read"] == "same", \
            f"rank {rank}: outputs / gradients that differed from the run without the read: " \
            f"{out[i]['same_as_without_read']}"
