"""FSDP2 with quantized all-gathers, end to end in spawned process groups.

gloo (CPU, CI) always; nccl on a machine with 2 CUDA devices (the GPU run adds the memory-growth check):
    python -m pytest -q -m distributed tests/distributed -k nccl

Oracles (all bitwise):
- sharding invariance: the weight FSDP2 gathers is the quantization of the full weight on one device, for
  every format and hybrid, uneven / straddling shapes, world sizes 1 and 2;
- training: losses of every step, gradients of the first step and parameters after 3 steps equal a
  single-process replay that runs each rank's micro-batch separately and averages gradients in FSDP2's order
  (so quantization of activations and gradients sees the same data); reduction order allows bitwise equality
  for 2 ranks and for the 2x2 HSDP mesh (sums of two, halvings are exact).
World sizes 4 and 8 (HSDP 2x2 included): test_large_world.py.
"""

from __future__ import annotations

import math

import pytest

import hybridq
from hybridq import Role
from hybridq.distributed import gather_bytes_per_step

from _harness import backends, spawn
import _jobs

pytestmark = pytest.mark.distributed

PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block_fwd_mxfp8_bwd",
           "fp8_fwd_high_precision_bwd"]


def _memory(backend) -> dict:
    """On GPUs: 4 steps, and allocated / peak memory must not grow after the first (optimizer state) step."""
    return {"memory": True, "steps": 4} if backend == "nccl" else {}


def check_invariance(inv: dict, world_size: int, rank: int, names=_jobs.INVARIANCE_CASES) -> None:
    """The gathered weight is bitwise the one-device quantization of the full weight, both directions after a
    full unshard, only the rowwise one after a forward-only unshard (identity: one buffer serves both); the
    quantized buffers are freed at reshard; with several ranks, precompute_scales is one all-reduce and the
    second round's unshards use its statistics. `names`: the cases the job ran."""
    where = f"rank {rank} of {world_size}"
    assert not inv["not_gathered_weight"], f"{where}: unsharded weight is not a GatheredWeight: {inv['not_gathered_weight']}"
    assert not inv["diffs"], f"{where}: gathered parts differ from the unsharded quantization:\n" + "\n".join(inv["diffs"][:40])
    assert inv["checked"] == 4 * len(names), (where, inv["checked"])
    for name, mat in inv["materialized"].items():
        want = "rowwise" if name.endswith("forward-only") and not name.startswith("identity") else "rowwise+columnwise"
        assert mat == want, f"{where}: {name} materialized {mat!r}, expected {want!r}"
    assert all(inv["freed"]), f"{where}: quantized unsharded buffers survived reshard (rounds {inv['freed']})"
    # precompute_scales runs after every optimizer step: a repeat call asks the device mesh nothing (its size and this
    # rank's index are remembered per mesh)
    assert inv["mesh_queries"] == 0, f"{where}: a repeated precompute_scales made {inv['mesh_queries']} DeviceMesh " \
                                     f"size/get_local_rank calls"
    if world_size > 1:
        assert inv["precompute"]["all_reduces"] == 1, (where, inv["precompute"])
        over = {n: c for n, c in inv["counters"].items() if c.get("stats_allreduce", 0) > 1}
        assert not over, f"{where}: the second round did not use the precomputed statistics: {over}"


def check_training(run: dict, rank: int) -> None:
    """Every step's losses, the first step's gradients and the parameters after the last step are bitwise the
    single-process replay's; the quantized buffers are freed at reshard; memory does not grow after step 0;
    reshard_after_forward=False gathers nothing in backward; activation recompute gathers the rowwise form
    lazily."""
    where = f"{run['preset']}, rank {rank}"
    assert run["wrapped"] > 0, f"{where}: no weight was wrapped"
    for what, diffs in run["diffs"].items():
        assert not diffs, f"{where}: {what} differ from the single-process reference:\n" + "\n".join(diffs[:20])
    assert run["freed"], f"{where}: quantized unsharded buffers survived reshard"
    mem = run["memory"]
    if mem:  # step 0 allocates the optimizer state; after that nothing may grow
        assert len(mem) >= 3 and mem[1:] == mem[1:2] * (len(mem) - 1), f"{where}: memory grows across steps: {mem}"
    c = run["counters"]
    if not run["reshard_after_forward"]:
        assert c.get("gather_backward", 0) == 0, f"{where}: reshard_after_forward=False re-gathered in backward: {c}"
    elif run["recompute"]:
        assert c.get("lazy_gathers", 0) > 0, f"{where}: activation recompute read no lazily gathered rowwise form: {c}"
    if run["clip_norm"] is not None:
        assert math.isfinite(run["clip_norm"]) and run["clip_norm"] > 0, f"{where}: grad norm {run['clip_norm']}"


