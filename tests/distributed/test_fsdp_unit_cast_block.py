"""The unit cast of FP8 128x128-tile weights ([Note: unit cast], hybridq/distributed/unit_cast.py): the first such
weight of a unit to be asked for its all-gather input prepares the payloads of its qualifying siblings in one
`quantize_fp8_block_tensors` call. Specified against the per-weight path (the switch off, `set_unit_cast(False)`):
every gathered weight (bytes and tile scales), loss and gradient bitwise the same over training steps, with and
without precompute_scales, with per-tensor FP8 weights in the unit (a batch of their own kind), with a partial last
tile row and partial tile columns, a tile of zeros and non-finite values; at two ranks a shard whose boundary splits
a tile is left to the per-weight path, and so is every weight whose statistics need a collective at its unshard; a
payload made stale between the batch and its weight's hook is not used. Real FSDP2 on gloo (world 1 in-process,
world 2 spawned); the CUDA kernel's bytes: tests/test_fp8_block_tensors.py."""

from __future__ import annotations

import pytest
import torch

from hybridq.distributed import unit_cast

import _unit_cast_block_jobs as jobs
import _unit_cast_jobs as base
from _harness import job_several, spawn

pytestmark = pytest.mark.distributed

UNITS, STEPS = 2, 3


def _batched(counts: dict, mixed: bool, left_out: tuple = ()) -> None:
    """From the second step on (the first unshard of each training state is per weight), every forward unshard of a
    unit is one batch per kind of its qualifying weights (two kinds where `mixed`), and each of those weights sent its
    batch's payload; the weights `left_out` sent none."""
    for n, got in counts["payload_unit"].items():
        want = 0 if n.split(".")[1] in left_out else STEPS - 1
        assert got == want, f"{n} sent {got} unit payloads, expected {want}"
    kinds = 2 if mixed is True else 1
    assert sum(counts["unit_batches"].values()) == kinds * UNITS * (STEPS - 1), \
        f"unit batches {counts['unit_batches']}, expected {kinds} per unit per forward from the second step on"


@pytest.mark.parametrize("mixed", [False, True], ids=["fp8_block", "with_tensorwise_weights"])
@pytest.mark.parametrize("precompute", [False, True], ids=["own_stats", "precomputed"])
def test_one_rank_training_is_bitwise_the_per_weight_path(one_rank, precompute, mixed):
    counts = jobs.parity(0, 1, one_rank, precompute, mixed, steps=STEPS)
    _batched(counts, mixed)


@pytest.mark.parametrize("mixed", [False, True, "no_pow2"],
                         ids=["fp8_block", "with_tensorwise_weights", "with_two_tile_quantizers"])
def test_two_ranks_training_is_bitwise_the_per_weight_path(mixed):
    """Two ranks: with precompute_scales the tile-amax grids are reduced before the unshards (batched, except v, whose
    shard boundary splits a tile; the tile scales of each quantizer's weights computed at once); without, every weight
    reduces its own at its unshard (a collective), so nothing is batched and the collectives are those of the
    per-weight path. Non-finite values at two ranks too."""
    kinds = {"precomputed": (jobs.parity, dict(precompute=True, mixed=mixed, steps=STEPS)),
             "own_stats": (jobs.parity, dict(precompute=False, mixed=mixed, steps=STEPS))}
    if not mixed:
        kinds["nonfinite"] = (jobs.nonfinite, dict(precompute=True))
    results = spawn(job_several, 2, "gloo", jobs=kinds)
    for rank, r in enumerate(results):
        _batched(r["precomputed"], mixed, left_out=jobs.CUT_AT_TWO)
        assert sum(r["own_stats"]["unit_batches"].values()) == 0, \
            f"rank {rank}: statistics that need a collective at the unshard were batched: {r['own_stats']}"
        if not mixed:
            assert r["nonfinite"]["batches"] == UNITS, f"rank {rank}: {r['nonfinite']['batches']} unit batches"


def test_non_finite_values_and_zero_tiles_stay_in_their_tiles(one_rank):
    """Weights with an inf, a NaN, a -inf and tiles of zeros: gathered bitwise as the per-weight path gathers them;
    the tiles that hold them have scale_inv 1 (amax inf / NaN / 0), every other tile's is finite and not 1 --
    nothing leaks into another tile or weight of the batch."""
    r = jobs.nonfinite(0, 1, one_rank, precompute=False)
    assert r["batches"] == UNITS, f"{r['batches']} unit batches in the recorded forward, expected {UNITS}"
    ones = {"0.k": {2}, "0.up": {2}, "1.up": {2, 4}, "1.down": {3}}  # (flat tile indices: inf / NaN / zeros)
    for name, scales in r["scale_inv"].items():
        for i, s in enumerate(scales):
            if i in ones.get(name, ()):
                assert s == 1.0, f"{name} tile {i} (non-finite or zero) has scale_inv {s}, expected 1"
            else:
                assert s != 1.0 and s == s and abs(s) != float("inf"), f"{name} tile {i}: scale_inv {s}"


def test_a_payload_made_stale_before_its_hook_is_not_used(one_rank, monkeypatch):
    """The master of a sibling changed in place after the batch prepared its payload (its version counter moves): its
    hook prepares its own from the new values, and the weight gathered is the quantization of those."""
    base.assert_stale_payload_not_used(jobs.build(one_rank, 1), jobs.D, "up", monkeypatch)


def test_the_switch_turns_the_batch_off(one_rank):
    """set_unit_cast(False) (HYBRIDQ_UNIT_CAST=0 at start): no unit batch of tile weights either."""
    was = unit_cast.set_unit_cast(False)
    try:
        m = jobs.build(one_rank, 1)
        with torch.no_grad():
            for _ in range(3):
                m(torch.randn(4, jobs.D))
        assert sum(base.counters(m, "unit_batches").values()) == 0
        assert sum(base.counters(m, "payload_unit").values()) == 0
    finally:
        unit_cast.set_unit_cast(was)
