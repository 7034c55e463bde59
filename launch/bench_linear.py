"""Linear forward+backward step benchmark (eager mode, bf16 inputs): bf16 nn.Linear, every hybridq preset, and
torchao float8 (tensorwise, rowwise; eager and torch.compile) when torchao is importable.

Shapes [tokens M, in K, out N]: 8192 x 8192 x 8192 and a Llama-like 8192 x 4096 x 14336. One step is
y = linear(x); y.backward(dy) (three GEMMs: fprop, dgrad, wgrad, plus every quantization).

    python launch/bench_linear.py
    python launch/bench_linear.py --shapes 8192x8192x8192 --presets fp8_tensorwise --no-torchao --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn

import hybridq
from bench_kernels import bench  # same timing method (CUDA events, median of back-to-back calls)


def make_step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        y = module(x)
        y.backward(dy)
    return step


def torchao_modules(k: int, n: int, which=None):
    """(name, module) for torchao float8 training recipes, eager and compiled; [] without torchao. `which`: the names
    to build (torchao_tensorwise, torchao_tensorwise_compiled, torchao_rowwise, torchao_rowwise_compiled)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001
        print(f"torchao not available ({type(e).__name__}: {e}); skipping it", flush=True)
        return []
    out = []
    for recipe in ("tensorwise", "rowwise"):
        for compiled in (False, True):
            name = f"torchao_{recipe}" + ("_compiled" if compiled else "")
            if which is not None and name not in which:
                continue
            try:
                m = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
                convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
                if compiled:
                    m = torch.compile(m)
                out.append((name, m))
            except Exception as e:  # noqa: BLE001
                print(f"torchao {recipe}: {type(e).__name__}: {e}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x8192x8192,8192x4096x14336", help="MxKxN,...")
    ap.add_argument("--presets", default=",".join(hybridq.preset_names()))
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--torchao", default="tensorwise,tensorwise_compiled,rowwise,rowwise_compiled",
                    help="torchao variants to include (each torch.compile'd one costs its compile time)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    dev = torch.cuda.get_device_name()
    from hybridq.kernels import extension_available
    print(f"device: {dev}; torch {torch.__version__}; hybridq CUDA extension: {extension_available()}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flop = 3 * 2 * m * n * k
        cands = [("bf16 nn.Linear", nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))]
        for p in args.presets.split(","):
            cands.append((p, hybridq.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16,
                                            recipe=hybridq.recipe(p))))
        if not args.no_torchao:
            cands += torchao_modules(k, n, {f"torchao_{v}" for v in args.torchao.split(",") if v})
        base = None
        for name, mod in cands:
            with torch.no_grad():
                for p in mod.parameters():
                    p.normal_(0, 0.02)
            try:
                ms = bench(make_step(mod, x, dy), iters=args.iters)
            except Exception as e:  # noqa: BLE001
                print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if base is None:
                base = ms
            row = {"shape": shape, "name": name, "ms": ms, "tflops": flop / (ms * 1e-3) / 1e12, "speedup": base / ms}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del mod
            torch.cuda.empty_cache()

    print("\n| shape MxKxN | linear | step ms | TFLOP/s | speed-up vs bf16 eager |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['speedup']:.2f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
