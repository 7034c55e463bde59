"""A compiled block whose per-tensor FP8 Linears (current scaling) FSDP2 all-gathers quantized: the gathered ops'
bodies run float8_graph's fast path (the eager fast path's quantize ops and GEMMs), not linear_function's general
path, and give bit for bit the general path's results and the eager model's (losses, gradients, parameters after 2
AdamW steps)."""

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


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device + NCCL")
def test_gathered_per_tensor_fp8_ops_run_the_fast_path_gpu():
    """nccl, world size 1: the extension's casts and torch._scaled_mm, Inductor around the ops."""
    out = spawn(_gathered_fast_jobs.gathered_ops_fast_path, 1, "nccl", compiler="inductor", act="identity")
    _check(out[0], "nccl, inductor")
