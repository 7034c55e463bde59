"""The steady state of a grouped weight's all-gather hooks (hybridq/distributed/grouped_fast.py, [Note: grouped hooks'
steady state]; issue 30: the MoE job's GPU waits for the host while FSDP2 unshards the next layer): whether the
experts share one block-format quantizer is asked once per tuple of quantizers, a lane's pre-all-gather path and
payload key parts once per lane and setting of the stacked block payload's switch.

Oracle (bitwise): the same run with the steady state off (`set_grouped_fast(False)`: everything asked at every
unshard, as before) -- every expert's gathered tensors of every all-gather, the output, input gradient and weight
gradient shard, over train / eval / train / train with SGD steps between; per-tensor FP8, FP8 128x128 blocks, MXFP8
and the FP8-blocks / MXFP8 hybrid, gloo world 1 and 2 on the CPU (3 experts on 2 ranks: uneven shards),
reshard_after_forward=False, non-finite weights, `out` 96 (no stacked block payload); NCCL world 1 on a GPU."""

from __future__ import annotations

import pytest

from _harness import nccl_devices, spawn
import _grouped_fast_jobs as jobs

from hybridq.distributed import grouped_fast
from hybridq.distributed.grouped_fast import one_local_quantizer
from hybridq.formats import Float8BlockQuantizer, Float8Quantizer

PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]
CASES = [dict(preset=p) for p in PRESETS] + [
    dict(preset="fp8_block", experts=3), dict(preset="fp8_tensorwise", experts=3),  # (uneven on 2 ranks)
    dict(preset="fp8_block", out=96),  # (a 128x128 tile would span two experts: the per-expert payload)
    dict(preset="fp8_tensorwise", reshard=False), dict(preset="mxfp8", reshard=False),
    dict(preset="fp8_block", nonfinite=True), dict(preset="fp8_tensorwise", nonfinite=True)]
IDS = ["-".join(f"{k}={v}" for k, v in c.items()) for c in CASES]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request):  # (one spawn per world size for every case)
    return request.param, spawn(jobs.job_fast_hooks, request.param, "gloo", cases=CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_steady_state_is_bitwise_the_hooks_asking_at_every_unshard(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert res[i]["gathers"] > 0, f"world {ws} rank {rank} {IDS[i]}: no all-gather was read"
        assert not res[i]["diffs"], f"world {ws} rank {rank} {IDS[i]}:\n" + "\n".join(res[i]["diffs"][:10])


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_steady_state_keeps_flags_per_lane_and_reuses_payloads_as_before(runs, i):
    """On: the lanes' flags are kept (off: none); both runs reuse the forward's payload in the backward equally
    often and build as many stacked block payloads."""
    ws, results = runs
    for rank, res in enumerate(results):
        on, off = res[i]["on"], res[i]["off"]
        where = f"world {ws} rank {rank} {IDS[i]}"
        assert on["lanes_flagged"] > 0 and off["lanes_flagged"] == 0, f"{where}: flags kept on / off {on} {off}"
        assert on["reused"] == off["reused"], f"{where}: payloads reused on {on['reused']}, off {off['reused']}"
        assert on["stacked_block_payloads"] == off["stacked_block_payloads"], f"{where}: {on} vs {off}"


@pytest.mark.distributed
@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c["preset"] == "fp8_tensorwise"],
                         ids=[IDS[i] for i, c in enumerate(CASES) if c["preset"] == "fp8_tensorwise"])
def test_stacked_fp8_fills_run_again_from_kept_copies(runs, i):
    """Per-tensor FP8 (the stacked fill, `grouped_batched.fill_stacked`): on, the unshards after the first of each
    plan fill from the kept copies; off, none does."""
    ws, results = runs
    for rank, res in enumerate(results):
        on, off = res[i]["on"]["stacked_fills_kept"], res[i]["off"]["stacked_fills_kept"]
        assert on > 0 and off == 0, f"world {ws} rank {rank} {IDS[i]}: fills from kept copies on {on}, off {off}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_kept_stacked_fill_is_taken_only_with_the_views_it_recorded(world):
    """Fails if the kept fill skipped its check of the stacked views (`_fill_kept`): after the state's views are
    made anew, no fill of that step runs from kept copies, and its buffers are bitwise a fill asking everything."""
    for rank, res in enumerate(spawn(jobs.job_kept_fill_follows_the_stacked_views, world, "gloo")):
        kept_on, kept_off = res["kept_on"], res["kept_off"]
        assert kept_on[1] > 0 and kept_on[2] == 0 and not any(kept_off), f"world {world} rank {rank}: fills from " \
            f"kept copies per step on {kept_on}, off {kept_off}"
        assert not res["diffs"], f"world {world} rank {rank}:\n" + "\n".join(res["diffs"][:10])


