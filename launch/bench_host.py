"""Host (CPU) cost of issuing hybridq's GPU work: microseconds per call for the pieces of a Linear step, on tensors
so small that the GPU is never the limit (the host issues calls back to back; one synchronize at the end).

What an FSDP2 step at few tokens per GPU waits on (see BENCHMARKS.md, "host ms"): this splits it into the custom
ops, torch's own ops and the Python layers around them, next to the bf16 baseline (`nn.Linear` fwd+bwd).

    python launch/bench_host.py                 # CUDA (the numbers that matter); CPU works too, as a smoke test
    python launch/bench_host.py --dim 256 --json host.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn

import hybridq
from hybridq.nn.linear import shared_input_quantization
from hybridq.formats import Float8Quantizer


def per_call_us(fn, device: torch.device, n: int = 2000, warmup: int = 50) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def cases(dim: int, device: torch.device) -> list:
    x = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    f8 = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    q = Float8Quantizer()
    lin = nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16)
    hq = hybridq.Linear.from_linear(nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16),
                                    hybridq.recipe("fp8_tensorwise"), name="bench")

    def step(m):
        def run():
            m(xg).backward(dy)
            xg.grad = None
            for p in m.parameters():
                p.grad = None
        return run

    out = [
        ("torch.empty_like (allocator)", lambda: torch.empty_like(x)),
        ("x.abs() (one torch kernel)", lambda: x.abs()),
        ("nn.Linear forward (bf16 mm)", lambda: lin(x)),
        ("nn.Linear fwd+bwd", step(lin)),
        ("hybridq Linear fwd+bwd (fp8_tensorwise)", step(hq)),
        ("Float8Quantizer.quantize_parts (rowwise+columnwise)", lambda: q.quantize_parts(x, True, True)),
    ]
    if device.type == "cuda":
        from hybridq.kernels import extension_available
        if extension_available():
            ops = torch.ops.hybridq
            out += [
                ("op amax", lambda: ops.amax(x)),
                ("op fp8_tensor_quantize (amax pass + cast, both directions)",
                 lambda: ops.fp8_tensor_quantize(x, torch.float8_e4m3fn, None, None, 0.0, False, True, True, False)),
            ]
        if torch.cuda.get_device_capability(device) >= (8, 9):
            out.append(("torch._scaled_mm (E4M3, per-tensor scales)",
                        lambda: torch._scaled_mm(f8, f8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write where a hybridq Linear step spends host time (torch.profiler "
                    "self CPU time per op, cProfile per Python function) to this file")
    args = ap.parse_args()
    # every step feeds the same input tensor: with sharing on, hybridq would reuse its quantization from the step
    # before (the cache that lets wq/wk/wv quantize one input once), which a real step with a fresh input cannot
    shared_input_quantization(False)
    device = torch.device(args.device)
    rows = []
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}); "
          f"torch {torch.__version__}; tensors {args.dim}x{args.dim} bf16\n")
    print("| call | host us per call |\n|---|---|")
    for name, fn in cases(args.dim, device):
        us = per_call_us(fn, device, n=args.n)
        rows.append({"call": name, "us": us})
        print(f"| {name} | {us:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device), "torch": torch.__version__, "dim": args.dim, "rows": rows}, fh, indent=1)
    if args.profile:
        profile_linear_step(dict(cases(args.dim, device))["hybridq Linear fwd+bwd (fp8_tensorwise)"], device,
                            args.profile)


def profile_linear_step(step, device: torch.device, path: str, n: int = 200) -> None:
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    with open(path, "w") as fh:
        print(f"==== torch.profiler, {n} hybridq Linear fwd+bwd steps, by self CPU time ====", file=fh)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80),
              file=fh)
        print(f"==== cProfile, {n} steps, by own time ====", file=fh)
        print(buf.getvalue(), file=fh)


if __name__ == "__main__":
    main()
