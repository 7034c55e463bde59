"""Sharding invariance and training parity at world sizes 4 and 8: FSDP2 (1 x N), HSDP (2 x 2, 2 x 4) and FSDP2
over dp x tensor parallelism (dp x tp = 1x4, 4x1, 2x2, 2x4, 4x2).

On a machine with 4 or 8 GPUs (world-8 cases skip with fewer than 8 devices):
    python -m pytest -q -m distributed tests/distributed/test_large_world.py -k nccl
On the CPU (gloo): world 4 always, world-8 invariance always (~25 s on 2 cores); world-8 training and FSDP2 x TP
take ~1.5 min on 2 cores, so they run only with HYBRIDQ_GLOO_WORLD8=1:
    HYBRIDQ_GLOO_WORLD8=1 python -m pytest -q -m distributed tests/distributed/test_large_world.py -k gloo

Oracles:
- sharding invariance (bitwise, as at 2 ranks): every gathered weight is the one-device quantization of the full
  weight. A shape a format cannot shard at 8 ranks (NVFP4 with the Hadamard transform on 64 rows: 8-row shards)
  must be refused naming the rule; a 128-row weight of that format stands in for it.
- FSDP2 / HSDP training against the single-process replay (_models.reference_run). The 2x2 HSDP mesh is bitwise
  over the whole run (sums of two; halving is exact). Beyond two shards the reduce-scatter sums the ranks'
  gradients in another order than the replay, so each step is replayed from the parameters the sharded model
  holds at its start (_jobs._run_training, grad_rtol): that step's losses bitwise, its reduced gradients within
  GRAD_RTOL x max |replay's| per tensor, and the sharded AdamW step bitwise a plain AdamW fed the same gradients.
- FSDP2 x TP (_tp_jobs.tp_fsdp_job): every fprop's quantized weight operand bitwise the piece of the one-device
  quantization; gradients and parameters after two SGD steps within 1e-5 of the largest magnitude (bitwise for
  Linear weight gradients only on the CPU with dp <= 2 and tp <= 2).
"""

from __future__ import annotations

import os

import pytest

from _harness import job_several, nccl_devices, spawn
import _jobs
import _tp_jobs
from test_fsdp import check_invariance, check_training

pytestmark = pytest.mark.distributed

WORLD8_GLOO = os.environ.get("HYBRIDQ_GLOO_WORLD8") == "1"

# Reduced gradients vs the replay, per tensor: max |diff| <= GRAD_RTOL x max |replay's|. Measured on gloo (every
# step, fp8_tensorwise / mxfp8_fwd_nvfp4_bwd / fp8_block / mxfp8 / nvfp4, meshes 1x4, 1x8, 2x4, 4x2) and with the
# replay's own sum reordered (reversed, tree, rotated rings): at most 3.1e-8. A-priori, any order of n fp32 terms
# stays within (n - 1) u max_i |g_i| of another (u = 2^-24): 4.2e-7 x max_i |g_i| / max |mean| at n = 8. A real
# bug is far above: a rank's gradient left out moved the gradients by 0.43 x max (and step 0's losses), stale weights
# in a later step by 0.8 x max (and its losses); reduced gradients scaled by 1 + 1e-4 fail too.
# Why per step rather than one free-running run within a tolerance: replaying with reordered sums kept later losses
# bitwise and parameters within 2.9e-7 x max on this model, but Gaussian noise of one fp32 rounding (u mean_i |g_i|)
# on every reduced gradient element moved step-2 losses by up to 4e-3 and parameters by up to ~3 lr (a weight whose
# bf16 or quantized value flips changes later gradients; AdamW turns a changed small gradient into a changed
# ~lr-sized step): a bound safe for NCCL's order would be too loose to catch a real bug.
GRAD_RTOL = 1e-5


def _world(ws: int, backend: str, gated: bool = False):
    marks = []
    if backend == "nccl":
        marks.append(pytest.mark.skipif(not nccl_devices(ws), reason=f"needs {ws} CUDA devices + NCCL"))
    elif gated:
        marks.append(pytest.mark.skipif(not WORLD8_GLOO, reason="world-8 training on gloo takes ~1.5 min: HYBRIDQ_GLOO_WORLD8=1"))
    return pytest.param((ws, backend), id=f"{backend}-world{ws}", marks=marks)


INVARIANCE_WORLDS = [_world(4, "gloo"), _world(8, "gloo"), _world(4, "nccl"), _world(8, "nccl")]
TRAINING_WORLDS = [_world(4, "gloo"), _world(8, "gloo", gated=True), _world(4, "nccl"), _world(8, "nccl")]

