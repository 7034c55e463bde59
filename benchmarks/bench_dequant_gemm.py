"""GEMM-only benchmark of the sm_90 MXFP8 / NVFP4 GEMM that dequantizes K tiles in registers
(hybridq.kernels.triton_dequant_gemm) against torch.mm in bf16, torch._scaled_mm FP8 tensorwise (E4M3, fast
accumulation) and the bf16 emulation it would replace (the CUDA extension's dequantize kernels write bf16 copies,
then torch.mm; NVFP4 with an fp32 result times the global factors, as `native_gemm._bf16_run`); for MXFP8 x MXFP8
also the FP8-tensor-core kernel hybridq.kernels.triton_mxfp8 (its default config).

For each Linear shape [tokens M, in K, out N] the three GEMMs of a step, as `a @ b^T` with a [m, k], b [n, k]:
fprop (M, N, K), dgrad (M, K, N), wgrad (N, K, M); pairings MXFP8 x MXFP8, NVFP4 x NVFP4, MXFP8 x NVFP4.
TFLOP/s = 2 m n k / time (CUDA events, median). Each GEMM first prints the kernel's relative error against the
emulation's fp32 math on the same operands.

    python benchmarks/bench_dequant_gemm.py --smoke     # one small GEMM per pairing: does it compile, is it right?
    python benchmarks/bench_dequant_gemm.py
    python benchmarks/bench_dequant_gemm.py --shapes 8192x8192x8192 --pairs nvfp4xnvfp4 --configs --json out.json
    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section InstructionStats \
        -k regex:dequant python benchmarks/bench_dequant_gemm.py --profile-once   # one launch per pairing, for Nsight
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from bench_kernels import bench
from hybridq.kernels import triton_dequant_gemm as tdg
from hybridq.kernels.native_gemm import _mm_fp32_out

PAIRS = {"mxfp8xmxfp8": (tdg.MXFP8, tdg.MXFP8), "nvfp4xnvfp4": (tdg.NVFP4, tdg.NVFP4),
         "mxfp8xnvfp4": (tdg.MXFP8, tdg.NVFP4), "nvfp4xmxfp8": (tdg.NVFP4, tdg.MXFP8)}


def operand(fmt: int, rows: int, k: int, g: torch.Generator) -> tdg.Operand:
    """Random operand as a quantizer would store it: MXFP8 E4M3 codes of N(0, 1) values and E8M0 bytes 118..135;
    NVFP4 uniform random E2M1 codes, E4M3 block scales of values in [0.25, 4), global amax 1."""
    if fmt == tdg.MXFP8:
        codes = torch.randn(rows, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
        scale = torch.randint(118, 136, (rows, k // 32), device="cuda", generator=g, dtype=torch.uint8)
        return tdg.mxfp8_operand(codes, scale)
    codes = torch.randint(0, 256, (rows, k // 2), device="cuda", generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, k // 16, device="cuda", generator=g) * 3.75 + 0.25).to(torch.float8_e4m3fn)
    return tdg.nvfp4_operand(codes, scale, torch.ones(1, device="cuda"))


def emulation_operand(p: tdg.Operand) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The emulation's (bf16 copy, fp32 global factor or None): the CUDA extension's dequantize kernels
    (`native_gemm.exact_bf16_operand`)."""
    ops = torch.ops.hybridq
    if p.fmt == tdg.MXFP8:
        return ops.mxfp8_dequantize(p.codes, p.scale, torch.bfloat16), None
    return ops.nvfp4_dequantize(p.codes, p.scale, p.amax, False, False, torch.bfloat16), p.amax / 2688.0


def emulation(a: tdg.Operand, b: tdg.Operand, fp32_out: bool = False) -> torch.Tensor:
    """`native_gemm._bf16_run` on the operands: dequantize to bf16 copies, torch.mm, global factors."""
    (ma, fa), (mb, fb) = emulation_operand(a), emulation_operand(b)
    if fa is None and fb is None and not fp32_out:
        return torch.mm(ma, mb.t())
    y = _mm_fp32_out(ma, mb.t())
    for f in (fa, fb):
        if f is not None:
            y = y * f
    return y if fp32_out else y.to(torch.bfloat16)


def smoke() -> int:
    """One 256 x 192 x 512 GEMM per pairing with the default config (and the autotuned launch once): prints SMOKE OK
    or, for each failure, SMOKE FAILED with the error. Without the CUDA extension the reference is torch ops."""
    from hybridq.kernels import extension_available

    print(f"smoke: device {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__}, triton available {tdg.available()}, hybridq CUDA extension "
          f"{extension_available()}", flush=True)
    if not tdg.available():
        print("SMOKE FAILED: Triton does not import", flush=True)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    failed = 0
    for name, (fa, fb) in PAIRS.items():
        for autotuned in (False, True):
            if autotuned and name != "nvfp4xnvfp4":
                continue
            what = f"{name} 256x192x512 {'autotuned' if autotuned else 'default config'}"
            t0 = time.time()
            try:
                a, b = operand(fa, 256, 512, g), operand(fb, 192, 512, g)
                cfg = None if autotuned else tdg.default_config(512, fa, fb)
                y = tdg.dequant_mm(a, b, torch.float32, config=cfg)
                torch.cuda.synchronize()
                ref = emulation(a, b, fp32_out=True) if extension_available() else None
                if ref is not None:
                    err = float((y - ref).norm() / ref.norm())
                    ok = err < 1e-5  # exact bf16 products in both: only the fp32 summation order differs
                    print(f"SMOKE {'OK' if ok else 'FAILED'}: {what}: relative error vs emulation {err:.2e} "
                          f"({time.time() - t0:.1f} s incl. compile)", flush=True)
                    failed += not ok
                else:
                    ok = bool(torch.isfinite(y).all())
                    print(f"SMOKE {'OK' if ok else 'FAILED'}: {what}: ran, finite {ok} (no extension: not "
                          f"compared) ({time.time() - t0:.1f} s)", flush=True)
                    failed += not ok
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"SMOKE FAILED: {what}: {type(e).__name__}: {str(e)[:3000]}", flush=True)
                traceback.print_exc(limit=4)
    print("SMOKE OK (all pairings)" if not failed else f"SMOKE FAILED ({failed} cases)", flush=True)
    return 1 if failed else 0


