"""One hybridq layer under FSDP2 with the quantized all-gather, as the grouped / pending-direction jobs build it."""

from __future__ import annotations

import torch

import hybridq
from hybridq.distributed import apply_hybrid_fsdp


class Root(torch.nn.Module):
    """FSDP2's root around the layer: the layer's own unit then reshards after forward, so backward gathers again
    (FSDP2 keeps the root's parameters unsharded from forward to backward)."""

    def __init__(self, lin: torch.nn.Module):
        super().__init__()
        self.lin = lin

    def forward(self, *args):
        return self.lin(*args)


def spread_expert_magnitudes_(lin: hybridq.GroupedLinear) -> None:
    """Each expert at its own magnitude (1e-2 .. 1e2): an expert quantized with another's statistics would differ."""
    e = lin.weight.shape[0]
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-2, 2, e).view(e, 1, 1))


def shard_under_root(lin: torch.nn.Module, preset: str, device, world_size: int) -> Root:
    """apply_hybrid_fsdp, then fully_shard of the layer (bf16 params, fp32 reduce) and of a Root around it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lin.to(device)
    apply_hybrid_fsdp(lin, hybridq.recipe(preset), on_incompatible="error")
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(lin, mesh=mesh, mp_policy=mp)
    root = Root(lin)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    return root
