"""Host (CPU) cost of issuing hybridq's GPU work: microseconds per call for the pieces of a Linear step, on tensors
so small that the GPU is never the limit (the host issues calls back to back; one synchronize at the end).

What an FSDP2 step at few tokens per GPU waits on (see BENCHMARKS.md, "host ms"): this splits it into the custom
ops, torch's own ops, the autograd machinery and the Python layers around them, next to the bf16 baseline
(`nn.Linear` fwd+bwd). The "Function(...)" rows are a ladder: an empty `torch.autograd.Function` fwd+bwd, then the
same with one piece of hybridq's work inside its forward or backward, so each piece's cost *in place* (where it is
paid in a real step) is its row minus the empty one. Every row is measured in --rounds interleaved rounds and the
median round is reported (single runs on a fresh GPU machine were seen to move by +-30%).

    python benchmarks/bench_host.py                 # CUDA (the numbers that matter); CPU works too, as a smoke test
    python benchmarks/bench_host.py --dim 256 --json host.json --profile host_prof.txt
    python benchmarks/bench_host.py --only "gathered op"   # the compiled Linear's gathered ops alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import hybridq
from hybridq.formats import Float8Quantizer
from hybridq.kernels import native_gemm
from hybridq.nn import delayed_linear, float8_graph, linear_function
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization
from fsdp_setup import exit_without_finalization


def per_call_us(fn, device: torch.device, n: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def in_function(fwd=None, bwd=None):
    """fn(x, dy) running `fwd(x)` inside an autograd.Function's forward and `bwd(dy)` inside its backward."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if fwd is not None:
                fwd(x.detach())
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            if bwd is not None:
                bwd(g)
            return torch.empty_like(g)

    return lambda x, dy: Probe.apply(x).backward(dy)


