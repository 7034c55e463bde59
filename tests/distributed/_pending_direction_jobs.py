"""Jobs of test_fsdp_pending_direction.py, run by spawned processes (see _harness.spawn): a Linear or GroupedLinear
whose weight FSDP2 gathers quantized, under a root unit (so the layer's own unit reshards after forward and its
backward unshard gathers the deferred direction), and a forward pre-hook that reads a direction of the gathered
weight while it is registered -- in an eval forward (autograd off) or in a training forward before its backward. A
read of a direction the backward unshard fills read FSDP2's freed buffer (a segfault); it must raise hybridq's
error, before anything reads the memory or any state changes."""

from __future__ import annotations

import torch

import hybridq
from hybridq.distributed import grouped_blocks_batched

from _fsdp_layer import Root

IN, OUT, EXPERTS = 128, 128, 4


def _shard(lin: torch.nn.Module, recipe, device, world_size: int) -> Root:
    """As _fsdp_layer.shard_under_root, for a recipe object (a backward override), applied to the root (so the
    weights are named as in a model: lin.weight)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hybridq.distributed import apply_hybrid_fsdp

    root = Root(lin).to(device)
    apply_hybrid_fsdp(root, recipe, on_incompatible="error")
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(lin, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    return root


def _model(case: dict, device, world_size: int):
    torch.manual_seed(0)
    preset = case["preset"]
    recipe = hybridq.recipe(preset, backward_override=case.get("override"))
    if case["layer"] == "grouped":
        lin = hybridq.GroupedLinear(EXPERTS, IN, OUT, recipe=preset, name="moe.w1")
        args = (torch.randn(4 * EXPERTS, IN, device=device), [4] * EXPERTS)
    else:
        lin = hybridq.Linear(IN, OUT, recipe=preset, name="proj")
        args = (torch.randn(32, IN, device=device),)  # (MXFP8's 32-row blocks)
    return _shard(lin, recipe, device, world_size), args


def _read(weight, how: str, direction: str) -> float:
    """Read every byte of `direction` of the gathered weight (as a kernel would), through one way in: the sum of
    their values."""
    if how == "stacked":
        got = weight.stacked_part(direction)
        tensors = got[1] if got is not None else weight.unbind(0)[0].part(direction).tensors()
    elif how == "expert":
        tensors = weight.unbind(0)[0].part(direction).tensors()
    elif how == "part":
        tensors = weight.part(direction).tensors()
    elif how == "property":
        tensors = getattr(weight, str(direction)).tensors()
    elif how == "dequantize":
        tensors = {"values": weight.dequantize(direction=direction)}
    elif how == "clone":
        return _sum_all(weight.clone())
    elif how == "to":
        return _sum_all(weight.to("cpu", copy=True))
    elif how == "high_precision":
        tensors = {"data": weight.high_precision()}
    else:
        raise ValueError(how)
    return sum(float(t.double().sum()) for t in tensors.values() if t is not None)


def _sum_all(qt) -> float:
    return sum(float(t.double().sum()) for p in (qt._rowwise, qt._columnwise) if p is not None
               for t in p.tensors().values() if t is not None)


def job_pending_reads(rank, world_size, device, cases: list) -> list:
    """`job_pending_read` of each case, in one spawn."""
    return [job_pending_read(rank, world_size, device, c) for c in cases]


def job_pending_read(rank, world_size, device, case: dict) -> dict:
    """Train / eval / train, with an SGD step after each train step; the read in a forward pre-hook of the layer in
    the case's mode (`when`: "eval", autograd off, or "train", before its backward). Returns the read's outcome
    ("read" or the error's text), whether the steps' outputs were finite, and (`compare`) whether every step's
    output, input gradient and weight gradient are bitwise those of the same run without the read."""
    read = _run(device, world_size, case, read=True)
    out = {"outcome": read["outcome"], "finite": read["finite"]}
    if case.get("compare"):
        plain = _run(device, world_size, case, read=False)
        out["same_as_without_read"] = [
            f"step {i} {k}" for i, (a, b) in enumerate(zip(read["steps"], plain["steps"])) for k in a
            if not torch.equal(a[k], b[k])] or "same"
    return out


def _run(device, world_size: int, case: dict, read: bool) -> dict:
    grouped_blocks_batched.set_stacked_block_gather(case.get("stacked", True))
    root, args = _model(case, device, world_size)
    opt = torch.optim.SGD(root.parameters(), lr=0.01)
    when = case.get("when", "eval")
    outcome = {}

    def hook(module, inputs):
        if module.training != (when == "train") or "outcome" in outcome:
            return
        try:
            _read(module.weight, case["how"], case["direction"])
            outcome["outcome"] = "read"
        except RuntimeError as e:
            outcome["outcome"] = str(e)

    if read:
        root.lin.register_forward_pre_hook(hook)
    finite, steps = [], []
    for mode in ("train", "eval", "train"):
        if mode == "train":
            root.train()
            x = args[0].detach().clone().requires_grad_(True)
            y = root(x, *args[1:])
            y.float().square().mean().backward()
            w = root.lin.weight
            steps.append({"y": y.detach().float(), "dx": x.grad.clone(),
                          "dw": w.grad.full_tensor() if hasattr(w.grad, "full_tensor") else w.grad.clone()})
            opt.step()
            opt.zero_grad()
        else:
            root.eval()
            with torch.no_grad():
                y = root(*args)
        finite.append(bool(torch.isfinite(y).all()))
    return {"outcome": outcome.get("outcome", "no read"), "finite": finite, "steps": steps}
