"""`precompute_scales` leaves out a grouped weight whose every unshard takes the batched block payload
(hybridq/distributed/scales.py `_scales_travel_in_the_payload`; [Note: stacked block payload]: each expert's 128x128
tile scales travel in its slot, so no unshard reads the tiles' reduced statistics): it neither computes nor
all-reduces them, and its counts say so. Where some unshard takes the per-expert payload (`out` 96 under 128x128
tiles, the switch HYBRIDQ_STACKED_BLOCK_PAYLOAD off, Shard(1), a format with a tensor-wide statistic) the statistics
are computed and reduced as before.

Oracle (bitwise), gloo world 2 on the CPU, two grouped weights under one root (`a`: the case's `out`; `b`: 96 rows,
whose statistics are always needed), an eval forward, then three train steps with precompute_scales before each (also
under activation recompute: a lazy gather in the first backward): the switch off throughout (the per-expert payload,
every weight's statistics precomputed) against the switch on throughout and flipped between precompute_scales and the
unshards (both ways): every gathered tensor of every expert, y, dx and both weights' dw."""

from __future__ import annotations

import pytest

from _harness import spawn
import _precompute_block_jobs as jobs

CASES = [dict(preset="fp8_block"), dict(preset="fp8_block_fwd_mxfp8_bwd"), dict(preset="mxfp8"),
         dict(preset="fp8_block", experts=3),  # (uneven on 2 ranks)
         dict(preset="fp8_block", out=96), dict(preset="fp8_block_fwd_mxfp8_bwd", out=96),  # (a tile spans experts)
         dict(preset="fp8_block", recompute=True), dict(preset="fp8_block_fwd_mxfp8_bwd", recompute=True)]
IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES]


def left_out(case: dict) -> bool:
    """Whether `a`'s statistics are left out with the switch on: it has tile statistics (not MXFP8 alone) and `out` is
    a whole number of 128x128 tiles."""
    return case["preset"] != "mxfp8" and case.get("out", 256) % 128 == 0


@pytest.fixture(scope="module")
def runs():
    return spawn(jobs.job_precompute_block_payload, 2, "gloo", cases=CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["on", "flip_off", "flip_on"])
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_training_is_bitwise_the_per_expert_path_with_every_statistic_precomputed(runs, i, run):
    """Switch on throughout, on for precompute_scales then off for the unshards (the per-expert payload must reduce
    the statistics precompute_scales left out, never read stale ones), and off then on."""
    for rank, res in enumerate(runs):
        diffs = res[i][run]["diffs"]
        assert not diffs, f"rank {rank} {IDS[i]} {run}:\n" + "\n".join(diffs[:10])


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_precompute_scales_reduces_no_statistics_of_a_weight_whose_scales_travel_in_the_payload(runs, i):
    """With the switch on, `a`'s statistics are left out where every unshard takes the batched payload: the fused
    all-reduce carries `b`'s alone and the counts say so (before the change: `a`'s 2 tiles x 4 experts were reduced
    too, 12 values where 4 are now); elsewhere exactly what the switch-off run reduces."""
    for rank, res in enumerate(runs):
        for run in ("on", "flip_off"):  # (the switch on during precompute_scales)
            for s, (got, ref, fresh, ref_fresh) in enumerate(zip(
                    res[i][run]["precompute"], res[i]["per_expert"]["precompute"], res[i][run]["fresh"],
                    res[i]["per_expert"]["fresh"])):
                where = f"rank {rank} {IDS[i]} {run} step {s}"
                if left_out(CASES[i]):
                    assert ref_fresh["a"] > 0, f"{where}: the switch-off run reduced none of a's statistics"
                    want = dict(weights=ref["weights"] - 1, values=ref["values"] - ref_fresh["a"],
                                all_reduces=ref["all_reduces"])
                    assert fresh == {"a": 0, "b": ref_fresh["b"]}, f"{where}: values reduced per weight {fresh}"
                else:
                    want = ref
                    assert fresh == ref_fresh, f"{where}: values reduced per weight {fresh}, switch off {ref_fresh}"
                assert got == want, f"{where}: precompute_scales {got}, expected {want}"


LEFT_OUT = [i for i, c in enumerate(CASES) if left_out(c) and not c.get("recompute")]
RECOMPUTE = [i for i, c in enumerate(CASES) if c.get("recompute")]


