"""Host microseconds per call of the compiled Linear's gathered ops (`hybridq::gathered_linear_forward` /
`_backward`) on a CPU machine, the layers above the phase ops only: FSDP2's real gathered weight (world of one, gloo,
resharded never) read through its handle as a compiled graph reads it, with the extension's C++ phase ops -- which
need CUDA -- replaced by stand-ins that return fixed tensors (the CUDA path's Python then runs on the CPU:
`_cpp_phase` / `_block_phase_op` say yes). Rows: the whole op call (dispatcher, body, outputs' aliasing check) and the
body alone, with each call site's plan reused and with every call decided anew (`gathered_plans(False)`; a tree
without the plans: one "as built" row each); interleaved rounds, min and 25th percentile reported. The clock is the
thread's CPU time by default (`--clock thread`: a shared machine's load preempts the process, which wall time would
count), `--clock wall` for wall time. A measurement tool, not a test: on a GPU machine use
benchmarks/bench_host.py --only "gathered op" (the real ops).

    python benchmarks/gathered_op_host_cpu.py [--rounds 40] [--clock wall]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hybridq.distributed import apply_hybrid_fsdp
from hybridq.kernels import cuda_fp8_block, cuda_fp8_tensor
from hybridq.nn import compiled_linear, float8_graph
from fsdp_setup import exit_without_finalization

IN, OUT, DT = 256, 256, torch.bfloat16


def stand_in_phases(x: torch.Tensor) -> None:
    """The C++ phase ops replaced by functions returning fixed tensors of their outputs' shapes, and taken where
    CUDA would take them."""
    m = x.numel() // x.shape[-1]
    fp8 = torch.float8_e4m3fn
    outs = {"fp8_linear_fprop": (torch.empty(*x.shape[:-1], OUT, dtype=DT), torch.empty(IN, m, dtype=fp8),
                                 torch.empty(1)),
            "fp8_block_linear_fprop": (torch.empty(*x.shape[:-1], OUT, dtype=DT), torch.empty(IN, m, dtype=fp8),
                                       torch.empty(IN, m // 128)),
            "fp8_linear_grads": (torch.empty(x.shape, dtype=DT), torch.empty(OUT, IN, dtype=DT), torch.empty(0))}
    outs["fp8_block_linear_grads"] = outs["fp8_linear_grads"]
    cuda_fp8_tensor.linear_op = cuda_fp8_block.linear_op = lambda name: (lambda *a: outs[name])
    float8_graph._cpp_phase = lambda t: float8_graph._CPP_OPS.on
    float8_graph._block_phase_op = lambda t, fast: float8_graph._CPP_OPS.on


def calls(recipe: str, x: torch.Tensor, dy: torch.Tensor, mesh) -> tuple:
    """(forward(op), backward(op), the module) of one gathered Linear of `recipe` as a compiled graph calls it."""
    ops = torch.ops.hybridq
    m = nn.Sequential(nn.Linear(IN, OUT, bias=False, dtype=DT))
    apply_hybrid_fsdp(m, recipe)
    fully_shard(m, mesh=mesh, reshard_after_forward=False)
    m.unshard()
    handle, key = m[0].weight._handle, m[0]._configuration_key
    cast = compiled_linear._shared_input_cast(key)
    parts = [] if cast is None else list(ops.linear_input_quantize(x, cast[0], cast[1], cast[2], not cast[3]))

    def forward(op):
        return op(x, handle, None, key, None, True, True, [OUT, IN], DT, *parts)

    out = forward(ops.gathered_linear_forward.default)
    saved = out[1:] if not parts else [parts[2], parts[1]]  # (what the layer's autograd saves of x's parts)

    def backward(op):
        return op(dy, None, handle, saved, key, None, True, True, False, list(x.shape), [OUT, IN], DT, DT, DT)

    backward(ops.gathered_linear_backward.default)
    return forward, backward, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--n", type=int, default=300, help="calls per round")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tempfile.mkdtemp(), 'store')}", rank=0,
                            world_size=1)
    x, dy = torch.randn(2, 128, IN, dtype=DT), torch.randn(2, 128, OUT, dtype=DT)
    stand_in_phases(x)
    mesh = init_device_mesh("cpu", (1,))
    ops = torch.ops.hybridq
    bodies = (compiled_linear.gathered_linear_forward.__wrapped__, compiled_linear.gathered_linear_backward.__wrapped__)
    opdefs = (ops.gathered_linear_forward.default, ops.gathered_linear_backward.default)
    rows, keep = {}, []
    for recipe in ("fp8_tensorwise", "fp8_block"):
        fwd, bwd, m = calls(recipe, x, dy, mesh)
        keep.append(m)
        plans = getattr(compiled_linear, "gathered_plans", None)
        settings = ((("plans reused", contextlib.nullcontext), ("decided anew", lambda: plans(False)))
                    if plans is not None else (("as built", contextlib.nullcontext),))
        for setting, ctx in settings:
            for what, fn in (("op forward", lambda f=fwd: f(opdefs[0])), ("op backward", lambda b=bwd: b(opdefs[1])),
                             ("body forward", lambda f=fwd: f(bodies[0])),
                             ("body backward", lambda b=bwd: b(bodies[1]))):
                rows[(recipe, setting, what)] = (ctx, fn, [])
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    for _ in range(args.rounds):
        for ctx, fn, ts in rows.values():
            with ctx():
                for _ in range(20):
                    fn()
                t0 = clock()
                for _ in range(args.n):
                    fn()
                ts.append((clock() - t0) / args.n * 1e6)
    print(f"torch {torch.__version__}, CPU, {args.rounds} rounds of {args.n} calls, {args.clock} clock; "
          f"x {tuple(x.shape)} {DT}\n")
    print("| recipe | calls | what | us per call (min round) | 25th percentile |\n|---|---|---|---|---|")
    for (recipe, setting, what), (_, _, ts) in rows.items():
        ts.sort()
        print(f"| {recipe} | {setting} | {what} | {ts[0]:.2f} | {ts[len(ts) // 4]:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization()
