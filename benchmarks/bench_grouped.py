"""Grouped linear (mixture-of-experts) forward+backward step benchmark, eager: bf16 `torch._grouped_mm`, every
hybridq preset's `GroupedLinear`, and a per-expert loop of bf16 `nn.Linear`.

A config `ExTxKxDxH` is E experts, T tokens each routed to K experts (T*K rows, split over the experts by a
seeded random top-K routing: uneven counts, as a router gives them), one grouped projection d_model D -> hidden H
(weight [E, H, D]). One step is y = layer(x sorted by expert, m_splits); y.backward(dy): three GEMMs per expert
(fprop, dgrad, wgrad) plus every quantization. Defaults: Mixtral-like E=8 top-2 d4096 h14336, E=16 top-4 d2048
h5632 and fine-grained E=64 top-8 d2048 h3072, each at 16k tokens.

Each candidate is timed in --rounds interleaved rounds (`measure`): every timed block of --iters steps comes right
after --warm-steps untimed steps of the same candidate, and the order of the candidates rotates by one each round.
The steps timed right after bf16's ran slower than the same layer's placed later: with blocks of 1 warm + 5 timed
steps (the defaults until 2026-11-29) the preset's row, which follows a bf16 candidate in every round, ran 3-8%
slower than the same layer's "(jagged path)" row on an H200, its GEMMs slower in the profile too (what bf16's
sustained tensor-core load leaves in the clocks); with 10 warm + 20 timed steps (the defaults now, ~0.2-0.4 s per
block) the two rows agree within 1%, and bf16 itself measures what a sustained run gives it (slower than in short
blocks). The rotation spreads what is left over all candidates instead of charging it to one every round. The table
gives the median round and the ratio to bf16 `torch._grouped_mm` (to the nn.Linear loop when `torch._grouped_mm`
cannot run here, which the output says). A preset that takes one of GroupedLinear's packed
paths (per-tensor FP8 with current scaling; FP8 blocks, MXFP8 and their hybrid; NVFP4 and its hybrid) is timed a
second time with `packed_path = False`: the "(per-expert path)" row right after it; block formats also with the packed
path and its grouped GEMMs forced whatever the token counts (`grouped_blocks.PER_EXPERT_MIN_US` = inf: the "(packed
path forced)" row; the preset's own row is the automatic choice between the two); per-tensor FP8 where the jagged
path runs (tokens as routed, group bounds on the device: CUDA sm_90 with Triton, and the CPU) also with the jagged
layout forced (`jagged_path = True`; the preset's own row is GroupedLinear's automatic choice) and off
(`jagged_path = False`): the "(jagged path)" and "(padded packed path)" rows. On CUDA, per-tensor FP8 and block
formats also get a "(device counts)" row: the same layer given its counts as a CUDA tensor (as a router's `bincount`
gives them), which takes the paths that never read the counts on the host (the jagged path; the block formats'
device-count path) -- the other rows pass a list.

Where torchao imports (0.18: `torchao.prototype.moe_training`), its FP8 rowwise grouped GEMM (dynamic rowwise E4M3
for every operand, `torch._scaled_grouped_mm` for all three GEMMs) is timed eager and torch.compile'd ("torchao
fp8 rowwise", "... compiled"; --torchao picks them). torchao 0.18 takes only groups that are multiples of 16 tokens
(its in-op padding is not implemented): its input is the routed tokens with each expert's count rounded up to 16
(at most 15 extra rows per expert), the rest of the step as for the others.

    python benchmarks/bench_grouped.py
    python benchmarks/bench_grouped.py --configs 8x16384x2x4096x14336 --presets mxfp8,fp8_block --json out.json
    python benchmarks/bench_grouped.py --smoke      # tiny sizes on the CPU (the test suite runs this)
    python benchmarks/bench_grouped.py --torchao ""  # without the torchao rows
    python benchmarks/bench_grouped.py --presets fp8_tensorwise --torchao "" --profile 3   # + where each step goes

`--profile N` profiles N more steps of every candidate after the timing (torch.profiler) and prints, per config and
candidate, the kernels' time per step by name (GPU time on CUDA, the ops' own CPU time on the CPU) with the launches
per step: where the FP8 step's time goes next to bf16's.

`--routings N` gives the steps N seeded routings of the same tokens in turn (a router's counts change at every step;
the default, 1, repeats one routing): what is set up per token count -- e.g. a cuBLASLt plan per expert GEMM shape
where the per-tensor FP8 experts run one cuBLAS GEMM per expert (a heuristic query per new shape, then cached) --
is then paid as a training run pays it. Every candidate gets the same routings in the same order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn

import hybridq
from hybridq.gemm import jagged_fp8_kernels
from hybridq.kernels import grouped_blocks
from hybridq.nn.grouped_packed import FP8_TENSOR, ROW_GROUPS, packed_quantizers
from hybridq.nn.linear import shared_input_quantization

DEFAULT_CONFIGS = "8x16384x2x4096x14336,16x16384x4x2048x5632,64x16384x8x2048x3072"
SMOKE_CONFIGS = "4x48x2x64x96,8x40x2x32x64"
GROUPED_MM = "bf16 torch._grouped_mm"
LOOP = "bf16 nn.Linear per expert"
TORCHAO = {"rowwise": "torchao fp8 rowwise", "rowwise_compiled": "torchao fp8 rowwise compiled"}


def timed(fn, device: torch.device, iters: int) -> float:
    """Milliseconds per call: CUDA events around back-to-back calls on a GPU (host dispatch overlaps the previous
    call's kernels, as in training), wall time on the CPU."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def measure(steps: dict[str, Callable[[], None]], timer: Callable[[Callable[[], None]], float], rounds: int,
            warm_steps: int = 1) -> dict[str, list[float]]:
    """Each candidate's time (`timer(step)`) in each of `rounds` rounds. Round r takes the candidates in their order
    rotated by r; each timed block comes right after `warm_steps` untimed steps of the same candidate."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for n in names[shift:] + names[:shift]:
            for _ in range(warm_steps):
                steps[n]()
            times[n].append(timer(steps[n]))
    return times


def routed_splits(e: int, tokens: int, top_k: int, seed: int = 0) -> list[int]:
    """Token counts per expert of a random top-k routing (each token picks k distinct experts)."""
    g = torch.Generator().manual_seed(seed)
    choice = torch.rand(tokens, e, generator=g).topk(top_k, dim=-1).indices
    return torch.bincount(choice.reshape(-1), minlength=e).tolist()


class GroupedMM(nn.Module):
    """bf16 `torch._grouped_mm` over a `[E, out, in]` weight (offsets: the cumulative token counts)."""

    def __init__(self, e: int, k: int, n: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(e, n, k, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


class TorchaoRowwise(nn.Module):
    """torchao's FP8 rowwise grouped GEMM over a `[E, out, in]` weight; takes offsets whose groups are multiples of 16
    (the caller pads the routing: see the module docstring)."""

    def __init__(self, e: int, k: int, n: int, device, dtype):
        super().__init__()
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
        self.mm = _to_fp8_rowwise_then_scaled_grouped_mm
        self.weight = nn.Parameter(torch.empty(e, n, k, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.mm(x, self.weight.transpose(-2, -1), offs, out_dtype=torch.bfloat16,
                       pad_token_groups_for_grouped_mm=False)


def torchao_candidates(e: int, d: int, h: int, which: list[str], device, dtype) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, takes offsets) for the torchao rows asked for; [] (with a note) where torchao does not import
    or has no grouped FP8 GEMM here."""
    if not which or device.type != "cuda":
        return []
    try:
        TorchaoRowwise(1, 16, 16, "meta", dtype)
    except Exception as err:  # noqa: BLE001 (ImportError, or an API torchao no longer has)
        print(f"torchao FP8 grouped GEMM not available ({type(err).__name__}: {err}); skipping it", flush=True)
        return []
    out = []
    for w in which:
        mod = TorchaoRowwise(e, d, h, device, dtype)
        out.append((TORCHAO[w], torch.compile(mod) if w.endswith("_compiled") else mod, True))
    return out


