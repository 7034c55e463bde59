"""GEMM-only benchmark of the sm_90 MXFP8 x MXFP8 Triton kernel (hybridq.kernels.triton_mxfp8) against torch.mm in
bf16, torch._scaled_mm FP8 tensorwise (E4M3, fast accumulation on and off) and the bf16 emulation it replaces
(dequantize both operands to bf16, then torch.mm; with the CUDA extension's dequantize kernel when it is built).

For each Linear shape [tokens M, in K, out N] the three GEMMs of a step, as `a @ b^T` with a [m, k], b [n, k]:
fprop (M, N, K), dgrad (M, K, N), wgrad (N, K, M). TFLOP/s = 2 m n k / time (CUDA events, median).

    python benchmarks/bench_mxfp8_gemm.py
    python benchmarks/bench_mxfp8_gemm.py --shapes 8192x8192x8192 --configs all --json out.json
    python benchmarks/bench_mxfp8_gemm.py --diag     # where the time goes (see diag())
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_kernels import bench
from hybridq.kernels import triton_mxfp8 as tm


def _operands(m, n, k, g):
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(n, k, device="cuda", generator=g)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa = torch.randint(118, 136, (m, k // 32), device="cuda", generator=g, dtype=torch.uint8)
    sb = torch.randint(118, 136, (n, k // 32), device="cuda", generator=g, dtype=torch.uint8)
    return a.to(torch.bfloat16), b.to(torch.bfloat16), a8, b8, sa, sb


def _dequant(d, s):
    from hybridq.kernels import extension_available
    if extension_available():
        return torch.ops.hybridq.mxfp8_dequantize(d, s, torch.bfloat16)
    e = s.to(torch.int32).repeat_interleave(32, 1)
    return (d.float() * torch.exp2((e - 127).float())).to(torch.bfloat16)


def diag(n: int = 8192) -> None:
    """Where the kernel's time goes at n^3, per config: MODE 2 is a plain FP8 GEMM in the same kernel (scales
    ignored, one accumulator: the Triton FP8 ceiling), MODE 1 the fresh product per 32-wide K block added unscaled,
    MODE 0 the real kernel; with registers / spills, and for MODE 0 the layout conversions and MMA instructions of
    the compiled kernel (TTGIR / PTX) and the TTGIR lines that convert layouts."""
    g = torch.Generator(device="cuda").manual_seed(0)
    _, _, a8, b8, sa, sb = _operands(n, n, n, g)
    for mode in (2, 1, 0):
        for c in tm._CONFIGS:
            conf = dict(tm.config_dict(c), MODE=mode)
            fn = (lambda conf=conf: tm.mxfp8_mm(a8, sa, b8, sb, torch.bfloat16, config=conf))
            try:
                fn()
                kern = tm.LAST_COMPILED["kernel"]
                ms = bench(fn, iters=3, inner=3)
            except Exception as e:  # noqa: BLE001
                print(f"MODE {mode} {c}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"MODE {mode} {c}: {2 * n ** 3 / (ms * 1e-3) / 1e12:.0f} TFLOP/s, regs {kern.n_regs} spills "
                  f"{kern.n_spills}", flush=True)
            if mode == 0:
                ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
                print(f"  convert_layout {ttgir.count('convert_layout')}, warp_group_dot "
                      f"{ttgir.count('warp_group_dot ')}, wgmma.mma_async {ptx.count('wgmma.mma_async')}, "
                      f"mma.sync {ptx.count('mma.sync')}, bar.sync {ptx.count('bar.sync')}", flush=True)
                for line in ttgir.splitlines():
                    if "convert_layout" in line:
                        print("   ", line.strip()[:240])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x8192x8192,8192x4096x14336", help="Linear MxKxN,...")
    ap.add_argument("--configs", default="first", help="'all': time every fixed config on every GEMM; 'first': on "
                    "the first GEMM only; 'none'")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--diag", action="store_true", help="only the per-MODE breakdown at 8192^3 (see diag())")
    args = ap.parse_args()
    if args.diag:
        diag()
        return
    from hybridq.kernels import extension_available
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton available: {tm.available()}; "
          f"hybridq CUDA extension: {extension_available()}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    first = True
    for shape in args.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        for gemm_name, (m, n, k) in (("fprop", (M, N, K)), ("dgrad", (M, K, N)), ("wgrad", (N, K, M))):
            if M == K == N and gemm_name != "fprop":
                continue  # square: the three GEMMs have one shape
            a, b, a8, b8, sa, sb = _operands(m, n, k, g)
            one = torch.ones((), device="cuda")
            flop = 2 * m * n * k
            cands = {
                "bf16 torch.mm": lambda: torch.mm(a, b.t()),
                "fp8 tensorwise _scaled_mm (fast accum)": lambda: torch._scaled_mm(
                    a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True),
                "fp8 tensorwise _scaled_mm": lambda: torch._scaled_mm(
                    a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False),
                "mxfp8 emulation (dequant to bf16 + mm)": lambda: torch.mm(_dequant(a8, sa), _dequant(b8, sb).t()),
                "mxfp8 triton (autotuned)": lambda: tm.mxfp8_mm(a8, sa, b8, sb, torch.bfloat16),
            }
            if args.configs == "all" or (args.configs == "first" and first):
                for c in tm._CONFIGS:
                    conf = tm.config_dict(c)
                    if k % (32 * conf["SLICES"]):
                        continue
                    cands[f"mxfp8 triton {c}"] = (lambda conf=conf: tm.mxfp8_mm(a8, sa, b8, sb, torch.bfloat16,
                                                                                 config=conf))
            first = False
            # the kernel against the emulation on these operands (same fp8 bytes and scales)
            ref = torch.mm(_dequant(a8, sa).float(), _dequant(b8, sb).float().t())
            y = tm.mxfp8_mm(a8, sa, b8, sb, torch.float32)
            err = float((y - ref).norm() / ref.norm())
            print(f"{shape} {gemm_name} [{m}, {k}] x [{n}, {k}]^T: triton vs fp32 emulation relative error {err:.2e}",
                  flush=True)
            for name, fn in cands.items():
                try:
                    fn()
                    extra = ""
                    if name.startswith("mxfp8 triton (") and "kernel" in tm.LAST_COMPILED and "autotuned" not in name:
                        kern = tm.LAST_COMPILED["kernel"]
                        extra = f" regs {getattr(kern, 'n_regs', '?')} spills {getattr(kern, 'n_spills', '?')}"
                    ms = bench(fn, iters=args.iters)
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} {gemm_name} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row = {"shape": shape, "gemm": gemm_name, "mnk": [m, n, k], "name": name, "ms": ms,
                       "tflops": flop / (ms * 1e-3) / 1e12}
                rows.append(row)
                print(f"{shape} {gemm_name} | {name} | {ms:.3f} ms | {row['tflops']:.0f} TFLOP/s{extra}", flush=True)
            del a, b, a8, b8, sa, sb, ref, y
            torch.cuda.empty_cache()
    if tm.available():
        best = getattr(tm._mxfp8_gemm_tuned, "cache", {})
        for key, cfg in best.items():
            print(f"autotuned {key[:3]}: {cfg}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
