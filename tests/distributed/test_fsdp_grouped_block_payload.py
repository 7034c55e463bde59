"""FSDP2-gathered block-format experts (FP8 1x128 / 128x128, MXFP8, their hybrid) whose all-gather payload is built
for all experts a rank holds at once (hybridq/distributed/grouped_blocks_payload.py, [Note: stacked block payload];
issue 30: the MoE job's pre-all-gather side quantized and packed every expert on its own): one quantization of the
`[held*out, in]` experts, one copy per tensor kind into the slots, the 128x128 tiles' scales carried in the slots
instead of reduced across ranks.

Oracles (bitwise), per all-gather of train / eval / train (an SGD step between): each expert's full weight quantized
here, and the same run with the batched payload off (the per-expert payload): every expert's gathered tensors of every
direction, the output, input gradient and weight gradient shard -- under the stacked receiver (`fill_stacked_blocks`)
and under the per-expert one (the slots' scales read expert by expert). Gloo world 1 and 2 on the CPU (3 experts on 2
ranks: uneven shards, a rank's empty slot), reshard_after_forward=False (both directions in one payload), NCCL world
1 on a GPU; `out` 96 under 128x128 tiles takes the per-expert payload (a tile would span two experts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _harness import nccl_devices, spawn
import _block_payload_jobs as jobs

PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]
CASES = [dict(preset=p) for p in PRESETS] + [
    dict(preset=p, out=96) for p in PRESETS] + [  # (128x128 tiles would span experts: the per-expert payload)
    dict(preset="mxfp8", experts=3), dict(preset="fp8_block", experts=3),  # (uneven on 2 ranks)
    dict(preset="fp8_block_fwd_mxfp8_bwd", experts=3)] + [
    dict(preset=p, nonfinite=True) for p in ("fp8_block", "fp8_block_fwd_mxfp8_bwd")] + [
    dict(preset=p, reshard=False) for p in ("mxfp8", "fp8_block_fwd_mxfp8_bwd")]  # (both directions in one payload)
IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES]


def batched(case: dict) -> str:
    """Which of the case's payloads are built for all experts at once: those whose directions' row blocks `out` is a
    whole number of (128x128 tiles: 128; MXFP8 columnwise: 32): "all", "some" (out 96 in the hybrid: its MXFP8
    columnwise payloads, not its tiles' rowwise ones) or "none"."""
    out, preset = case.get("out", 256), case["preset"]
    if out % 128 == 0 or preset == "mxfp8":
        return "all"
    return "some" if preset == "fp8_block_fwd_mxfp8_bwd" else "none"


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request):  # (one spawn per world size for every case)
    return request.param, spawn(jobs.job_block_payload, request.param, "gloo", cases=CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_every_gather_holds_each_experts_own_quantization(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert not res[i]["oracle"], f"world {ws} rank {rank} {IDS[i]}:\n" + "\n".join(res[i]["oracle"][:10])


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_batched_payload_is_bitwise_the_per_expert_payload(runs, i):
    """Under the stacked receiver and under the per-expert one: every gathered tensor, y, dx and dw."""
    ws, results = runs
    for rank, res in enumerate(results):
        assert not res[i]["diffs"], f"world {ws} rank {rank} {IDS[i]}:\n" + "\n".join(res[i]["diffs"][:10])


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_batched_payload_builds_every_payload_exactly_where_no_block_spans_two_experts(runs, i):
    """Every payload quantized (not reused) in the runs with the switch on comes from `prepare_stacked_blocks` where
    the blocks allow it, none elsewhere and none with the switch off."""
    ws, results = runs
    for rank, res in enumerate(results):
        c = res[i]["counters"]
        for name in ("on", "on_per_expert_fill"):
            fresh, got, want = c[name]["sent"] - c[name]["reused"], c[name]["payloads"], batched(CASES[i])
            ok = {"all": got == fresh, "some": 0 < got < fresh, "none": got == 0}[want]
            assert fresh > 0 and ok, (f"world {ws} rank {rank} {IDS[i]} {name}: {got} batched payloads of {fresh} "
                                      f"built, expected {want}")
        for name in ("off", "off_per_expert_fill"):
            assert c[name]["payloads"] == 0, f"world {ws} rank {rank} {IDS[i]} {name}: {c[name]['payloads']}"


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_kept_payload_is_reused_in_backward_as_before(runs, i):
    """The forward payload the backward unshard re-sends (128x128 tiles: rowwise, columnwise derived) is reused as
    often with the batched payload as without."""
    ws, results = runs
    for rank, res in enumerate(results):
        c = res[i]["counters"]
        on, off = c["on"]["reused"], c["off"]["reused"]
        assert on == off, f"world {ws} rank {rank} {IDS[i]}: payloads reused on {on}, off {off}"
        if CASES[i]["preset"] == "fp8_block":
            assert on > 0, f"world {ws} rank {rank} {IDS[i]}: the forward payload was never reused"


@pytest.mark.distributed
@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if batched(c) == "all"],
                         ids=[IDS[i] for i, c in enumerate(CASES) if batched(c) == "all"])
