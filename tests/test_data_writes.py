"""The data-write check's parts (hybridq/data_writes.py, [Note: data-write check]): the fingerprint (the int64 sum of a
tensor's bit patterns: any one change seen, NaN-proof), a check of one rank's decision on the CPU (derive anew, with a
warning, only where the values changed), the queue of world > 1 checks (one flag per weight, in the order first seen:
the same on every rank), the batched compare of queued local checks, and the switch `HYBRIDQ_CHECK_DATA_WRITES` (off:
nothing taken, nothing checked, the is_first_microbatch cache's fingerprint included). The FSDP2 caches that use it:
tests/distributed/test_fsdp_data_writes.py, test_fsdp_precomputed_payloads.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import weakref

import pytest
import torch

import hybridq as hq
from hybridq import data_writes
from hybridq.data_writes import CHECK, Ledger, QueuedChecks, bits_sum, fingerprint
from hybridq.errors import StaleWeightError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
WARNING = "changed through `.data`"


@pytest.mark.parametrize("shape", [(37, 29), (16, 64)], ids=["rows of odd bytes", "rows of whole int64 words"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fingerprint_changes_with_any_one_element(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g).to(dtype)
    ref = bits_sum(w)
    for i in (0, 500, w.numel() - 1):
        for new in (w.view(-1)[i] * 2, -w.view(-1)[i], w.view(-1)[i] + 1):
            v = w.clone()
            v.view(-1)[i] = new
            if torch.equal(v, w):
                continue
            assert bits_sum(v) != ref, f"{dtype} {shape}: element {i} changed to {float(new)}, the fingerprint did not"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fingerprint_of_a_weight_with_nan_and_inf_is_its_own(dtype):
    """NaN != NaN, but the bits are equal: the same values give the same fingerprint (no false positive), and -0.0
    differs from 0.0 (a sign is a change)."""
    w = torch.randn(8, 16).to(dtype)
    w[1, 2], w[3, 4], w[5, 6] = float("nan"), float("inf"), -float("inf")
    assert bits_sum(w) == bits_sum(w.clone()), f"{dtype}: a weight with NaN / inf fingerprinted differently"
    z = torch.zeros(4, dtype=dtype)
    n = z.clone()
    n[2] = -0.0
    assert bits_sum(z) != bits_sum(n), f"{dtype}: -0.0 and 0.0 fingerprinted alike"


def test_a_cpu_check_of_one_rank_derives_anew_only_where_the_values_changed(caplog):
    w = torch.randn(16, 8)
    ref = bits_sum(w)
    ledger = Ledger()
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        rederive, now = ledger.reused("a.weight", w, ref, None, True, "a payload")
        assert not rederive and torch.equal(now, ref) and WARNING not in caplog.text, "unchanged values re-derived"
        w.data.mul_(2)
        rederive, now = ledger.reused("a.weight", w, ref, None, True, "a payload")
    assert rederive and torch.equal(now, bits_sum(w)), "a write through .data was not seen"
    assert caplog.text.count(WARNING) == 1 and "a.weight" in caplog.text, caplog.text
    assert not ledger.local and not ledger.reports, "a CPU check of one rank queued something"


def test_world_above_one_checks_are_queued_on_the_weight_and_flag_each_changed_weight():
    """Never derived anew by one rank: each check goes to the weight's queue (which precompute_scales reports, the
    flags sent with its all-reduce); `flags` gives one fp32 flag per weight with queued checks, set where any of its
    checks saw a change, and empties the queues."""
    ledger = Ledger()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ra, rb = bits_sum(a), bits_sum(b)
    qa, qb = QueuedChecks("a"), QueuedChecks("b")
    b.data.add_(1)
    for name, t, ref, q in (("a", a, ra, qa), ("b", b, rb, qb), ("a", a, ra, qa), ("b", b, bits_sum(b), qb)):
        rederive, now = ledger.reused(name, t, ref, q, False, "statistics")
        assert not rederive and torch.equal(now, bits_sum(t)), f"{name}: a world > 1 check asked for a derivation"
    assert not ledger.local, "a world > 1 check went to the local queue"
    assert (qa.count, qb.count) == (2, 2), f"checks queued: a {qa.count}, b {qb.count}"
    assert data_writes.flags([qa, qb]).tolist() == [0.0, 1.0], "the flags of a (unchanged), b (changed, then not)"
    assert not qa and not qb and data_writes.flags([qa, qb]).tolist() == [0.0, 0.0], "reported checks stayed queued"
    assert ledger.reused("c", a, ra, None, False, "statistics") == (False, None), "a check without a queue"


@pytest.mark.parametrize("local", [False, True], ids=["world above one", "one rank"])
def test_queued_checks_hold_no_tensor_of_their_own(local):
    """However many checks wait, a weight holds one buffer of flags (the same tensor): the fingerprints compared are
    not kept, so memory does not grow from step to step without a report (2026-11-29: on two H200s, a training run
    without precompute_scales grew by 18 KiB a step, one fingerprint per queued check). (CPU tensors stand in for
    the CUDA path of one rank.)"""
    ledger = Ledger()
    w, q = torch.randn(8, 8), QueuedChecks("w")
    ref = bits_sum(w)

    def check(now):
        if local:
            ledger.queue_local("w", q, ref, now, "a payload")
        else:
            q.add(ref, now, "statistics")

    kept = []
    for i in range(53):
        now = bits_sum(w)
        check(now)
        kept.append(weakref.ref(now))
        if i == 0:
            held = ledger.local[q] if local else q
            first = held.seen
        del now
    assert held.seen is first and held.count == 53, f"the flag buffer was replaced ({held.count} checks)"
    assert all(r() is None for r in kept), "a queued check kept its fingerprint alive"


def test_a_weight_whose_checks_no_precompute_scales_reports_stops_queuing_until_one_does(monkeypatch):
    """World > 1 without precompute_scales nothing reads the queued checks: past `_UNREPORTED` a weight makes none
    (no fingerprint read); once a report empties its queue (`flags`), checks are made again."""
    monkeypatch.setattr(data_writes, "_UNREPORTED", 3)
    ledger, w, q = Ledger(), torch.randn(4, 4), QueuedChecks("w")
    ref = bits_sum(w)
    made = [ledger.reused("w", w, ref, q, False, "statistics")[1] is not None for _ in range(5)]
    assert made == [True, True, True, False, False] and q.count == 3, f"checks made {made}, queued {q.count}"
    assert q.will_report(True), "one rank's own checks stopped"
    data_writes.flags([q])
    assert ledger.reused("w", w, ref, q, False, "statistics")[1] is not None, "no check after the report"


def test_queued_local_checks_are_compared_in_one_batch_and_raised_by_a_later_poll(monkeypatch):
    """The queue of one rank's checks on CUDA (here with CPU tensors: the compare and the report, without the event
    the GPU test covers): nothing raised until the batch is compared (every `_FLUSH` checks); a poll then names the
    changed weights."""
    monkeypatch.setattr(data_writes, "_FLUSH", 3)
    ledger = Ledger()
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    ra, rb = bits_sum(a), bits_sum(b)
    qa, qb = QueuedChecks("a"), QueuedChecks("b")
    b.data.neg_()
    ledger.queue_local("a", qa, ra, bits_sum(a), "a payload")
    ledger.queue_local("b", qb, rb, bits_sum(b), "a payload")
    ledger.poll(wait=False)  # (nothing compared yet)
    assert not ledger.reports, "compared before the batch was full"
    ledger.queue_local("a", qa, ra, bits_sum(a), "a payload")
    with pytest.raises(StaleWeightError, match=r"^b: changed without a version counter changing"):
        ledger.poll(wait=False)
    ledger.poll(wait=True)  # (reported once)
    assert not any(ledger.local.values()), "the local queues were not emptied by the batch"


def test_precompute_scales_reports_the_queued_local_batches_of_earlier_calls():
    """`begin_report` hands the earlier batches to `end_report` (which waits for them) and compares the checks queued
    since in a new batch, reported at a later call."""
    ledger = Ledger()
    w = torch.randn(3, 3)
    ref = bits_sum(w)
    w.data.add_(1)
    q = QueuedChecks("w")
    ledger.queue_local("w", q, ref, bits_sum(w), "a payload")
    assert ledger.end_report(ledger.begin_report()) == [], "the batch of this call was read in the same call"
    assert ledger.end_report(ledger.begin_report()) == ["w"], "the batch of the call before was not reported"


def test_switched_off_nothing_is_fingerprinted_or_checked():
    w = torch.randn(4, 4)
    ref = bits_sum(w)
    w.data.mul_(2)
    ledger = Ledger()
    with CHECK.turned(False):
        assert fingerprint(w) is None
        assert ledger.reused("w", w, ref, None, True, "a payload") == (False, None)
        queue = QueuedChecks("w")
        assert ledger.reused("w", w, ref, queue, False, "statistics") == (False, None)
    assert not queue and not ledger.local


def test_switched_off_the_is_first_microbatch_cache_does_not_see_a_write_through_data(caplog):
    """The switch covers the is_first_microbatch cache's fingerprint too: off, a write through `.data` between
    micro-batches leaves the old quantization in use (no warning); on, it is quantized anew with the warning."""
    results = {}
    for on in (True, False):
        torch.manual_seed(0)
        layer = hq.Linear(64, 32, recipe="fp8_tensorwise", name="fc")
        x = torch.randn(16, 64)
        with CHECK.turned(on), caplog.at_level(logging.WARNING, logger="hybridq"):
            caplog.clear()
            before = layer(x, is_first_microbatch=True).detach()
            layer.weight.data.mul_(4)
            after = layer(x, is_first_microbatch=False).detach()
        results[on] = (torch.equal(before, after), "weight changed since it was quantized" in caplog.text)
    assert results[True] == (False, True), f"check on: (old output reused, warned) = {results[True]}"
    assert results[False] == (True, False), f"check off: (old output reused, warned) = {results[False]}"


def test_the_switch_is_read_from_the_environment_when_hybridq_is_imported():
    env = dict(os.environ, HYBRIDQ_CHECK_DATA_WRITES="0")
    code = "from hybridq import data_writes; print(data_writes.check_data_writes_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", f"HYBRIDQ_CHECK_DATA_WRITES=0: the check is {out.strip()}, expected off"
