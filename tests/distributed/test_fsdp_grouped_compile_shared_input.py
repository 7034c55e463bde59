"""Compiled MoE blocks whose grouped weights FSDP2 all-gathers quantized (the MoE training job's setting): the
experts' w1 and w3, which read one input, quantize it once per training step ([Note: one input quantization in the
graph], hybridq/nn/compiled_grouped.py) -- three input quantizations per block (x for w1 and w3, h for w2, the
experts' output for proj) where each of the four products quantized its own -- and training stays bit for bit the
eager model's (which shares the same way)."""

from __future__ import annotations

import pytest
import torch

import hybridq as hq

from _harness import nccl_devices, spawn
import _shared_input_jobs as jobs

pytestmark = pytest.mark.distributed

# per block: w1 and w3 share x; w2 reads h; proj reads the experts' output
INPUTS_PER_BLOCK = 3


def _check(r: dict, where: str) -> None:
    assert not r["diffs"], f"{where}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])
    want = INPUTS_PER_BLOCK * r["blocks"]
    assert r["inputs"] == want, \
        f"{where}: one compiled training step ran {r['inputs']} input quantizations, want {want} " \
        f"({INPUTS_PER_BLOCK} per block: w1 and w3 share theirs)"


@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_moe_blocks_quantize_the_experts_shared_input_once(world_size):
    """aot_eager (AOTAutograd's min-cut partitioner, as Inductor's), gloo, routed top-2 blocks. (fails before the
    input quantize op: 4 per block)"""
    for rank, r in enumerate(spawn(jobs.compiled_step_input_quantizations, world_size, "gloo")):
        _check(r, f"rank {rank} of {world_size}")


def _cuda_jagged() -> bool:
    from hybridq.gemm import jagged_fp8_kernels
    q = hq.GroupedLinear(1, 64, 64, recipe="fp8_tensorwise").expert_quantizers[0]
    return nccl_devices(1) and jagged_fp8_kernels(torch.device("cuda"), 64, 96, q) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_jagged(), reason="needs a CUDA device with the jagged kernels (sm_90, Triton, the "
                                               "built extension) and NCCL")
def test_compiled_moe_blocks_quantize_the_experts_shared_input_once_under_inductor_on_cuda():
    """Inductor, NCCL world 1, bf16, the given counts on the device (no residual, no SiLU: what Inductor fuses
    rounds otherwise than eager; see test_fsdp_grouped_compile.py)."""
    r = spawn(jobs.compiled_step_input_quantizations, 1, "nccl", compiler="inductor", routed=False,
              dtype="bfloat16")[0]
    _check(r, "cuda, inductor")