def test_batched_payload_reduces_no_statistics(runs, i):
    """The tiles' scales of experts held elsewhere travel in the slots: no all-reduce at the unshard."""
    ws, results = runs
    for rank, res in enumerate(results):
        got = res[i]["counters"]["on"]["stats_allreduce"]
        assert got == 0, f"world {ws} rank {rank} {IDS[i]}: {got} statistics all-reduces"


@pytest.mark.distributed
@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c.get("nonfinite")],
                         ids=[IDS[i] for i, c in enumerate(CASES) if c.get("nonfinite")])
def test_nonfinite_weights_stay_nonfinite(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert all(res[i]["nonfinite_y"]), f"world {ws} rank {rank} {IDS[i]}: outputs {res[i]['nonfinite_y']}"


@pytest.mark.parametrize("value,want", [("0", False), ("1", True)])
def test_switch_is_read_from_the_environment_at_start_up(value, want):
    code = "from hybridq.distributed import grouped_blocks_payload as g; print(g.stacked_block_payload())"
    env = {**os.environ, "HYBRIDQ_STACKED_BLOCK_PAYLOAD": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(want), f"HYBRIDQ_STACKED_BLOCK_PAYLOAD={value}: {out.stdout}{out.stderr}"


JOIN_CASES = [  # (preset, out, directions sent, layout dim, world size, expected)
    ("fp8_block", 256, ("rowwise",), 0, 2, True),
    ("fp8_block", 96, ("rowwise",), 0, 2, False),  # (a 128x128 tile would span two experts)
    ("mxfp8", 96, ("rowwise",), 0, 2, True),
    ("mxfp8", 96, ("columnwise",), 0, 2, True),
    ("mxfp8", 256, ("rowwise", "columnwise"), 0, 1, True),
    ("fp8_block_fwd_mxfp8_bwd", 96, ("columnwise",), 0, 2, True),
    ("fp8_block_fwd_mxfp8_bwd", 96, ("rowwise",), 0, 2, False),
    ("fp8_block", 256, ("rowwise",), 1, 2, False),  # (Shard(1): rows of every expert per rank)
    ("fp8_block", 256, ("high_precision",), 0, 2, False),
    ("fp8_tensorwise", 256, ("rowwise",), 0, 2, False),  # (a tensor-wide statistic: not local scaling)
    ("nvfp4", 256, ("rowwise",), 0, 2, False),
]


@pytest.mark.parametrize("case", JOIN_CASES, ids=[f"{c[0]}-out{c[1]}-{'+'.join(c[2])}-dim{c[3]}" for c in JOIN_CASES])
def test_batched_payload_applies_where_the_blocks_allow(case):
    import hybridq
    from hybridq.distributed import grouped_blocks_payload as g
    from hybridq.distributed.layout import ExpertLayout

    preset, out, send, dim, ws, want = case
    qs = hybridq.GroupedLinear(4, 128, out, recipe=preset).weight_quantizers()
    layout = ExpertLayout(dim, 4, out, 128, ws, 0)
    assert g.joins_blocks(qs, send, layout) is want, f"{case}: joins_blocks {not want}, expected {want}"
    try:
        g.set_stacked_block_payload(False)
        off = g.joins_blocks(qs, send, layout)
    finally:
        g.set_stacked_block_payload(True)
    assert off is False, f"{case}: joins_blocks with the switch off"


OP_CASES = [dict(preset=p, experts=e) for p in PRESETS for e in (4, 16)]
OP_IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in OP_CASES]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def pre_gather_ops(request):
    return request.param, spawn(jobs.job_pre_gather_ops, request.param, "gloo", cases=OP_CASES)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(OP_CASES)), ids=OP_IDS)
