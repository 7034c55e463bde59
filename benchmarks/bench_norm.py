"""RMSNorm / LayerNorm forward + backward, and the norm followed by the cast of its output that the next Linear
layers (q/k/v, w1/w3) make, for hybridq's norms against the baselines measured in the same run: the launch model's
eager RMSNorm (torchtitan's: fp32 PyTorch operations) or torch.nn.LayerNorm, torch's RMSNorm, and the baseline under
torch.compile. The hybridq rows: the kernel alone (the Linear casts y itself, with the norm's max|y| for per-tensor
formats), and the kernel writing the Linear's rowwise block-format input in the same pass ("fused": FP8 block 1x128,
MXFP8 1x32; hybridq/nn/fused_input.py) -- both bitwise the same result.

    python benchmarks/bench_norm.py                      # 1B-job shape: 16384 tokens x 2048, bf16 (CUDA), RMSNorm
    python benchmarks/bench_norm.py --norm layer --tokens 8192 --dim 4096 --presets fp8_tensorwise,mxfp8

Times are medians of CUDA-event samples (ms); the ratio columns are the eager baseline's time over the row's. The
cast columns quantize rowwise + columnwise (a training step's input of a Linear).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))  # the job's modules

import hybridq  # noqa: E402
from hybridq.kernels.norm_quantize import fusable_row_quantizer  # noqa: E402
from hybridq.nn.linear_function import _quantize_input, shared_input_quantization  # noqa: E402
from bench_kernels import bench  # noqa: E402
from model import RMSNorm as ModelRMSNorm  # noqa: E402


def _norms(kind: str, dim: int, dev: str) -> dict:
    """name -> (module, fused): the baselines and hybridq's norm unfused and fused."""
    if kind == "rms":
        base = {"model RMSNorm, eager": ModelRMSNorm(dim).to(dev),
                "torch.nn.RMSNorm, eager": torch.nn.RMSNorm(dim, eps=1e-5).to(dev),
                "model RMSNorm, torch.compile": torch.compile(ModelRMSNorm(dim).to(dev))}
        make = lambda: hybridq.RMSNorm.from_module(ModelRMSNorm(dim).to(dev))  # noqa: E731
    else:
        base = {"torch.nn.LayerNorm, eager": torch.nn.LayerNorm(dim).to(dev),
                "torch.nn.LayerNorm, torch.compile": torch.compile(torch.nn.LayerNorm(dim).to(dev))}
        make = lambda: hybridq.LayerNorm.from_module(torch.nn.LayerNorm(dim).to(dev))  # noqa: E731
    out = {n: (m, False) for n, m in base.items()}
    out[f"hybridq {kind} norm"] = (make(), False)
    out[f"hybridq {kind} norm, fused"] = (make(), True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--norm", choices=("rms", "layer"), default="rms")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--presets", default="fp8_tensorwise,fp8_block,mxfp8",
                   help="the recipes whose input cast follows the norm (comma-separated preset names)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py measures CUDA kernels: no CUDA device here")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = (torch.randn(args.tokens, args.dim, device=dev, dtype=dt)).requires_grad_()
    dy = torch.randn(args.tokens, args.dim, device=dev, dtype=dt)
    presets = [s for s in args.presets.split(",") if s]
    qs = {s: hybridq.recipe(s).quantizer(hybridq.Role("linear", "input", "wq")) for s in presets}
    rows = []
    with shared_input_quantization(False):
        for name, (norm, fused) in _norms(args.norm, args.dim, dev).items():
            def fwd():
                return norm(x)

            def fwd_bwd():
                norm(x).backward(dy)

            def fwd_cast(q):  # the norm, then the next Linear's input cast (rowwise + columnwise)
                if fused:  # (what the reading Linear registers: [Note: pre-quantized norm outputs])
                    norm._readers.quantizer = fusable_row_quantizer(q)
                elif hasattr(norm, "_readers"):  # (unfused: forget what the previous call's cast registered)
                    norm._readers.quantizer = None
                y = norm(x)
                return _quantize_input(q, y, y, True, "input of wq")

            times = [bench(f, iters=args.rounds, inner=args.iters) for f in (fwd, fwd_bwd)]
            times += [bench(lambda q=q: fwd_cast(q), iters=args.rounds, inner=args.iters) for q in qs.values()]
            rows.append((name, times))
    base = rows[0][1]
    print(f"{args.norm} norm [{args.tokens}, {args.dim}] bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    head = f"{'norm':34s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'vs base':>8s}"
    for s in presets:
        head += f" {'fwd+' + s + ' ms':>22s} {'vs base':>8s}"
    print(head)
    for name, t in rows:
        line = f"{name:34s} {t[0]:8.3f} {t[1]:11.3f} {base[1] / t[1]:7.2f}x"
        for i in range(len(presets)):
            line += f" {t[2 + i]:22.3f} {base[2 + i] / t[2 + i]:7.2f}x"
        print(line)


if __name__ == "__main__":
    main()
