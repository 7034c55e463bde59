"""Writes through `.data` and hybridq's FSDP2 caches of weight-derived data ([Note: data-write check],
hybridq/data_writes.py). A write through `p.data` (or the local shard's `.data`) moves no version counter, so a cache
keyed by them would reuse data derived from the old values; each reused entry carries the fingerprint of the values it
came from. Specified per cache against the same write made through the parameter under `torch.no_grad()` (its version
counters move: everything is derived anew):
- one CPU rank: the kept forward payload (Linear and grouped weights) is quantized anew from the current values
  (bitwise the no_grad write's run; the precomputed payloads: test_fsdp_precomputed_payloads.py);
- two ranks: the reuse of reduced statistics (precompute_scales' and an unshard's, Linear and grouped weights) and of
  payloads made with them is reported by the next precompute_scales on every rank (StaleWeightError naming the
  weights), never re-derived by one rank alone;
- caches that re-read the values (lanes, unit cast, fill replay, gathered views) need no check: a write between steps
  trains bitwise like the no_grad write;
- no false positive: optimizer steps, in-place edits under no_grad, load_state_dict, DCP load, evaluation forwards,
  NaN / inf weights;
- `HYBRIDQ_CHECK_DATA_WRITES=0` (`set_check_data_writes(False)`): nothing checked (the stale data is used: the check is
  what the tests above see).
Real FSDP2 on gloo (world 1 in-process, world 2 spawned); CUDA: the GPU tests at the end."""

from __future__ import annotations

import pytest
import torch

import _data_write_jobs as jobs
from _harness import job_several, spawn

from hybridq.data_writes import CHECK

pytestmark = pytest.mark.distributed

WEIGHTS = ("lin.weight", "experts.weight")


@pytest.fixture
def check_off():
    with CHECK.turned(False):
        yield


def _same(got: dict, want: dict, where: str) -> None:
    assert torch.equal(got["dx"], want["dx"]), f"{where}: the input gradient differs from the no_grad write's run"
    for name, a, b in zip(WEIGHTS, got["grads"], want["grads"]):
        assert torch.equal(a, b), f"{where}: the gradient of {name} differs from the no_grad write's run"


def test_one_rank_a_kept_forward_payload_written_through_data_before_backward_is_quantized_anew(one_rank, caplog):
    """Forward, both weights (a Linear's, a grouped one's) written through `.data`, backward: the backward unshard does
    not re-send the forward's kept payload but quantizes the current values (bitwise the run with the write under
    no_grad), with a warning naming each weight; nothing is left to report."""
    got = jobs.kept_payload(0, 1, one_rank, "data")
    want = jobs.kept_payload(0, 1, one_rank, "param")
    _same(got, want, "world 1, kept payload")
    assert got["error"] is None, got["error"]
    warned = sorted(r.getMessage().split(":")[0] for r in caplog.records if "changed through `.data`" in r.getMessage())
    assert warned == sorted(WEIGHTS), f"expected one warning per weight, got {warned}"


def test_one_rank_units_kept_gathered_from_forward_to_backward_read_the_forward_gather_either_way(one_rank, caplog):
    """reshard_after_forward=False (e.g. the last block): FSDP2 keeps its unsharded weight from the forward for the
    backward, whatever wrote the sharded one since -- the same for a write through `.data` and under no_grad (FSDP2's
    semantics for every dtype, no hybridq cache): bitwise alike, nothing warned or raised."""
    got = jobs.kept_payload(0, 1, one_rank, "data", reshard_after_forward=False)
    want = jobs.kept_payload(0, 1, one_rank, "param", reshard_after_forward=False)
    _same(got, want, "world 1, kept gathered")
    assert got["error"] is None and "changed through `.data`" not in caplog.text, (got["error"], caplog.text)