class PackedForced(nn.Module):
    """A GroupedLinear on its packed path and grouped GEMMs whatever the token counts: `grouped_blocks.
    PER_EXPERT_MIN_US` (the automatic choice's threshold) set to infinity around its calls."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        saved, grouped_blocks.PER_EXPERT_MIN_US = grouped_blocks.PER_EXPERT_MIN_US, float("inf")
        try:
            return self.layer(x, m_splits)
        finally:
            grouped_blocks.PER_EXPERT_MIN_US = saved


class DeviceCounts(nn.Module):
    """A GroupedLinear given its token counts as a CUDA tensor, as a router's `bincount` gives them (the jagged path
    and the block formats' device-count path: no host sync); the tensor is made once per routing (a router makes
    its counts on the device: no copy in its step)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self._counts: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        key = tuple(m_splits)
        if key not in self._counts:
            self._counts[key] = torch.tensor(m_splits, device=x.device)
        return self.layer(x, self._counts[key])


class LinearLoop(nn.Module):
    """One bf16 nn.Linear per expert on its token slice."""

    def __init__(self, e: int, k: int, n: int, device, dtype):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(k, n, bias=False, device=device, dtype=dtype) for _ in range(e))

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        return torch.cat([lin(part) for lin, part in zip(self.experts, x.split(m_splits))])


