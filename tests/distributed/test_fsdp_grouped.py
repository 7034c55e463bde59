"""FSDP2 for grouped (mixture-of-experts) weights `[E, out, in]`: GroupedLinear and expert modules converted by
apply_hybrid_fsdp, sharded by FSDP2 along dim 0 (whole experts, uneven counts included) or dim 1 (rows of every
expert, `shard_placement_fn=lambda p: Shard(1)`), all-gathered quantized.

Oracles (bitwise): every expert's gathered parts are the one-device quantization of that expert's full `[out, in]`
weight; a tiny routed MoE trained under FSDP2 has every step's loss, the first step's gradients and the final
parameters of a single-process replay (each rank's batch run separately, gradients averaged in FSDP2's order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hybridq
from hybridq.distributed import GroupedHybridWeight

from _harness import nccl_devices, spawn
import _grouped_jobs as jobs

pytestmark = pytest.mark.distributed

# every preset once, the placements and expert counts (3 experts on 2 ranks: uneven) spread over them, and the
# backward overrides, reshard_after_forward=False and activation recompute (a lazily gathered rowwise form)
TRAINING = [
    dict(preset="fp8_tensorwise", dim=0, experts=3, recompute=True),
    dict(preset="fp8_block", dim=1, experts=4, reshard_after_forward=False),
    dict(preset="mxfp8", dim=0, experts=4, backward_override="dequantized"),
    dict(preset="nvfp4", dim=1, experts=3, backward_override="high_precision"),
    dict(preset="mxfp8_fwd_nvfp4_bwd", dim=1, experts=4),
    dict(preset="mxfp8_fwd_nvfp4_bwd", dim=0, experts=3),
    dict(preset="fp8_block_fwd_mxfp8_bwd", dim=0, experts=3),
    dict(preset="fp8_fwd_high_precision_bwd", dim=1, experts=3),
]


@pytest.fixture(scope="module")
def invariance_and_errors():
    return spawn(jobs.job_grouped_invariance_and_errors, 2, "gloo")


@pytest.fixture(scope="module")
def training():
    return spawn(jobs.job_moe_training, 2, "gloo", configs=TRAINING)


def test_gathered_experts_are_the_single_device_quantization(invariance_and_errors):
    """Shard(0) and Shard(1), 3 or 4 experts, every format and hybrid of GROUPED_CASES: each expert's gathered
    rowwise and columnwise parts equal quantizing that expert's full weight on one device, before and after an
    in-place update; forward-only unshards gather the rowwise form only; buffers are freed at reshard."""
    for rank, res in enumerate(invariance_and_errors):
        inv = res["invariance"]
        assert not inv["not_gathered"], f"rank {rank}: unsharded weight is not a GroupedGatheredWeight: {inv['not_gathered']}"
        assert not inv["diffs"], f"rank {rank}: gathered experts differ:\n" + "\n".join(inv["diffs"][:30])
        n_experts = sum(e for _, (e, _, _) in jobs.GROUPED_CASES.values())
        assert inv["checked"] == 2 * 2 * 2 * n_experts, (rank, inv["checked"])  # dims x rounds x directions
        for name, mat in inv["materialized"].items():
            want = ("rowwise" if name.endswith("forward-only") and not name.startswith("identity")
                    else "rowwise+columnwise")
            assert mat == want, f"rank {rank}: {name} materialized {mat!r}, expected {want!r}"
        assert all(inv["freed"]), f"rank {rank}: unsharded expert buffers survived reshard: {inv['freed']}"


def test_statistics_of_all_experts_reduce_in_one_all_reduce(invariance_and_errors):
    """One MAX all-reduce per grouped weight per unshard (not one per expert), and precompute_scales reduces every
    grouped weight of the model in one all-reduce that the next unshards use."""
    for rank, res in enumerate(invariance_and_errors):
        inv = res["invariance"]
        for pre in inv["precompute"]:
            assert pre["all_reduces"] == 1 and pre["weights"] > 0, (rank, pre)
        for per_weight in inv["allreduces"]:
            assert max(per_weight.values()) == 1, f"rank {rank}: more than one all-reduce per weight: {per_weight}"


def test_shard_along_in_features_is_refused_naming_the_weight(invariance_and_errors):
    for res in invariance_and_errors:
        msg = res["errors"]["shard2"]
        assert msg is not None and "moe.w1" in msg and "dim 2" in msg and "Shard(1)" in msg, msg


def test_shard1_boundary_the_format_refuses_is_an_error_at_the_first_gather(invariance_and_errors):
    """NVFP4 with the Hadamard transform needs 16-row aligned shards: 48 rows per expert on 2 ranks cut at 24."""
    for res in invariance_and_errors:
        msg = res["errors"]["rht_rows"]
        assert msg is not None and "moe.w1" in msg and "NVFP4" in msg and "24" in msg, msg


@pytest.mark.parametrize("i", range(len(TRAINING)), ids=[
    f"{c['preset']}-Shard{c['dim']}-E{c['experts']}" + "".join(
        f"-{k}={v}" for k, v in c.items() if k not in ("preset", "dim", "experts")) for c in TRAINING])
def test_moe_training_matches_single_process(training, i):
    for rank, res in enumerate(training):
        run = res["runs"][i]
        assert len(run["wrapped"]) == 8, f"{run['where']}: grouped weights wrapped: {run['wrapped']}"
        for what, diffs in run["diffs"].items():
            assert not diffs, f"rank {rank}: {what} differ from the single-process replay:\n" + "\n".join(diffs[:10])
        if TRAINING[i].get("recompute") and TRAINING[i].get("backward_override") is None:
            assert run["counters"].get("lazy_gathers", 0) > 0, (run["where"], run["counters"])
        if TRAINING[i].get("reshard_after_forward") is False:
            assert run["counters"].get("gather_backward", 0) == 0, (run["where"], run["counters"])


# ---- set-up, single process ----------------------------------------------------------------------------------

def test_apply_hybrid_fsdp_wraps_grouped_linear_and_expert_weights():
    model = jobs.TinyMoE(3)
    sd_keys = set(model.state_dict())
    report = hybridq.apply_hybrid_fsdp(model, hybridq.recipe("fp8_tensorwise"))
    wrapped = {n for n, p in model.named_parameters() if isinstance(p.data, GroupedHybridWeight)
               or isinstance(p, GroupedHybridWeight)}
    want = {f"blocks.{b}.{w}" for b in range(2) for w in ("experts.w1", "experts.w3", "experts.w2", "proj.weight")}
    assert wrapped == want
    assert want - {f"blocks.{b}.proj.weight" for b in range(2)} <= set(report.converted)
    assert {f"blocks.{b}.proj" for b in range(2)} <= set(report.converted)
    assert set(model.state_dict()) == sd_keys
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())
    x = torch.randint(0, 67, (2, 9))
    model(x).float().sum().backward()  # unsharded: the wrapped weights compute as before
    assert model.blocks[0].experts.w1.grad is not None


def test_delayed_scaling_on_expert_weights_is_refused_before_anything_changes():
    model = jobs.TinyMoE(3)
    before = {n: type(p) for n, p in model.named_parameters()}
    base = hybridq.recipe("fp8_tensorwise")

    def qfactory(role):  # delayed scaling on the expert weights only: the Linear layers would convert
        if role.module_type == "grouped_linear" and role.tensor_type == "weight":
            return hybridq.Float8Quantizer(scaling="delayed")
        return base.quantizer(role)

    with pytest.raises(ValueError, match=r"expert 0 of blocks\.0\.experts\.w1 uses delayed scaling"):
        hybridq.apply_hybrid_fsdp(model, hybridq.CustomRecipe(qfactory))
    assert {n: type(p) for n, p in model.named_parameters()} == before
    assert not hybridq.nn.grouped.converted_experts(model.blocks[0].experts)
    assert not isinstance(model.blocks[0].router, hybridq.Linear)


# ---- per-tensor FP8 experts: the gather is batched over the experts ---------------------------------------------

def _gpu_world(n):
    return pytest.param((n, "nccl"), id=f"world{n}-nccl", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not nccl_devices(n), reason=f"needs {n} CUDA device(s) + NCCL")])


# gloo on CPU (the reference path); NCCL on the GPU machine (the grouped cast kernel, the stacked copies on the device)
BATCHED_WORLDS = [pytest.param((1, "gloo"), id="world1"), pytest.param((2, "gloo"), id="world2"), _gpu_world(1),
                  _gpu_world(2)]


@pytest.fixture(scope="module", params=BATCHED_WORLDS)
def batched_gather(request):
    ws, backend = request.param
    return ws, spawn(jobs.job_batched_gather, ws, backend)


def test_batched_fp8_gather_is_the_single_device_quantization(batched_gather):
    """Every expert's gathered rowwise and derived columnwise parts (one a NaN) equal quantizing that expert's full
    weight on one device, bit for bit, on one and two ranks, Shard(0) and Shard(1)."""
    ws, results = batched_gather
    for rank, res in enumerate(results):
        assert res["checked"] == len(jobs.BATCHED_FP8) * (2 if ws > 1 else 1) * (4 + 8), (rank, res["checked"])
        assert not res["diffs"], f"world {ws} rank {rank}: gathered experts differ:\n" + "\n".join(res["diffs"][:20])


def test_batched_fp8_gather_ops_do_not_grow_with_the_expert_count(batched_gather):
    """One unshard of a per-tensor FP8 grouped weight (statistics, quantization, payload, fills, derived columnwise
    form) issues the same ops for 4 experts as for 8: one amax pass and one cast for all experts, not one per expert."""
    ws, results = batched_gather
    for rank, res in enumerate(results):
        by_case = res["ops"]
        for case, ops in by_case.items():
            if not case.endswith("E=8"):
                continue
            few = by_case[case.replace("E=8", "E=4")]
            grew = {op: (few.get(op, 0), n) for op, n in ops.items() if n > few.get(op, 0)}
            assert not grew, (f"world {ws} rank {rank} {case}: ops that grow with the experts (E=4 -> E=8): {grew}; "
                              f"all at E=8: {ops}")


def test_batched_fp8_gather_host_work_does_not_grow_with_the_expert_count(batched_gather):
    """One unshard of whole experts per rank (Shard(0)) makes the same Python calls for 4 experts as for 8: the
    experts' payload metadata is built once per layout and the fill reads every expert's bytes out of the gathered
    payloads with one copy, no per-expert Python objects (the host cost that made the MoE job host-bound)."""
    ws, results = batched_gather
    for rank, res in enumerate(results):
        for case, calls in res["calls"].items():
            if "Shard(0)" in case and case.endswith("E=8"):
                few = res["calls"][case.replace("E=8", "E=4")]
                assert calls == few, f"world {ws} rank {rank} {case}: {few} Python calls at E=4, {calls} at E=8"


def test_gathered_fp8_experts_are_not_copied_for_backward(batched_gather):
    """A forward on FSDP2-gathered per-tensor FP8 experts reads their stacked rowwise buffers in place and saves no
    weight-sized FP8 copy for backward: dgrad reads the columnwise form the backward unshard derives."""
    ws, results = batched_gather
    for rank, res in enumerate(results):
        copies = {case: saved for case, saved in res["saved_fp8"].items() if saved}
        assert not copies, f"world {ws} rank {rank}: weight-sized FP8 tensors saved for backward: {copies}"


def test_gathered_fp8_experts_data_and_scales_are_read_in_place(batched_gather):
    """The grouped GEMMs of forward (fprop) and backward (dgrad) on FSDP2-gathered per-tensor FP8 experts read the
    experts' stacked data and scales where the unshard put them: no copy of either per call (the scales' 16-byte
    aligned `[E, 4]` buffer is read with its stride; a copy was one more allocation and launch per GEMM)."""
    ws, results = batched_gather
    for rank, res in enumerate(results):
        for case, reads in res["copied"].items():
            if reads is None:  # (a GPU without jagged kernels for these test shapes: the per-expert path ran)
                assert res["device"] != "cpu", f"world {ws} rank {rank} {case}: the jagged path did not run on the CPU"
                continue
            assert len(reads) == 2, f"world {ws} rank {rank} {case}: expected fprop and dgrad, got {reads}"
            copied = [r for r in reads if not all(r.values())]
            assert not copied, f"world {ws} rank {rank} {case}: GEMM operands copied out of the gathered experts " \
                               f"(False: a copy): {reads}"


@pytest.fixture(scope="module", params=[pytest.param(1, id="world1"), pytest.param(2, id="world2")])
def kept_payload(request):
    return request.param, spawn(jobs.job_kept_payload, request.param, "gloo")


def test_backward_unshard_reuses_the_forward_payload_of_linear_and_grouped_weights(kept_payload):
    """With the weights unchanged since forward, the backward unshard of a Linear and of a per-tensor FP8 grouped
    weight sends the payload its forward unshard quantized (no cast, no quantization in backward), and the input
    gradient is bitwise the one of a run that quantizes again (reuse_forward_payload=False)."""
    ws, results = kept_payload
    for rank, res in enumerate(results):
        assert not res["diffs"], f"world {ws} rank {rank}:\n" + "\n".join(res["diffs"])
        for name, c in res["counters"]["None"].items():
            assert c.get("payload_reused", 0) == c["gather_backward"] == 1, (
                f"world {ws} rank {rank} {name}: the backward unshard quantized its shard again: {c}")


def test_forward_payload_is_not_reused_after_an_in_place_update(kept_payload):
    """Weights doubled in place between forward and backward: the kept payload is stale, so the backward unshard
    quantizes the new values (the input gradient is bitwise the one of a run that never keeps it, and differs from
    the unchanged weights' gradient)."""
    ws, results = kept_payload
    for rank, res in enumerate(results):
        assert res["update_changes_gradient"], f"world {ws} rank {rank}: doubling the weights left dx unchanged"
        assert not res["diffs"], f"world {ws} rank {rank}:\n" + "\n".join(res["diffs"])
        for name, c in res["counters"]["2.0"].items():
            assert c.get("payload_reused", 0) == 0 < c["gather_backward"], (
                f"world {ws} rank {rank} {name}: a stale payload was sent after the weight changed: {c}")
