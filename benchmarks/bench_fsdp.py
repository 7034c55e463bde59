"""FSDP2 training-step benchmark on 2 GPUs (eager): a Llama-style block stack (RMSNorm, causal attention,
SwiGLU MLP; every projection a Linear) trained with AdamW, each block `fully_shard`ed, bf16 compute with fp32
master weights and fp32 gradient reduction.

Modes, measured in one run: bf16 FSDP2; every hybridq preset through `apply_hybrid_fsdp` (quantized
all-gathers, `precompute_scales` after each optimizer step); torchao float8 (tensorwise, float8 all-gather
and precomputed scales) when torchao is importable. Per mode: median step time, tokens/s (all ranks),
all-gather bytes sent per rank per step (every `all_gather_into_tensor`, statistics all-reduces excluded),
peak allocated memory.

    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py                      # d=4096, 8 layers, seq 4096
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --modes bf16,fp8_tensorwise,torchao --json bench.json
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --device cpu --dim 256 --layers 2 --seq 128 --steps 2
                                                                          # smoke test on CPU (gloo)
Targets: fp8_tensorwise >= 1.3x bf16 tokens/s and ahead of torchao eager; every preset's
all-gather bytes below bf16's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))  # the job's modules

import hybridq  # noqa: E402
from comm import CommCounter  # noqa: E402 (launch/comm.py: the job counts its gathers the same way)
from fsdp_setup import exit_without_finalization  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.wo(a)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stack(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


def build(mode: str, args, device, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = Stack(args.dim, args.layers, args.heads, args.hidden)
    post_step = None
    if mode == "torchao":
        from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                    precompute_float8_dynamic_scale_for_fsdp)

        cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=cfg)

        def post_step():
            precompute_float8_dynamic_scale_for_fsdp(model)
    elif mode != "bf16":
        hybridq.apply_hybrid_fsdp(model, hybridq.recipe(mode))

        def post_step():
            hybridq.precompute_scales(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt, post_step


def profile_steps(step, mode: str, path: str, is_cuda: bool, steps: int = 2) -> None:
    """Append to `path` (rank 0) where two steps spend their time: torch.profiler's top device kernels and CPU
    ops, and cProfile's top Python functions by cumulative time (every rank runs the same steps)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    rank0 = dist.get_rank() == 0
    with profile(activities=acts, with_stack=True, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if is_cuda:
            torch.cuda.synchronize()
    dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    if is_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if not rank0:
        return
    ka = prof.key_averages()
    out = io.StringIO()
    print(f"\n==================== {mode}: {steps} steps ====================", file=out)
    if is_cuda:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / 1e3
        print(f"device kernel time, all streams: {busy:.1f} ms over {steps} steps", file=out)
        print(ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70), file=out)
        print("-- by Python stack (the op that launched the kernels) --", file=out)
        print(prof.key_averages(group_by_stack_n=6).table(sort_by="self_device_time_total", row_limit=25,
                                                          max_name_column_width=50), file=out)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70), file=out)
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(25)
    with open(path, "a") as fh:
        fh.write(out.getvalue())


def run_mode(mode: str, args, device, mesh) -> dict:
    model, opt, post_step = build(mode, args, device, mesh)
    g = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=torch.bfloat16, generator=g)
    is_cuda = device.type == "cuda"

    def step():
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if post_step is not None:
            post_step()
        return loss

    for _ in range(args.warmup):
        step()
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    times, host = [], []
    with CommCounter() as counter:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            host.append(time.perf_counter() - t0)  # CPU time to issue the step (no sync inside a step)
            if is_cuda:
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    if args.profile:
        profile_steps(step, mode, args.profile, is_cuda)
    ws = dist.get_world_size()
    row = {
        "mode": mode, "step_ms": ms, "tokens_per_s": args.batch * args.seq * ws / (ms / 1e3),
        "allgather_MB_per_rank_step": counter.bytes["allgather"] / args.steps / 2**20,
        "host_ms": 1e3 * statistics.median(host),
        "peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if is_cuda else float("nan"),
        "loss": float(loss.detach()),
    }
    del model, opt, post_step, x
    gc.collect()
    if is_cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=None, help="SwiGLU hidden size (default Llama: 8/3 d, x256)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=None, help="comma list: bf16, preset names, torchao (default: all)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="append a profile of 2 extra steps per mode to this file")
    args = ap.parse_args()
    args.hidden = args.hidden or 256 * math.ceil(8 * args.dim / 3 / 256)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    modes = args.modes.split(",") if args.modes else (
        ["bf16"] + [p for p in hybridq.preset_names() if p != "fp8_delayed"] + ["torchao"])
    if "torchao" in modes:
        try:
            import torchao.float8  # noqa: F401
        except Exception as e:  # noqa: BLE001
            if rank == 0:
                print(f"torchao not importable ({type(e).__name__}: {e}); skipping it", flush=True)
            modes.remove("torchao")
    if rank == 0:
        dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"device: {dev} x{dist.get_world_size()}; torch {torch.__version__}; d={args.dim} layers={args.layers} "
              f"seq={args.seq} batch/rank={args.batch} hidden={args.hidden}", flush=True)
    rows = []
    for mode in modes:
        try:
            row = run_mode(mode, args, device, mesh)
        except Exception as e:  # noqa: BLE001
            if rank == 0:
                print(f"{mode}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and rows:
        base = next((r for r in rows if r["mode"] == "bf16"), rows[0])
        print("\n| mode | step ms | host ms | tokens/s | vs bf16 | all-gather MB/rank/step | vs bf16 | peak GiB |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['step_ms']:.1f} | {r['host_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['allgather_MB_per_rank_step']:.1f} | "
                  f"{r['allgather_MB_per_rank_step'] / max(base['allgather_MB_per_rank_step'], 1e-9):.2f} | "
                  f"{r['peak_GiB']:.1f} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()
