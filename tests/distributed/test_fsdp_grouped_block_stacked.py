"""FSDP2-gathered block-format experts (FP8 1x128 / 128x128, MXFP8, their hybrid) with stacked buffers and a batched
fill (hybridq/distributed/grouped_blocks_batched.py, [Note: stacked block gather]; issue 30): the experts' unsharded
tensors are `[E, ...]` views of one buffer per kind (`stacked_part`: the packed path reads them without a cat), and
where whole experts are gathered and `out` is a whole number of the format's row blocks, all experts are assembled
and derived as one `[E*out, in]` weight and copied in one copy per tensor kind.

Oracles (bitwise), per all-gather of train / eval / train (an SGD step between: new values refilled into the same
buffers, no stale bytes): each expert's full weight quantized here, and the same run with the switch off (the
per-expert buffers and fill): every expert's tensors, the output, input gradient and weight gradient shard. Gloo
world 1 and 2 on the CPU (3 experts on 2 ranks: uneven shards), NCCL world 1 on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _harness import nccl_devices, spawn
import _block_stacked_jobs as jobs

PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]
CASES = [dict(preset=p) for p in PRESETS] + [
    dict(preset=p, out=96) for p in PRESETS] + [  # (128x128 tiles would span experts: the per-expert derivation)
    dict(preset="mxfp8", experts=3), dict(preset="fp8_block", experts=3)] + [  # (uneven on 2 ranks)
    dict(preset=p, nonfinite=True) for p in ("fp8_block", "fp8_block_fwd_mxfp8_bwd")]
IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES]


def joined(case: dict) -> bool:
    """Whether the case's experts are assembled as one weight: `out` a whole number of the row blocks of both
    directions (128x128 tiles: 128; MXFP8 columnwise: 32)."""
    return case.get("out", 256) % (32 if case["preset"] == "mxfp8" else 128) == 0


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request):  # (one spawn per world size for every case)
    return request.param, spawn(jobs.job_stacked_blocks, request.param, "gloo", cases=CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_every_gather_holds_each_experts_own_quantization(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert not res[i]["oracle"], f"world {ws} rank {rank} {IDS[i]}:\n" + "\n".join(res[i]["oracle"][:10])


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_stacked_gather_is_bitwise_the_per_expert_gather(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert not res[i]["diffs"], f"world {ws} rank {rank} {IDS[i]}:\n" + "\n".join(res[i]["diffs"][:10])


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_gathered_directions_are_stacked_views(runs, i):
    """Every direction an all-gather fills is `[E, ...]` views of one buffer per kind (what `stacked_part` hands the
    packed path); none with the switch off."""
    ws, results = runs
    for rank, res in enumerate(results):
        at = f"world {ws} rank {rank} {IDS[i]}"
        assert res[i]["views_on"] and all(mat == views for mat, views in res[i]["views_on"]), (
            f"{at}: (filled, stacked) per gather {res[i]['views_on']}")
        assert all(not views for _, views in res[i]["views_off"]), f"{at} (off): {res[i]['views_off']}"


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_joined_fill_runs_exactly_where_no_block_spans_two_experts(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        want = len(res[i]["views_on"]) if joined(CASES[i]) else 0
        assert (res[i]["fills_on"], res[i]["fills_off"]) == (want, 0), (
            f"world {ws} rank {rank} {IDS[i]}: joined fills on / off {res[i]['fills_on']} / {res[i]['fills_off']}, "
            f"expected {want} / 0")


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_joined_forward_fills_copy_straight_from_the_slots_and_keep_their_copies(runs, i):
    """[Note: direct joined fill]: where the experts are joined, the forward's rowwise fill (every preset's rowwise
    tensors are a payload buffer or a replicated tensor as sent) copies straight from the slots, and the next unshard
    of the same plan reuses those copies (views of the same all-gather output); the oracles above check each gather's
    bytes. Experts uneven over the ranks (3 on 2): each rank's payload is padded, the slots are sliced by a copy, so
    the copies are made anew each time."""
    ws, results = runs
    for rank, res in enumerate(results):
        r = res[i]
        if joined(CASES[i]):
            even = CASES[i].get("experts", 4) % ws == 0
            assert r["direct_on"] > 0 and (r["kept_on"] > 0) == even, \
                f"world {ws} rank {rank} {IDS[i]}: direct fills {r['direct_on']}, kept {r['kept_on']}"
            assert r["kept_on"] < r["direct_on"] <= r["fills_on"], f"world {ws} rank {rank} {IDS[i]}: {r}"
        else:
            assert r["direct_on"] == 0, f"world {ws} rank {rank} {IDS[i]}: direct fills without a joined fill"


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_direct_fills_copy_the_slots_in_8_byte_words(runs, i):
    """The direct fill's kept copies move the experts' bytes as 8-byte words where the slots and stacked buffers
    allow (every case here: aligned slots, K a multiple of 8): a strided copy of 1-byte FP8 elements runs CUDA's
    element-by-element kernel. (fails before: 1-byte copies)"""
    ws, results = runs
    for rank, res in enumerate(results):
        r = res[i]
        if r["kept_on"]:
            assert r["copy_items_on"] in ([8], []), \
                f"world {ws} rank {rank} {IDS[i]}: kept copies of {r['copy_items_on']}-byte elements, expected 8"
            assert r["copy_items_on"] or derives_directly(CASES[i]), f"world {ws} rank {rank} {IDS[i]}: no copies"


@pytest.mark.parametrize("offset, want", [(16, torch.int64), (4, torch.int32), (2, torch.int16), (3, None)])
def test_slot_words_are_the_same_bytes(offset, want):
    """`_words`: a stacked buffer and the slots' strided view as the widest integer words both allow, the same bytes
    after a copy; an unaligned source keeps its own elements."""
    from hybridq.distributed.grouped_blocks_batched import _words
    g = torch.Generator().manual_seed(3)
    slots = torch.randint(0, 256, (4, 128 * 64 + 32), dtype=torch.uint8, generator=g)
    src = slots[:, offset:offset + 128 * 64].view(torch.float8_e4m3fn).view(4, 128, 64)
    dst = torch.zeros(4, 128, 64, dtype=torch.float8_e4m3fn)
    a, b = _words(dst, src)
    assert a.dtype == b.dtype == (want or torch.float8_e4m3fn), f"offset {offset}: {a.dtype} / {b.dtype}"
    assert a.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr(), "not a view of the stacked buffer"
    a.copy_(b)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), f"offset {offset}: bytes differ after the copy"


def derives_directly(case: dict) -> bool:
    """Whether the case's backward derives the columnwise form straight from the slots: joined experts whose weight
    format derives it from the rowwise one (fp8_block's 128x128 tiles: the transpose); MXFP8's columnwise 1x32 blocks
    are gathered, the hybrid's columnwise form is another format's."""
    return case["preset"] == "fp8_block" and joined(case)


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_joined_backward_derives_the_columnwise_form_straight_from_the_slots(runs, i):
    """[Note: direct joined fill]: every backward gather of joined fp8_block experts writes their columnwise tiles
    by the format's `derive_experts_into`, from the gathered rowwise bytes in the slots into the stacked buffers (one
    transpose of all experts' data, one of their tile scales) instead of assembling the joined weight, deriving it
    and splitting it into the stacked buffers; the oracles and the switch-off run above check its bytes. (fails
    before: 0 direct derivations)"""
    ws, results = runs
    for rank, res in enumerate(results):
        r = res[i]
        want = r["columnwise_gathers_on"] if derives_directly(CASES[i]) else 0
        assert r["columnwise_gathers_on"] > 0, f"world {ws} rank {rank} {IDS[i]}: no gather filled the columnwise form"
        assert r["derived_on"] == want, (f"world {ws} rank {rank} {IDS[i]}: {r['derived_on']} direct derivations "
                                         f"for {r['columnwise_gathers_on']} columnwise gathers, expected {want}")


@pytest.mark.distributed
@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c.get("nonfinite")],
                         ids=[IDS[i] for i, c in enumerate(CASES) if c.get("nonfinite")])
def test_nonfinite_weights_stay_nonfinite(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert all(res[i]["nonfinite_y"]), f"world {ws} rank {rank} {IDS[i]}: outputs {res[i]['nonfinite_y']}"


@pytest.mark.parametrize("value,want", [("0", False), ("1", True)])
def test_switch_is_read_from_the_environment_at_start_up(value, want):
    code = "from hybridq.distributed import grouped_blocks_batched as g; print(g.stacked_block_gather())"
    env = {**os.environ, "HYBRIDQ_STACKED_BLOCK_GATHER": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(want), f"HYBRIDQ_STACKED_BLOCK_GATHER={value}: {out.stdout}{out.stderr}"


def test_switch_turns_stacking_off_and_on():
    from hybridq.distributed import grouped_blocks_batched as g
    import hybridq

    qs = hybridq.GroupedLinear(2, 128, 128, recipe="fp8_block").weight_quantizers()
    try:
        g.set_stacked_block_gather(False)
        off = g.stacks_blocks(qs)
        g.set_stacked_block_gather(True)
        on = g.stacks_blocks(qs)
    finally:
        g.set_stacked_block_gather(True)
    assert (off, on) == (False, True), f"stacks_blocks off / on: {off} / {on}"


OP_CASES = [dict(preset=p) for p in PRESETS] + [dict(preset="fp8_block", experts=16)]
OP_IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in OP_CASES]


@pytest.fixture(scope="module")
def post_gather_ops():
    return spawn(jobs.job_post_gather_ops, 2, "gloo", cases=OP_CASES)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(OP_CASES)), ids=OP_IDS)
def test_stacked_fill_issues_fewer_ops_than_the_per_expert_fill(post_gather_ops, i):
    """Ops (kernel launches, GPU-equivalent) of the post-all-gather hook per step, 2 ranks: fewer with the stacked
    fill (one assembly, derivation and copy per tensor kind, not per expert); measured 2026-11-28 (on / off, 4 experts;
    16 experts): fp8_block 7 / 16; 7 / 64, mxfp8 14 / 16; 14 / 64, fp8_block_fwd_mxfp8_bwd 11 / 16; 11 / 64."""
    r = post_gather_ops[i]
    on, off = r["on"]["post_all_gather"], r["off"]["post_all_gather"]
    assert on < off, f"{OP_IDS[i]}: post_all_gather ops per step on {on}, off {off}"


# ---- on a GPU: the CUDA quantize and derive kernels ---------------------------------------------------------------

GPU_CASES = [dict(preset=p) for p in PRESETS] + [dict(preset="fp8_block", out=96),
                                                dict(preset="fp8_block_fwd_mxfp8_bwd", nonfinite=True)]
GPU_IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in GPU_CASES]


@pytest.fixture(scope="module")
def gpu_runs():
    return spawn(jobs.job_stacked_blocks, 1, "nccl", cases=GPU_CASES)[0]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device and NCCL")
@pytest.mark.parametrize("i", range(len(GPU_CASES)), ids=GPU_IDS)
def test_gpu_stacked_gather_is_bitwise_the_per_expert_gather(gpu_runs, i):
    """CUDA, NCCL world 1: every gather's experts bitwise their own quantization and the switch-off run (tensors,
    output, gradients), the directions stacked, the joined fill where exact."""
    r = gpu_runs[i]
    assert not r["oracle"], f"{GPU_IDS[i]}:\n" + "\n".join(r["oracle"][:10])
    assert not r["diffs"], f"{GPU_IDS[i]}:\n" + "\n".join(r["diffs"][:10])
    assert r["views_on"] and all(mat == views for mat, views in r["views_on"]), f"{GPU_IDS[i]}: {r['views_on']}"
    want = len(r["views_on"]) if joined(GPU_CASES[i]) else 0
    assert r["fills_on"] == want, f"{GPU_IDS[i]}: joined fills {r['fills_on']}, expected {want}"
    # ([Note: direct joined fill]: the forward's rowwise fills straight from the slots, their copies kept; fp8_block's
    # columnwise tiles derived from the slots by the device's tiled transpose)
    assert (r["direct_on"] > 0 and r["kept_on"] > 0) == joined(GPU_CASES[i]), f"{GPU_IDS[i]}: {r}"
    want = r["columnwise_gathers_on"] if derives_directly(GPU_CASES[i]) else 0
    assert r["derived_on"] == want, f"{GPU_IDS[i]}: direct derivations {r['derived_on']}, expected {want}: {r}"
