"""Tensor-parallel training-step benchmark (eager): one transformer block of the launch model (RMSNorm, causal
attention, SwiGLU MLP) under TP = world size with sequence parallelism, the plan of `launch/parallel.py`
(hybridq's styles; on plain nn.Linear layers they are torch's). bf16 (no conversion) vs each preset, measured
in interleaved rounds in one run. Per mode: median forward+backward step time, ratio to bf16, sequence-parallel
all-gather bytes per rank per step (forward + backward, from `hybridq.distributed.sequence_gather_bytes`), peak
allocated memory (CUDA).

    torchrun --nproc_per_node 2 benchmarks/bench_tp.py                         # d 4096, seq 4096, batch 1, bf16
    torchrun --nproc_per_node 4 benchmarks/bench_tp.py --modes bf16,fp8_tensorwise,mxfp8 --json tp.json
    torchrun --nproc_per_node 2 benchmarks/bench_tp.py --smoke                 # tiny sizes on the CPU (gloo; any world)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))  # the job's modules

import hybridq  # noqa: E402
from model import Block, ModelConfig, rope_tables  # noqa: E402
from parallel import block_plan  # noqa: E402
from fsdp_setup import exit_without_finalization  # noqa: E402


def build(mode: str, cfg: ModelConfig, mesh, device, dtype):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    block = Block(cfg).to(device=device, dtype=dtype)
    if mode != "bf16":
        hybridq.convert_linears(block, hybridq.recipe(mode))
    parallelize_module(block, mesh, block_plan())
    return block


def gather_bytes(block, shape, tp: int) -> tuple[int, int]:
    """(quantized, bf16) bytes per rank of the block's sequence-parallel gathers (one per shared input)."""
    from hybridq.distributed import sequence_gather_bytes

    q = b = 0
    for name, mod in block.named_modules():
        if isinstance(mod, hybridq.Linear) and name.endswith(("wq", "w1")):
            r = sequence_gather_bytes(mod.input_quantizer, shape, 1, tp,
                                      backward_override=mod.recipe.backward_override,
                                      save_original_input=mod.save_original_input)
            q, b = q + r.total, b + r.bf16
    return q, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="bf16," + ",".join(n for n in hybridq.preset_names() if n != "fp8_delayed"))
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 step, 1 round (CI on the CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.smoke:  # the smallest sizes every preset splits over `world` ranks: 128 columns, 32 sequence rows each
        args.dim, args.heads, args.hidden, args.seq = 128 * world, 2 * world, 256 * world, 32 * world
        args.batch, args.steps, args.rounds = 1, 1, 1
    cuda = (torch.cuda.is_available() and world <= torch.cuda.device_count()) if args.device == "auto" \
        else args.device == "cuda"  # (auto: the CPU when there are fewer GPUs than processes)
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    tp, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (tp,))
    dtype = torch.bfloat16
    cfg = ModelConfig(d_model=args.dim, n_layers=1, n_heads=args.heads, hidden=args.hidden, max_seq=args.seq)
    cos, sin = (t.to(device) for t in rope_tables(cfg.head_dim, args.seq, cfg.rope_theta))
    modes = args.modes.split(",")
    blocks = {m: build(m, cfg, mesh, device, dtype) for m in modes}
    local = (args.batch, args.seq // tp, args.dim)
    x = torch.randn(local, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(rank))

    def step(block):
        y = block(x.detach().requires_grad_(), cos, sin)
        y.float().square().mean().backward()

    times = {m: [] for m in modes}
    peak = {}
    for m in modes:  # warm-up (and peak memory of one step)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        step(blocks[m])
        if cuda:
            torch.cuda.synchronize()
            peak[m] = torch.cuda.max_memory_allocated() / 2**30
    for _ in range(args.rounds):
        for m in modes:
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(blocks[m])
            if cuda:
                torch.cuda.synchronize()
            times[m].append((time.perf_counter() - t0) / args.steps * 1e3)
    shape = (args.batch, args.seq, args.dim)
    rows = []
    base = statistics.median(times[modes[0]])
    for m in modes:
        ms = statistics.median(times[m])
        qb, bb = gather_bytes(blocks[m], shape, tp) if m != "bf16" else (None, None)
        if bb is None:
            bb = 2 * 2 * args.batch * (args.seq // tp) * args.dim  # attention and MLP inputs, bf16
        rows.append({"mode": m, "ms": ms, "ratio": base / ms, "gather_bytes": qb if qb is not None else bb,
                     "bf16_gather_bytes": bb, "peak_gib": peak.get(m)})
    if rank == 0:
        print(f"\nTP={tp} + SP, {device.type}, torch {torch.__version__}: block d={args.dim} heads={args.heads} "
              f"hidden={args.hidden}, seq {args.seq} x batch {args.batch}; median of {args.rounds} rounds")
        print(f"| mode | step ms | speed-up vs {modes[0]} | SP gather bytes/rank/step | vs bf16 | peak GiB |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            pk = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
            print(f"| {r['mode']} | {r['ms']:.2f} | {r['ratio']:.2f}x | {r['gather_bytes']:,} | "
                  f"{r['gather_bytes'] / r['bf16_gather_bytes']:.3f} | {pk} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tp": tp, "device": str(device), "args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()
