"""Jobs of test_dcp.py (spawned; not a test module): a user script's DCP save / load of an FSDP2 hybridq model and
its optimizer with torch's standard helpers, across world sizes, and into a plain PyTorch model."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hybridq

from _compare import parts_diff

RECIPE = "mxfp8_fwd_nvfp4_bwd"
D, HIDDEN = 64, 128


def plain_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, HIDDEN, bias=False), nn.GELU(), nn.Linear(HIDDEN, D))
                           for _ in range(2)])


def sharded_model(world_size: int, seed: int):
    model = plain_model(seed)
    hybridq.apply_hybrid_fsdp(model, hybridq.recipe(RECIPE))
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def step(model, opt, n: int, world_size: int, rank: int) -> float:
    """One step on a global batch of 8 x 32 tokens split across ranks; returns the global mean loss."""
    x = torch.randn(8, 32, D, generator=torch.Generator().manual_seed(100 + n))
    per = 8 // world_size
    loss = model(x[rank * per:(rank + 1) * per]).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach() / world_size
    dist.all_reduce(t)
    return float(t)


def full_state(model, opt) -> dict:
    """The gathered state on every rank (CPU tensors here: gloo)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def save(model, opt, folder: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)


def load(model, opt, folder: str) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def diffs(got: dict, want: dict, where: str) -> list[str]:
    out = []

    def walk(a, b, path):
        if isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                out.append(f"{where}{path}: keys {sorted(a) if isinstance(a, dict) else type(a)} != {sorted(b)}")
                return
            for k in b:
                walk(a[k], b[k], f"{path}.{k}")
        elif isinstance(b, (list, tuple)):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif isinstance(b, torch.Tensor):
            if type(a) is not torch.Tensor or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                out.append(f"{where}{path}: {type(a).__name__} differs from the saved tensor")
        elif a != b:
            out.append(f"{where}{path}: {a!r} != {b!r}")
    walk(got, want, "")
    return out


def job_save(rank, world_size, device, folder):
    """Train 2 steps, save (DCP) and the full reference state, export one file, then the 3rd step's loss."""
    model, opt = sharded_model(world_size, seed=0)
    for n in range(2):
        step(model, opt, n, world_size, rank)
    save(model, opt, os.path.join(folder, f"ck{world_size}"))
    ref = full_state(model, opt)
    hybridq.export_state_dict(model, os.path.join(folder, f"export{world_size}.pt"), format="torch")
    refused = ""
    try:
        hybridq.export_state_dict(model, os.path.join(folder, f"export{world_size}.pt"), format="torch")
    except FileExistsError as e:
        refused = str(e)
    if rank == 0:
        torch.save(ref, os.path.join(folder, f"ref{world_size}.pt"))
    loss3 = step(model, opt, 2, world_size, rank)
    out = job_load(rank, world_size, device, folder, world_size)  # the same world size, fresh processes' state
    return {**out, "saved_loss3": loss3, "refused": refused}


def load_into_quantized_parameters(checkpoint: str, saved: dict) -> list[str]:
    """The checkpoint loaded (get/set_model_state_dict + dcp.load) into an unsharded model whose hybridq weights
    are held quantized: each weight is the quantization of the saved one, bitwise; other parameters equal."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = plain_model(seed=4)
    hybridq.convert_linears(model, hybridq.recipe(RECIPE))
    hybridq.quantize_parameters(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    out = []
    for name, layer in model.named_modules():
        if isinstance(layer, hybridq.Linear):
            info = layer.weight._hybridq_param
            want = info.quantizer.quantize(saved[f"{name}.weight"], rowwise=True, columnwise=info.columnwise_stored)
            for d in ("rowwise", "columnwise"):
                if want.has(d) and parts_diff(layer.weight.part(d), want.part(d), ""):
                    out.append(f"quantized-parameter model loaded from DCP: {d} form of {name}.weight differs")
    biases = {k: v for k, v in saved.items() if k.endswith(".bias")}
    out += diffs({k: v for k, v in model.state_dict().items() if k in biases}, biases,
                 "quantized-parameter model loaded from DCP")
    return out


def job_load(rank, world_size, device, folder, saved_world):
    """Load ck{saved_world} into a fresh (differently initialised) sharded model: full state == saved, bitwise;
    the next step's loss; then load it into a plain PyTorch model (no hybridq, no FSDP) and run it."""
    ref = torch.load(os.path.join(folder, f"ref{saved_world}.pt"), weights_only=False)
    model, opt = sharded_model(world_size, seed=1)
    step(model, opt, 0, world_size, rank)  # optimizer state exists (and differs) before the load
    load(model, opt, os.path.join(folder, f"ck{saved_world}"))
    out = {"diffs": diffs(full_state(model, opt), ref, f"loaded ck{saved_world} at world size {world_size}")}
    out["loss3"] = step(model, opt, 2, world_size, rank)

    plain = plain_model(seed=2)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, f"ck{saved_world}"))
    plain.load_state_dict(state["model"])
    out["diffs"] += diffs(plain.state_dict(), ref["model"], "plain model loaded from DCP")
    exported = torch.load(os.path.join(folder, f"export{saved_world}.pt"), weights_only=True)
    plain2 = plain_model(seed=3)
    plain2.load_state_dict(exported)  # strict: exactly a plain model's keys
    out["diffs"] += diffs(plain2.state_dict(), ref["model"], "plain model loaded from the exported file")
    with torch.no_grad():
        out["plain_out_finite"] = bool(torch.isfinite(plain(torch.randn(4, D))).all())
    out["diffs"] += load_into_quantized_parameters(os.path.join(folder, f"ck{saved_world}"), ref["model"])
    if world_size == 1:  # 1 -> 2: save from here for the next job
        save(model, opt, os.path.join(folder, "ck1"))
        hybridq.export_state_dict(model, os.path.join(folder, "export1.pt"), format="torch")
        if rank == 0:
            torch.save(full_state(model, opt), os.path.join(folder, "ref1.pt"))
    return out
