"""Does FSDP2 + per-block torch.compile(mode="reduce-overhead") record its CUDA graphs again every step, and with
which FSDP2 setting? (issue 33: the 1B bf16 job under `--compile-mode reduce-overhead` re-records, 1-1.9 s steps.)

A stack of bf16 transformer-like blocks (RMSNorm, Linears, SwiGLU; no hybridq), each compiled like train.py does and
sharded with fully_shard, trained for a few steps: per step it prints how many CUDA graphs cudagraph trees recorded
(`CUDAGraphTreeManager.record_function` calls) and the step time, for default mode and for reduce-overhead with
reshard_after_forward True / False, and compares every loss with default mode's (bitwise).

    python benchmarks/cudagraph_rerecords.py                 # one GPU (a world of one)
    torchrun --nproc-per-node 2 benchmarks/cudagraph_rerecords.py

Measured with this script's first form (the same model and steps, the inputs drawn before the steps; one H200,
torch 2.11, 2026-11-27 10:12 UTC, 6 blocks d=1024, world 1): reshard_after_forward=True records 12
graphs (6 forward + 6 backward) in steps 2 and 3 and none after (26 ms steps vs 34-40 ms in default mode, losses
bitwise default mode's); reshard_after_forward=False records 10-12 every step (~175 ms steps).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import cudagraph_trees
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from fsdp_setup import exit_without_finalization

RECORDED = {"n": 0}
_record = cudagraph_trees.CUDAGraphTreeManager.record_function


def _counting_record(self, *args, **kwargs):
    RECORDED["n"] += 1
    return _record(self, *args, **kwargs)


cudagraph_trees.CUDAGraphTreeManager.record_function = _counting_record


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        x = x + self.o(F.gelu(self.q(self.n1(x))))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def run(a, mode: str, reshard_after_forward: bool) -> tuple[list[float], list[int], list[float]]:
    """(losses, graphs recorded, step ms) per step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(a.d, a.hidden) for _ in range(a.blocks)]).cuda()
    for b in model:
        b.forward = torch.compile(b.forward, mode=mode)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model:
        fully_shard(b, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())
    losses, recorded, ms = [], [], []
    for _ in range(a.steps):
        x = torch.randn(a.batch, a.seq, a.d, device="cuda", generator=g)
        torch.cuda.synchronize()
        t, r = time.perf_counter(), RECORDED["n"]
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        ms.append(1e3 * (time.perf_counter() - t))
        recorded.append(RECORDED["n"] - r)
    return losses, recorded, ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    base, _, base_ms = run(a, "default", True)
    lead = dist.get_rank() == 0
    if lead:
        print(f"default mode: step ms {[round(t) for t in base_ms]}", flush=True)
    for raf in (True, False):
        losses, recorded, ms = run(a, "reduce-overhead", raf)
        same = sum(x == y for x, y in zip(losses, base))
        if lead:
            print(f"reduce-overhead, reshard_after_forward={raf}: graphs recorded per step {recorded}, step ms "
                  f"{[round(t) for t in ms]}, losses bitwise default mode's in {same} of {len(base)} steps",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()
