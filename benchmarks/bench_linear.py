"""Linear forward+backward step benchmark (eager mode, bf16 inputs): bf16 nn.Linear, every hybridq preset, and
torchao float8 (tensorwise, rowwise; eager and torch.compile) when torchao is importable.

Shapes [tokens M, in K, out N]: 8192 x 8192 x 8192 and a Llama-like 8192 x 4096 x 14336. One step is
y = linear(x); y.backward(dy) (three GEMMs: fprop, dgrad, wgrad, plus every quantization).

Each candidate is timed in --rounds interleaved rounds (the FP8 GEMMs run at the power limit, so what ran just
before changes the clock); the SM clock and board power while it ran come from nvidia-smi.

    python benchmarks/bench_linear.py
    python benchmarks/bench_linear.py --shapes 8192x8192x8192 --presets fp8_tensorwise --no-torchao --json out.json
    python benchmarks/bench_linear.py --presets mxfp8,nvfp4 --no-torchao --triton-dequant-gemm   # with and without it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import threading

import torch
import torch.nn as nn

import hybridq
from hybridq.nn.linear import shared_input_quantization
from bench_kernels import bench  # same timing method (CUDA events, median of back-to-back calls)


class GpuSampler:
    """SM clock and board power of the current GPU while each labelled block runs (`nvidia-smi -lms 50` read by a
    thread); records nothing when nvidia-smi is missing."""

    def __init__(self) -> None:
        self._label = None
        self._samples: dict = {}
        cmd = ["nvidia-smi", "-i", str(torch.cuda.current_device()), "--format=csv,noheader,nounits"]
        try:
            # the instantaneous reading where the driver has it (power.draw is a 1 s average on recent drivers)
            ok = subprocess.run(cmd + ["--query-gpu=power.draw.instant"], capture_output=True).returncode == 0
            field = "power.draw.instant" if ok else "power.draw"
            self._proc = subprocess.Popen(cmd + [f"--query-gpu=clocks.sm,{field}", "-lms", "50"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            label = self._label
            try:
                clk, w = (float(v) for v in line.split(","))
            except ValueError:
                continue
            if label is not None:
                self._samples.setdefault(label, []).append((clk, w))

    @contextlib.contextmanager
    def label(self, name: str):
        self._label = name
        try:
            yield
        finally:
            self._label = None

    def summary(self, name: str) -> dict:
        s = self._samples.get(name)
        if not s:
            return {}
        return {"sm_mhz": statistics.mean(c for c, _ in s), "watts": statistics.mean(w for _, w in s)}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def make_step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        y = module(x)
        y.backward(dy)
    return step


DEQUANT_TAG = " +triton-dequant-gemm"


def dequant_gemm_switch(step, on: bool):
    """`step` with the sm_90 Triton dequant GEMM switched on or off while it runs (the process-wide switch
    that HYBRIDQ_TRITON_DEQUANT_GEMM sets at import), so both variants of a preset run interleaved in one process."""
    from hybridq.kernels import native_gemm as ng

    def run():
        with ng.TRITON_DEQUANT_GEMM.turned(on):
            step()
    return run


def profile_step(step, name: str, path: str, steps: int = 3) -> None:
    """Append to `path` the device kernels of `steps` steps (torch.profiler), largest total time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1e3 / steps
    with open(path, "a") as fh:
        print(f"\n==== {name}: device kernel time {busy:.3f} ms per step ({len(kernels) // steps} kernels) ====",
              file=fh)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=90),
              file=fh)


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
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds per candidate")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="append each linear's kernel profile (3 extra steps) to this file")
    ap.add_argument("--triton-dequant-gemm", action="store_true",
                    help="also time each preset with the sm_90 Triton dequant GEMM on (HYBRIDQ_TRITON_DEQUANT_GEMM), "
                    "as '<preset> +triton-dequant-gemm', interleaved with the same preset with it off")
    args = ap.parse_args()
    # every step feeds the same input tensor: with sharing on, hybridq would reuse its quantization from the step
    # before (the cache that lets wq/wk/wv quantize one input once), which a real step with a fresh input cannot
    shared_input_quantization(False)

    dev = torch.cuda.get_device_name()
    from hybridq.kernels import extension_available
    print(f"device: {dev}; torch {torch.__version__}; hybridq CUDA extension: {extension_available()}", flush=True)
    rows = []
    sampler = GpuSampler()
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flop = 3 * 2 * m * n * k
        cands = [("bf16 nn.Linear", nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))]
        for p in args.presets.split(","):
            cands.append((p, hybridq.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16,
                                            recipe=hybridq.recipe(p))))
            if args.triton_dequant_gemm:
                cands.append((p + DEQUANT_TAG, hybridq.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16,
                                                               recipe=hybridq.recipe(p))))
        if not args.no_torchao:
            cands += torchao_modules(k, n, {f"torchao_{v}" for v in args.torchao.split(",") if v})
        steps = {}
        for name, mod in cands:
            with torch.no_grad():
                for p in mod.parameters():
                    p.normal_(0, 0.02)
            steps[name] = make_step(mod, x, dy)
            if args.triton_dequant_gemm:
                steps[name] = dequant_gemm_switch(steps[name], name.endswith(DEQUANT_TAG))
            try:
                steps[name]()  # compiles (torch.compile'd candidates) before the measured, sampled rounds
            except Exception as e:  # noqa: BLE001
                print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                del steps[name]
        # rounds interleave the candidates, so clock and power drift (the FP8 GEMMs here run at the power limit)
        # hits them alike; each round is `bench` (median of back-to-back samples), the result the median round
        times: dict = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in list(steps.items()):
                try:
                    with sampler.label(f"{shape} {name}"):
                        times[name].append(bench(step, iters=args.iters))
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    del steps[name], times[name]
        base = None
        for name, step in steps.items():
            if args.profile:
                profile_step(step, f"{shape} {name}", args.profile)
            ms = statistics.median(times[name])
            base = base or ms
            row = {"shape": shape, "name": name, "ms": ms, "rounds_ms": times[name],
                   "tflops": flop / (ms * 1e-3) / 1e12, "speedup": base / ms, **sampler.summary(f"{shape} {name}")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cands, steps
        torch.cuda.empty_cache()
    sampler.stop()

    print("\n| shape MxKxN | linear | step ms | TFLOP/s | speed-up vs bf16 eager | SM MHz | W | J/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        clk, w = r.get("sm_mhz"), r.get("watts")
        extra = f"{clk:.0f} | {w:.0f} | {w * r['ms'] * 1e-3:.2f}" if clk else "– | – | –"
        print(f"| {r['shape']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['speedup']:.2f}x | {extra} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
