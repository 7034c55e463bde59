"""Ops per converted weight per training step in the FSDP2 weight path (each a kernel launch on a GPU), per
preset: held to a budget (the counts measured when the budget was set) so a change that adds launches fails;
a change that removes some should lower the budget. The table goes to the terminal summary. GPU-equivalent
counting: a quantization the CUDA kernels take counts as one op. See tests/distributed/_opcount.py."""

from __future__ import annotations

import pytest

from _harness import spawn
import _jobs

pytestmark = pytest.mark.distributed

PHASES = ("pre_all_gather", "post_all_gather", "precompute_scales")

# launches per converted weight per step (3 weights, steps 2-3 of 3, reshard_after_forward=True, precompute_scales).
# pre_all_gather includes the reference quantization of shards that split a block (the kernels take only shards
# that split none); its FP8 conversion writes the non-finite bytes explicitly (4 ops per conversion). precompute_scales'
# fused reduction includes amax_all_reduce_'s in-place abs (1 launch for the 3 weights: it keeps a rank's NaN).
# The data-write check ([Note: data-write check], hybridq/data_writes.py) adds one read of a weight's shard per
# derivation and per reuse, and one compare into the weight's flag per queued check: pre_all_gather +4 (the forward's
# reuse of precompute_scales' statistics, the backward's of the kept payload, a read and a compare each; MXFP8: only
# its statistics-bearing weight's), precompute_scales +1 per weight (the values the statistics come from) and the
# stack, any and fp32 copy of the queued flags, one multi-tensor zero, per process group (+1 for 3 weights).
BUDGET = {
    "fp8_tensorwise": {"pre_all_gather": 6.0, "post_all_gather": 3.0, "precompute_scales": 7.0},
    "fp8_block": {"pre_all_gather": 33.0, "post_all_gather": 3.0, "precompute_scales": 11.333},
    # (MXFP8 1x32: its reference columnwise quantization of a block-splitting shard reads the transposed shard made
    # contiguous, one copy: a part is contiguous wherever it is made, as the CUDA kernels reading it need)
    "mxfp8": {"pre_all_gather": 27.667, "post_all_gather": 12.0, "precompute_scales": 5.667},
    "nvfp4": {"pre_all_gather": 80.0, "post_all_gather": 22.0, "precompute_scales": 8.0},
    # (93: the reference NVFP4 columnwise quantization of a block-splitting shard packs its transposed codes into
    # contiguous bytes, one copy, which the CUDA kernels reading them need)
    "mxfp8_fwd_nvfp4_bwd": {"pre_all_gather": 93.0, "post_all_gather": 18.0, "precompute_scales": 11.333},
    "fp8_block_fwd_mxfp8_bwd": {"pre_all_gather": 66.333, "post_all_gather": 7.0, "precompute_scales": 14.667},
    "fp8_fwd_high_precision_bwd": {"pre_all_gather": 10.0, "post_all_gather": 1.0, "precompute_scales": 8.0},
}
PRESETS = list(BUDGET)


def _cell(d, phase, kind="launches"):
    return d.get(phase, {}).get(kind, 0.0)


def format_table(out) -> str:
    rows = ["| preset | pre_all_gather (stats / quantize / pack) | post_all_gather (unpack) | precompute_scales | "
            "total launches | KiB written | host constants | plain Linear weight quantize |",
            "|---|---|---|---|---|---|---|---|"]
    for preset, r in out.items():
        f, p = r["fsdp"], r["plain"]
        total = sum(_cell(f, ph) for ph in PHASES)
        kib = sum(_cell(f, ph, "bytes") for ph in PHASES) / 1024
        const = sum(_cell(f, ph, "constants") for ph in PHASES)
        rows.append(
            f"| {preset} | {_cell(f, 'pre_all_gather'):.1f} ({_cell(f, 'pre_all_gather/stats'):.1f} / "
            f"{_cell(f, 'pre_all_gather/quantize'):.1f} / {_cell(f, 'pre_all_gather/pack'):.1f}) | "
            f"{_cell(f, 'post_all_gather'):.1f} ({_cell(f, 'post_all_gather/unpack'):.1f}) | "
            f"{_cell(f, 'precompute_scales'):.1f} | {total:.1f} | {kib:.0f} | {const:.1f} | "
            f"{_cell(p, 'plain_weight'):.1f} |")
    return "\n".join(rows)


@pytest.fixture(scope="module")
def opcounts() -> dict:
    return spawn(_jobs.job_opcount, 2, "gloo", presets=PRESETS)[0]


def test_every_preset_counted(opcounts, summary_table):
    summary_table("FSDP2 weight path: ops (kernel launches, GPU-equivalent) per converted weight per step, 2 ranks, "
                  f"weights {list(_jobs.OPCOUNT_SHAPES)}, reshard_after_forward=True, precompute_scales",
                  format_table(opcounts))
    missing = [p for p in PRESETS if _cell(opcounts[p]["fsdp"], "pre_all_gather") == 0]
    assert not missing, f"no pre_all_gather ops counted for {missing}: the counter no longer sees the hooks"


@pytest.mark.parametrize("preset", PRESETS)
def test_launches_within_budget(opcounts, preset):
    f = opcounts[preset]["fsdp"]
    over = {ph: (round(_cell(f, ph), 3), BUDGET[preset][ph]) for ph in PHASES
            if round(_cell(f, ph), 3) > BUDGET[preset][ph]}
    assert not over, f"{preset}: launches per weight per step over budget (measured, budget): {over}"
