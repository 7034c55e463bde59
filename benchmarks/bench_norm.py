"""RMSNorm forward + backward, and RMSNorm followed by the per-tensor FP8 cast of its output (what q/k/v and w1/w3
read), for hybridq.nn.RMSNorm against the baselines measured in the same run: the launch model's eager RMSNorm
(torchtitan's: fp32 PyTorch operations), torch.nn.RMSNorm, and the model's norm under torch.compile.

    python benchmarks/bench_norm.py                      # 1B-job shape: 16384 tokens x 2048, bf16 (CUDA)
    python benchmarks/bench_norm.py --tokens 8192 --dim 4096

Times are medians of CUDA-event samples (ms); the ratio column is the eager model norm's time over the row's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))  # the job's modules

import hybridq  # noqa: E402
from hybridq.nn.linear_function import _quantize_input, shared_input_quantization  # noqa: E402
from bench_kernels import bench  # noqa: E402
from model import RMSNorm as ModelRMSNorm  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py measures CUDA kernels: no CUDA device here")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = (torch.randn(args.tokens, args.dim, device=dev, dtype=dt)).requires_grad_()
    dy = torch.randn(args.tokens, args.dim, device=dev, dtype=dt)
    model_norm = ModelRMSNorm(args.dim).to(dev)
    norms = {
        "model RMSNorm, eager": model_norm,
        "torch.nn.RMSNorm, eager": torch.nn.RMSNorm(args.dim, eps=1e-5).to(dev),
        "model RMSNorm, torch.compile": torch.compile(ModelRMSNorm(args.dim).to(dev)),
        "hybridq.nn.RMSNorm": hybridq.RMSNorm.from_module(ModelRMSNorm(args.dim).to(dev)),
    }
    q = hybridq.recipe("fp8_tensorwise").quantizer(hybridq.Role("linear", "input", "wq"))
    rows = []
    with shared_input_quantization(False):
        for name, norm in norms.items():
            def fwd():
                return norm(x)

            def fwd_bwd():
                norm(x).backward(dy)

            def fwd_cast():  # the norm, then the next Linear's input cast (rowwise + columnwise)
                y = norm(x)
                return _quantize_input(q, y, y, True, "input of wq")

            rows.append((name, *(bench(f, iters=args.rounds, inner=args.iters) for f in (fwd, fwd_bwd, fwd_cast))))
    base = rows[0]
    print(f"RMSNorm [{args.tokens}, {args.dim}] bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'norm':32s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'vs eager':>9s} {'fwd+fp8 cast ms':>16s} {'vs eager':>9s}")
    for name, f, fb, fc in rows:
        print(f"{name:32s} {f:8.3f} {fb:11.3f} {base[2] / fb:8.2f}x {fc:16.3f} {base[3] / fc:8.2f}x")


if __name__ == "__main__":
    main()
