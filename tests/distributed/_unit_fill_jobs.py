"""Jobs of test_fsdp_unit_fill.py (spawned by _harness.spawn, or run in-process on one rank): _unit_cast_jobs' model
(two blocks, each one FSDP2 unit of six Linears of five shapes) trained with the unit fill ([Note: unit fill],
hybridq/distributed/unit_fill.py) on and off; every gathered weight (each forward's rowwise part and each backward's
columnwise part, bytes and scales), loss and gradient is recorded for a bitwise comparison."""

from __future__ import annotations

import pathlib
import sys
import warnings

import torch
import torch.nn as nn

import hybridq as hq
from hybridq.distributed import unit_fill
from hybridq.torch_private import local_tensor

from _unit_cast_jobs import D, Block, _bits, recipe, shard_blocks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import assert_training_runs_bitwise  # noqa: E402

COUNTERS = ("unit_filled", "fill_replayed", "derived_in_place", "aliased", "adopted")


def build(device, world_size: int, preset: str = "fp8_tensorwise", mixed: bool = False,
          reshard: bool = True) -> nn.Module:
    """`reshard`: the blocks' reshard_after_forward (False: the forward unshard fills both directions, the columnwise
    form derived; backward gathers nothing)."""
    torch.manual_seed(0)
    m = nn.Sequential(Block(), Block()).to(device)
    return shard_blocks(m, recipe(mixed) if preset == "fp8_tensorwise" else hq.recipe(preset), device, world_size,
                        reshard_after_forward=reshard)


def _part_bytes(part) -> dict:
    return {n: _bits(t) for n, t in part.tensors().items() if t is not None}


def record_parts(m: nn.Module, into: list) -> list:
    """Hooks on every hybridq Linear appending (name, direction, {tensor name: bytes}): its gathered rowwise part before
    each forward, its gathered columnwise part (what dgrad reads, filled by the backward unshard) before each
    backward."""
    handles = []
    for name, mod in m.named_modules():
        if isinstance(mod, hq.Linear):
            def fwd(mod, args, name=name):
                into.append((name, "rowwise", _part_bytes(mod.weight.part("rowwise"))))

            def bwd(mod, grad_out, name=name):
                w = mod.weight
                if w._columnwise is not None:
                    into.append((name, "columnwise", _part_bytes(w.part("columnwise"))))
            handles.append(mod.register_forward_pre_hook(fwd))
            handles.append(mod.register_full_backward_pre_hook(bwd))
    return handles


def counters(m: nn.Module) -> dict:
    return {key: {n: int(local_tensor(p)._hq.counters[key]) for n, p in m.named_parameters()} for key in COUNTERS}


def train(m: nn.Module, device, steps: int, start: int = 0) -> dict:
    """`steps` AdamW steps: every gathered part, the losses and the gradients, as bytes."""
    parts: list = []
    handles = record_parts(m, parts)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + start)
    losses, grads = [], []
    for _ in range(steps):
        loss = m(torch.randn(16, D, generator=g).to(device)).float().square().mean()
        with warnings.catch_warnings():  # (the first Linear's input needs no gradient: its hook fires on outputs)
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        losses.append(_bits(loss))
        grads.append([_bits(p.grad.full_tensor()) for p in m.parameters()])
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    return {"parts": parts, "losses": losses, "grads": grads}


def compare(got: dict, want: dict, where: str) -> None:
    assert_training_runs_bitwise(got, want, where, "with the unit fill")


def parity(rank, world_size, device, preset: str = "fp8_tensorwise", mixed: bool = False, steps: int = 3,
           reshard: bool = True) -> dict:
    """Training with the unit fill on is bitwise training with it off; returns both runs' counters."""
    out = {}
    was = unit_fill.set_unit_fill(False)
    try:
        runs = {}
        for on in (False, True):
            unit_fill.set_unit_fill(on)
            m = build(device, world_size, preset, mixed, reshard)
            runs[on] = train(m, device, steps)
            out[on] = counters(m)
    finally:
        unit_fill.set_unit_fill(was)
    compare(runs[True], runs[False], f"rank {rank} of {world_size}, {preset}, mixed={mixed}, reshard={reshard}")
    return {"on": out[True], "off": out[False]}