# world size -> FSDP2 / HSDP runs (_jobs.run_training configs) and FSDP2 x TP meshes with their presets
TRAINING = {
    4: [{"preset": p, "grad_rtol": GRAD_RTOL} for p in ("fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd", "fp8_block")]
       + [{"preset": "mxfp8_fwd_nvfp4_bwd", "mesh_shape": [2, 2]},  # bitwise
          {"preset": "fp8_tensorwise", "mesh_shape": [2, 2], "accum": 2}],
    8: [{"preset": p, "grad_rtol": GRAD_RTOL} for p in ("fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd", "fp8_block")]
       + [{"preset": "mxfp8_fwd_nvfp4_bwd", "mesh_shape": [2, 4], "grad_rtol": GRAD_RTOL},
          {"preset": "fp8_tensorwise", "mesh_shape": [2, 4], "accum": 2, "grad_rtol": GRAD_RTOL}],
}
TP_PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8_fwd_nvfp4_bwd"]
TP_MESHES = {4: [(1, 4), (4, 1), (2, 2)], 8: [(2, 4), (4, 2)]}


def _config_id(cfg: dict) -> str:
    mesh = cfg.get("mesh_shape")
    return "-".join([cfg["preset"], "x".join(map(str, mesh)) if mesh else "fsdp"]
                    + (["accum2"] if cfg.get("accum") else []) + (["per-step"] if cfg.get("grad_rtol") else []))


_SPAWNED: dict = {}


def _spawned(what: str, ws: int, backend: str) -> list:
    """One spawn per (what, world, backend), shared by the tests that read it (a failed spawn fails each once)."""
    key = (what, ws, backend)
    if key not in _SPAWNED:
        try:
            if what == "invariance":
                refused = list(_jobs.REFUSED_AT.get(ws, {}))
                _SPAWNED[key] = spawn(_jobs.job_invariance, ws, backend, names=_jobs.invariance_names(ws),
                                      refused=refused)
            else:
                jobs = {"fsdp": (_jobs.job_training, {"configs": TRAINING[ws]})}
                jobs.update({f"tp {m}": (_tp_jobs.tp_fsdp_job, {"mesh_shape": m, "presets": TP_PRESETS})
                             for m in TP_MESHES[ws]})
                _SPAWNED[key] = spawn(job_several, ws, backend, jobs=jobs)
        except Exception as e:  # noqa: BLE001 - kept, so the tests that share the spawn report it without rerunning
            _SPAWNED[key] = e
    if isinstance(_SPAWNED[key], Exception):
        raise _SPAWNED[key]
    return _SPAWNED[key]


@pytest.mark.parametrize("world", INVARIANCE_WORLDS)
def test_gathered_weights_are_the_one_device_quantization_at_every_world_size(world):
    ws, backend = world
    names = _jobs.invariance_names(ws)
    for rank, inv in enumerate(_spawned("invariance", ws, backend)):
        check_invariance(inv, ws, rank, names)


@pytest.mark.parametrize("world", [w for w in INVARIANCE_WORLDS if w.values[0][0] in _jobs.REFUSED_AT])
def test_a_shape_the_format_cannot_shard_at_this_world_size_is_refused_naming_the_rule(world):
    ws, backend = world
    for rank, inv in enumerate(_spawned("invariance", ws, backend)):
        for name in _jobs.REFUSED_AT[ws]:
            msg = inv["refused"][name]
            assert f"cannot be sharded over {ws} ranks" in msg and "multiple of 16 rows" in msg, \
                f"rank {rank} of {ws}, {name}: expected the layout refusal naming the 16-row rule, got: {msg}"


def _training_params():
    return [pytest.param(w.values[0], i, id=f"{w.id}-{_config_id(cfg)}", marks=w.marks)
            for w in TRAINING_WORLDS for i, cfg in enumerate(TRAINING[w.values[0][0]])]


@pytest.mark.parametrize("world,config", _training_params())
def test_fsdp2_and_hsdp_training_match_the_single_process_replay(world, config, summary_table):
    """Losses of every step bitwise; gradients bitwise (2x2) or within GRAD_RTOL (per-step replay); parameters
    bitwise (after the run, or after every step's AdamW on the same gradients)."""
    ws, backend = world
    out = _spawned("training", ws, backend)
    for rank, r in enumerate(out):
        check_training(r["fsdp"]["runs"][config], rank)
    rows = [f"{_config_id(cfg):<44} {run['worst_grad'][0]:.2e}  {run['worst_grad'][1]}"
            for cfg, run in zip(TRAINING[ws], out[0]["fsdp"]["runs"]) if run["worst_grad"]]
    summary_table(f"{backend} world {ws}: worst reduced-gradient error / max |replay| (bound {GRAD_RTOL:.0e})",
                  "\n".join(rows))


def _tp_params():
    return [pytest.param(w.values[0], m, p, id=f"{w.id}-{m[0]}x{m[1]}-{p}", marks=w.marks)
            for w in TRAINING_WORLDS for m in TP_MESHES[w.values[0][0]] for p in TP_PRESETS]


@pytest.mark.parametrize("world,mesh,preset", _tp_params())
def test_fsdp2_over_dp_on_tensor_parallel_weights_matches_the_single_process_run(world, mesh, preset):
    ws, backend = world
    for rank, r in enumerate(_spawned("training", ws, backend)):
        diffs = r[f"tp {mesh}"][preset]
        assert not diffs, f"rank {rank} of {ws}, mesh dp x tp = {mesh}, {preset}:\n" + "\n".join(diffs[:20])
