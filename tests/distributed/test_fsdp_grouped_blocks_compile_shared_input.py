"""Compiled MoE blocks with block-format experts whose grouped weights FSDP2 all-gathers quantized (the MoE training
job's fp8_block setting): the experts' w1 and w3, which read one input, quantize it once per training step ([Note: one
input quantization of block experts in the graph], hybridq/nn/compiled_grouped_blocks.py) -- three input
quantizations per block (x for w1 and w3, h for w2, the experts' output for proj) where each of the four products
quantized its own -- and training stays bit for bit the eager model's."""

from __future__ import annotations

import pytest

from _harness import nccl_devices, spawn
import _shared_input_jobs as jobs

pytestmark = pytest.mark.distributed

# per block: w1 and w3 share x; w2 reads h; proj reads the experts' output
INPUTS_PER_BLOCK = 3
PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]


def _check(r: dict, where: str) -> None:
    assert not r["diffs"], f"{where}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])
    want = INPUTS_PER_BLOCK * r["blocks"]
    assert r["inputs"] == want, \
        f"{where}: one compiled training step ran {r['inputs']} input quantizations, want {want} " \
        f"({INPUTS_PER_BLOCK} per block: w1 and w3 share theirs)"


# every preset on one rank, FP8 blocks on two (each case compiles two models: CPU time)
CASES = [(p, 1) for p in PRESETS] + [("fp8_block", 2)]


@pytest.mark.parametrize("preset, world_size", CASES, ids=[f"{p}-world{w}" for p, w in CASES])
def test_compiled_moe_blocks_quantize_the_block_experts_shared_input_once(preset, world_size):
    """aot_eager (AOTAutograd's min-cut partitioner, as Inductor's), gloo, routed top-2 blocks. (fails before the
    block input quantize op: 4 per block)"""
    for rank, r in enumerate(spawn(jobs.compiled_step_input_quantizations, world_size, "gloo", recipe=preset)):
        _check(r, f"{preset}, rank {rank} of {world_size}")


def _cuda_blocks(preset: str) -> bool:
    import torch
    import hybridq as hq
    from hybridq.nn.grouped_device_blocks import device_path_runs
    from hybridq.nn.grouped_packed import packed_quantizers
    if not nccl_devices(1):
        return False
    d, h = jobs.jobs.D, jobs.jobs.H
    qs = packed_quantizers(hq.GroupedLinear(1, d, h, recipe=preset).expert_quantizers).quantizers
    return all(device_path_runs(qs, torch.device("cuda"), jobs.jobs.E, n, k) for n, k in ((h, d), (d, h), (d, d)))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fp8_block", "mxfp8"])
def test_compiled_moe_blocks_quantize_the_block_experts_shared_input_once_under_inductor_on_cuda(preset):
    """Inductor, NCCL world 1, bf16, the given counts on the device (no residual, no SiLU: what Inductor fuses
    rounds otherwise than eager; see test_fsdp_grouped_compile.py)."""
    if not _cuda_blocks(preset):
        pytest.skip("needs CUDA sm_90 with the grouped block kernels (Triton, the built extension) and NCCL")
    r = spawn(jobs.compiled_step_input_quantizations, 1, "nccl", compiler="inductor", routed=False,
              dtype="bfloat16", recipe=preset)[0]
    _check(r, f"{preset} cuda, inductor")
