"""The next forward's all-gather payloads prepared after the optimizer step (`precompute_scales(model, payloads=True)`,
[Note: precomputed payloads], hybridq/distributed/precomputed_payloads.py). Specified against the per-weight path (no
precomputed payloads, the unit cast off): every gathered rowwise part, loss, gradient and final parameter bitwise the
same over training steps, per FSDP2 unit or per model, for per-tensor FP8, a unit with an MXFP8 weight (left to its
hook) and 128x128 tiles beside per-tensor FP8 (a tile split by a shard boundary at two ranks: left to its hook); each
qualifying weight's forward hook sends the payload prepared for it (counters) and quantizes nothing; a weight changed
after the precompute -- an in-place edit, a second optimizer step -- is quantized anew (bitwise its new values; the
run fails where the hook's key check is removed); the switch off prepares nothing. Real FSDP2 on gloo (world 1
in-process, world 2 spawned); CUDA (NCCL world 1): the GPU tests at the end."""

from __future__ import annotations

import pytest
import torch

import _precomputed_payload_jobs as jobs
from _harness import job_several, spawn

pytestmark = pytest.mark.distributed

STEPS = 3
UNITS = 2
MODELS = list(jobs.MODELS)
# model -> (kinds of quantizer batched per unit, weight names (suffixes) no payload is prepared for at world 1 / 2)
EXPECTED = {
    "fp8_tensorwise": (1, (), ()),
    "fp8_tensorwise_no_reshard": (1, (), ()),  # (reshard_after_forward=False: the forward's payloads not kept)
    "fp8_tensorwise_mxfp8_o": (1, (".o.weight",), (".o.weight",)),
    "fp8_block_and_tensorwise": (2, (), (".v.weight",)),  # (v: 200 rows, 100 per rank: a tile split at two ranks)
}


def _left_out(model: str, world_size: int) -> tuple[str, ...]:
    return EXPECTED[model][1 if world_size == 1 else 2]


def _sent_precomputed(r: dict, model: str, world_size: int, where: str, edited: str | None = None,
                      stale: bool = False) -> None:
    """Each qualifying weight's forward hook sent its precomputed payload from the second step on (the first forward
    makes the lanes), every one left out none; no forward unit batch ran where every payload was taken."""
    sent = r["counters"]["payload_precomputed"]
    for name, n in sent.items():
        fresh = not stale and not name.endswith(_left_out(model, world_size)) and name != f"{edited}.weight"
        want = STEPS - 1 if fresh else 0
        assert n == want, f"{where}: {name} sent {n} precomputed payloads, expected {want}"
    if not stale:
        assert sum(r["counters"]["unit_batches"].values()) == 0, \
            f"{where}: forward unit batches ran beside the precomputed payloads: {r['counters']['unit_batches']}"
    assert r["counters"]["payload_reused"] == r["reference"]["payload_reused"], \
        f"{where}: backward unshards re-sent {r['counters']['payload_reused']} kept payloads, per weight " \
        f"{r['reference']['payload_reused']}"


def _prepared(r: dict, model: str, world_size: int, per_unit: bool, where: str) -> None:
    """After every step, one batch per unit and kind (per model: per kind), a payload for each qualifying weight."""
    qualifying = [n for n in r["counters"]["payload_precomputed"] if not n.endswith(_left_out(model, world_size))]
    kinds = EXPECTED[model][0]
    for s, p in enumerate(r["prepared"]):
        assert p["weights"] == len(qualifying), f"{where}: step {s} prepared {p['weights']}, expected {len(qualifying)}"
        assert p["batches"] == kinds * (UNITS if per_unit else 1), f"{where}: step {s}: {p['batches']} batches"


@pytest.mark.parametrize("per_unit", [True, False], ids=["per_unit", "per_model"])
@pytest.mark.parametrize("model", MODELS)
def test_one_rank_training_is_bitwise_the_per_weight_path(one_rank, model, per_unit):
    r = jobs.parity(0, 1, one_rank, model, STEPS, per_unit)
    where = f"world 1, {model}, per_unit={per_unit}"
    _sent_precomputed(r, model, 1, where)
    _prepared(r, model, 1, per_unit, where)