def test_one_rank_with_the_check_off_the_kept_payload_of_the_old_values_is_sent(one_rank, check_off):
    """The specification's own check: switched off, the backward re-sends the forward's payload of the old values and
    the gradients differ from the no_grad write's run (so the test above can fail)."""
    got = jobs.kept_payload(0, 1, one_rank, "data")
    want = jobs.kept_payload(0, 1, one_rank, "param")
    with pytest.raises(AssertionError, match="differs"):
        _same(got, want, "world 1, check off")


@pytest.mark.parametrize("when", ["between_forward_and_backward", "after_precompute"])
def test_two_ranks_a_write_through_data_is_reported_by_the_next_precompute_scales_on_every_rank(when):
    """Two ranks: a write through `.data` between the forward and the backward (the kept payload, the backward's
    statistics) or after precompute_scales (the statistics it reduced, a Linear's and a grouped weight's): the next
    precompute_scales raises StaleWeightError on every rank, naming both weights and the remedy; the same write under
    no_grad raises nothing."""
    for rank, r in enumerate(spawn(jobs.kept_payload_pair, 2, "gloo", when=when)):
        assert r["param"] is None, f"rank {rank}: a no_grad write raised: {r['param']}"
        msg = r["data"]
        assert msg is not None, f"rank {rank}: no StaleWeightError after a write through .data ({when})"
        named = msg.split(": changed")[0].split(", ")
        assert named == sorted(WEIGHTS), f"rank {rank}: the error names {named}, expected {sorted(WEIGHTS)}"
        assert "torch.no_grad()" in msg and "load_state_dict" in msg and "precompute_scales again" in msg, msg


def test_two_ranks_with_the_check_off_nothing_is_raised():
    for rank, r in enumerate(spawn(jobs.kept_payload_pair, 2, "gloo", when="after_precompute", check=False)):
        assert r["data"] is None, f"rank {rank}: raised with the check off: {r['data']}"
        assert not r["same"], f"rank {rank}: the stale statistics went unseen yet the run matched the no_grad write's"


@pytest.mark.parametrize("model", ["fp8_tensorwise", "fp8_block_and_tensorwise"])
def test_one_rank_writes_through_data_between_steps_train_bitwise(one_rank, model):
    jobs.between_steps(0, 1, one_rank, model)


def test_two_ranks_writes_through_data_between_steps_train_bitwise():
    runs = {m: (jobs.between_steps, dict(model=m)) for m in ("fp8_tensorwise", "fp8_block_and_tensorwise")}
    spawn(job_several, 2, "gloo", jobs=runs)


FALSE_POSITIVE_CASES = [("fp8_tensorwise", b) for b in (None, "edit", "extra_step", "eval", "load_state_dict",
                                                        "local_copy")] + [("nonfinite", None)]


@pytest.mark.parametrize("model,between", FALSE_POSITIVE_CASES + [("fp8_tensorwise", "dcp_load")])
def test_one_rank_changes_whose_versions_move_warn_nothing(one_rank, model, between, caplog, tmp_path):
    """No warning (nothing derived anew) after optimizer steps, in-place edits under no_grad, load_state_dict, a
    write into the DTensor's local shard, an evaluation forward, DCP loads, or with NaN / inf weights."""
    r = jobs.no_false_positive(0, 1, one_rank, model, between, ckpt=str(tmp_path / "ckpt"))
    warned = [x.getMessage() for x in caplog.records if "changed through `.data`" in x.getMessage()]
    assert not warned and not r["raised"], f"{model}, {between}: {warned} {r['raised']}"


def test_two_ranks_changes_whose_versions_move_raise_nothing(tmp_path):
    """The same changes at two ranks: no StaleWeightError from any precompute_scales."""
    runs = {f"{m}/{b}": (jobs.no_false_positive, dict(model=m, between=b)) for m, b in FALSE_POSITIVE_CASES}
    runs["dcp_load"] = (jobs.no_false_positive, dict(model="fp8_tensorwise", between="dcp_load",
                                                     ckpt=str(tmp_path / "ckpt")))
    for rank, res in enumerate(spawn(job_several, 2, "gloo", jobs=runs)):
        for name, r in res.items():
            assert not r["raised"], \
                f"rank {rank}, {name}: StaleWeightError without a write through .data: {r['raised']}"


