"""Quantize-kernel benchmark: each quantizer at 8192^2 and 16384^2 bf16 inputs, rowwise + columnwise in one call.

For every case it reports the time of the CUDA kernel path (`quantizer.quantize_parts`, Python dispatch
included), of the eager PyTorch reference and of `torch.compile` of the reference, and the achieved bandwidth
(bytes read + bytes written, counting the input once and every output once) as a fraction of the device's
copy bandwidth measured in the same run.

    python benchmarks/bench_kernels.py                 # everything (torch.compile: a few minutes of compiling)
    python benchmarks/bench_kernels.py --no-compile    # skip torch.compile
    python benchmarks/bench_kernels.py --sizes 8192 --cases fp8_tensorwise,mxfp8 --json out.json
    python benchmarks/bench_kernels.py --no-compile --no-reference --sizes 16384 --dequant  # + the dequantize kernels
    python benchmarks/bench_kernels.py --tile-cfgs 0,2,g8  # also time the op under other tile-kernel configurations:
                        # N = HYBRIDQ_TILE_CFG=N (needs a build with HYBRIDQ_TILE_VARIANTS=1; 0 one-shot, 2 three
                        # stages x 512 threads), gN = HYBRIDQ_TILE_GROUP=N (tile order: groups of N tile rows);
                        # NVFP4 rows also time the quantize kernel alone (amaxes given) under each

Rows besides the quantizers: `fp8_tensorwise_cast` is the cast pass of per-tensor FP8 alone (amax given, as with a
global amax), `amax` the max|x| pass alone (bytes = the input read once). `--delayed N` also times the
delayed-scaling update of N quantizers (history 1024): `update_delayed_scaling` against a loop of `update()`.
NVFP4 rows also time the quantize kernel alone, its global amaxes given (the op without them first reads the input
once more for them: with rht, transforming it too); `--dequant` adds the MXFP8 / NVFP4 dequantize kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hybridq.formats import Float8BlockQuantizer, Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer

CASES = {
    # name: (factory, rowwise, columnwise, note)
    "fp8_tensorwise": (lambda: Float8Quantizer(), True, True, "amax pass + fused cast/transpose"),
    "fp8_tensorwise_row": (lambda: Float8Quantizer(), True, False, "amax pass + cast"),
    "fp8_tensorwise_cast": (lambda: Float8Quantizer(), True, True, "cast pass only (amax given)"),
    "amax": (None, False, False, "max|x| pass only (reads the input)"),
    "fp8_delayed": (lambda: Float8Quantizer(scaling="delayed"), True, True, "one pass (amax fused)"),
    "fp8_block_1x128": (lambda: Float8BlockQuantizer(), True, True, ""),
    "fp8_block_128x128": (lambda: Float8BlockQuantizer(block_dim=2), True, True, ""),
    "mxfp8": (lambda: MXFP8Quantizer(), True, True, ""),
    "mxfp8_32x32": (lambda: MXFP8Quantizer(block_2d=True), True, True, ""),
    "nvfp4": (lambda: NVFP4Quantizer(), True, True, "amax pass + fused cast"),
    "nvfp4_16x16": (lambda: NVFP4Quantizer(block_2d=True), True, True, "amax pass + fused cast"),
    "nvfp4_rht": (lambda: NVFP4Quantizer(rht=True), True, True, "amax(+RHT) pass + fused cast"),
    "nvfp4_rht_sr": (lambda: NVFP4Quantizer(rht=True, stochastic_rounding=True), True, True, "as nvfp4_rht, SR"),
}
COMPILE_CASES = ("fp8_tensorwise", "fp8_block_1x128", "mxfp8", "nvfp4_rht")


def bench(fn, warmup: int = 3, iters: int = 20, inner: int = 5) -> float:
    """Milliseconds per call of fn(): median over `iters` samples of `inner` back-to-back calls (CUDA events),
    so host-side dispatch overlaps with the previous call's kernels as in a training step."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / (ms * 1e-3)


def raw_op(q, x, r, c, name=""):
    """The CUDA op alone (no Python dispatch, no delayed-scaling state update), or None."""
    ops = torch.ops.hybridq
    if name == "amax":
        return lambda: ops.amax(x)
    if name == "fp8_tensorwise_cast":
        am = x.float().abs().amax().reshape(1)
        return lambda: ops.fp8_tensor_quantize(x, q.dtype, None, am, 0.0, False, r, c, False)
    if isinstance(q, Float8Quantizer):
        if q.scaling == "delayed":
            s = torch.ones(1, device=x.device)
            return lambda: ops.fp8_tensor_quantize(x, q.dtype, s, None, 0.0, False, r, c, True)
        return lambda: ops.fp8_tensor_quantize(x, q.dtype, None, None, 0.0, False, r, c, False)
    if isinstance(q, Float8BlockQuantizer):
        return lambda: ops.fp8_block_quantize(x, q.dtype, q.block_dim, 0.0, q.power_2_scale, r, c)
    if isinstance(q, MXFP8Quantizer):
        return lambda: ops.mxfp8_quantize(x, q.dtype, q.block_2d, r, c, False)
    if isinstance(q, NVFP4Quantizer):
        return lambda: ops.nvfp4_quantize(x, q.block_2d, q.rht, q.stochastic_rounding, None, r, c)
    return None


