"""Jobs of test_fsdp_grouped_compile_shared_input.py and test_fsdp_grouped_blocks_compile_shared_input.py: the MoE
blocks of _grouped_compile_jobs.py (SwiGLU experts w1 / w3 / w2 and a GroupedLinear proj, per-tensor FP8 or a block
format, weights FSDP2 gathered quantized), compiled per block, against the same model run eagerly; what differed, and
how many input quantizations one compiled training step runs ([Note: one input quantization in the graph],
hybridq/nn/compiled_grouped.py; [Note: one input quantization of block experts in the graph],
compiled_grouped_blocks.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import hybridq
from hybridq.gemm import jagged_fp8_kernels
from hybridq.nn.grouped_packed import BLOCKS, packed_quantizers

import _grouped_compile_jobs as jobs
from _shared_input import count_block_input_quantizations  # (tests/: on the path once _grouped_compile_jobs is)

RECIPE = "fp8_tensorwise"


def _count_input_quantizations(device: torch.device, recipe: str = RECIPE) -> list[str]:
    """The names of the input quantizations the experts run from now on: per-tensor FP8, the jagged kernels' (one
    object for every shape here); block formats, the device-count block path's (`grouped_device_blocks._quantize`)."""
    layer = hybridq.GroupedLinear(1, jobs.D, jobs.H, recipe=recipe)
    if packed_quantizers(layer.expert_quantizers).kind == BLOCKS:
        return count_block_input_quantizations()  # (this process only: spawned for the job)
    q = layer.expert_quantizers[0]
    kernels = jagged_fp8_kernels(device, jobs.D, jobs.H, q)
    assert kernels is not None and all(jagged_fp8_kernels(device, k, n, q) is kernels
                                       for k, n in ((jobs.H, jobs.D), (jobs.D, jobs.D)))
    seen: list[str] = []
    real = kernels.quantize

    def quantize(q, x2d, groups, columnwise, name):
        if name.startswith("input of"):
            seen.append(name)
        return real(q, x2d, groups, columnwise, name)

    kernels.quantize = quantize  # (this process only: spawned for the job)
    return seen


def compiled_step_input_quantizations(rank, world_size, device, compiler="aot_eager", routed=True, dtype="float32",
                                      steps=2, recipe=RECIPE):
    """`steps` AdamW steps of an eager and a compiled copy (`recipe`; bit for bit: `diffs`), then one more compiled
    training step whose input quantizations are counted (`inputs`); `blocks`: the model's blocks."""
    dt = getattr(torch, dtype)
    act = F.silu if routed else jobs._identity  # (Inductor may round a fused SiLU otherwise than eager)

    def batch(step):
        x = torch.randn(2, 16, jobs.D, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)
        if routed:
            return x, None
        return x.reshape(-1, jobs.D), torch.tensor([7, 0, 16 + step, 9 - step], device=device)

    torch.manual_seed(0)
    base = jobs.Net(routed, act).to(device)
    torch._dynamo.reset()
    eager = jobs._shard(copy.deepcopy(base), recipe, device, world_size, dt)
    compiled = jobs._shard(copy.deepcopy(base), recipe, device, world_size, dt, compiler)
    diffs = jobs._train_both(eager, compiled, batch, steps)
    seen = _count_input_quantizations(device, recipe)
    x, splits = batch(steps)
    x = x.to(dt).requires_grad_()
    y = compiled(x) if splits is None else compiled(x, splits)
    y.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"diffs": diffs, "inputs": len(seen), "blocks": len(compiled.blocks)}
