"""An eager per-tensor FP8 Linear whose weight FSDP2 all-gathers quantized runs as the extension's one op
`hybridq::fp8_linear` (its autograd node in C++, reading the gathered weight's parts: rowwise in forward, the
columnwise part after the backward unshard refilled it), bit for bit the general path: every step's output, input
gradient and parameter gradients, and the parameters after 2 AdamW steps; with reshard_after_forward True (the
columnwise part freed after forward and refilled by the backward unshard) and False, activation recompute, non-finite
inputs and gradients, save_original_input; and the gathers (the forward payload reused by the backward unshard)
unchanged by the op. World size 1 on one GPU through NCCL (FSDP2's no-collective path, the extension's kernels)."""

from __future__ import annotations

import functools

import pytest

from hybridq.nn import float8_graph

from _harness import job_several, nccl_devices, spawn
import _one_op_jobs

ONE_OP, GENERAL = "torch::autograd::CppNode<hybridq::ops::Fp8Linear>", "_LinearFunctionBackward"

pytestmark = [pytest.mark.distributed, pytest.mark.gpu, pytest.mark.skipif(
    not (nccl_devices(1) and float8_graph._cuda_fp8_ready(0)),
    reason="needs a CUDA device with FP8 tensor cores, the extension and NCCL")]

# the per-tensor FP8 format cases the GEMM takes in every role (E5M2 x E5M2 has none), the preset, and casts that
# all differ; each with the weight resharded after forward (refilled by the backward unshard) and kept
CASES = {f"{case}, reshard_after_forward={ra}": {"case": case, "reshard": ra}
         for case in ("fp8_tensorwise", "fp8_e4m3", "fp8_e4m3_pow2", "mixed") for ra in (True, False)}
CASES.update({f"fp8_tensorwise, {what}, reshard_after_forward={ra}": {"reshard": ra, what: True}
              for what in ("recompute", "nonfinite", "save_original_input") for ra in (True, False)})


@functools.lru_cache(maxsize=None)
def _runs() -> dict:
    # (one spawn for every case: starting a rank and NCCL costs seconds)
    jobs = {name: (_one_op_jobs.one_op_matches_general_path, kw) for name, kw in CASES.items()}
    return spawn(job_several, 1, "nccl", jobs=jobs)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_weight_linears_run_as_the_one_op(name):
    r = _runs()[name]
    assert r["nodes"] == [ONE_OP], f"{name}: the Linears' outputs had the nodes {r['nodes']}, expected the one op's"
    assert r["general_nodes"] == [GENERAL], f"{name}: the general path's run had the nodes {r['general_nodes']}"


@pytest.mark.parametrize("name", list(CASES))
def test_one_op_on_gathered_weights_trains_bitwise_as_the_general_path(name):
    r = _runs()[name]
    assert not r["diffs"], f"{name}: the one op differs from the general path:\n" + "\n".join(r["diffs"][:20])


@pytest.mark.parametrize("name", list(CASES))
def test_one_op_leaves_the_gathers_as_they_were(name):
    """The same all-gathers as on the general path; resharded after forward, the backward unshard reuses the
    forward's payload (the weight is unchanged in between), and the columnwise part the op reads is gathered with
    backward's, never lazily."""
    r = _runs()[name]
    c, g = r["counters"], r["general_counters"]
    keys = ("gather_forward", "gather_backward", "payload_reused", "lazy_gathers")
    assert {k: c.get(k, 0) for k in keys} == {k: g.get(k, 0) for k in keys}, \
        f"{name}: the gathers differ from the general path's: one op {c}, general {g}"
    if CASES[name]["reshard"]:
        assert c.get("payload_reused", 0) == c["gather_backward"] > 0, \
            f"{name}: the backward unshards did not reuse the forward payload: {c}"
    assert c.get("lazy_gathers", 0) == 0, f"{name}: a direction was gathered lazily: {c}"