@pytest.mark.distributed
@pytest.mark.parametrize("i", LEFT_OUT, ids=[IDS[i] for i in LEFT_OUT])
def test_a_left_out_weight_is_reduced_by_the_per_expert_payload_after_a_flip(runs, i):
    """Switch on at precompute_scales, off at the unshards: `a`'s per-expert payload reduces its statistics itself at
    every step after the first (precompute_scales set none for the new values; the first step's values are those the
    warm-up unshard reduced, kept under their key); switch on throughout: nothing reduced, ever."""
    for rank, res in enumerate(runs):
        flip, on = res[i]["flip_off"]["counters"]["a"], res[i]["on"]["counters"]["a"]
        assert flip["stats_allreduce"] == jobs.STEPS - 1, f"rank {rank} {IDS[i]}: flipped off {flip}"
        assert on["stats_allreduce"] == 0 and on["stats_precomputed"] == 0, f"rank {rank} {IDS[i]}: on {on}"


@pytest.mark.distributed
@pytest.mark.parametrize("i", RECOMPUTE, ids=[IDS[i] for i in RECOMPUTE])
def test_a_lazy_gather_of_a_left_out_weight_reduces_its_statistics_itself(runs, i):
    """Activation recompute reads the rowwise form nobody gathered for the first backward: a lazy gather
    (`gather_grouped_now`, the per-expert payload). With the switch on it reduces `a`'s statistics itself (one
    all-reduce: precompute_scales left them out) where the switch-off run reads the precomputed ones; bitwise the same
    (test_training_is_bitwise_...)."""
    for rank, res in enumerate(runs):
        on, ref = res[i]["on"]["counters"]["a"], res[i]["per_expert"]["counters"]["a"]
        assert on["lazy_gathers"] == ref["lazy_gathers"] == 1, f"rank {rank} {IDS[i]}: on {on}, switch off {ref}"
        assert on["stats_allreduce"] == 1 and on["stats_precomputed"] == 0, f"rank {rank} {IDS[i]}: on {on}"
        assert ref["stats_allreduce"] == 0 and ref["stats_precomputed"] > 0, f"rank {rank} {IDS[i]}: off {ref}"


# ---- the predicate, one process --------------------------------------------------------------------------------

PREDICATE_CASES = [  # (preset, out, layout dim, switch, backward override, left out)
    ("fp8_block", 256, 0, True, None, True),
    ("fp8_block", 256, 0, False, None, False),  # (the switch off: the per-expert payload)
    ("fp8_block", 96, 0, True, None, False),  # (a 128x128 tile would span two experts)
    ("fp8_block", 256, 1, True, None, False),  # (Shard(1): rows of every expert per rank)
    ("fp8_block", 256, 0, True, "high_precision", True),  # (backward gathers the shard: nothing reads statistics)
    ("fp8_block_fwd_mxfp8_bwd", 256, 0, True, None, True),
    ("fp8_block_fwd_mxfp8_bwd", 96, 0, True, None, False),  # (its rowwise tiles take the per-expert payload)
    ("mxfp8", 96, 0, True, None, True),
    ("fp8_tensorwise", 256, 0, True, None, False),  # (a tensor-wide statistic: never the batched block payload)
]


@pytest.mark.parametrize("case", PREDICATE_CASES,
                         ids=[f"{c[0]}-out{c[1]}-dim{c[2]}-{'on' if c[3] else 'off'}-{c[4]}" for c in PREDICATE_CASES])
def test_statistics_are_left_out_exactly_where_every_unshard_takes_the_batched_payload(case):
    import torch

    import hybridq
    from hybridq.distributed import grouped_blocks_payload as g
    from hybridq.distributed.layout import ExpertLayout
    from hybridq.distributed.scales import _scales_travel_in_the_payload
    from hybridq.distributed.state import GroupedWeightState

    preset, out, dim, on, override, want = case
    layer = hybridq.GroupedLinear(4, 128, out, recipe=hybridq.recipe(preset, backward_override=override))
    layout = ExpertLayout(dim, 4, out, 128, 2, 0)
    try:
        g.set_stacked_block_payload(on)
        got = _scales_travel_in_the_payload(GroupedWeightState(None, "moe.w1"), layer, layout, torch.bfloat16)
    finally:
        g.set_stacked_block_payload(True)
    assert got is want, f"{case}: left out {got}, expected {want}"
