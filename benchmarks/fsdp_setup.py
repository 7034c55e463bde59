"""The FSDP2 set-up the hook benchmarks share (bench_gather_hooks.py, bench_grouped_hooks.py, bench_post_hook.py): the
process group (one process, or each of torchrun's) and a model's hybridq weights under FSDP2, one `fully_shard` per
unit and one for the model, bf16 param dtype -- so that each benchmark's numbers come from the same set-up; and how
every benchmark that starts a process group leaves (`exit_without_finalization`)."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

import hybridq
from hybridq.distributed import apply_hybrid_fsdp


def init_world(device: str) -> tuple[int, str]:
    """(world size, device): joins torchrun's process group, or starts a world of one (gloo on the CPU, NCCL on a
    GPU); on a GPU the device is this rank's (`LOCAL_RANK`), e.g. `cuda:1`."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    return torch.distributed.get_world_size(), device


def shard_units(model: nn.Module, units, preset: str, device: torch.device, world: int) -> nn.Module:
    """`model`'s hybridq weights (recipe `preset`) under FSDP2 on a 1-D mesh of `world` ranks: each of `units` one
    `fully_shard`, the model another; bf16 param dtype, fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    apply_hybrid_fsdp(model, hybridq.recipe(preset), on_incompatible="error")
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def exit_without_finalization(code: int | None = 0) -> None:
    """Leaves the process now, output flushed, as launch/train.py does: DTensors and FSDP2 state that outlive `main()`
    keep the gloo process group's worker threads alive past `destroy_process_group`, and one still releasing the last
    collective's tensors needs the GIL while the interpreter finalizes -- the process then aborts ("terminate called
    without an active exception": bench_tp's TP=4 CPU smoke run, once on a loaded 2-core machine, 2026-11-29;
    pytorch/pytorch PR 179291 describes it). Every benchmark that starts a process group ends with it (`code` None
    is 0, as for `sys.exit`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else int(code))