def profile_rows(step: Callable[[], None], device: torch.device, steps: int, top: int = 12
                 ) -> tuple[float, list[tuple[str, float, float]]]:
    """(total ms per step, [(kernel or op name, ms per step, calls per step)] of the `top` largest) over `steps` steps
    of `step` under torch.profiler: GPU kernels on CUDA, the ops' own CPU time on the CPU."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    # (CUDA: each kernel event; the CPU: the ops' averages, their own time)
    events = ([(ev.name, ev.device_time_total, 1) for ev in prof.events()
               if ev.device_type == torch.autograd.DeviceType.CUDA] if cuda else
              [(ev.key, ev.self_cpu_time_total, ev.count) for ev in prof.key_averages()])
    for key, us, count in events:
        if us > 0:
            ms_calls = per.setdefault(key, [0.0, 0.0])
            ms_calls[0] += us / 1e3 / steps
            ms_calls[1] += count / steps
    rows = sorted(((k, v[0], v[1]) for k, v in per.items()), key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:top]


def make_step(module: nn.Module, inputs: list[tuple[torch.Tensor, torch.Tensor, object]]):
    """One forward + backward per call, on the next `(x, dy, route)` of `inputs` in turn (one per routing)."""
    params = list(module.parameters())
    turn = itertools.cycle(inputs)

    def step():
        for p in params:
            p.grad = None
        x, dy, route = next(turn)
        x.grad = None
        module(x, route).backward(dy)
    return step


def candidates(e: int, d: int, h: int, presets: list[str], device, dtype) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, takes offsets) for the bf16 grouped GEMM, every preset and the per-expert loop."""
    out = []
    if hasattr(torch, "_grouped_mm"):
        out.append((GROUPED_MM, GroupedMM(e, d, h, device, dtype), True))
    for p in presets:
        layer = hybridq.GroupedLinear(e, d, h, bias=False, device=device, dtype=dtype, recipe=hybridq.recipe(p),
                                      name=f"experts[{p}]")
        out.append((p, layer, False))
        kind = packed_quantizers(layer.expert_quantizers)
        if kind is not None:  # the same preset without the packed path
            loop = hybridq.GroupedLinear(e, d, h, bias=False, device=device, dtype=dtype, recipe=hybridq.recipe(p),
                                         name=f"experts[{p}, per expert]")
            loop.packed_path = False
            out.append((f"{p} (per-expert path)", loop, False))
        if kind is not None and kind.kind != ROW_GROUPS and torch.device(device).type == "cuda":  # ... counts on the GPU
            counted = hybridq.GroupedLinear(e, d, h, bias=False, device=device, dtype=dtype, recipe=hybridq.recipe(p),
                                            name=f"experts[{p}, device counts]")
            out.append((f"{p} (device counts)", DeviceCounts(counted), False))
        if kind is not None and kind.kind != FP8_TENSOR:  # ... and on the packed path whatever the automatic choice
            forced = hybridq.GroupedLinear(e, d, h, bias=False, device=device, dtype=dtype, recipe=hybridq.recipe(p),
                                           name=f"experts[{p}, packed]")
            out.append((f"{p} (packed path forced)", PackedForced(forced), False))
        if kind is not None and kind.kind == FP8_TENSOR and jagged_fp8_kernels(
                torch.device(device), d, h, kind.quantizers) is not None:  # ... with and without the jagged layout
            for name, on in (("jagged path", True), ("padded packed path", False)):
                forced = hybridq.GroupedLinear(e, d, h, bias=False, device=device, dtype=dtype,
                                               recipe=hybridq.recipe(p), name=f"experts[{p}, {name}]")
                forced.jagged_path = on
                out.append((f"{p} ({name})", forced, False))
    out.append((LOOP, LinearLoop(e, d, h, device, dtype), False))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help=f"ExTxKxDxH,... (default {DEFAULT_CONFIGS})")
    ap.add_argument("--presets", default=",".join(hybridq.preset_names()))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--iters", type=int, default=20, help="back-to-back steps per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds per candidate")
    ap.add_argument("--warm-steps", type=int, default=10,
                    help="untimed steps of a candidate right before each of its timed blocks")
    ap.add_argument("--smoke", action="store_true",
                    help=f"tiny configs ({SMOKE_CONFIGS}), 1 round of 1 step after at most 1 warm step, CPU")
    ap.add_argument("--torchao", default="rowwise,rowwise_compiled",
                    help=f"torchao rows where torchao imports ({', '.join(TORCHAO)}; '' for none)")
    ap.add_argument("--routings", type=int, default=1,
                    help="seeded routings of the same tokens the steps take in turn (1: one routing throughout)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N more steps of every candidate and print where each step's time goes")
    args = ap.parse_args(argv)
    torchao = [w for w in args.torchao.split(",") if w]
    if any(w not in TORCHAO for w in torchao):
        ap.error(f"--torchao takes {', '.join(TORCHAO)}, got {args.torchao!r}")
    if args.warm_steps < 0:
        ap.error(f"--warm-steps takes a count >= 0, got {args.warm_steps}")
    if args.routings < 1:
        ap.error(f"--routings takes a count >= 1, got {args.routings}")
    if args.profile < 0:
        ap.error(f"--profile takes a step count >= 0, got {args.profile}")
    if args.smoke:
        args.configs = args.configs or SMOKE_CONFIGS
        args.iters, args.rounds, args.warm_steps = 1, 1, min(args.warm_steps, 1)
        args.device = "cpu" if args.device == "auto" else args.device
    configs = args.configs or DEFAULT_CONFIGS
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = torch.bfloat16
    # every step feeds the same input: hybridq must not reuse the previous step's quantization of it
    shared_input_quantization(False)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    from hybridq.kernels import extension_available
    print(f"device: {name}; torch {torch.__version__}; hybridq CUDA extension: {extension_available()}; "
          f"torch._grouped_mm: {'present' if hasattr(torch, '_grouped_mm') else 'absent'}", flush=True)
    rows, notes, profiles = [], [], []
    for cfg in configs.split(","):
        e, t, k, d, h = (int(v) for v in cfg.split("x"))
        routings = [routed_splits(e, t, k, seed=i) for i in range(args.routings)]
        splits = routings[0]
        m = sum(splits)  # (t * k: the same for every routing)
        torch.manual_seed(0)
        x = torch.randn(m, d, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, h, device=device, dtype=dtype)
        offs = [torch.tensor(r, device=device).cumsum(0).to(torch.int32) for r in routings]
        # torchao's rows: each expert's tokens rounded up to 16 (see the module docstring), per routing a leaf view
        # of one buffer as long as the longest
        splits16 = [[-(-s // 16) * 16 for s in r] for r in routings]
        rows16 = max(sum(r) for r in splits16)
        x16 = torch.randn(rows16, d, device=device, dtype=dtype)
        dy16 = torch.randn(rows16, h, device=device, dtype=dtype)
        padded = [(x16[:sum(r)].detach().requires_grad_(), dy16[:sum(r)],
                   torch.tensor(r, device=device).cumsum(0).to(torch.int32)) for r in splits16]
        flop = 3 * 2 * m * d * h
        steps = {}
        for cname, mod, takes_offs in (candidates(e, d, h, args.presets.split(","), device, dtype)
                                       + torchao_candidates(e, d, h, torchao, device, dtype)):
            with torch.no_grad():
                for p in mod.parameters():
                    p.normal_(0, 0.02)
            if cname in TORCHAO.values():
                step = make_step(mod, padded)
            else:
                step = make_step(mod, [(x, dy, o if takes_offs else r) for o, r in zip(offs, routings)])
            try:
                step()  # warm-up (and the check that it runs here)
            except Exception as err:  # noqa: BLE001 - e.g. torch._grouped_mm on a GPU that lacks it
                notes.append(f"{cfg} {cname}: cannot run here ({type(err).__name__}: {str(err)[:200]})")
                print(notes[-1], flush=True)
                continue
            steps[cname] = step
        # interleaved: clock and power drift hit every candidate alike
        times = measure(steps, lambda fn: timed(fn, device, args.iters), args.rounds, args.warm_steps)
        base_name = GROUPED_MM if GROUPED_MM in times else LOOP
        base = statistics.median(times[base_name])
        for cname in steps:
            ms = statistics.median(times[cname])
            row = {"config": cfg, "experts": e, "tokens": t, "top_k": k, "d_model": d, "hidden": h,
                   "m_splits": splits, "routings": args.routings, "name": cname, "ms": ms, "rounds_ms": times[cname],
                   "tflops": flop / (ms * 1e-3) / 1e12, "vs": base_name, "ratio": base / ms,
                   # each round's ratio to the baseline's block of the same round (interleaved: the same drift)
                   "round_ratios": [b / c for b, c in zip(times[base_name], times[cname])]}
            rows.append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "m_splits"}), flush=True)
        if args.profile:
            for cname, step in steps.items():
                total, top = profile_rows(step, device, args.profile)
                profiles.append({"config": cfg, "name": cname, "ms": total,
                                 "top": [{"kernel": k_, "ms": ms, "calls": n} for k_, ms, n in top]})
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print("\n| E x tokens x top-k x d_model x hidden | candidate | step ms | TFLOP/s | speed-up vs bf16 | "
          "per round (min-max) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        vs = "" if r["vs"] == GROUPED_MM else " (vs the nn.Linear loop)"
        lo, hi = min(r["round_ratios"]), max(r["round_ratios"])
        print(f"| {r['config']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.3g} | {r['ratio']:.2f}x{vs} | "
              f"{lo:.2f}-{hi:.2f}x |")
    what, total = ("GPU kernel", "GPU kernels") if device.type == "cuda" else ("op (own CPU time)", "ops' own CPU time")
    for p in profiles:
        print(f"\n{p['config']} {p['name']}: {p['ms']:.3f} ms per step ({total}, profiled)")
        print(f"| {what} | ms per step | calls per step |\n|---|---|---|")
        for t in p["top"]:
            print(f"| {t['kernel'][:90]} | {t['ms']:.3f} | {t['calls']:g} |")
    for n in notes:
        print(f"note: {n}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows, "notes": notes,
                       "profiles": profiles}, fh, indent=1)


if __name__ == "__main__":
    main()
