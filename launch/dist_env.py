"""The training job's distributed set-up: the process group and the (dp, tp) mesh, each run's peak memory, rank 0's
decisions given to every rank, and the mean of a value over the ranks."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os

import torch
import torch.distributed as dist

from checkpoint import CheckpointError
from config import ConfigError
from preflight import REFUSALS


@dataclasses.dataclass
class Env:
    rank: int
    world: int
    device: torch.device
    backend: str
    mesh: object

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the tensor-parallel ranks of one dp index share its batches."""
        return self.mesh["dp"].get_local_rank()


def init_distributed(args, world: int) -> Env:
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but CUDA is not available")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}  # NCCL: bind the rank to its GPU up front
    if world == 1:
        # a world of one needs no rendezvous: an in-process store, not a TCP port (a port found free by train.py can
        # be taken by another job's connection before this one listens on it: EADDRINUSE)
        kw.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout), **kw)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    if args.tp > 1:
        # clip_grad_norm_ over parameters sharded on both dimensions reduces the norm over ("dp", "tp"): DTensor
        # warns (_NormPartial) for every step unless that pair exists as one flattened dimension of the mesh
        mesh[("dp", "tp")]._flatten("dp_tp")
    return Env(dist.get_rank(), world, device, backend, mesh)


class PeakMemory:
    """Each run's own peak memory: peak allocated GPU memory on a GPU (its peak statistic reset when a run starts),
    else the peak resident set size. On Linux the RSS peak (VmHWM) is reset too (/proc/self/clear_refs, after
    handing the heap's free memory back to the OS); where that is not possible the label says the peak is the
    process's since it started (all runs so far)."""

    def __init__(self, env: Env):
        self.device = env.device
        self.label = "peak GPU mem" if env.device.type == "cuda" else "peak RSS"

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            import ctypes
            ctypes.CDLL(None).malloc_trim(0)  # glibc: the freed heap back to the OS, so the RSS is what is live
        except (OSError, AttributeError):
            pass
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Linux >= 4.0: the peak RSS restarts from the current RSS
        except OSError:
            self.label = "peak RSS (process)"

    def read(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as f:
                return float(next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) * 1024)
        except (OSError, StopIteration, ValueError):
            import resource
            return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def on_rank0_then_broadcast(fn, env: Env):
    """Run `fn` on rank 0 only and give every rank its result, or raise its refusal on every rank (an unexpected
    error too: rank 0 raises it, the others stop instead of waiting in the next collective)."""
    box: list = [None]
    error = None
    if env.main:
        try:
            box[0] = ("ok", fn())
        except REFUSALS as e:
            box[0] = ("refused", type(e).__name__, str(e))
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others know)
            box[0], error = ("failed", "ConfigError", f"rank 0 failed: {type(e).__name__}: {e}"), e
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0][0] != "ok":
        raise (ConfigError if box[0][1] == "ConfigError" else CheckpointError)(box[0][2])
    return box[0][1]


def all_mean(x: torch.Tensor, env: Env) -> float:
    x = x.detach().float().reshape(1).clone()
    dist.all_reduce(x)
    return x.item() / env.world