@pytest.mark.parametrize("backend", backends())
def test_sharding_invariance_two_ranks(backend):
    out = spawn(_jobs.job_invariance, 2, backend)
    for rank, inv in enumerate(out):
        check_invariance(inv, 2, rank)


@pytest.mark.parametrize("backend", backends())
def test_one_rank_invariance_and_training(backend):
    """World size 1 (FSDP2's no-collective path): same invariance, plus a short training run."""
    out = spawn(_jobs.job_training, 1, backend, invariance=True,
                configs=[{"preset": "mxfp8_fwd_nvfp4_bwd", **_memory(backend)}])
    check_invariance(out[0]["invariance"], 1, 0)
    check_training(out[0]["runs"][0], 0)


@pytest.mark.parametrize("backend", backends())
def test_training_matches_single_process_every_preset(backend):
    configs = [{"preset": p, **_memory(backend)} for p in PRESETS]
    out = spawn(_jobs.job_training, 2, backend, configs=configs)
    for rank, r in enumerate(out):
        for run in r["runs"]:
            check_training(run, rank)
    for run in out[0]["runs"]:
        c = run["counters"]
        assert c["gather_forward"] > 0 and c["gather_backward"] > 0, run
        # precompute_scales after every step: only the first step's forward all-reduces statistics
        assert c.get("stats_allreduce", 0) <= run["converted"], run
        # a backward unshard that sends what the forward one sent reuses the forward's quantized shard
        sends = gather_bytes_per_step(hybridq.recipe(run["preset"]).quantizer(Role("linear", "weight")), (256, 256))
        want = c["gather_backward"] if sends.forward_sends == sends.backward_sends else 0
        assert c.get("payload_reused", 0) == want, (run["preset"], sends, c)
        if run["preset"] in ("fp8_tensorwise", "fp8_block"):  # payload of one buffer: no copy after the gather
            assert c.get("aliased", 0) >= c["gather_forward"], (run["preset"], c)


