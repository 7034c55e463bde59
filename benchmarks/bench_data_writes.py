"""What the data-write check costs ([Note: data-write check], hybridq/data_writes.py), in two parts:

1. Host microseconds per check, on a weight shard small enough that the device is never the limit (calls back to back,
   one synchronize at the end): the fingerprint alone (`bits_sum`: one launch), a check of a decision of one rank
   (`Ledger.reused(local=True)`: on the CPU compared at once; on CUDA queued, compared in batches), a check of a
   world > 1 decision (queued for precompute_scales), and the batch work per queued check (`_flush` / the fold).
2. Device time of the fingerprint of an activation `[tokens, dim]` against that activation's input quantization
   (rowwise + columnwise, what a Linear's shared input quantization saves the second Linear reading it): what a
   check of the shared input quantization would cost per reuse (docs/known-limits.md, "Writes through `.data`").

    python benchmarks/bench_data_writes.py                       # CPU
    python benchmarks/bench_data_writes.py --device cuda --tokens 16384 --dim 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hybridq
from hybridq.data_writes import Ledger, QueuedChecks, bits_sum


def per_call_us(fn, device: torch.device, n: int, rounds: int, clock=time.perf_counter) -> float:
    """The median over `rounds` of the mean microseconds per call of `n` calls back to back."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(n):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((clock() - t0) / n * 1e6)
    return statistics.median(out)


def host_costs(device: torch.device, rows: int, cols: int, n: int, rounds: int) -> dict:
    w = torch.randn(rows, cols, device=device)
    ref = bits_sum(w)

    queue, mine = QueuedChecks("w"), QueuedChecks("w")  # (a weight's queue of world > 1 checks; its local key)
    ledger = Ledger()

    def local():  # (on CUDA: queued, a batch compare every _FLUSH checks included)
        ledger.reused("w", w, ref, mine, True, "a payload")

    def deferred():
        ledger.reused("w", w, ref, queue, False, "statistics")
        if not queue.will_report(False):  # (as precompute_scales' report would: else it stops queuing)
            queue.count = 0

    weights = [QueuedChecks(f"w{i}") for i in range(140)]

    def batch():  # one step's queued checks of a 140-weight model, compared in one batch
        for q in weights:
            ledger.queue_local(q.name, q, ref, bits_sum(w), "a payload")
        ledger._flush()
        ledger.reports.clear()

    return {"bits_sum": per_call_us(lambda: bits_sum(w), device, n, rounds),
            "check, one rank (CPU: compared now; CUDA: queued)": per_call_us(local, device, n, rounds),
            "check, world > 1 (queued)": per_call_us(deferred, device, n, rounds),
            "one batch of 140 queued checks (incl. their 140 bits_sum and queueing)": per_call_us(batch, device, max(n // 100, 5),
                                                                                      rounds)}


def device_costs(device: torch.device, tokens: int, dim: int, presets: list[str], n: int, rounds: int) -> dict:
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    out = {"fingerprint of x": per_call_us(lambda: bits_sum(x), device, n, rounds)}
    for preset in presets:
        q = hybridq.recipe(preset).quantizer(hybridq.Role("linear", "input", "bench"))
        out[f"{preset} input quantization of x (rowwise + columnwise)"] = per_call_us(
            lambda: q.quantize(x, rowwise=True, columnwise=True), device, n, rounds)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=64, help="the weight shard of the host measurement")
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--presets", default="fp8_tensorwise,mxfp8")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    result = {"device": str(device), "torch": torch.__version__,
              "host_us_per_call": host_costs(device, args.rows, args.cols, args.calls, args.rounds),
              "device_us_per_call": device_costs(device, args.tokens, args.dim, args.presets.split(","),
                                                 max(args.calls // 100, 5), args.rounds)}
    print(f"bench_data_writes.py: {device}, torch {torch.__version__}")
    print(f"host, weight shard [{args.rows}, {args.cols}] fp32:")
    for k, v in result["host_us_per_call"].items():
        print(f"  {k:62s} {v:9.2f} us")
    print(f"per call, activation [{args.tokens}, {args.dim}] bf16:")
    for k, v in result["device_us_per_call"].items():
        print(f"  {k:62s} {v:9.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