def cases(dim: int, device: torch.device) -> list:
    x = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    q = Float8Quantizer()
    lin = nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16)
    hq = hybridq.Linear.from_linear(nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16),
                                    hybridq.recipe("fp8_tensorwise"), name="bench")
    hq_block = hybridq.Linear.from_linear(nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16),
                                          hybridq.recipe("fp8_block"), name="bench_block")
    hq_delayed = hybridq.Linear.from_linear(nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16),
                                            hybridq.recipe("fp8_delayed"), name="bench_delayed")

    def general(fn):
        """`fn` with FP8 Linears on the general path (linear_function.py), not float8_graph's few ops."""
        def run():
            with eager_fast_path(False):
                fn()
        return run

    def python_node(fn):
        """`fn` with per-tensor FP8 Linears on the fast path's Python autograd node, not the one op."""
        def run():
            one_op, float8_graph._one_op = float8_graph._one_op, lambda *a: False
            try:
                fn()
            finally:
                float8_graph._one_op = one_op
        return run

    def step(m, **kw):
        def run():
            m(xg, **kw).backward(dy)
            xg.grad = None
            for p in m.parameters():
                p.grad = None
        return run

    fresh = [x.clone().requires_grad_(True) for _ in range(8)]  # (more than the sharing table's 2 slots)

    def shared_step(m):
        """A training step's call: input sharing on (the default) and a new input tensor each step, which the
        layer quantizes and offers to the layers after it that read the same tensor."""
        i = [0]

        def run():
            xi = fresh[i[0] % len(fresh)]
            i[0] += 1
            with shared_input_quantization(True):
                m(xi).backward(dy)
            xi.grad = None
            for p in m.parameters():
                p.grad = None
        return run

    def uncached(fn):
        """`fn` with the fast path's checks asked at every call (the code before they were cached per shape)."""
        def run():
            cached, float8_graph._cached_fast_call = float8_graph._cached_fast_call, float8_graph._fast_call
            try:
                fn()
            finally:
                float8_graph._cached_fast_call = cached
        return run

    def shared_as_tensor(fn):
        """`fn` with each shared input built as a QuantizedTensor when shared, as before SharedParts."""
        def run():
            table = linear_function._SHARED
            table.put = lambda x, q, xq: type(table).put(
                table, x, q, xq.quantized() if isinstance(xq, linear_function.SharedParts) else xq)
            try:
                fn()
            finally:
                del table.put
        return run

    def block_python_node(fn):
        """`fn` with FP8 block Linears on the fast path's Python autograd node, not the one op hybridq::fp8_block_linear
        (csrc/linear_fp8_block.cpp: the code before it)."""
        def run():
            with float8_graph._BLOCK_OP.turned(False):
                fn()
        return run

    def delayed_python_node(fn):
        """`fn` with fp8_delayed Linears on nn/delayed_linear.py's Python node, not the one op."""
        def run():
            with delayed_linear._DELAYED_OP.turned(False):
                fn()
        return run

    def scaled_mm_blocks(fn):
        """`fn` with the FP8 block GEMMs run by F.scaled_mm from Python (the code before hybridq::fp8_block_mm,
        csrc/block_gemm.cu)."""
        def run():
            was = native_gemm.set_block_gemm_op(False)
            try:
                fn()
            finally:
                native_gemm.set_block_gemm_op(was)
        return run

    def probe(fwd=None, bwd=None):
        fn = in_function(fwd, bwd)
        return lambda: fn(xg, dy)

    quantize = lambda t: q.quantize(t, rowwise=True, columnwise=True)  # noqa: E731
    fsdp_bf16, fsdp_fp8, fsdp_block = fsdp_models(dim, device)
    out = [
        ("torch.empty_like (allocator)", lambda: torch.empty_like(x)),
        ("x.abs() (one torch kernel)", lambda: x.abs()),
        ("nn.Linear forward (bf16 mm)", lambda: lin(x)),
        ("nn.Linear fwd+bwd", step(lin)),
        ("hybridq Linear fwd+bwd (fp8_tensorwise)", step(hq)),
        ("hybridq Linear fwd+bwd (fp8_tensorwise, general path)", general(step(hq))),
        ("hybridq Linear fwd+bwd (fp8_tensorwise, fast-path checks uncached)", uncached(step(hq))),
        ("hybridq Linear fwd+bwd (fp8_tensorwise, sharing on, fresh input)", shared_step(hq)),
        ("hybridq Linear fwd+bwd (fp8_tensorwise, sharing on, fresh input, QuantizedTensor shared)",
         shared_as_tensor(shared_step(hq))),
        ("hybridq Linear fwd+bwd (fp8_delayed)", step(hq_delayed)),
        ("hybridq Linear fwd+bwd (fp8_delayed, general path)", general(step(hq_delayed))),
        ("hybridq Linear fwd+bwd (fp8_block)", step(hq_block)),
        ("hybridq Linear fwd+bwd (fp8_block, general path)", general(step(hq_block))),
        ("hybridq Linear forward only (grad on)", lambda: hq(xg)),
        ("hybridq Linear fwd+bwd, weight cached (is_first_microbatch=False)", step(hq, is_first_microbatch=False)),
        ("hybridq Linear fwd+bwd, weight cached (is_first_microbatch=False, general path)",
         general(step(hq, is_first_microbatch=False))),
        # FSDP2 (world 1, resharded after forward: the training job's weights): the unshard / reshard hooks around
        # each call, the weight all-gathered quantized (a GatheredWeight) for the hybridq Linear
        ("FSDP2 nn.Linear fwd+bwd (bf16)", step(fsdp_bf16)),
        ("FSDP2 hybridq Linear fwd+bwd (fp8_tensorwise, gathered weight)", step(fsdp_fp8)),
        ("FSDP2 hybridq Linear fwd+bwd (fp8_tensorwise, gathered weight, general path)", general(step(fsdp_fp8))),
        ("FSDP2 hybridq Linear fwd+bwd (fp8_block, gathered weight)", step(fsdp_block)),
        *gathered_op_rows(dim, device),
        ("Float8Quantizer.quantize_parts (rowwise+columnwise)", lambda: q.quantize_parts(x, True, True)),
        ("Function(empty) fwd+bwd", probe()),
        ("Function(Float8Quantizer.quantize in forward)", probe(fwd=quantize)),
        ("Function(Float8Quantizer.quantize in backward)", probe(bwd=quantize)),
    ]
    if device.type == "cuda":
        from hybridq.kernels import extension_available
        if extension_available():
            w = torch.randn(dim, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2

            def one_op():  # the Linear's op alone (fp8_tensorwise's casts), without the module's Python around it
                ops.fp8_linear(xg, w, None, None, None, None, None, e4, 0.0, False, e4, 0.0, False, e5, 0.0, False,
                               True, True, False, True).backward(dy)
                xg.grad = w.grad = None

            def unpacked(fn):
                """`fn` with hybridq::fp8_linear's tensors in an allocation each (csrc/linear_fp8.cpp, [Note: packed
                allocations of the Linear op]: the code before)."""
                def run():
                    was = _C.linear_packed_allocations(False)
                    try:
                        fn()
                    finally:
                        _C.linear_packed_allocations(was)
                return run

            from hybridq import _C
            ops = torch.ops.hybridq
            if torch.cuda.get_device_capability(device) == (9, 0) and dim % 128 == 0:
                # one fprop GEMM of fp8_block (1x128 x 128x128 tiles) alone: the op, and what ran before it
                xr, xs = ops.fp8_block_quantize(x, e4, 1, 0.0, True, True, False)[:2]
                wr, ws = ops.fp8_block_quantize(x, e4, 2, 0.0, True, True, False)[:2]
                F = torch.nn.functional

                def block_scaled_mm():
                    sa, sb = native_gemm.block_scale_operands(xs, ws, True)
                    F.scaled_mm(xr, wr.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                                output_dtype=torch.bfloat16)

                out += [
                    ("fp8_block GEMM 1x128 x 128x128 (op fp8_block_mm)",
                     lambda: ops.fp8_block_mm(xr, xs, wr, ws, True, torch.bfloat16)),
                    ("fp8_block GEMM 1x128 x 128x128 (F.scaled_mm, scales relaid in Python)", block_scaled_mm),
                ]
            out += [
                ("op fp8_linear fwd+bwd (no module)", one_op),
                ("op fp8_linear fwd+bwd (no module, unpacked allocations)", unpacked(one_op)),
                ("hybridq Linear fwd+bwd (fp8_tensorwise, unpacked allocations)", unpacked(step(hq))),
                ("hybridq Linear fwd+bwd (fp8_block, Python node)", block_python_node(step(hq_block))),
                ("hybridq Linear fwd+bwd (fp8_block, Python node, GEMMs by F.scaled_mm)",
                 block_python_node(scaled_mm_blocks(step(hq_block)))),
                # fp8_delayed on nn/delayed_linear.py's Python node instead of the op hybridq::fp8_linear_delayed
                ("hybridq Linear fwd+bwd (fp8_delayed, Python node)", delayed_python_node(step(hq_delayed))),
                # the fast path's Python autograd node around the same ops (what ran before hybridq::fp8_linear)
                ("hybridq Linear fwd+bwd (fp8_tensorwise, Python node)", python_node(step(hq))),
                ("hybridq Linear forward only (grad on, Python node)", python_node(lambda: hq(xg))),
                ("FSDP2 hybridq Linear fwd+bwd (fp8_tensorwise, gathered weight, Python node)",
                 python_node(step(fsdp_fp8))),
                ("FSDP2 hybridq Linear fwd+bwd (fp8_block, gathered weight, Python node)",
                 block_python_node(step(fsdp_block))),
            ]
            ops = torch.ops.hybridq
            op = lambda t: ops.fp8_tensor_quantize(t, torch.float8_e4m3fn, None, None, 0.0, False,  # noqa: E731
                                                   True, True, False)
            out += [
                ("op amax", lambda: ops.amax(x)),
                ("op fp8_tensor_quantize (amax pass + cast, both directions)", lambda: op(x)),
                ("Function(op in forward)", probe(fwd=op)),
                ("Function(op in backward)", probe(bwd=op)),
                ("Function(3 ops in backward)", probe(bwd=lambda t: (op(t), op(t), op(t)))),
            ]
        if torch.cuda.get_device_capability(device) >= (8, 9):
            f8 = x.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            mm = lambda: torch._scaled_mm(f8, f8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            out += [
                ("torch._scaled_mm (E4M3, per-tensor scales)", mm),
                ("Function(3 _scaled_mm in backward)", probe(bwd=lambda t: (mm(), mm(), mm()))),
            ]
    return out


def fsdp_models(dim: int, device: torch.device) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(an nn.Linear, a hybridq fp8_tensorwise Linear and an fp8_block one whose weights FSDP2 all-gathers
    quantized), each fully_shard-ed on a world of one (a process group of one rank is started here if none is: NCCL on
    CUDA, else gloo)."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybridq.distributed import apply_hybrid_fsdp

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                                world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    models = []
    for recipe in (None, "fp8_tensorwise", "fp8_block"):
        m = nn.Sequential(nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16))
        if recipe is not None:
            apply_hybrid_fsdp(m, recipe)
        models.append(fully_shard(m, mesh=mesh, reshard_after_forward=True))
    return models[0], models[1], models[2]


def gathered_op_rows(dim: int, device: torch.device) -> list:
    """Rows of the compiled Linear's gathered ops called as a compiled graph calls them
    (`hybridq::gathered_linear_forward` / `_backward` on FSDP2's gathered weight's handle; fp8_tensorwise handed x's
    parts by `hybridq::linear_input_quantize`, fp8_block quantizing x inside), with each call site's plan reused
    (compiled_linear.py's [Note: a gathered call site's plans]) and with every call decided anew
    (`gathered_plans(False)`, the code before). The weights: a world of one, gathered for forward and backward at
    once (reshard_after_forward=False) and left unsharded. Call `fsdp_models` first (the process group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybridq.distributed import apply_hybrid_fsdp
    from hybridq.nn import compiled_linear
    from hybridq.nn.compiled_linear import gathered_plans

    ops = torch.ops.hybridq
    dt = torch.bfloat16
    x = torch.randn(2, dim // 2, dim, device=device, dtype=dt)
    dy = torch.randn(2, dim // 2, dim, device=device, dtype=dt)
    rows = []
    for recipe in ("fp8_tensorwise", "fp8_block"):
        m = nn.Sequential(nn.Linear(dim, dim, bias=False, device=device, dtype=dt))
        apply_hybrid_fsdp(m, recipe)
        fully_shard(m, mesh=init_device_mesh(device.type, (1,)), reshard_after_forward=False)
        m.unshard()
        lin = m[0]
        handle, key = lin.weight._handle, lin._configuration_key
        cast = compiled_linear._shared_input_cast(key)
        parts = {} if cast is None else dict(zip(("x_row", "x_scale_inv", "x_col"), ops.linear_input_quantize(
            x, cast[0], cast[1], cast[2], not cast[3])))
        y, *saved = ops.gathered_linear_forward(x, handle, None, key, None, True, True, [dim, dim], dt, **parts)
        kept = [parts["x_col"], parts["x_scale_inv"]] if parts else saved

        def fwd(handle=handle, key=key, parts=parts, m=m):  # (m: the module keeps the weight's state alive)
            ops.gathered_linear_forward(x, handle, None, key, None, True, True, [dim, dim], dt, **parts)

        def bwd(handle=handle, key=key, kept=kept):
            ops.gathered_linear_backward(dy, None, handle, kept, key, None, True, True, False, list(x.shape),
                                         [dim, dim], dt, dt, dt)

        def decided_anew(fn):
            def run():
                with gathered_plans(False):
                    fn()
            return run

        what = f"{recipe}, {'x parts handed' if parts else 'x quantized inside'}"
        rows += [(f"compiled gathered op forward ({what})", fwd),
                 (f"compiled gathered op forward ({what}, every call decided anew)", decided_anew(fwd)),
                 (f"compiled gathered op backward ({recipe})", bwd),
                 (f"compiled gathered op backward ({recipe}, every call decided anew)", decided_anew(bwd))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=1000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median round is reported")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help="run only the rows whose name contains this text (e.g. 'gathered op')")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-steps", type=int, default=200, help="steps under each profiler with --profile")
    ap.add_argument("--profile", default=None, help="write where a hybridq Linear step spends host time (torch.profiler "
                    "self CPU time per op, cProfile per Python function) to this file")
    args = ap.parse_args()
    # every step feeds the same input tensor: with sharing on, hybridq would reuse its quantization from the step
    # before (the cache that lets wq/wk/wv quantize one input once), which a real step with a fresh input cannot
    shared_input_quantization(False)
    device = torch.device(args.device)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}); "
          f"torch {torch.__version__}; tensors {args.dim}x{args.dim} bf16; {args.rounds} rounds of {args.n} calls\n")
    todo = [(name, fn) for name, fn in cases(args.dim, device) if args.only is None or args.only in name]
    times: dict = {name: [] for name, _ in todo}
    for _ in range(args.rounds):
        for name, fn in todo:
            times[name].append(per_call_us(fn, device, n=args.n))
    rows = [{"call": name, "us": statistics.median(ts), "rounds_us": ts} for name, ts in times.items()]
    print("| call | host us per call (median round) | min-max over rounds |\n|---|---|---|")
    for r in rows:
        print(f"| {r['call']} | {r['us']:.1f} | {min(r['rounds_us']):.1f}-{max(r['rounds_us']):.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device), "torch": torch.__version__, "dim": args.dim, "rows": rows}, fh, indent=1)
    if args.profile:
        with open(args.profile, "w"):
            pass
        for row in ("hybridq Linear fwd+bwd (fp8_tensorwise)", "hybridq Linear fwd+bwd (fp8_block)"):
            if row in dict(todo):
                profile_linear_step(dict(todo)[row], row, device, args.profile, args.profile_steps)


def profile_linear_step(step, row: str, device: torch.device, path: str, n: int = 200) -> None:
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    for _ in range(min(20, n)):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    with open(path, "a") as fh:
        print(f"==== {row}: torch.profiler, {n} steps, by self CPU time ====", file=fh)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80),
              file=fh)
        print(f"==== {row}: cProfile, {n} steps, by own time (Python 3.12+: every thread) ====", file=fh)
        print(buf.getvalue(), file=fh)


if __name__ == "__main__":
    main()
    exit_without_finalization()
