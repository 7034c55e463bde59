"""Jobs of test_fsdp_compile.py: blocks compiled with torch.compile (torchtitan's per-block compile, before
fully_shard) whose hybridq Linears FSDP2 all-gathers quantized (apply_hybrid_fsdp), against the same model run
eagerly. Each job returns what differed (lists of messages) and what dynamo did (graph breaks, Linear ops in the
graphs); the tests assert on them."""

from __future__ import annotations

import copy
import functools
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridq.distributed import apply_hybrid_fsdp

# the shared test helpers live one level up; spawned ranks inherit this sys.path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import tensor_diff  # noqa: E402


class Block(nn.Module):
    """x + fc2(act(fc1(x))): a biased and an unbiased Linear."""

    def __init__(self, d: int, hidden: int, act):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d, bias=False)
        self.act = act

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 128, layers: int = 2, act=F.silu):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden, act) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _identity(t):
    return t


_ACTS = {"silu": F.silu, "identity": _identity}


class _Recorder:
    """A dynamo backend that counts the hybridq Linear ops (`op`, default `hybridq::linear_forward`) in the graphs
    it is given, then compiles with `backend`."""

    def __init__(self, backend: str, op: str = "linear_forward"):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.op = op
        self.linear_ops = 0

    def __call__(self, gm, inputs):
        op = getattr(torch.ops.hybridq, self.op)
        self.linear_ops += sum(n.target in (op, op.default) for n in gm.graph.nodes)
        return self.backend(gm, inputs)


def _shard(model: nn.Module, preset: str, device, world_size: int, compile_with=None, reshard=True) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    apply_hybrid_fsdp(model, preset)
    shard = functools.partial(fully_shard, mesh=init_device_mesh(device.type, (world_size,)),
                              reshard_after_forward=reshard)
    for b in model.blocks:
        if compile_with is not None:  # per block, before fully_shard (as train.py --compile)
            b.forward = torch.compile(b.forward, backend=compile_with)
        shard(b)
    shard(model)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(model, opt, x, seed: int) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(seed)  # (stochastic rounding draws from it)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _result(diffs: list, eager: nn.Module, compiled: nn.Module, when: str, rec: _Recorder) -> dict:
    """A job's result for one preset: `diffs` plus the parameters that differ `when`, and what dynamo did."""
    from torch._dynamo.utils import counters

    for (n, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
        d = tensor_diff(_full(pc.detach()), _full(pe.detach()), f"{n} {when}")
        if d:
            diffs.append(d)
    return {"diffs": diffs, "graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted(counters["graph_break"])[:3], "linear_ops": rec.linear_ops}


def compiled_matches_eager(rank, world_size, device, presets, compiler="aot_eager", act="silu", steps=2,
                           reshard=True):
    """For each preset: an eager and a compiled copy of one model, `steps` AdamW steps on this rank's batches.
    Returns {preset: {"diffs": [...], "graph_breaks": n, "linear_ops": n}}: the losses, every gradient of
    every step and the parameters after the last step compared bit for bit."""
    from torch._dynamo.utils import counters

    out = {}
    for preset in presets:
        torch.manual_seed(0)
        base = Net(act=_ACTS[act]).to(device)
        torch._dynamo.reset()
        counters.clear()
        rec = _Recorder(compiler)
        eager = _shard(copy.deepcopy(base), preset, device, world_size, reshard=reshard)
        compiled = _shard(copy.deepcopy(base), preset, device, world_size, compile_with=rec, reshard=reshard)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (eager, compiled)]
        diffs = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            # (an input that requires grad, as a block's input in a model does: every block runs one graph)
            x = torch.randn(2, 16, 64, generator=g).to(device).requires_grad_()
            (loss_e, grads_e), (loss_c, grads_c) = (_step(m, o, x, 100 * step + rank)
                                                    for m, o in zip((eager, compiled), opts))
            diffs += [d for d in [tensor_diff(loss_c, loss_e, f"step {step} loss")] if d]
            diffs += [d for n in grads_e for d in [tensor_diff(grads_c[n], grads_e[n], f"step {step} grad {n}")] if d]
        out[preset] = _result(diffs, eager, compiled, f"after {steps} steps", rec)
    return out


def tensor_parallel_compiled_matches_eager(rank, world_size, device, presets, compiler="aot_eager"):
    """A tensor-parallel block (sequence-parallel norm, column-parallel w1/w3, row-parallel w2: hybridq's styles,
    _tp_jobs.tp_plan) compiled whole, against its eager twin: 2 SGD steps each, outputs, input gradients and
    parameters compared bit for bit. Returns {preset: {"diffs", "graph_breaks", "linear_ops"}}; the TP Linears are
    traced as their own custom ops (distributed/compiled_tp.py), which `linear_ops` does not count."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import hybridq
    from _tp_jobs import Block as TPBlock, deterministic_recipe, tp_plan

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for preset in presets:
        torch.manual_seed(0)
        base = TPBlock(64, 128).to(device)
        hybridq.convert_linears(base, deterministic_recipe(preset))
        eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
        for m in (eager, compiled):
            parallelize_module(m, mesh, tp_plan(0))  # (sequence dim first: a rank's rows hold whole blocks)
        torch._dynamo.reset()
        counters.clear()
        rec = _Recorder(compiler)
        run = torch.compile(compiled, backend=rec)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled)]
        diffs = []
        for step in range(2):
            x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(10 + step))
            xl = x[rank * 64 // world_size:(rank + 1) * 64 // world_size].to(device)
            got = []
            for call, opt in ((eager, opts[0]), (run, opts[1])):
                xi = xl.clone().requires_grad_()
                y = call(xi)
                y.float().square().sum().backward()
                got.append((y.detach(), xi.grad))
                opt.step()
                opt.zero_grad()
            for what, g, w in (("output", got[1][0], got[0][0]), ("input grad", got[1][1], got[0][1])):
                d = tensor_diff(g, w, f"step {step} {what}")
                if d:
                    diffs.append(d)
        out[preset] = _result(diffs, eager, compiled, "after 2 steps", rec)
    return out
