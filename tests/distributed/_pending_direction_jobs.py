"""Jobs of test_fsdp_pending_direction.py, run by spawned processes (see _harness.spawn): a Linear or GroupedLinear
whose weight FSDP2 gathers quantized, under a root unit (so the layer's own unit reshards after forward and its
backward unshard gathers the deferred direction), and a forward pre-hook that reads a direction of the gathered
weight while it is registered. A read of a direction the backward unshard fills, with autograd off, read FSDP2's
freed buffer (a segfault); it must raise hybridq's error, before anything reads the memory."""

from __future__ import annotations

import torch

import hybridq
from hybridq.distributed import grouped_blocks_batched

from _fsdp_layer import shard_under_root

IN, OUT, EXPERTS = 128, 128, 4


def _model(case: dict, device, world_size: int):
    torch.manual_seed(0)
    preset = case["preset"]
    if case["layer"] == "grouped":
        lin = hybridq.GroupedLinear(EXPERTS, IN, OUT, recipe=preset, name="moe.w1")
        args = (torch.randn(4 * EXPERTS, IN, device=device), [4] * EXPERTS)
    else:
        lin = hybridq.Linear(IN, OUT, recipe=preset, name="proj")
        args = (torch.randn(32, IN, device=device),)  # (MXFP8's 32-row blocks)
    return shard_under_root(lin, preset, device, world_size), args


def _read(weight, how: str, direction: str) -> float:
    """Read every tensor of `direction` of the gathered weight (as a kernel would): the sum of their values."""
    if how == "stacked":
        got = weight.stacked_part(direction)
        tensors = got[1] if got is not None else weight.unbind(0)[0].part(direction).tensors()
    elif how == "expert":
        tensors = weight.unbind(0)[0].part(direction).tensors()
    else:
        tensors = weight.part(direction).tensors()
    return sum(float(t.double().sum()) for t in tensors.values() if t is not None)


def job_pending_reads(rank, world_size, device, cases: list) -> list:
    """`job_pending_read` of each case, in one spawn."""
    return [job_pending_read(rank, world_size, device, c) for c in cases]


def job_pending_read(rank, world_size, device, case: dict) -> dict:
    """Train / eval (the read in a pre-hook, autograd off) / train, with an SGD step between. Returns the eval
    read's outcome ("read" or the error's text) and whether the train steps after it ran with finite results."""
    grouped_blocks_batched.set_stacked_block_gather(case.get("stacked", True))
    root, args = _model(case, device, world_size)
    opt = torch.optim.SGD(root.parameters(), lr=0.01)
    outcome = {}

    def hook(module, inputs):
        if module.training:
            return
        try:
            _read(module.weight, case["how"], case["direction"])
            outcome["eval"] = "read"
        except RuntimeError as e:
            outcome["eval"] = str(e)

    root.lin.register_forward_pre_hook(hook)
    finite = []
    for mode in ("train", "eval", "train"):
        if mode == "train":
            root.train()
            y = root(*args)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            finite.append(bool(torch.isfinite(y).all()))
        else:
            root.eval()
            with torch.no_grad():
                y = root(*args)
            finite.append(bool(torch.isfinite(y).all()))
    outcome["finite"] = finite
    return outcome
