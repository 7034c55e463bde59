"""Tensor-parallel hybridq Linears (hybridq's ColwiseParallel / RowwiseParallel / PrepareModuleInput, with and
without sequence parallelism; under FSDP2 with quantized all-gathers on a 2-D mesh too) inside a block compiled
with `fullgraph=True` (distributed/compiled_tp.py), gloo ranks.

Oracles, per case (two SGD steps):
- the compile raises nothing under fullgraph=True (a graph break would) and the graphs hold one
  `hybridq::tp_linear_forward` per tensor-parallel Linear;
- outputs, input gradients, every parameter's gradient (this rank's piece) and the parameters after the steps are
  bit for bit the eager tensor-parallel block's;
- at the first step, outputs and gradients (eager and compiled) are within 1e-5 of the largest magnitude of the
  single-process hybridq block's (the row-parallel partial sums change the order of summation, nothing else does;
  later steps start from parameters that differ by as much). The ranks' pieces
  differ 8x in magnitude (input rows, weight rows / columns), so a piece quantized with its own statistics instead
  of the group's (per-tensor FP8, NVFP4's global scale) would land on other values and fail this.
"""

from __future__ import annotations

import functools

import pytest

import hybridq
from _harness import job_several, spawn
import _tp_compile_jobs

pytestmark = pytest.mark.distributed


def _tp_takes(preset: str) -> bool:
    """Whether tensor parallelism takes the preset (it refuses quantizers with state: delayed scaling)."""
    r = hybridq.recipe(preset)
    return not any(r.quantizer(hybridq.Role("linear", t, "x")).is_stateful for t in ("input", "weight", "grad_output"))


PRESETS = [p for p in hybridq.preset_names() if _tp_takes(p)]
BSH = (2, 256, 128)  # [B, S, H], sequence dim 1: each rank holds 2 runs of 128 tokens
SBH = (96, 1, 128)  # [S, B, H], sequence dim 0: the rank boundary at token 48 splits 32- and 128-row blocks
REPLICATED = (4, 32, 128)

# (block, preset, backward override, save_original_input, input shape, sequence dim or None, dynamo backend)
CASES = ([("mlp", p, None, False, BSH, 1, "aot_eager") for p in PRESETS]
         + [("residual", p, None, False, REPLICATED, None, "aot_eager") for p in PRESETS]
         + [("mlp", "fp8_tensorwise", None, False, SBH, 0, "aot_eager"),
            ("mlp", "mxfp8", None, False, SBH, 0, "aot_eager"),
            ("row_replicated", "fp8_tensorwise", None, False, REPLICATED, None, "aot_eager"),
            ("attention", "fp8_tensorwise", None, False, (2, 64, 128), 1, "aot_eager"),
            ("mlp", "fp8_tensorwise", "high_precision", False, BSH, 1, "aot_eager"),
            ("mlp", "nvfp4", "dequantized", False, BSH, 1, "aot_eager"),
            ("mlp", "mxfp8", None, True, BSH, 1, "aot_eager"),
            ("chain", "fp8_tensorwise", None, False, SBH, 0, "inductor"),
            ("chain", "mxfp8", None, False, REPLICATED, None, "inductor")])
# eager only: a column-parallel layer reading a replicated input computes a partial sum of the input gradient on
# each rank, which must be all-reduced (the eager path once handed each rank its partial sum as the gradient)
EAGER_CASES = [("residual", p, None, False, REPLICATED, None, None) for p in ("fp8_tensorwise", "mxfp8")]
TP_LINEARS = {"mlp": 3, "residual": 3, "attention": 4, "chain": 2, "row_replicated": 1}


# FSDP2 (apply_hybrid_fsdp: quantized all-gathers over "dp") on tensor-parallel pieces: mesh (dp, tp) -> presets
FSDP_TP = {(1, 2): ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"],
           (2, 2): ["fp8_tensorwise"]}


@functools.lru_cache(maxsize=None)
def _report() -> tuple:
    """Per rank {"tp": {case_key: result}, "fsdp_tp": {preset: result} (mesh (1, 2)), "copied": {preset: result},
    "unsharded": result, "non_finite eager" / "non_finite compiled": result}; every 2-rank job in one spawn."""
    return tuple(spawn(job_several, 2, "gloo", jobs={
        "tp": (_tp_compile_jobs.compiled_tp_matches_eager, {"cases": CASES + EAGER_CASES}),
        "fsdp_tp": (_tp_compile_jobs.fsdp_tp_compiled_matches_eager,
                    {"presets": FSDP_TP[(1, 2)], "mesh_shape": (1, 2)}),
        "copied": (_tp_compile_jobs.fsdp_tp_compiled_matches_eager,
                   {"presets": ["fp8_tensorwise"], "mesh_shape": (1, 2), "copied": True}),
        "unsharded": (_tp_compile_jobs.unsharded_hybrid_weights_compile, {}),
        **{f"non_finite {how}": (_tp_compile_jobs.replicated_input_gradient_keeps_non_finite, {"compiled": compiled})
           for how, compiled in (("eager", False), ("compiled", True))}}))


