"""Jobs of test_fsdp_live_tensors.py: how many tensors the process holds after each training step."""

from __future__ import annotations

import gc
import warnings

import torch
import torch.nn as nn

from hybridq import apply_hybrid_fsdp, precompute_scales

WIDTH, ROWS, STEPS = 128, 128, 6  # (32 tokens per expert: whole blocks of every format)


def live_tensors_per_step(rank, world_size, device, preset: str, precompute: bool, grouped: bool = False) -> list[int]:
    """Two Linears (each its own FSDP2 unit, resharding after forward: the backward re-sends the kept payloads) in
    `preset` -- `grouped`: a Linear and a GroupedLinear of 4 experts (`_grouped_jobs._KeptPayloadModel`) --, AdamW,
    `STEPS` steps (with `precompute_scales(payloads=True)` after each where `precompute`): the number of torch.Tensor
    objects alive after each step (after a garbage collection)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import _grouped_jobs as grouped_jobs

    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    if grouped:
        model = grouped_jobs._KeptPayloadModel(4, k=WIDTH, n=WIDTH).to(device)
        units, splits = (model.lin, model.experts), [ROWS // 4] * 4
    else:
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)).to(device)
        units, splits = (model[0], model[2]), None
    apply_hybrid_fsdp(model, preset)
    for layer in units:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    counts = []
    for _ in range(STEPS):
        x = torch.randn(ROWS, WIDTH, generator=g).to(device)
        (model(x, splits) if grouped else model(x)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_scales(model, payloads=True)
        counts.append(_live_tensors())
    return counts


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on torch.distributed's deprecated `reduce_op` object warns)
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
