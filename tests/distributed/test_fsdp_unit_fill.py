"""One replayed fill per FSDP2 unit ([Note: unit fill], hybridq/distributed/unit_fill.py): the first Linear weight of a
unit whose post-all-gather hook replays its recorded fill fills every later weight of the unit whose recorded fill
applies too, their launches batched, and marks each with the metadata its own hook will be handed. Specified against
the per-weight path (the switch off, `set_unit_fill(False)`): every gathered part (forward rowwise, backward
columnwise), loss and gradient bitwise the same over training steps, per-tensor FP8 and 128x128 tiles, a unit with
a weight of another format, world 1 and 2; the replay counters the same; a weight whose record does not fit is left to
its own hook; a mark is taken only by the hook call it was made for. Real FSDP2 on gloo (world 1 in-process, world 2
spawned)."""

from __future__ import annotations

import pytest

from hybridq.distributed import unit_fill
from hybridq.torch_private import local_tensor

import _unit_fill_jobs as jobs
from _harness import spawn

pytestmark = pytest.mark.distributed

STEPS = 3
CASES = [("fp8_tensorwise", False), ("fp8_block", False), ("fp8_tensorwise", True)]
IDS = ["fp8_tensorwise", "fp8_block", "one_mxfp8_weight"]


def _filled_as_unit(counts: dict, where: str) -> None:
    """The replay counters are the per-weight path's, and from the second step on every replayed fill was a unit's
    (each unit's weights all replay: the leader fills itself and the others)."""
    on, off = counts["on"], counts["off"]
    for key in ("fill_replayed", "derived_in_place", "aliased", "adopted"):
        assert on[key] == off[key], f"{where}: {key} per weight {on[key]} with the unit fill, {off[key]} without"
    for n, replayed in on["fill_replayed"].items():
        assert on["unit_filled"][n] == replayed, \
            f"{where}: {n} replayed {replayed} fills, {on['unit_filled'][n]} of them in its unit's fill"
    assert sum(on["fill_replayed"].values()) >= len(on["fill_replayed"]) * (STEPS - 1), \
        f"{where}: too few replayed fills {on['fill_replayed']}"
    assert sum(off["unit_filled"].values()) == 0, f"{where}: unit fills with the switch off: {off['unit_filled']}"


@pytest.mark.parametrize("preset,mixed", CASES, ids=IDS)
def test_one_rank_training_is_bitwise_the_per_weight_path(one_rank, preset, mixed):
    counts = jobs.parity(0, 1, one_rank, preset, mixed, steps=STEPS)
    _filled_as_unit(counts, f"world 1, {preset}")


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block"])
def test_without_reshard_after_forward(one_rank, preset):
    """reshard_after_forward=False: the forward unshard fills both directions (the columnwise form derived in place,
    in the unit's batch) and backward gathers nothing; bitwise the per-weight path."""
    counts = jobs.parity(0, 1, one_rank, preset, steps=STEPS, reshard=False)
    _filled_as_unit(counts, f"world 1, {preset}, reshard_after_forward=False")
    assert sum(counts["on"]["derived_in_place"].values()) > 0, "no columnwise form was derived in place"


def test_two_ranks_training_is_bitwise_the_per_weight_path():
    from _harness import job_several
    kinds = {preset: (jobs.parity, dict(preset=preset, steps=STEPS)) for preset in ("fp8_tensorwise", "fp8_block")}
    results = spawn(job_several, 2, "gloo", jobs=kinds)
    for rank, r in enumerate(results):
        for preset, counts in r.items():
            for key in ("on", "off"):  # (JSON: the counters came back as dicts of ints)
                counts[key] = {k: dict(v) for k, v in counts[key].items()}
            _filled_as_unit(counts, f"rank {rank} of 2, {preset}")


def test_a_weight_whose_record_does_not_fit_is_left_to_its_own_hook(one_rank):
    """One weight's own tensors re-pointed between steps (its buffers' version moves, as an adopting fill or a lazy
    gather moves it): the leader does not fill it, its own hook fills it as usual, and training stays bitwise the
    per-weight path's."""
    runs, filled = {}, {}
    was = unit_fill.set_unit_fill(False)
    try:
        for on in (False, True):
            unit_fill.set_unit_fill(on)
            m = jobs.build(one_rank, 1)
            first = jobs.train(m, one_rank, 2)
            st = local_tensor(m[0].v.weight)._hq
            st.buffers_version += 1  # (what `fill` does when it re-points an own tensor)
            before = jobs.counters(m)["unit_filled"]
            runs[on] = (first, jobs.train(m, one_rank, 1, start=2))
            filled[on] = {n: c - before[n] for n, c in jobs.counters(m)["unit_filled"].items()}
    finally:
        unit_fill.set_unit_fill(was)
    for half in (0, 1):
        jobs.compare(runs[True][half], runs[False][half], f"v's record invalidated after 2 steps, part {half}")
    for n, c in filled[True].items():  # (both of its records name the old version: its own hook fills it twice)
        want = 0 if n == "0.v.weight" else 2
        assert c == want, f"{n} was unit-filled {c} times in the step after 0.v's record was invalidated, not {want}"