def tile_op(q, x, r, c):
    """NVFP4's quantize kernel alone (the op with its global amaxes given, as a sharded tensor gets them), or None.
    The op without them first runs an amax pass over the input (with rht: the transform too)."""
    if not isinstance(q, NVFP4Quantizer):
        return None
    ops = torch.ops.hybridq
    p = ops.nvfp4_quantize(x, q.block_2d, q.rht, q.stochastic_rounding, None, r, c)
    am_r, am_c = p[2], p[5]
    return lambda: ops.nvfp4_quantize(x, q.block_2d, q.rht, q.stochastic_rounding, None, r, c, am_r, am_c)


def bench_dequant(n: int, bw: float, iters: int) -> list:
    """The MXFP8 / NVFP4 dequantize kernels (a rowwise part of an n x n bf16 input) to bf16 and fp32: bytes = codes +
    scales read + values written."""
    ops = torch.ops.hybridq
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    nv = ops.nvfp4_quantize(x, False, False, False, None, True, False)
    mx = ops.mxfp8_quantize(x, torch.float8_e4m3fn, False, True, False, False)
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        for name, fn, ins in (("nvfp4_dequant", lambda: ops.nvfp4_dequantize(nv[0], nv[1], nv[2], False, True, dt),
                               (nv[0], nv[1])),
                              ("mxfp8_dequant", lambda: ops.mxfp8_dequantize(mx[0], mx[1], dt), (mx[0], mx[1]))):
            nbytes = sum(t.numel() * t.element_size() for t in ins) + n * n * torch.finfo(dt).bits // 8
            t = bench(fn, iters=iters)
            rows.append({"case": f"{name}_{str(dt).split('.')[-1]}", "n": n, "bytes": nbytes, "op_ms": t,
                         "op_frac": nbytes / (t * 1e-3) / bw})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def out_bytes(parts) -> int:
    return sum(p.nbytes() for p in parts if p is not None)


