"""torch.compile of blocks whose hybridq Linears FSDP2 all-gathers quantized (apply_hybrid_fsdp): each block
compiled before fully_shard (torchtitan's per-block compile, train.py --compile). The gathered weight enters the
graph as its handle (nn/compiled_linear.py), so a block compiles without a graph break, and training computes bit
for bit what the same model computes eagerly: losses and every gradient of 2 AdamW steps, the parameters after
them, world sizes 1 and 2 (CPU gloo)."""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn

import hybridq as hq
from hybridq.distributed import apply_hybrid_fsdp

from _harness import backends, job_several, spawn
import _compile_jobs

pytestmark = pytest.mark.distributed


def _fsdp_takes(preset: str) -> bool:
    """Whether apply_hybrid_fsdp takes the preset (delayed scaling and formats without FSDP hooks are refused)."""
    try:
        apply_hybrid_fsdp(nn.Sequential(nn.Linear(128, 128)), preset)
    except (ValueError, TypeError, hq.RecipeError):
        return False
    return True


FSDP_PRESETS = [p for p in hq.preset_names() if _fsdp_takes(p)]


def _check(out: dict, rank: int, world_size: int, linear_ops_at_least: int) -> None:
    for preset, r in out.items():
        where = f"{preset}, rank {rank} of {world_size}"
        assert r["graph_breaks"] == 0, f"{where}: {r['graph_breaks']} graph breaks: {r['break_reasons']}"
        assert r["linear_ops"] >= linear_ops_at_least, \
            f"{where}: {r['linear_ops']} hybridq Linear ops in the compiled graphs, expected >= {linear_ops_at_least}"
        assert not r["diffs"], f"{where}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])


def test_the_case_list_has_fsdp_presets():
    assert {"fp8_tensorwise", "mxfp8", "nvfp4"} <= set(FSDP_PRESETS), FSDP_PRESETS


@functools.lru_cache(maxsize=None)
def _two_ranks(backend: str) -> tuple:
    """Both 2-rank jobs in one spawn (each resets dynamo per preset): {"fsdp": ..., "tp": ...} per rank."""
    return tuple(spawn(job_several, 2, backend, jobs={
        "fsdp": (_compile_jobs.compiled_matches_eager, {"presets": FSDP_PRESETS}),
        "tp": (_compile_jobs.tensor_parallel_compiled_matches_eager, {"presets": ["mxfp8", "fp8_tensorwise"]})}))


@pytest.mark.parametrize("backend", backends())
def test_compiled_blocks_with_quantized_gathers_two_ranks(backend):
    """Every preset apply_hybrid_fsdp takes: no graph break, the Linears in the graphs, bitwise eager."""
    for rank, o in enumerate(_two_ranks(backend)):
        _check(o["fsdp"], rank, 2, linear_ops_at_least=2)


@pytest.mark.parametrize("backend", backends())
def test_compiled_blocks_with_quantized_gathers_one_rank_and_inductor(backend):
    """World size 1 (FSDP2's no-collective path), the default backend (Inductor) around the ops, and the weights
    kept gathered from forward to backward (reshard_after_forward=False). No activation between the Linears:
    Inductor may round element-wise math differently from eager."""
    presets = ["mxfp8_fwd_nvfp4_bwd", "fp8_tensorwise", "fp8_fwd_high_precision_bwd"]
    job = _compile_jobs.compiled_matches_eager
    out = spawn(job_several, 1, backend, jobs={
        "inductor": (job, {"presets": presets, "compiler": "inductor", "act": "identity"}),
        "kept_gathered": (job, {"presets": ["mxfp8"], "reshard": False})})
    for o in out[0].values():
        _check(o, 0, 1, linear_ops_at_least=2)


@pytest.mark.parametrize("backend", backends())
def test_tensor_parallel_linears_compile_into_the_block(backend):
    """Tensor-parallel Linears (hybridq's styles: DTensor weights, quantized sequence all-gathers) are traced as
    their custom ops (distributed/compiled_tp.py; test_tp_compile.py covers them): no graph break, and the block
    computes bit for bit what it computes eagerly."""
    for rank, o in enumerate(_two_ranks(backend)):
        for preset, r in o["tp"].items():
            where = f"{preset}, rank {rank}"
            assert r["graph_breaks"] == 0, f"{where}: {r['graph_breaks']} graph breaks: {r['break_reasons']}"
            assert not r["diffs"], f"{where}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])