def test_a_stale_mark_is_never_taken(one_rank):
    """A mark left on a weight (a leader's fill of an unshard that failed before the weight's hook ran), then the switch
    turned off: the next unshards' hooks see a mark that is not their metadata and fill as usual -- training bitwise a
    model without the marks. (Taking any mark as "filled" would skip those fills: stale scales and derived bytes.)"""
    runs = {}
    was = unit_fill.set_unit_fill(True)
    try:
        for stale in (False, True):
            unit_fill.set_unit_fill(True)
            m = jobs.build(one_rank, 1)
            jobs.train(m, one_rank, 2)
            unit_fill.set_unit_fill(False)
            if stale:
                for p in m.parameters():
                    local_tensor(p)._hq.unit_filled = ("metadata of an unshard whose hooks never ran",)
            runs[stale] = jobs.train(m, one_rank, 1, start=2)
    finally:
        unit_fill.set_unit_fill(was)
    jobs.compare(runs[True], runs[False], "stale marks planted after 2 steps")


def test_take_mark_is_for_one_hook_call():
    """`take_mark` is True only for the metadata object the mark names (a new object per pre-all-gather call), and
    drops the mark either way."""
    from types import SimpleNamespace

    md, other = tuple(["metadata"]), tuple(["metadata"])  # (equal, not the same object)
    st = SimpleNamespace(unit_filled=md)
    assert unit_fill.take_mark(st, other) is False, "a mark was taken by another unshard's (equal) metadata"
    assert st.unit_filled is None, "a mark not taken was kept"
    st.unit_filled = md
    assert unit_fill.take_mark(st, md) is True and st.unit_filled is None
    assert unit_fill.take_mark(st, md) is False, "a mark was taken twice"


def test_launches_per_unit_drop(one_rank):
    """Launches of the post-all-gather hooks per training step (tests/distributed/_opcount.py), from the second step
    on: the forward unshard's scale copies are one `_foreach_copy_` per unit (one copy per weight without the unit
    fill); the backward unshard's derived scales likewise, its byte transposes one each on the CPU (on CUDA one call of
    the list transpose, test_transpose_list.py)."""
    from _opcount import launches_per_step

    launches = launches_per_step(lambda: jobs.build(one_rank, 1), unit_fill.set_unit_fill, "post_all_gather", jobs.D)
    units, weights = 2, 2 * len(jobs.__dict__["Block"]().__dict__["_modules"])
    assert launches[False] == 3 * weights, \
        f"{launches[False]} post-all-gather launches per step without the unit fill, expected {3 * weights}"
    assert launches[True] == weights + 2 * units, \
        f"{launches[True]} post-all-gather launches per step with the unit fill, expected {weights + 2 * units}"


def test_the_switch_turns_the_unit_fill_off(one_rank):
    """set_unit_fill(False): no unit fill; set_unit_fill returns the previous setting."""
    was = unit_fill.set_unit_fill(False)
    try:
        assert unit_fill.set_unit_fill(False) is False and unit_fill.unit_fill_enabled() is False
        m = jobs.build(one_rank, 1)
        jobs.train(m, one_rank, 2)
        assert sum(jobs.counters(m)["unit_filled"].values()) == 0
    finally:
        unit_fill.set_unit_fill(was)


# ---- on a GPU: the CUDA kernels' quantization, the list transpose, one record_stream per storage --------------------

@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block"])
def test_gpu_training_is_bitwise_the_per_weight_path(preset):
    """CUDA, NCCL world 1 (FSDP2 copies each input into its output; the hooks run one after another): every gathered
    part, loss and gradient bitwise the switch off, every replay from the second step on a unit's fill."""
    from _gpu import extension_ready
    from _harness import nccl_devices

    if not (nccl_devices(1) and extension_ready()):
        pytest.skip("needs a CUDA device, NCCL and the extension")
    (counts,) = spawn(jobs.parity, 1, "nccl", preset=preset, steps=STEPS)
    for key in ("on", "off"):
        counts[key] = {k: dict(v) for k, v in counts[key].items()}
    _filled_as_unit(counts, f"CUDA world 1, {preset}")