@functools.lru_cache(maxsize=None)
def _fsdp_tp_report(mesh: tuple) -> tuple:
    if mesh == (1, 2):
        return tuple(r["fsdp_tp"] for r in _report())
    return tuple(spawn(_tp_compile_jobs.fsdp_tp_compiled_matches_eager, mesh[0] * mesh[1], "gloo",
                       presets=FSDP_TP[mesh], mesh_shape=mesh))


def _results(case: tuple):
    key = _tp_compile_jobs.case_key(case)
    return [(rank, rep["tp"][key]) for rank, rep in enumerate(_report())]


def _id(case: tuple) -> str:
    block, preset, override, soi, _, seq_dim, compiler = case
    sp = "no_sp" if seq_dim is None else f"sp{seq_dim}"
    return "-".join(str(v) for v in (block, preset, override or "", "soi" if soi else "", sp, compiler or "eager")
                    if v)


def test_the_case_list_has_the_tensor_parallel_presets():
    assert {"fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"} <= set(PRESETS), PRESETS


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_tensor_parallel_linears_compile_into_one_graph(case):
    for rank, r in _results(case):
        assert r["error"] is None, f"rank {rank}: compiling with fullgraph=True failed: {r['error']}"
        assert r["tp_ops"] == TP_LINEARS[case[0]], \
            f"rank {rank}: {r['tp_ops']} tensor-parallel Linear ops in the graphs, expected {TP_LINEARS[case[0]]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_compiled_tensor_parallel_step_is_bitwise_the_eager_one(case):
    for rank, r in _results(case):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert not r["diffs"], f"rank {rank}:\n" + "\n".join(r["diffs"][:20])


@pytest.mark.parametrize("case", EAGER_CASES, ids=_id)
def test_eager_column_parallel_layer_on_a_replicated_input_gives_the_whole_input_gradient(case):
    for rank, r in _results(case):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert not r["diffs"], f"rank {rank}:\n" + "\n".join(r["diffs"][:20])


@pytest.mark.parametrize("mesh,preset", [(m, p) for m, ps in FSDP_TP.items() for p in ps],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_fsdp2_gathered_tensor_parallel_pieces_compile_bitwise_the_eager_step(mesh, preset):
    """The weight pieces FSDP2 gathers quantized enter the graph as their handles: no graph break
    (fullgraph=True), one op per Linear, bitwise the eager step."""
    for rank, rep in enumerate(_fsdp_tp_report(mesh)):
        r = rep[preset]
        assert r["error"] is None, f"rank {rank}: compiling with fullgraph=True failed: {r['error']}"
        assert r["tp_ops"] == 3, f"rank {rank}: {r['tp_ops']} tensor-parallel Linear ops in the graphs, expected 3"
        assert not r["diffs"], f"rank {rank}:\n" + "\n".join(r["diffs"][:20])


def test_a_deep_copy_of_tensor_parallel_layers_compiles_on_its_own_after_the_original_is_freed():
    """copy.deepcopy of a model after the TP styles (before fully_shard), the original dropped: the copy's layers
    name themselves for the compiled path (they once named the original's, and the compile failed once it was freed)
    -- no graph break, bitwise the eager step."""
    for rank, rep in enumerate(_report()):
        r = rep["copied"]["fp8_tensorwise"]
        assert r["error"] is None, f"rank {rank}: compiling the copy with fullgraph=True failed: {r['error']}"
        assert r["tp_ops"] == 3, f"rank {rank}: {r['tp_ops']} tensor-parallel Linear ops in the graphs, expected 3"
        assert not r["diffs"], f"rank {rank}:\n" + "\n".join(r["diffs"][:20])


def test_tensor_parallel_pieces_prepared_for_fsdp2_but_not_sharded_stay_eager_in_the_graph():
    """apply_hybrid_fsdp and the TP styles without fully_shard: nothing gathers the pieces, so the layers stay graph
    breaks (dynamo cannot wrap the sharded pieces) and the compiled block gives the eager output."""
    for rank, rep in enumerate(_report()):
        r = rep["unsharded"]
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["graph_breaks"] > 0 and r["diff"] is None, f"rank {rank}: {r}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_replicated_input_gradient_all_reduce_keeps_non_finite_values_of_every_rank(compiled):
    """The input gradient's all-reduce of a column-parallel layer on a replicated input: a NaN in grad_output on the
    last rank and an inf on the first reach every rank's input gradient (row 1 NaN, row 2 inf), never made finite."""
    for rank, rep in enumerate(_report()):
        r = rep[f"non_finite {'compiled' if compiled else 'eager'}"]
        assert r["nan"] == [False, True, False, False], f"rank {rank}: NaN rows of the input gradient {r['nan']}"
        assert r["inf"] == [False, False, True, False], f"rank {rank}: inf rows of the input gradient {r['inf']}"
