"""A compiled block whose FP8 Linears (current scaling: per-tensor, or fp8_block's 1x128 / 128x128 blocks) FSDP2
all-gathers quantized: the gathered ops' bodies run float8_graph's fast path (the eager fast path's quantize ops and
GEMMs), not linear_function's general path, and give bit for bit the general path's results and the eager model's
(losses, gradients, parameters after 2 AdamW steps)."""

from __future__ import annotations

import pytest

from _harness import job_several, nccl_devices, spawn
import _gathered_fast_jobs

pytestmark = pytest.mark.distributed


def _check(r: dict, where: str) -> None:
    on, off = r["True"], r["False"]
    for run in (on, off):
        assert run["graph_breaks"] == 0 and run["linear_ops"] >= 2, f"{where}: the Linears left the graph: {run}"
    assert on["forward_and_saved"] == on["linear_grads"] == 0, \
        f"{where}: the gathered ops' bodies ran the general path with the fast path on: {on}"
    assert on["plans_made"] == 0, f"{where}: the gathered ops planned calls again after the first step: {on}"
    # (the counting sees the general path when it runs: the fast path's check above can fail)
    assert off["forward_and_saved"] > 0 and off["linear_grads"] > 0, \
        f"{where}: the general path was not counted with the fast path off: {off}"
    assert not r["diffs"], f"{where}: fast path differs:\n" + "\n".join(r["diffs"][:20])


def test_gathered_per_tensor_fp8_ops_run_the_fast_path_cpu():
    """gloo, world size 1, the CPU reference casts and emulated GEMMs: aot_eager, with save_original_input too, and
    Inductor with no activation between the Linears (it may round element-wise math differently from eager)."""
    job = _gathered_fast_jobs.gathered_ops_fast_path
    out = spawn(job_several, 1, "gloo", jobs={
        "aot_eager": (job, {}),
        "aot_eager, save_original_input": (job, {"save_original_input": True}),
        "inductor": (job, {"compiler": "inductor", "act": "identity"})})
    for name, r in out[0].items():
        _check(r, f"gloo, {name}")


# fp8_block: widths whose 128x128 weight tiles are whole on each of 2 ranks
_BLOCK = {"preset": "fp8_block", "d": 256, "hidden": 256}


def test_gathered_fp8_block_ops_run_the_fast_path_cpu():
    """gloo, world size 1, the block reference casts and emulated GEMMs: aot_eager, with save_original_input too, and
    Inductor with no activation between the Linears."""
    job = _gathered_fast_jobs.gathered_ops_fast_path
    out = spawn(job_several, 1, "gloo", jobs={
        "aot_eager": (job, _BLOCK),
        "aot_eager, save_original_input": (job, {**_BLOCK, "save_original_input": True}),
        "inductor": (job, {**_BLOCK, "compiler": "inductor", "act": "identity"})})
    for name, r in out[0].items():
        _check(r, f"gloo, fp8_block, {name}")
        assert r["True"]["python_phases"] > 0, f"gloo, fp8_block, {name}: the CPU ran no Python phase: {r['True']}"


def test_gathered_fp8_block_ops_run_the_fast_path_on_two_ranks_cpu():
    """gloo, world size 2: each rank's gathered weight is the whole tile grid of the two shards."""
    job = _gathered_fast_jobs.gathered_ops_fast_path
    out = spawn(job_several, 2, "gloo", jobs={"aot_eager": (job, _BLOCK)})
    for rank, r in enumerate(out):
        _check(r["aot_eager"], f"gloo rank {rank}/2, fp8_block, aot_eager")


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device + NCCL")
def test_gathered_per_tensor_fp8_ops_run_the_fast_path_gpu():
    """nccl, world size 1: the extension's casts and torch._scaled_mm, Inductor around the ops."""
    out = spawn(_gathered_fast_jobs.gathered_ops_fast_path, 1, "nccl", compiler="inductor", act="identity")
    _check(out[0], "nccl, inductor")


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device + NCCL")
def test_gathered_fp8_block_ops_run_the_fast_path_gpu():
    """nccl, world size 1, fp8_block on sm_90: the C++ phase ops (`hybridq::fp8_block_linear_fprop` / `_grads`: 128
    rows, every GEMM the extension's block GEMM), no Python phase, Inductor around the ops, bitwise the general path
    and the eager model."""
    import torch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block GEMM op runs on sm_90")
    out = spawn(_gathered_fast_jobs.gathered_ops_fast_path, 1, "nccl", compiler="inductor", act="identity",
                tokens=64, **_BLOCK)
    _check(out[0], "nccl, fp8_block, inductor")
    assert out[0]["True"]["python_phases"] == 0, f"the C++ phase ops did not run every phase: {out[0]['True']}"