# ---- on a GPU: the checks queued on the device, read later (no host sync) -------------------------------------------

@pytest.mark.gpu
def test_gpu_a_queued_check_costs_no_host_sync_and_raises_later():
    """CUDA: a local check queues its fingerprint (no host sync: run under the sync debug mode 'error'); the batch
    compare reaches pinned memory and a later poll raises StaleWeightError naming the weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hybridq.data_writes import Ledger, QueuedChecks, bits_sum
    from hybridq.errors import StaleWeightError

    ledger, queue = Ledger(), QueuedChecks("w")
    w = torch.randn(256, 512, device="cuda")
    ref = bits_sum(w)
    w.data.mul_(2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rederive, now = ledger.reused("w", w, ref, queue, True, "a payload")
        ledger._flush()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not rederive and now is not None
    with pytest.raises(StaleWeightError, match="^w: changed"):
        ledger.poll(wait=True)


@pytest.mark.gpu
def test_gpu_one_rank_a_write_through_data_after_the_precompute_raises_later(tmp_path):
    """CUDA, NCCL world 1: precomputed payloads, a weight written through `.data` after precompute_scales: the forward
    sends the old payload (no host sync to see it), and StaleWeightError naming the weight follows within the next two
    precompute_scales calls (or at a later check)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = spawn(jobs.stale_on_cuda, 1, "nccl")
    r = results[0]
    assert r["raised"] is not None, "no StaleWeightError after a write through .data on CUDA"
    assert r["raised"].startswith("0.v.weight:"), r["raised"]


@pytest.mark.gpu
@pytest.mark.parametrize("precompute", [False, True], ids=["without precompute_scales", "with precompute_scales"])
def test_gpu_one_rank_queued_checks_do_not_grow_memory(precompute):
    """CUDA, NCCL world 1 (each backward's kept-payload check queued on the device): allocated and peak memory after
    every step are the same from the second step on. (2026-11-29, on two H200s: each queued check kept its
    fingerprints until a batch compare or a report, 18 KiB more a step without precompute_scales.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import _jobs as training_jobs

    cfg = {"preset": "fp8_tensorwise", "precompute": precompute, "memory": True, "steps": 6}
    run = spawn(training_jobs.job_training, 1, "nccl", configs=[cfg])[0]["runs"][0]
    mem = run["memory"]
    assert len(mem) == 6 and mem[1:] == mem[1:2] * 5, f"memory (allocated, peak) after each step grows: {mem}"
    assert run["counters"].get("payload_reused", 0) > 0, f"no kept payload was reused (nothing checked): {run['counters']}"


def test_two_ranks_a_precomputed_payload_kept_for_backward_is_checked_once_per_step():
    """World 2 (checks queued for precompute_scales): a weight whose precomputed payload the backward re-sends is read
    for the check once per step -- at the backward's kept-payload check, against the fingerprint the payload was
    prepared from -- not also at the forward; a write through `.data` after the precompute is still reported."""
    for rank, r in enumerate(spawn(jobs.queued_checks_per_step, 2, "gloo")):
        assert r["counts"] and set(r["counts"].values()) == {1}, f"rank {rank}: checks queued per weight {r['counts']}"
        assert r["raised"] is not None and r["raised"].startswith(r["edited"]), f"rank {rank}: {r['raised']}"


def test_two_ranks_a_nan_statistic_and_a_stale_flag_in_one_all_reduce_both_survive():
    """The data-write flags ride in precompute_scales' MAX all-reduce of the statistics: rank 1's NaN statistic stays
    NaN on both ranks beside them, and rank 0's flag (a write through `.data` on rank 0 only) reaches rank 1."""
    for rank, r in enumerate(spawn(jobs.nan_beside_a_flag, 2, "gloo")):
        assert r["nan_kept"], f"rank {rank}: the NaN weight's reduced statistics came out finite"
        assert r["raised"] is not None and r["raised"].startswith(r["edited"]), f"rank {rank}: {r['raised']}"
