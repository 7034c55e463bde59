"""One cast + quantize per FSDP2 unit ([Note: unit cast], hybridq/distributed/unit_cast.py): the first per-tensor FP8
weight of a unit to be asked for its all-gather input prepares the payloads of its qualifying siblings in one batch;
each sibling's hook uses its payload only under its own key. Specified against the per-weight path (the switch off,
`set_unit_cast(False)`): every gathered weight, loss and gradient bitwise the same, over training steps (the optimizer
changes the masters: no stale payload), with and without precompute_scales, with a weight of another format in the
unit, with non-finite values in some weights; and a payload made stale between the batch and its weight's hook is
not used. Real FSDP2 on gloo (world 1 in-process, world 2 spawned); the CUDA kernel's bytes:
tests/test_fp8_tensors.py."""

from __future__ import annotations

import math

import pytest
import torch

from hybridq.distributed import unit_cast

import _unit_cast_jobs as jobs
from _harness import spawn

pytestmark = pytest.mark.distributed

UNITS, STEPS = 2, 3


def _batched(counts: dict, mixed: bool) -> None:
    """From the second step on (the first unshard of each training state is per weight), every forward unshard of a
    unit is one batch of its qualifying weights, and each of those weights sent the batch's payload."""
    qualifying = [n for n in counts["payload_unit"] if not (mixed and n.endswith(".o.weight"))]
    for n in counts["payload_unit"]:
        want = STEPS - 1 if n in qualifying else 0
        assert counts["payload_unit"][n] == want, f"{n} sent {counts['payload_unit'][n]} unit payloads, expected {want}"
    assert sum(counts["unit_batches"].values()) == UNITS * (STEPS - 1), \
        f"unit batches {counts['unit_batches']}, expected one per unit per forward from the second step on"


@pytest.mark.parametrize("mixed", [False, True], ids=["fp8", "one_mxfp8_weight"])
@pytest.mark.parametrize("precompute", [False, True], ids=["own_stats", "precomputed"])
def test_one_rank_training_is_bitwise_the_per_weight_path(one_rank, precompute, mixed):
    counts = jobs.parity(0, 1, one_rank, precompute, mixed, steps=STEPS)
    _batched(counts, mixed)


@pytest.mark.parametrize("mixed", [False, True], ids=["fp8", "one_mxfp8_weight"])
def test_two_ranks_training_is_bitwise_the_per_weight_path(mixed):
    """Two ranks: with precompute_scales the shards' statistics are reduced before the unshards (batched); without,
    every weight reduces its own at its unshard (a collective), so nothing is batched and the collectives are
    those of the per-weight path."""
    kinds = {"precomputed": (jobs.parity, dict(precompute=True, mixed=mixed, steps=STEPS)),
             "own_stats": (jobs.parity, dict(precompute=False, mixed=mixed, steps=STEPS))}
    from _harness import job_several
    results = spawn(job_several, 2, "gloo", jobs=kinds)
    for rank, r in enumerate(results):
        _batched(r["precomputed"], mixed)
        assert sum(r["own_stats"]["unit_batches"].values()) == 0, \
            f"rank {rank}: statistics that need a collective at the unshard were batched: {r['own_stats']}"


def test_non_finite_values_stay_in_their_weight(one_rank):
    """A weight with an inf and one with a NaN: gathered bitwise as the per-weight path gathers them (their FP8 data
    non-finite, their scale 1: amax inf / NaN), and every sibling's scale finite -- nothing leaks into the batch's
    other weights."""
    r = jobs.nonfinite(0, 1, one_rank)
    assert r["batches"] == UNITS, f"{r['batches']} unit batches in the recorded forward, expected {UNITS}"
    scales = r["scale_inv"]
    for name in ("0.k", "1.up"):
        assert scales[name][0] == 1.0, f"{name} (non-finite master) has scale_inv {scales[name][0]}, expected 1"
        assert any(b & 0x7F == 0x7F for b in r["data"][name]), f"{name}: no non-finite FP8 byte in its gathered data"
    for name, s in scales.items():
        if name not in ("0.k", "1.up"):
            assert math.isfinite(s[0]) and s[0] != 1.0, f"{name}: scale_inv {s[0]} (a sibling of a non-finite weight)"


def test_a_payload_made_stale_before_its_hook_is_not_used(one_rank, monkeypatch):
    """The master of a sibling changed in place after the batch prepared its payload (its version counter moves): its
    hook prepares its own from the new values, and the weight gathered is the quantization of those."""
    jobs.assert_stale_payload_not_used(jobs.build(one_rank, 1), jobs.D, "v", monkeypatch)


def test_the_switch_turns_the_batch_off(one_rank):
    """set_unit_cast(False): no unit batch, every weight prepares its own payload; set_unit_cast returns the previous
    setting."""
    was = unit_cast.set_unit_cast(False)
    try:
        assert unit_cast.set_unit_cast(False) is False
        m = jobs.build(one_rank, 1)
        with torch.no_grad():
            for _ in range(3):
                m(torch.randn(4, jobs.D))
        assert sum(jobs.counters(m, "unit_batches").values()) == 0
        assert sum(jobs.counters(m, "payload_unit").values()) == 0
    finally:
        unit_cast.set_unit_cast(was)


def test_launches_per_unit_drop(one_rank):
    """GPU-equivalent launches of the pre-all-gather hooks (tests/distributed/_opcount.py: a quantization the CUDA
    kernels take counts as its launches) per training step, from the second step on: with the unit cast, each unit's
    forward unshard is one amax and one cast launch for all its weights (no per-weight cast to bf16, amax and FP8
    cast); its backward unshard re-sends the kept payloads."""
    from _opcount import launches_per_step
    from hybridq.data_writes import CHECK

    # (the data-write check's reads of the kept payloads' weights are budgeted in test_fsdp_opcount.py: off here, the
    # count is the unit cast's alone)
    with CHECK.turned(False):
        launches = launches_per_step(lambda: jobs.build(one_rank, 1), unit_cast.set_unit_cast, "pre_all_gather",
                                     jobs.D)
    weights = UNITS * len(jobs.NAMES)
    assert launches[True] == 2 * UNITS, f"{launches[True]} launches per step with the unit cast, expected {2 * UNITS}"
    assert launches[False] >= 2 * weights, f"{launches[False]} launches per step without it, expected >= {2 * weights}"


def test_a_backward_override_set_between_steps(one_rank, monkeypatch):
    """HYBRIDQ_BACKWARD_OVERRIDE set between steps (the siblings' lanes were derived without it; the batch does not
    read it, their hooks do): training stays bitwise the per-weight path's."""
    runs = {}
    was = unit_cast.set_unit_cast(False)
    try:
        for on in (False, True):
            unit_cast.set_unit_cast(on)
            monkeypatch.delenv("HYBRIDQ_BACKWARD_OVERRIDE", raising=False)
            m = jobs.build(one_rank, 1)
            first = jobs.train(m, one_rank, 2, precompute=False)
            monkeypatch.setenv("HYBRIDQ_BACKWARD_OVERRIDE", "dequantized")
            runs[on] = (first, jobs.train(m, one_rank, 2, precompute=False))
    finally:
        unit_cast.set_unit_cast(was)
    for half in (0, 1):
        jobs.compare(runs[True][half], runs[False][half], f"override set after 2 steps, part {half}")
    assert sum(jobs.counters(m, "unit_batches").values()) >= UNITS, "no unit batch ran"
