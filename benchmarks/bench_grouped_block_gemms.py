"""The two backends of the packed path's FP8 block GEMMs, phase by phase (what `grouped_blocks.CUBLAS_COST` is
measured with): the Triton grouped kernels (`triton_grouped_blocks`) and the cuBLAS loop (one block-scaled cuBLAS
GEMM per expert from C++: `hybridq::grouped_block_cublas_mm` / `_wgrad`), on random E4M3 operands in the slot
layout of bench_grouped's configs (each expert's slot its token count rounded up to 128, as with wgrad), the loop on
one stream and on two (csrc/expert_streams.h). Per phase:
milliseconds per call with CUDA events around 10 back-to-back calls (host dispatch overlapping the GPU, as in
training) and the host's share (wall time of the calls alone). CUDA sm_90 with Triton and the built extension only.

    python benchmarks/bench_grouped_block_gemms.py [--configs 16x16384x4x2048x5632,...]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench_grouped import DEFAULT_CONFIGS, routed_splits


def _fp8(*shape):
    return (torch.randn(*shape, device="cuda") * 40).clamp(-440, 440).to(torch.float8_e4m3fn)


def _scales(*shape):
    return torch.exp2(torch.randint(-6, 6, shape, device="cuda").float())


def _ms(fn, iters: int = 10) -> tuple[float, float]:
    """(ms per call on the GPU clock, ms per call of host time)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) * 1e3 / iters
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters, host


def phases(e: int, splits: list[int], d: int, h: int) -> dict:
    """{phase: (Triton fn, cuBLAS-loop fn of the stream count)} of a `[E, h, d]` projection with 128x128 weight
    tiles."""
    from hybridq.kernels import triton_grouped_blocks as tgb
    p = [-(-m // 128) * 128 for m in splits]
    offs = [sum(p[:g]) for g in range(e)]
    starts = [sum(splits[:g]) for g in range(e)]
    s, t, kd, kh = sum(p), sum(splits), d // 128, h // 128
    x, sx, dy, sdy = _fp8(s, d), _scales(s, kd), _fp8(s, h), _scales(s, kh)
    w, sw = _fp8(e * h, d), _scales(e * kh, kd)  # rowwise weight (fprop)
    wc, swc = _fp8(d, e * h), _scales(kd, e * kh)  # columnwise weight (dgrad)
    dyc, sdyc, xc, sxc = _fp8(h, s), _scales(h, s // 128), _fp8(d, s), _scales(d, s // 128)
    bounds = torch.tensor([offs, starts, splits], dtype=torch.int32, device="cuda")
    slots = torch.tensor([offs, p], dtype=torch.int32, device="cuda")
    bsf = F.pad(sw, (0, -kd % 4)).reshape(e, kh, -1)
    bsd = F.pad(swc.reshape(kd, e, kh).permute(1, 0, 2), (0, -kh % 4)).contiguous()
    ops = torch.ops.hybridq
    return {
        "fprop": (lambda: tgb.grouped_block_mm(x, sx, w, h * d, d, h, sw, (kh * kd, kd, 1), 128, bounds, t),
                  lambda st: ops.grouped_block_cublas_mm(x, sx, w, bsf, True, 0, offs, p, splits, slots[0], slots[1],
                                                         torch.bfloat16, st)),
        "dgrad": (lambda: tgb.grouped_block_mm(dy, sdy, wc, h, e * h, d, swc, (kh, e * kh, 1), 128, bounds, t),
                  lambda st: ops.grouped_block_cublas_mm(dy, sdy, wc, bsd, True, 1, offs, p, splits, slots[0],
                                                         slots[1], torch.bfloat16, st)),
        "wgrad": (lambda: tgb.grouped_block_wgrad(dyc, sdyc, xc, sxc, bounds[0], slots[1], True),
                  lambda st: ops.grouped_block_cublas_wgrad(dyc, sdyc, xc, sxc, offs, p, torch.bfloat16, st)),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="ExTxKxDxH,... (bench_grouped's)")
    args = ap.parse_args(argv)
    from hybridq.kernels import _ext, grouped_blocks
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and grouped_blocks._triton() is not None and _ext.load()
            and hasattr(torch.ops.hybridq, "grouped_block_cublas_mm")):
        raise SystemExit("bench_grouped_block_gemms: needs CUDA sm_90, Triton and the built extension "
                         f"({_ext.error() or 'no GPU'})")
    print("| config | phase | Triton ms (host) | TFLOP/s | cuBLAS loop, one stream: ms (host) | TFLOP/s | two streams: "
          "ms (host) | TFLOP/s |\n|---|---|---|---|---|---|---|---|")
    for cfg in args.configs.split(","):
        e, tokens, top_k, d, h = (int(v) for v in cfg.split("x"))
        splits = routed_splits(e, tokens, top_k)
        flop = 2.0 * sum(splits) * d * h
        for name, (triton, cublas) in phases(e, splits, d, h).items():
            cells = [_ms(triton)] + [_ms(lambda st=st: cublas(st)) for st in (1, 2)]
            print(f"| {cfg} | {name} | " + " | ".join(f"{g:.3f} ({h:.3f}) | {flop / g / 1e9:.0f}" for g, h in cells)
                  + " |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