def tensors_of(parts):
    return [t for p in parts if p is not None for t in p.tensors().values() if t is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,16384")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-cases", default=",".join(COMPILE_CASES))
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tile-cfgs", default="", help="comma-separated tile-kernel variants to time the op under "
                                                    "(N: HYBRIDQ_TILE_CFG=N, gN: HYBRIDQ_TILE_GROUP=N)")
    ap.add_argument("--delayed", type=int, default=0, help="also time the delayed-scaling update of N quantizers")
    ap.add_argument("--dequant", action="store_true", help="also time the MXFP8 / NVFP4 dequantize kernels")
    args = ap.parse_args()
    tile_cfgs = [c for c in args.tile_cfgs.split(",") if c]

    from hybridq.kernels import extension_available
    if not extension_available():
        raise SystemExit("the hybridq CUDA extension is not built (python setup.py build_ext --inplace)")
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"device: {dev}; torch {torch.__version__}; copy bandwidth (read+write) {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    compile_cases = set(args.compile_cases.split(",")) if not args.no_compile else set()
    for n in sizes:
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for name in args.cases.split(","):
            factory, r, c, note = CASES[name]
            q = factory() if factory is not None else None
            kw = {}
            if name == "fp8_tensorwise_cast":
                kw = {"amax": x.float().abs().amax().reshape(1)}
            if q is not None:
                parts = q.quantize_parts(x, r, c, **kw)
                nbytes = x.numel() * x.element_size() + out_bytes(parts)
                del parts
                t_k = bench(lambda: q.quantize_parts(x, r, c, **kw), iters=args.iters)
            else:
                nbytes = x.numel() * x.element_size()
                t_k = bench(lambda: torch.ops.hybridq.amax(x), iters=args.iters)
            row = {"case": name, "n": n, "bytes": nbytes, "kernel_ms": t_k, "kernel_frac": nbytes / (t_k * 1e-3) / bw,
                   "note": note}
            op = raw_op(q, x, r, c, name)
            if op is not None:
                t_o = bench(op, iters=args.iters)
                row.update(op_ms=t_o, op_frac=nbytes / (t_o * 1e-3) / bw)
                tile = tile_op(q, x, r, c)
                if tile is not None:  # NVFP4: the quantize kernel alone, its global amaxes given
                    t_t = bench(tile, iters=args.iters)
                    row.update(tile_ms=t_t, tile_frac=nbytes / (t_t * 1e-3) / bw)
                for cfg in tile_cfgs:
                    var = "HYBRIDQ_TILE_GROUP" if cfg.startswith("g") else "HYBRIDQ_TILE_CFG"
                    os.environ[var] = cfg.lstrip("g")
                    try:
                        t_c = bench(op, iters=args.iters)
                        t_tc = bench(tile, iters=args.iters) if tile is not None else None
                    finally:
                        os.environ.pop(var, None)
                    row[f"op_ms_cfg{cfg}"] = t_c
                    row[f"op_frac_cfg{cfg}"] = nbytes / (t_c * 1e-3) / bw
                    if t_tc is not None:
                        row[f"tile_ms_cfg{cfg}"] = t_tc
                        row[f"tile_frac_cfg{cfg}"] = nbytes / (t_tc * 1e-3) / bw
            if q is None or name == "fp8_tensorwise_cast":
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            if not args.no_reference:
                qr = factory()
                try:
                    t_r = bench(lambda: qr.reference_parts(x, r, c), warmup=1, iters=max(3, args.iters // 4), inner=1)
                    row.update(ref_ms=t_r, ref_frac=nbytes / (t_r * 1e-3) / bw)
                except torch.OutOfMemoryError:
                    row.update(ref_ms=None)
                torch.cuda.empty_cache()
            if name in compile_cases:
                qc = factory()
                fn = torch.compile(lambda t: tensors_of(qc.reference_parts(t, r, c)), dynamic=False)
                try:
                    t0 = time.time()
                    fn(x)
                    row["compile_s"] = time.time() - t0
                    t_c = bench(lambda: fn(x), iters=args.iters)
                    row.update(compiled_ms=t_c, compiled_frac=nbytes / (t_c * 1e-3) / bw)
                except Exception as e:  # noqa: BLE001  (report, keep going)
                    row["compiled_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x
        torch.cuda.empty_cache()
        if args.dequant:
            rows += bench_dequant(n, bw, args.iters)
            torch.cuda.empty_cache()

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    print(f"\n| case | size | MB moved | op ms | op % of copy BW | quantize_parts ms | % | eager ref ms | eager % | "
          f"compiled ms | compiled % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "kernel_ms" not in r:  # dequantize rows: below
            continue
        print(f"| {r['case']} | {r['n']}^2 | {r['bytes'] / 1e6:.0f} | {f(r.get('op_ms'), '{:.3f}')} | "
              f"{f(r.get('op_frac') and 100 * r['op_frac'], '{:.0f}%')} | {r['kernel_ms']:.3f} | {100 * r['kernel_frac']:.0f}% | "
              f"{f(r.get('ref_ms'), '{:.2f}')} | {f(r.get('ref_frac') and 100 * r['ref_frac'], '{:.0f}%')} | "
              f"{f(r.get('compiled_ms'), '{:.3f}')} | "
              f"{f(r.get('compiled_frac') and 100 * r['compiled_frac'], '{:.0f}%')} |")
    extra = [r for r in rows if "tile_ms" in r or "kernel_ms" not in r]
    if extra:
        print("\n| case | size | MB moved | kernel ms (% of copy BW) |\n|---|---|---|---|")
        for r in extra:  # NVFP4's quantize kernel alone (amaxes given), the dequantize kernels
            ms, frac = (r["tile_ms"], r["tile_frac"]) if "tile_ms" in r else (r["op_ms"], r["op_frac"])
            name = r["case"] + (" (amax given)" if "tile_ms" in r else "")
            print(f"| {name} | {r['n']}^2 | {r['bytes'] / 1e6:.0f} | {ms:.3f} ({100 * frac:.0f}%) |")
    if tile_cfgs:
        print(f"\n| case | size | " + " | ".join(f"cfg {c} ms (% copy BW)" for c in tile_cfgs) + " |")
        print("|---|---|" + "---|" * len(tile_cfgs))
        for r in rows:
            print(f"| {r['case']} | {r['n']}^2 | " + " | ".join(
                f"{r[f'op_ms_cfg{c}']:.3f} ({100 * r[f'op_frac_cfg{c}']:.0f}%)" if f"op_ms_cfg{c}" in r else "-"
                for c in tile_cfgs) + " |")
            if f"tile_ms_cfg{tile_cfgs[0]}" in r:  # NVFP4: the quantize kernel alone (amaxes given)
                print(f"| {r['case']} (amax given) | {r['n']}^2 | " + " | ".join(
                    f"{r[f'tile_ms_cfg{c}']:.3f} ({100 * r[f'tile_frac_cfg{c}']:.0f}%)" for c in tile_cfgs) + " |")
    delayed = None
    if args.delayed:
        delayed = bench_delayed(args.delayed)
        print(f"\ndelayed-scaling update of {args.delayed} quantizers (history 1024): "
              f"update_delayed_scaling {delayed['batched_ms']:.3f} ms, loop of update() {delayed['loop_ms']:.3f} ms",
              flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "torch": torch.__version__, "copy_bw": bw, "rows": rows, "delayed": delayed},
                      fh, indent=1)


def bench_delayed(n: int) -> dict:
    """Wall time per update of n delayed-scaling quantizers (host + device: synchronized at the end of each)."""
    from hybridq.kernels import update_delayed_scaling

    def make():
        qs = [Float8Quantizer(scaling="delayed", amax_history_len=1024) for _ in range(n)]
        for q in qs:
            q.amax_history = torch.rand(1024, device="cuda")
            q.scale = torch.ones(1, device="cuda")
        return qs

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    qa, qb = make(), make()
    return {"n": n, "batched_ms": timed(lambda: update_delayed_scaling(qa)),
            "loop_ms": timed(lambda: [q.update() for q in qb])}


if __name__ == "__main__":
    main()