@pytest.mark.parametrize("backend", backends())
def test_training_variants(backend):
    """reshard_after_forward=False, gradient accumulation with set_requires_gradient_sync, activation
    recompute (lazy rowwise gather in backward), state_dict / load_state_dict / grad clipping, the per-weight
    statistics fallback (no precompute_scales), HSDP 2x1 and 1x2 meshes, backward_override='dequantized',
    CPU offload (gloo), the forward payload not kept for backward, and backward_override='high_precision' (see
    HIGH_PRECISION_CONFIGS)."""
    mem = _memory(backend)
    configs = [
        {"preset": "mxfp8_fwd_nvfp4_bwd", "reshard_after_forward": False, **mem},
        {"preset": "fp8_tensorwise", "accum": 2, "precompute": False, **mem},
        {"preset": "mxfp8_fwd_nvfp4_bwd", "recompute": True},
        {"preset": "fp8_block", "check_state_dict": True, "check_clip": True},
        {"preset": "mxfp8", "mesh_shape": [2, 1], **mem},
        {"preset": "nvfp4", "mesh_shape": [1, 2], "accum": 2, "unsharded_accum": True},
        {"preset": "fp8_block_fwd_mxfp8_bwd", "backward_override": "dequantized"},
        {"preset": "fp8_tensorwise", "reuse_payload": False},
    ]
    if backend == "gloo":  # FSDP2's CPU offload path (to(device) before each all-gather)
        configs.append({"preset": "fp8_tensorwise", "offload": True})
    configs += HIGH_PRECISION_CONFIGS
    out = spawn(_jobs.job_training, 2, backend, configs=configs, high_precision={"presets": HIGH_PRECISION_PRESETS})
    for rank, r in enumerate(out):
        for run in r["runs"]:
            check_training(run, rank)
        for cfg, run in zip(configs, r["runs"]):
            if cfg.get("check_state_dict"):
                assert not run["diffs"]["state_dict"], (rank, run["diffs"]["state_dict"])
            if cfg.get("check_clip"):
                assert run["clip_norm"] is not None, (rank, cfg)
    runs = out[0]["runs"]
    assert runs[0]["counters"].get("gather_backward", 0) == 0  # nothing re-gathered in backward
    assert runs[1]["counters"]["stats_allreduce"] >= 3 * runs[1]["converted"] - 3  # fallback: one per step
    assert runs[2]["counters"]["lazy_gathers"] > 0
    assert runs[7]["counters"].get("payload_reused", 0) == 0 < runs[7]["counters"]["gather_backward"], \
        "reuse_forward_payload=False: every backward unshard quantizes its shard again"
    _check_high_precision(out, runs[-len(HIGH_PRECISION_CONFIGS):])


# backward_override="high_precision" under FSDP2 (backward reads the weight gathered in param_dtype): the whole
# TinyLM (losses of every step, gradients of step 0, parameters after 3 steps) and one Linear (output, input and
# weight gradients of every step, reshard_after_forward True and False, override from the environment, activation
# recompute) bitwise equal to the single-process hybridq run with the same override, whose gradients are those of
# nn.Linear
HIGH_PRECISION_PRESETS = ["fp8_tensorwise", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]
HIGH_PRECISION_CONFIGS = [
    {"preset": "fp8_tensorwise", "backward_override": "high_precision"},
    {"preset": "mxfp8", "backward_override": "high_precision", "reshard_after_forward": False},
    {"preset": "nvfp4", "backward_override": "high_precision"},
    {"preset": "mxfp8_fwd_nvfp4_bwd", "env_override": "high_precision", "recompute": True},
]


def _check_high_precision(out, runs):
    for cfg, run in zip(HIGH_PRECISION_CONFIGS, runs):
        c = run["counters"]
        if cfg.get("recompute"):  # recompute reads the rowwise form in backward: gathered lazily in the first
            # step only; later backward unshards quantize it from the gathered param_dtype weight
            assert 0 < c["lazy_gathers"] <= run["converted"], (cfg, c)
        else:
            assert c.get("lazy_gathers", 0) == 0, (cfg, c)  # backward's gather was planned, not lazy
        if cfg.get("reshard_after_forward", True):
            assert c["gather_backward"] > 0, (cfg, c)
        else:
            assert c.get("gather_backward", 0) == 0, (cfg, c)
    for rank, r in enumerate(out):
        for name, case in r["high_precision"].items():
            assert not case["diffs"], f"rank {rank}, {name}: differs from the one-device run:\n" + "\n".join(case["diffs"])
            assert case["freed"], f"rank {rank}, {name}: unsharded buffers survived the reshard"
            assert case["bytes_per_step"] == case["expected_bytes_per_step"], (rank, name, case)
            if not case["reshard_after_forward"]:
                assert case["counters"].get("gather_backward", 0) == 0, (rank, name, case["counters"])
    hp = out[0]["high_precision"]
    assert len(hp) == 2 * len(HIGH_PRECISION_PRESETS) + 1, sorted(hp)
    for name, r in hp.items():
        # one rank's shard of the 160x64 weight in bf16 is 80*64*2 bytes: backward (or, without reshard, the only)
        # gather sends exactly that
        ra = "reshard_after_forward=True" in name
        bf16 = 80 * 64 * 2
        assert (r["bytes_per_step"] > bf16) if ra else (r["bytes_per_step"] == bf16), (name, r)
