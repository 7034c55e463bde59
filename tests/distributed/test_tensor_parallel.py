"""Tensor and sequence parallelism with hybridq's styles, in spawned gloo process groups (2 ranks).

Oracles:
- every quantized operand a rank hands to an fprop GEMM is, bit for bit, its piece of the single-process
  model's operand (column-parallel: the whole gathered input and this rank's weight rows; row-parallel: this
  rank's K columns of input and weight);
- outputs, input gradients, parameter gradients and parameters after two SGD steps equal the single-process
  hybridq model's within 1e-5 of the largest magnitude (the row-parallel layer sums partial products, which
  changes the summation order; everything else is computed identically);
- the sequence-parallel all-gathers carry the quantized bytes (uint8 payloads), once per phase per input read by
  several layers.
"""

from __future__ import annotations

import pytest
import torch

import hybridq
from hybridq import Role
from hybridq.distributed import sequence_gather_bytes

from _harness import spawn
import _tp_jobs

pytestmark = pytest.mark.distributed

PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block_fwd_mxfp8_bwd",
           "fp8_fwd_high_precision_bwd"]
BSH = (2, 256, 128)  # [B, S, H], sequence dim 1: each rank holds 2 runs of 128 tokens
SBH = (96, 1, 128)  # [S, B, H], sequence dim 0: rank boundary at token 48 splits 32- and 128-row blocks


def _cases():
    cases = [("mlp", p, None, False, BSH, 1) for p in PRESETS]
    cases += [("mlp", p, None, False, SBH, 0) for p in PRESETS]
    cases += [("mlp", p, o, False, BSH, 1) for p in ("fp8_tensorwise", "mxfp8", "nvfp4")
              for o in ("high_precision", "dequantized")]
    cases += [("mlp", p, None, True, BSH, 1) for p in ("mxfp8", "fp8_block_fwd_mxfp8_bwd")]
    cases += [("attention", p, None, False, (2, 64, 128), 1) for p in ("fp8_tensorwise", "mxfp8", "nvfp4")]
    return cases


@pytest.fixture(scope="module")
def block_report():
    return spawn(_tp_jobs.tp_block_job, 2, "gloo", cases=_cases())


@pytest.mark.parametrize("case", range(len(_cases())), ids=lambda i: "-".join(map(str, _cases()[i][:4])))
def test_tensor_parallel_block_matches_the_single_process_model(block_report, case):
    block, p, o, soi, shape, sd = _cases()[case]
    key = f"{block}/{p}/{o}/soi={soi}/{tuple(shape)}/seq{sd}"
    for rank, rep in enumerate(block_report):
        assert not rep[key]["diffs"], f"rank {rank}:\n" + "\n".join(rep[key]["diffs"])


@pytest.mark.parametrize("case", range(len(_cases())), ids=lambda i: "-".join(map(str, _cases()[i][:4])))
def test_the_sequence_all_gathers_carry_the_tables_bytes_once_per_input_and_phase(block_report, case):
    """Per step: one forward gather for the layers reading the input; with the per-phase plan one backward gather
    of the ranks' own forms for all of them too; with backward_override="high_precision" or save_original_input
    each layer gathers the rows again in backward."""
    block, p, o, soi, shape, sd = _cases()[case]
    key = f"{block}/{p}/{o}/soi={soi}/{tuple(shape)}/seq{sd}"
    gathers = [tuple(g) for g in block_report[0][key]["gathers"]]
    q = _tp_jobs.deterministic_recipe(p, o).quantizer(Role("linear", "input"))
    want = sequence_gather_bytes(q, shape, sd, 2, backward_override=o, save_original_input=soi, dtype=torch.float32)
    # (the recorder gives elements: fp32 rows, uint8 payloads)
    step = [("torch.float32", want.forward // 4) if want.forward_sends == "high_precision"
            else ("torch.uint8", want.forward)]
    if want.backward_sends == "high_precision":  # each layer gathers its rows again
        step += [("torch.float32", want.backward // 4)] * len(_tp_jobs.BLOCKS[block][2])
    elif want.backward:  # one gather of the ranks' own forms for the layers reading the input
        step += [("torch.uint8", want.backward)]
    assert gathers == step * 2, f"{key}: gathers {gathers}, table {want}"


def test_sequence_gather_bytes_per_format():
    """Per-tensor FP8 sends its rowwise form in forward and again in backward (its columnwise form is the
    transpose), keeping only this rank's rows for wgrad; NVFP4 about half of bf16 over both phases; MXFP8's two
    directions (33/32 of bf16 each) are more bytes than the bf16 rows, which it sends instead, in forward only."""
    shape = (1, 4096, 4096)
    r = {p: sequence_gather_bytes(hybridq.recipe(p).quantizer(Role("linear", "input")), shape)
         for p in ("fp8_tensorwise", "mxfp8", "nvfp4")}
    t = r["fp8_tensorwise"]
    assert (t.forward_sends, t.backward_sends, t.ratio) == ("rowwise", "rowwise", 1.0), t
    assert t.kept == t.bf16_kept // 2 // 2 + 4, t  # (this rank's rows in 8 bits, and the scale)
    assert r["mxfp8"].forward_sends == "high_precision" and r["mxfp8"].ratio == 1.0 and not r["mxfp8"].backward, r
    assert r["mxfp8"].quantized_payload / r["mxfp8"].bf16 == pytest.approx(33 / 32), r
    assert r["nvfp4"].backward_sends == "columnwise" and r["nvfp4"].ratio == pytest.approx(9 / 16), r


@pytest.fixture(scope="module")
def errors():
    return spawn(_tp_jobs.tp_errors_job, 2, "gloo")[0]


def test_torch_stock_styles_on_a_hybridq_linear_name_the_hybridq_style(errors):
    msg = errors["stock_style"]
    assert msg.startswith("NotImplementedError") and "hybridq.distributed.ColwiseParallel" in msg, msg


def test_a_k_split_inside_a_block_is_refused_at_parallelize_time(errors):
    msg = errors["k_split"]
    assert msg.startswith("FormatShapeError") and "MXFP8" in msg and "weight of" in msg and "32" in msg, msg


def test_delayed_scaling_is_refused_under_tensor_parallelism(errors):
    msg = errors["delayed"]
    assert msg.startswith("RecipeError") and "delayed scaling" in msg, msg  # (a ValueError: a rule of the recipe)


def test_sequence_runs_that_split_a_block_are_refused_naming_the_rule(errors):
    msg = errors["runs"]
    assert msg.startswith("FormatShapeError") and "24 rows" in msg and "32" in msg, msg


MESHES = {(2, 2): ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"],
          (1, 2): ["fp8_tensorwise", "nvfp4"], (2, 1): ["mxfp8", "nvfp4"]}


@pytest.fixture(scope="module")
def fsdp_tp_reports():
    return {m: spawn(_tp_jobs.tp_fsdp_job, m[0] * m[1], "gloo", mesh_shape=m, presets=p) for m, p in MESHES.items()}


@pytest.mark.parametrize("mesh,preset", [(m, p) for m, ps in MESHES.items() for p in ps],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_fsdp2_over_dp_on_tensor_parallel_weights_matches_the_single_process_run(fsdp_tp_reports, mesh, preset):
    """Linear weight gradients and operands bitwise; the norm (summed over other ranks' tokens) and the
    parameters after two steps within 1e-5 of the largest magnitude."""
    for rank, rep in enumerate(fsdp_tp_reports[mesh]):
        assert not rep[preset], f"rank {rank}:\n" + "\n".join(rep[preset])
