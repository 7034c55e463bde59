"""Spawned jobs of test_fsdp_convert.py: conversion under FSDP2 of models whose layers are not all called as modules."""

from __future__ import annotations

import copy
import pathlib
import sys

import torch
import torch.nn as nn

import hybridq

# the shared test helpers live one level up; spawned ranks inherit this sys.path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _conversion_models import D, AttentionBlock  # noqa: E402


def transformer_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True), AttentionBlock(),
                         nn.Linear(D, D))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def job_transformer_fsdp(rank, world_size, device, preset: str):
    """apply_hybrid_fsdp(model, preset name) + fully_shard of nn.TransformerEncoderLayer and nn.MultiheadAttention
    blocks: the report, then forward / backward (training) and an inference forward, against the same model
    converted on one process (every rank feeds the same batch, so FSDP2's averaged gradients are that model's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = transformer_model().to(device)
    reference = copy.deepcopy(model)
    hybridq.convert_linears(reference, preset)
    report = hybridq.apply_hybrid_fsdp(model, preset)
    mesh = init_device_mesh(device.type, (world_size,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(1)).to(device)
    out = {"converted": report.converted, "skipped": report.skipped}
    y, y_ref = model(x), reference(x)
    y.square().mean().backward()
    y_ref.square().mean().backward()
    out["output_diff"] = _max_diff(y.detach(), y_ref.detach())
    grads = dict(reference.named_parameters())
    out["grad_diffs"] = {n: _max_diff(p.grad.full_tensor(), grads[n].grad) for n, p in model.named_parameters()}
    model.eval()
    reference.eval()
    with torch.no_grad():
        out["inference_diff"] = _max_diff(model(x), reference(x))
    return out