@pytest.mark.distributed
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block"])
def test_stacked_buffers_made_anew_are_allocated_by_their_own_sizes(preset):
    """Fails if the kept storages and sizes of `alloc_slabs` outlived the buffers they were asked of: new stacked
    buffers, freed, are allocated to their full size."""
    sizes = spawn(jobs.job_alloc_after_new_buffers, 1, "gloo", preset=preset)[0]
    assert sizes and all(have == need for have, need in sizes), f"(bytes, size) of each new slab: {sizes}"


@pytest.mark.distributed
def test_kept_flags_follow_the_stacked_block_payload_switch():
    """Fails if a lane's kept flags ignored the switch's setting (its check in `pre_flags` removed): turned off,
    no stacked block payload is built; turned on again, every train step builds them again."""
    res = spawn(jobs.job_flags_follow_the_payload_switch, 1, "gloo")[0]
    built = res["built"]
    assert built[0] > 0 and built[1] == built[0], f"stacked block payloads per step (on, on, off, off, on): {built}"
    assert built[2] == 0 and built[3] == 0, f"built with the switch off: {built}"
    assert built[4] == built[0], f"not built again after the switch was turned on: {built}"


@pytest.mark.distributed
def test_kept_flags_are_taken_only_by_the_lane_they_were_made_for():
    """Fails if an entry made for another lane object were taken (the identity check in `pre_flags` removed): every
    kept entry replaced by another lane's saying "no block payload", the next train step still builds them."""
    res = spawn(jobs.job_flags_belong_to_their_lane, 1, "gloo")[0]
    assert res["stale_entries"] > 0, res
    assert res["built"] > 0, f"the stale entries were taken: {res}"


@pytest.mark.distributed
@pytest.mark.parametrize("preset", ["fp8_block", "mxfp8"])
def test_steady_state_hooks_compare_no_quantizers(preset):
    """The experts' quantizers (E equal objects) are compared once per tuple, not at every unshard: no `__eq__`
    call in the hooks of steady-state train steps with the steady state on (off: E-1 per question)."""
    res = spawn(jobs.job_no_quantizer_comparisons, 1, "gloo", preset=preset)[0]
    assert res["on"] == 0 and res["off"] > 0, f"quantizer comparisons in the hooks of 2 train steps: {res}"


def _blocks(**kw):
    return Float8BlockQuantizer(block_dim=2, **kw)


@pytest.mark.parametrize("qs, want", [
    ((_blocks(),) * 3, True),  # (one object)
    (tuple(_blocks() for _ in range(4)), True),  # (equal objects, as a recipe makes them per expert)
    ((_blocks(), _blocks(), Float8BlockQuantizer(block_dim=1)), False),
    (tuple(Float8Quantizer("e4m3") for _ in range(3)), False),  # (per-tensor scaling: not local)
    ((), False)], ids=["one-object", "equal", "differ", "per-tensor", "empty"])
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_one_local_quantizer_answers_as_asking_every_time(monkeypatch, qs, want, on):
    monkeypatch.setattr(grouped_fast._ON, "on", on)
    assert one_local_quantizer(qs) is want
    assert one_local_quantizer(qs) is want, "the cached answer differs"
    assert one_local_quantizer(list(qs)) is want, "a list of the same quantizers is answered differently"


def test_one_local_quantizer_takes_no_entry_of_another_tuple(monkeypatch):
    """Fails if the cache's identity check were removed: an entry of another tuple left under this tuple's id
    (the id of a freed tuple reused) is not taken."""
    monkeypatch.setattr(grouped_fast._ON, "on", True)
    qs = (_blocks(), Float8BlockQuantizer(block_dim=1))
    other = (_blocks(),) * 2
    monkeypatch.setitem(grouped_fast._ONE, id(qs), (other, True))
    assert one_local_quantizer(qs) is False


def test_one_local_quantizer_caches_nothing_with_the_switch_off(monkeypatch):
    monkeypatch.setattr(grouped_fast._ON, "on", False)
    monkeypatch.setattr(grouped_fast, "_ONE", {})
    one_local_quantizer((_blocks(),) * 2)
    assert grouped_fast._ONE == {}


GPU_CASES = [dict(preset=p) for p in PRESETS] + [dict(preset="fp8_block", nonfinite=True)]


@pytest.fixture(scope="module")
def gpu_runs():
    return spawn(jobs.job_fast_hooks, 1, "nccl", cases=GPU_CASES)[0]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device and NCCL")
@pytest.mark.parametrize("i", range(len(GPU_CASES)), ids=["-".join(f"{k}={v}" for k, v in c.items())
                                                          for c in GPU_CASES])
def test_cuda_steady_state_is_bitwise_the_hooks_asking_at_every_unshard(gpu_runs, i):
    res = gpu_runs[i]
    assert res["gathers"] > 0 and res["on"]["lanes_flagged"] > 0, res
    assert not res["diffs"], "\n".join(res["diffs"][:10])