def profile_once(n: int = 8192) -> None:
    """Two launches per pairing (MXFP8 x MXFP8, NVFP4 x NVFP4) at n^3 with the config the autotuner chose on an
    H100 (128x256x64, 8 warps, 3 stages), nothing else on the GPU: the target of an Nsight Compute run."""
    g = torch.Generator(device="cuda").manual_seed(0)
    conf = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    for fa, fb in (PAIRS["mxfp8xmxfp8"], PAIRS["nvfp4xnvfp4"]):
        a, b = operand(fa, n, n, g), operand(fb, n, n, g)
        for _ in range(2):
            tdg.dequant_mm(a, b, torch.bfloat16, config=conf)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x8192x8192,8192x4096x14336", help="Linear MxKxN,...")
    ap.add_argument("--pairs", default="mxfp8xmxfp8,nvfp4xnvfp4,mxfp8xnvfp4", help=",".join(PAIRS))
    ap.add_argument("--configs", action="store_true", help="also time every fixed config on the first GEMM")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="only the smoke test (see smoke()); exit 1 on failure")
    ap.add_argument("--profile-once", action="store_true", help="only the launches to profile (see profile_once())")
    args = ap.parse_args()
    if args.smoke:
        sys.exit(smoke())
    if args.profile_once:
        return profile_once()
    from hybridq.kernels import extension_available
    from hybridq.kernels import triton_mxfp8 as tm

    ext = extension_available()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton available: {tdg.available()}; "
          f"hybridq CUDA extension: {ext}" + ("" if ext else " (emulation rows skipped)"), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, first = [], True
    for shape in args.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        for gemm_name, (m, n, k) in (("fprop", (M, N, K)), ("dgrad", (M, K, N)), ("wgrad", (N, K, M))):
            if M == K == N and gemm_name != "fprop":
                continue  # square: the three GEMMs have one shape
            flop = 2 * m * n * k
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
            x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            cands = {"bf16 torch.mm": lambda: torch.mm(x, w.t()),
                     "fp8 tensorwise _scaled_mm (fast accum)": lambda: torch._scaled_mm(
                         x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)}
            for pair in args.pairs.split(","):
                fa, fb = PAIRS[pair]
                a, b = operand(fa, m, k, g), operand(fb, n, k, g)
                if ext:
                    ref = emulation(a, b, fp32_out=True)
                    y = tdg.dequant_mm(a, b, torch.float32)
                    err = float((y - ref).norm() / ref.norm())
                    print(f"{shape} {gemm_name} [{m}, {k}] x [{n}, {k}]^T {pair}: triton dequant vs emulation "
                          f"relative error {err:.2e}", flush=True)
                    del ref, y
                    cands[f"{pair} emulation (dequant kernels + bf16 mm)"] = (lambda a=a, b=b: emulation(a, b))
                cands[f"{pair} triton dequant (autotuned)"] = (lambda a=a, b=b: tdg.dequant_mm(a, b, torch.bfloat16))
                if pair == "mxfp8xmxfp8" and tm.available():
                    conf = tm.default_config(k)
                    cands[f"{pair} triton_mxfp8 (FP8 tensor cores, default config)"] = (
                        lambda a=a, b=b, conf=conf: tm.mxfp8_mm(a.codes, a.scale, b.codes, b.scale, torch.bfloat16,
                                                                config=conf))
                if args.configs and first:
                    for c in tdg._CONFIGS:
                        conf = tdg.config_dict(c)
                        if k % conf["BLOCK_K"] or conf["BLOCK_K"] < 64:
                            continue
                        cands[f"{pair} triton dequant {c}"] = (
                            lambda a=a, b=b, conf=conf: tdg.dequant_mm(a, b, torch.bfloat16, config=conf))
            first = False
            for name, fn in cands.items():
                try:
                    fn()
                    extra = ""
                    if " triton dequant (" in name and "autotuned" not in name and "kernel" in tdg.LAST_COMPILED:
                        kern = tdg.LAST_COMPILED["kernel"]
                        extra = f" regs {getattr(kern, 'n_regs', '?')} spills {getattr(kern, 'n_spills', '?')}"
                    ms = bench(fn, iters=args.iters)
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} {gemm_name} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row = {"shape": shape, "gemm": gemm_name, "mnk": [m, n, k], "name": name, "ms": ms,
                       "tflops": flop / (ms * 1e-3) / 1e12}
                rows.append(row)
                print(f"{shape} {gemm_name} | {name} | {ms:.3f} ms | {row['tflops']:.0f} TFLOP/s{extra}", flush=True)
            del cands, x, w, x8, w8
            torch.cuda.empty_cache()
    if tdg.available():
        for key, cfg in getattr(tdg._dequant_gemm_tuned, "cache", {}).items():
            print(f"autotuned {key}: {cfg}", flush=True)
    print("\n| shape MxKxN | GEMM | candidate | ms | TFLOP/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['gemm']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
