"""An eager FP8 block Linear (fp8_block: 1x128 input and gradient blocks, 128x128 weight tiles) whose weight FSDP2
all-gathers quantized runs as the extension's one op `hybridq::fp8_block_linear` (its autograd node in C++, reading the
gathered weight's parts: rowwise in forward, the columnwise part after the backward unshard refilled it), bit for bit
the general path: every step's output, input gradient and parameter gradients, and the parameters after 2 AdamW steps;
with reshard_after_forward True (the columnwise part freed after forward and refilled by the backward unshard) and
False, activation recompute, non-finite inputs and gradients, save_original_input; and the gathers unchanged by the op.
World size 1 on one sm_90 GPU through NCCL (FSDP2's no-collective path, the extension's kernels and block GEMM). The
blocks' widths and tokens are multiples of 128: every GEMM is the block GEMM op's (tests/distributed/_one_op_jobs.py's
job, as test_fsdp_one_op.py runs it for per-tensor FP8)."""

from __future__ import annotations

import functools

import pytest
import torch

from hybridq.nn import float8_graph

from _harness import job_several, nccl_devices, spawn
import _one_op_jobs

ONE_OP, GENERAL = "torch::autograd::CppNode<hybridq::ops::Fp8BlockLinear>", "_LinearFunctionBackward"
DIMS = {"d": 128, "hidden": 256, "tokens": 64}  # (M = 2 x 64 tokens, K and N 128 / 256: the block GEMM's shapes)


def _sm90() -> bool:
    return nccl_devices(1) and float8_graph._cuda_fp8_ready(0) and torch.cuda.get_device_capability(0) == (9, 0)


pytestmark = [pytest.mark.distributed, pytest.mark.gpu, pytest.mark.skipif(
    not _sm90(), reason="needs an sm_90 CUDA device (the block GEMM), the extension and NCCL")]

CASES = {f"fp8_block, reshard_after_forward={ra}": {"case": "fp8_block", "reshard": ra} for ra in (True, False)}
CASES.update({f"fp8_block, {what}, reshard_after_forward={ra}": {"case": "fp8_block", "reshard": ra, what: True}
              for what in ("recompute", "nonfinite", "save_original_input") for ra in (True, False)})


@functools.lru_cache(maxsize=None)
def _runs() -> dict:
    # (one spawn for every case: starting a rank and NCCL costs seconds)
    jobs = {name: (_one_op_jobs.one_op_matches_general_path, {**kw, **DIMS}) for name, kw in CASES.items()}
    return spawn(job_several, 1, "nccl", jobs=jobs)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_block_weight_linears_run_as_the_one_op(name):
    r = _runs()[name]
    assert r["nodes"] == [ONE_OP], f"{name}: the Linears' outputs had the nodes {r['nodes']}, expected the one op's"
    assert r["general_nodes"] == [GENERAL], f"{name}: the general path's run had the nodes {r['general_nodes']}"


@pytest.mark.parametrize("name", list(CASES))
def test_block_one_op_on_gathered_weights_trains_bitwise_as_the_general_path(name):
    r = _runs()[name]
    assert not r["diffs"], f"{name}: the one op differs from the general path:\n" + "\n".join(r["diffs"][:20])


@pytest.mark.parametrize("name", list(CASES))
def test_block_one_op_leaves_the_gathers_as_they_were(name):
    r = _runs()[name]
    c, g = r["counters"], r["general_counters"]
    keys = ("gather_forward", "gather_backward", "payload_reused", "lazy_gathers")
    assert {k: c.get(k, 0) for k in keys} == {k: g.get(k, 0) for k in keys}, \
        f"{name}: the gathers differ from the general path's: one op {c}, general {g}"
    if not CASES[name].get("recompute"):
        # (under activation recompute the recomputed forward asks a direction the backward unshard did not gather:
        # one lazy gather per weight in the first step, then gathered with backward's -- the general path's too)
        assert c.get("lazy_gathers", 0) == 0, f"{name}: a direction was gathered lazily: {c}"