def test_batched_payload_quantizes_once_per_direction_sent(pre_gather_ops, i):
    """Ops of the pre-all-gather hook per train step (GPU-equivalent: a quantization the CUDA kernels take counts
    once): one quantization per direction sent, whatever the expert count, where the per-expert payload quantizes
    every expert held (and, at world 2, rebuilds the tiles' scales of every expert held elsewhere). Measured
    2026-11-28 (launches on / off, 16 experts; world 1, world 2): fp8_block 5 / 18, 5 / 354; mxfp8 12 / 100,
    12 / 84; fp8_block_fwd_mxfp8_bwd 12 / 84, 12 / 604."""
    ws, res = pre_gather_ops
    r = res[i]
    sends = {"fp8_block": 1, "mxfp8": 2, "fp8_block_fwd_mxfp8_bwd": 2}[OP_CASES[i]["preset"]]  # (per train step)
    on, off = r["on"], r["off"]
    assert on["fused_quantize"] == sends, f"world {ws} {OP_IDS[i]}: {on['fused_quantize']} quantizations per step"
    assert on["launches"] < off["launches"], f"world {ws} {OP_IDS[i]}: launches on {on}, off {off}"
    assert on["collectives"] == 0, f"world {ws} {OP_IDS[i]}: collectives in the pre-all-gather hook {on}"


@pytest.mark.distributed
@pytest.mark.parametrize("preset", PRESETS)
def test_batched_payload_ops_do_not_grow_with_the_experts(pre_gather_ops, preset):
    ws, res = pre_gather_ops
    got = {c["experts"]: res[i]["on"]["launches"] for i, c in enumerate(OP_CASES) if c["preset"] == preset}
    assert got[4] == got[16], f"world {ws} {preset}: pre-all-gather launches per step by experts {got}"


# ---- on a GPU: the CUDA quantize kernels ---------------------------------------------------------------------------

GPU_CASES = [dict(preset=p) for p in PRESETS] + [dict(preset="fp8_block", out=96),
                                                dict(preset="fp8_block_fwd_mxfp8_bwd", nonfinite=True)]
GPU_IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in GPU_CASES]


@pytest.fixture(scope="module")
def gpu_runs():
    return spawn(jobs.job_block_payload, 1, "nccl", cases=GPU_CASES)[0]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device and NCCL")
@pytest.mark.parametrize("i", range(len(GPU_CASES)), ids=GPU_IDS)
def test_gpu_batched_payload_is_bitwise_the_per_expert_payload(gpu_runs, i):
    """CUDA, NCCL world 1: every gather's experts bitwise their own quantization and the switch-off run (tensors,
    output, gradients) under both receivers, the batched payload built where the blocks allow it."""
    r = gpu_runs[i]
    assert not r["oracle"], f"{GPU_IDS[i]}:\n" + "\n".join(r["oracle"][:10])
    assert not r["diffs"], f"{GPU_IDS[i]}:\n" + "\n".join(r["diffs"][:10])
    c = r["counters"]["on"]
    fresh, got, want = c["sent"] - c["reused"], c["payloads"], batched(GPU_CASES[i])
    ok = {"all": got == fresh, "some": 0 < got < fresh, "none": got == 0}[want]
    assert fresh > 0 and ok, f"{GPU_IDS[i]}: {got} batched payloads of {fresh} built, expected {want}"
