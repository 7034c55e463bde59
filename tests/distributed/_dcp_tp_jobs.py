"""Jobs of test_dcp_tp.py (spawned; not a test module), written as a user's training script would be: a hybridq
model tensor-parallelised with hybridq's styles over the "tp" dimension of a 2-D (dp, tp) mesh and fully_shard over
"dp" (torchtitan's order), saved and loaded with torch's standard checkpoint helpers (get_state_dict /
set_state_dict + dcp.save / dcp.load), across layouts.

Each layout splits the same global batch: dp ranks take micro-batches, tp ranks sequence slices (sequence
parallelism). The loss is the global mean of the squared output whatever the layout, so every layout trains the
same model; only the summation order of row-parallel partial products and of gradient reductions differs.
"""

from __future__ import annotations

import copy
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

import hybridq
from hybridq.distributed import ColwiseParallel, PrepareModuleInput, RowwiseParallel

# the shared test helpers live one level up; spawned ranks inherit this sys.path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _conversion_models import SwiGLU  # noqa: E402
from _dcp_jobs import full_state, load, save  # noqa: E402 (DCP's standard helpers: the FSDP2 checkpoint jobs')

RECIPE = "mxfp8"  # deterministic (no stochastic rounding): every layout quantizes the same operands
D, HIDDEN, LAYERS = 64, 128, 2
BATCH, SEQ = 4, 128  # the global batch; SEQ / tp must keep MXFP8's 32-row blocks whole ([B, S, H] with B > 1)
LR = 1e-2


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.mlp = SwiGLU(D, HIDDEN)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def tp_plan() -> dict:
    # the norm is sequence-parallel; w1 / w3 share one quantized all-gather of its output; w2 reduce-scatters
    return {"norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1))}


def parallel_model(dp: int, tp: int, seed: int):
    """The user's set-up: convert, tensor-parallelise over "tp", fully_shard over "dp"; AdamW."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = Model(seed)
    hybridq.apply_hybrid_fsdp(model, hybridq.recipe(RECIPE))
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=LR), mesh


def batch(n: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(100 + n))


def local_slice(mesh) -> tuple[slice, slice]:
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    b, s = BATCH // dp, SEQ // tp
    i, j = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    return slice(i * b, (i + 1) * b), slice(j * s, (j + 1) * s)


def global_output(model, mesh, x: torch.Tensor) -> torch.Tensor:
    """The model's output on the whole batch x, assembled from every rank's piece (each rank its rows and
    sequence slice; a sum of zeros elsewhere is exact)."""
    rows, cols = local_slice(mesh)
    out = torch.zeros_like(x)
    with torch.no_grad():
        out[rows, cols] = model(x[rows, cols].contiguous())
    dist.all_reduce(out)
    return out


def train_step(model, opt, mesh, n: int) -> float:
    """One step on global batch n; returns the global mean loss (the same number on every rank)."""
    rows, cols = local_slice(mesh)
    y = model(batch(n)[rows, cols].contiguous())
    total = batch(n).numel()
    # FSDP2 averages gradients over dp; tp ranks' contributions add up: scale by dp for the global mean
    (y.float().square().sum() * mesh["dp"].size() / total).backward()
    opt.step()
    opt.zero_grad()
    loss = y.detach().float().square().sum() / total
    dist.all_reduce(loss)
    return float(loss)


def state_diffs(got, want, path: str = "") -> list[str]:
    """Where `got` differs from `want` (keys, tensor dtype / shape / bits, other values)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [d for k in want for d in state_diffs(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in state_diffs(a, b, f"{path}[{i}]")]
    if isinstance(want, torch.Tensor):
        if type(got) is not torch.Tensor or got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: {type(got).__name__} {getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))} "
                    f"!= {want.dtype} {tuple(want.shape)}"]
        return [] if torch.equal(got, want) else [f"{path}: values differ (max |diff| "
                                                  f"{(got.float() - want.float()).abs().max().item():.3e})"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0.0: bitwise equal values)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def job_save(rank: int, world_size: int, device, folder: str, dp: int, tp: int) -> dict:
    """Train 2 steps at (dp, tp) and save; record the full state, the forward on a fixed batch and the losses of
    steps 3 and 4 (the reference every other layout resumes against). Then, in the same processes, load the
    checkpoint into a fresh model at the same layout: state, forward and losses must be bitwise the original's."""
    model, opt, mesh = parallel_model(dp, tp, seed=0)
    for n in range(2):
        train_step(model, opt, mesh, n)
    ck = os.path.join(folder, "ck")
    save(model, opt, ck)
    # (a copy: the optimizer's step counters are updated in place by the steps below)
    ref = copy.deepcopy({**full_state(model, opt), "forward": global_output(model, mesh, batch(99))})
    ref["losses"] = [train_step(model, opt, mesh, n) for n in (2, 3)]
    if rank == 0:
        torch.save(ref, os.path.join(folder, "ref.pt"))
    dist.barrier()
    return job_load(rank, world_size, device, folder, dp, tp)


def job_load(rank: int, world_size: int, device, folder: str, dp: int, tp: int) -> dict:
    """Load the checkpoint into a fresh, differently initialised model at (dp, tp) whose optimizer has already
    stepped: the full state must equal the saved one bitwise; returns the forward's and the next two losses'
    relative difference to the saved run's."""
    ref = torch.load(os.path.join(folder, "ref.pt"), weights_only=False)
    model, opt, mesh = parallel_model(dp, tp, seed=1)
    train_step(model, opt, mesh, 7)  # optimizer state exists (and differs) before the load
    load(model, opt, os.path.join(folder, "ck"))
    out = {"diffs": state_diffs(full_state(model, opt), {"model": ref["model"], "optim": ref["optim"]},
                                f"loaded at dp{dp} x tp{tp}")}
    out["forward_err"] = rel_err(global_output(model, mesh, batch(99)), ref["forward"])
    out["losses"] = [train_step(model, opt, mesh, n) for n in (2, 3)]
    out["saved_losses"] = ref["losses"]
    return out


def plain_resume(folder: str) -> dict:
    """No process group, no FSDP, no TP: load the checkpoint into a plain PyTorch model of the same class (DCP's
    single-process load), check its weights against the saved full state, then convert it with the same recipe
    and continue training one process (same optimizer, state loaded from the full optimizer state_dict)."""
    ref = torch.load(os.path.join(folder, "ref.pt"), weights_only=False)
    plain = Model(seed=2)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, "ck"))
    plain.load_state_dict(state["model"])
    out = {"diffs": state_diffs(dict(plain.state_dict()), dict(ref["model"]), "plain model loaded from DCP")}
    hybridq.convert_linears(plain, hybridq.recipe(RECIPE), on_incompatible="error")
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    set_state_dict(plain, opt, model_state_dict=ref["model"], optim_state_dict=ref["optim"],
                   options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        out["forward_err"] = rel_err(plain(batch(99)), ref["forward"])
    losses = []
    for n in (2, 3):
        y = plain(batch(n))
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    out["losses"], out["saved_losses"] = losses, ref["losses"]
    return out
