"""The backward unshard of a per-tensor FP8 or 128x128-tile weight (rowwise gathered, columnwise derived) replayed
under the real FSDP2 (gloo, world 1 and 2): the columnwise form derived into the storage FSDP2 allocated for it
instead of a fresh allocation (buffers.py [Note: replayed fill]). Against the same model whose weights never record a
fill (every unshard filled as the code before did): outputs, losses, gradients and every gathered byte of every
unshard bitwise, over AdamW steps (values change: a stale derivation would differ), eval forwards, a change of
reshard_after_forward (a new plan: its first unshard fills as usual, the next ones replay, in forward now), a new
recipe (new quantizers: never derived by the old record) and a non-finite weight; the gathered columnwise
form also against the full weight's quantization on one rank."""

from __future__ import annotations

import pytest

from _gpu import extension_ready
from _harness import nccl_devices, spawn
import _derived_replay_jobs as jobs

pytestmark = pytest.mark.distributed

CASES = [dict(preset="fp8_tensorwise"), dict(preset="fp8_block")]
IDS = [c["preset"] for c in CASES]
STEPS = jobs._steps()
WEIGHTS = ("fc1", "fc2")


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request):
    return spawn(jobs.job_derived_replays, request.param, "gloo", cases=CASES)


def _counts(out, i: int, step: int, tag: str, name: str) -> tuple[int, int]:
    c = out[i]["per_step"][step]["counters"][tag][name]
    return c.get("fill_replayed", 0), c.get("derived_in_place", 0)


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_replayed_run_equals_the_usual_fills(runs, i):
    for rank, out in enumerate(runs):
        diffs = out[i]["diffs"]
        assert not diffs, f"rank {rank}: {len(diffs)} differences, first: {diffs[:5]}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_backward_unshards_are_derived_in_place(runs, i):
    """From the second step on, each weight's forward and backward unshards are replayed, the backward one deriving
    its columnwise form in place; the first step fills as usual; the other model never replays."""
    for rank, out in enumerate(runs):
        for name in WEIGHTS:
            assert _counts(out, i, 0, "replay", name) == (0, 0), f"rank {rank} {name}: step 0 replayed"
            for step in (1, 2):
                got = _counts(out, i, step, "replay", name)
                assert got == (2, 1), (f"rank {rank} {name} step {step}: (replayed fills, in-place derivations) "
                                       f"{got}, not (2, 1)")
            assert all(_counts(out, i, s, "usual", name) == (0, 0) for s in range(len(STEPS))), \
                f"rank {rank} {name}: the model without records replayed"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_a_new_plan_is_filled_before_it_is_replayed(runs, i):
    """reshard_after_forward=False (steps 7, 8): forward gathers both directions, deriving the columnwise one; its
    first unshard fills as usual, the next derives in place; no backward unshard runs."""
    first = next(s for s, st in enumerate(STEPS) if st.get("reshard_after_forward") is False)
    for rank, out in enumerate(runs):
        for name in WEIGHTS:
            assert _counts(out, i, first, "replay", name) == (0, 0), \
                f"rank {rank} {name}: the first unshard of a new plan was replayed"
            got = _counts(out, i, first + 1, "replay", name)
            assert got == (1, 1), f"rank {rank} {name}: step {first + 1} (replayed, derived in place) {got}, not (1, 1)"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_a_new_recipe_is_not_derived_from_the_old_record(runs, i):
    """fc1 given a new recipe (step 11: new quantizer objects of the same format): its backward unshard of that step
    derives as usual, not by the replay recorded for the old quantizer; fc2 replays on; fc1 replays again from the
    next step."""
    change = next(s for s, st in enumerate(STEPS) if st.get("recipe"))
    for rank, out in enumerate(runs):
        got = _counts(out, i, change, "replay", "fc1")
        assert got[1] == 0, f"rank {rank}: fc1 derived in place by a record of its old quantizer: {got}"
        assert _counts(out, i, change, "replay", "fc2") == (2, 1), f"rank {rank}: fc2 stopped replaying"
        assert _counts(out, i, change + 1, "replay", "fc1") == (2, 1), \
            f"rank {rank}: fc1 did not replay its new recipe's fills"


# ---- on a GPU: the CUDA kernels' quantization, the tiled transpose into FSDP2's allocation ---------------------------

@pytest.fixture(scope="module")
def gpu_runs():
    return spawn(jobs.job_derived_replays, 1, "nccl", cases=CASES)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not (nccl_devices(1) and extension_ready()), reason="needs a CUDA device, NCCL and the extension")
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_gpu_replayed_run_equals_the_usual_fills(gpu_runs, i):
    """CUDA, NCCL world 1: the same steps, bitwise the model without records and the full weight's quantization;
    the backward unshards of steps 1 and 2 derived in place."""
    out = gpu_runs[i]
    assert not out["diffs"], f"{IDS[i]}: {len(out['diffs'])} differences, first: {out['diffs'][:5]}"
    for name in WEIGHTS:
        for step in (1, 2):
            got = _counts([out], 0, step, "replay", name)
            assert got == (2, 1), f"{IDS[i]} {name} step {step}: (replayed, derived in place) {got}, not (2, 1)"