@pytest.mark.parametrize("model", MODELS)
def test_the_payloads_held_between_steps_are_one_byte_per_local_element(one_rank, model):
    """What the precompute costs between the optimizer step and the forward: each qualifying weight's FP8 elements
    (one byte each), its region rounded up to 16 bytes (scales not counted)."""
    m = jobs.MODELS[model][0](one_rank, 1)
    from hybridq.distributed import precompute_scales
    from hybridq.torch_private import local_tensor

    x = torch.randn(4, jobs.MODELS[model][1])
    m(x).float().sum().backward()  # (the first forward makes the lanes)
    pre = precompute_scales(m, payloads=True).payloads
    want = sum(-(-local_tensor(p).numel() // 16) * 16 for n, p in m.named_parameters()
               if not n.endswith(_left_out(model, 1)))
    assert pre.bytes == want, f"{model}: {pre.bytes} payload bytes held, expected {want} (one per element, aligned)"


def test_two_ranks_training_is_bitwise_the_per_weight_path():
    """Two ranks: the statistics reduced by precompute_scales' all-reduce, the payloads prepared from them; a weight
    whose shard splits a tile is left to its hook (which then needs no collective: its statistics are reduced)."""
    runs = {f"{model}/{per_unit}": (jobs.parity, dict(model=model, steps=STEPS, per_unit=per_unit))
            for model in MODELS for per_unit in (True, False)}
    results = spawn(job_several, 2, "gloo", jobs=runs)
    for rank, res in enumerate(results):
        for name, r in res.items():
            model, per_unit = name.split("/")
            where = f"rank {rank} of 2, {name}"
            _sent_precomputed(r, model, 2, where)
            _prepared(r, model, 2, per_unit == "True", where)
            assert sum(r["counters"]["stats_allreduce"].values()) == sum(r["reference"]["stats_allreduce"].values()), \
                f"{where}: the unshards issued other all-reduces than the per-weight path's"


@pytest.mark.parametrize("model", MODELS)
def test_a_weight_edited_in_place_after_the_precompute_is_quantized_anew(one_rank, model):
    """Between the precompute and the forward one weight's master is scaled in place (its version counters move):
    its hook drops the payload prepared from the old values and quantizes the new ones (the run stays bitwise the
    per-weight path's with the same edits); its siblings send theirs."""
    r = jobs.parity(0, 1, one_rank, model, STEPS, between="edit")
    _sent_precomputed(r, model, 1, f"world 1, {model}, edited in place", edited=jobs.MODELS[model][2])


@pytest.mark.parametrize("model", MODELS)
def test_a_second_optimizer_step_after_the_precompute_makes_every_payload_stale(one_rank, model):
    """A second AdamW step between the precompute and the forward changes every master: no prepared payload is sent
    (the forward quantizes every weight anew, bitwise the per-weight path)."""
    r = jobs.parity(0, 1, one_rank, model, STEPS, between="extra_step")
    _sent_precomputed(r, model, 1, f"world 1, {model}, second optimizer step", stale=True)


@pytest.mark.parametrize("model", MODELS)
def test_an_evaluation_forward_between_the_precompute_and_the_next_step_trains_bitwise(one_rank, model):
    """A no_grad forward (evaluation) after the precompute takes the payloads; the training step after it is still
    bitwise the per-weight path's with the same evaluation."""
    jobs.parity(0, 1, one_rank, model, STEPS, between="eval")


def test_two_ranks_an_evaluation_forward_between_the_precompute_and_the_next_step_trains_bitwise():
    runs = {model: (jobs.parity, dict(model=model, steps=STEPS, between="eval")) for model in MODELS}
    spawn(job_several, 2, "gloo", jobs=runs)


@pytest.mark.parametrize("between", ["load_state_dict", "local_copy"])
def test_a_weight_loaded_or_written_in_its_local_shard_after_the_precompute_is_quantized_anew(one_rank, between):
    """`load_state_dict` (every parameter copied in place) or a write into the DTensor's local shard between the
    precompute and the forward: the changed weight is quantized anew (bitwise the per-weight path's run)."""
    jobs.parity(0, 1, one_rank, "fp8_tensorwise", STEPS, between=between)


def test_one_rank_a_weight_written_through_data_after_the_precompute_is_quantized_anew_with_a_warning(one_rank, caplog):
    """A write through `weight.data` (no version counter moves) between the precompute and the forward: on one CPU
    rank the hook sees the weight's fingerprint differ from the payload's, drops the payload and quantizes the current
    values (the run bitwise the per-weight path's with the same writes), with a warning naming the weight; its siblings
    send theirs ([Note: data-write check])."""
    r = jobs.parity(0, 1, one_rank, "fp8_tensorwise", STEPS, between="edit_data")
    edited = jobs.MODELS["fp8_tensorwise"][2]
    _sent_precomputed(r, "fp8_tensorwise", 1, "world 1, written through .data", edited=edited)
    warned = [rec.getMessage() for rec in caplog.records if "changed through `.data`" in rec.getMessage()]
    assert len(warned) == STEPS - 1 and all(w.startswith(f"{edited}.weight:") for w in warned), \
        f"expected one warning naming {edited}.weight per forward after a precompute, got {warned}"


@pytest.mark.parametrize("payloads", [False, True], ids=["scales", "scales_and_payloads"])
def test_two_ranks_a_weight_written_through_data_after_precompute_scales_raises_at_the_next_one_on_every_rank(payloads):
    """Two ranks: a write through `weight.data` after precompute_scales; the next forward's unshard reuses the
    statistics reduced from the old values (re-reducing them on one rank would leave the other in a collective), so
    each rank queues the check and the next precompute_scales all-reduces the flags with the statistics: every rank
    raises StaleWeightError there, in the same call, naming the weight and what to do."""
    results = spawn(jobs.stale_at_precompute, 2, "gloo", payloads=payloads)
    for rank, r in enumerate(results):
        steps = [s for s, _ in r["raised"]]
        assert steps == [1, 2], f"rank {rank}: StaleWeightError at the precompute_scales of steps {steps}, expected " \
                                f"[1, 2] (the calls after each write)"
        for _, msg in r["raised"]:
            assert msg.startswith(f"{r['edited']}:") and "torch.no_grad()" in msg and "precompute_scales" in msg, \
                f"rank {rank}: the error does not name {r['edited']} and the remedy: {msg}"


def test_two_ranks_an_in_place_edit_after_precompute_scales_is_cast_with_its_new_scale():
    spawn(jobs.scales_against_none, 2, "gloo", between="edit")


def test_two_ranks_stale_payloads_are_quantized_anew():
    runs = {f"{model}/{between}": (jobs.parity, dict(model=model, steps=STEPS, between=between))
            for model in ("fp8_tensorwise", "fp8_block_and_tensorwise") for between in ("edit", "extra_step")}
    results = spawn(job_several, 2, "gloo", jobs=runs)
    for rank, res in enumerate(results):
        for name, r in res.items():
            model, between = name.split("/")
            edited = jobs.MODELS[model][2] if between == "edit" else None
            _sent_precomputed(r, model, 2, f"rank {rank} of 2, {name}", edited=edited, stale=between == "extra_step")


def test_a_stale_payload_is_sent_where_the_hooks_key_check_is_removed(one_rank, monkeypatch):
    """The specification's own check: with the hand-over's key comparison replaced by 'always the same', the edited
    weight's stale payload is sent and the run differs from the per-weight path (so the tests above can fail). (The
    data-write check is turned off here: it would see the edit's changed values too, [Note: data-write check].)"""
    from hybridq.data_writes import CHECK
    from hybridq.distributed import unit_cast

    monkeypatch.setattr(CHECK, "on", False)

    real = unit_cast.unit_payload

    def no_key_check(local, lane, key, **kwargs):
        prepared = local._hq.__dict__.get("unit_prepared")
        return real(local, lane, prepared.key if prepared is not None and key is not None else key, **kwargs)

    monkeypatch.setattr("hybridq.distributed.weights.unit_payload", no_key_check)
    with pytest.raises(AssertionError, match="differs"):
        jobs.parity(0, 1, one_rank, "fp8_tensorwise", STEPS, between="edit")


@pytest.mark.parametrize("model", ["fp8_tensorwise", "fp8_block_and_tensorwise"])
def test_switched_off_nothing_is_prepared(one_rank, model):
    """`HYBRIDQ_PRECOMPUTED_PAYLOADS` off (`set_precomputed_payloads(False)`): `payloads=True` prepares nothing and
    every forward hook quantizes as before."""
    r = jobs.switched_off(0, 1, one_rank, model)
    assert all(p == dict(weights=0, batches=0, bytes=0) for p in r["prepared"]), r["prepared"]
    assert sum(r["counters"]["payload_precomputed"].values()) == 0 == sum(r["counters"]["payloads_precomputed"].values())


# ---- on a GPU: the CUDA batch kernels, the payloads made on the compute stream and taken on FSDP2's copy-in stream --

@pytest.mark.gpu
@pytest.mark.parametrize("between", [None, "edit"], ids=["unchanged", "edited"])
@pytest.mark.parametrize("model", ["fp8_tensorwise", "fp8_block_and_tensorwise"])
def test_gpu_training_is_bitwise_the_per_weight_path(model, between):
    """CUDA, NCCL world 1: training with precomputed payloads (per unit and per model) bitwise the per-weight path,
    every qualifying weight's forward sending its precomputed payload (an edited one quantized anew)."""
    from _gpu import extension_ready
    from _harness import nccl_devices

    if not (nccl_devices(1) and extension_ready()):
        pytest.skip("needs a CUDA device, NCCL and the extension")
    runs = {str(per_unit): (jobs.parity, dict(model=model, steps=STEPS, per_unit=per_unit, between=between))
            for per_unit in (True, False)}
    (res,) = spawn(job_several, 1, "nccl", jobs=runs)
    for per_unit, r in res.items():
        where = f"CUDA world 1, {model}, per_unit={per_unit}, between={between}"
        edited = jobs.MODELS[model][2] if between == "edit" else None
        _sent_precomputed(r, model, 1, where, edited=edited)
        _prepared(r, model, 1, per_unit == "True", where)
