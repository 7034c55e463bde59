"""Jobs of test_tp_compile.py: tensor-parallel hybridq Linears (hybridq's ColwiseParallel / RowwiseParallel /
PrepareModuleInput, with and without sequence parallelism) in a block compiled with `fullgraph=True`, against the
same block run eagerly and against the single-process hybridq block. Each case returns what differed, the error a
compile raised (a graph break under fullgraph=True) and how many tensor-parallel Linear ops the graphs hold."""

from __future__ import annotations

import copy
import gc
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from _compare import close_diff, tensor_diff  # noqa: E402
from _compile_jobs import _Recorder  # noqa: E402
from _tp_jobs import AttentionBlock, attention_plan, deterministic_recipe  # noqa: E402

# the ranks' pieces differ in magnitude by this factor (input rows, weight rows and columns): a piece quantized with
# its own statistics instead of the group's lands on other values
SKEW = 8.0


class BiasedSwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) with biases on w1 (column-parallel: a bias piece) and w2 (row-parallel: added after
    the partial sums are reduced)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MLPBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.mlp = BiasedSwiGLU(d, h)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Residual(nn.Module):
    """x + mlp(x): the MLP with replicated input and output (no norm: hybridq's RMSNorm differs between compiled
    and eager by an ulp in its input gradient on one device already, which is not what is tested here)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.mlp = BiasedSwiGLU(d, h)

    def forward(self, x):
        return x + self.mlp(x)


class Chain(nn.Module):
    """Two Linears and nothing element-wise between them (Inductor may round element-wise math differently from
    eager; the Linears' ops are opaque to it)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, h), nn.Linear(h, d, bias=False))

    def forward(self, x):
        return self.mlp(x)


class RowOnly(nn.Module):
    """One row-parallel Linear reading a replicated input (RowwiseParallel(input_layouts=Replicate()))."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc = nn.Linear(d, h)

    def forward(self, x):
        return self.fc(x)


def _plan(block: str, seq_dim: int | None) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    from hybridq.distributed import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    if block == "attention":
        return attention_plan(seq_dim)
    if block == "row_replicated":
        return {"fc": RowwiseParallel(input_layouts=Replicate())}
    if block == "chain":
        plan = {"mlp.0": ColwiseParallel(), "mlp.1": RowwiseParallel()}
        if seq_dim is not None:
            plan = {"mlp": PrepareModuleInput(input_layouts=(Shard(seq_dim),), desired_input_layouts=(Replicate(),)),
                    "mlp.0": ColwiseParallel(), "mlp.1": RowwiseParallel(output_layouts=Shard(seq_dim))}
        return plan
    if block == "residual":  # replicated input, replicated output (the row-parallel partial sums all-reduced)
        return {"mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
    return {"norm": SequenceParallel(sequence_dim=seq_dim),
            "mlp": PrepareModuleInput(input_layouts=(Shard(seq_dim),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(seq_dim))}


MODELS = {"mlp": MLPBlock, "residual": Residual, "attention": AttentionBlock, "chain": Chain,
          "row_replicated": RowOnly}


def case_key(case: tuple) -> str:
    block, preset, override, soi, shape, seq_dim, compiler = case
    return f"{block}/{preset}/{override}/soi={soi}/{tuple(shape)}/seq{seq_dim}/{compiler}"


def _skew_(model: nn.Module, world_size: int) -> None:
    """Scale every Linear weight's last rows or last columns (alternately) by SKEW: the ranks' pieces of each (rows
    of a column-parallel weight, columns of a row-parallel one) differ in amax."""
    with torch.no_grad():
        for i, m in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
            n, k = m.weight.shape
            if i % 2:
                m.weight[:, k - k // world_size:] *= SKEW
            else:
                m.weight[n - n // world_size:] *= SKEW


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _one_case(rank: int, world_size: int, device, mesh, case: tuple) -> dict:
    from torch._dynamo.utils import counters
    from torch.distributed.tensor.parallel import parallelize_module

    block, preset, override, soi, shape, seq_dim, compiler = case
    torch.manual_seed(0)
    d = shape[-1]
    ref = MODELS[block](d, 2 * d).to(device)
    _skew_(ref, world_size)
    hybridq.convert_linears(ref, deterministic_recipe(preset, override))
    for lin in ref.modules():
        if isinstance(lin, hybridq.Linear):
            lin.save_original_input = soi
    eager, compiled = copy.deepcopy(ref), copy.deepcopy(ref)
    for m in (eager, compiled):
        parallelize_module(m, mesh, _plan(block, seq_dim))
    torch._dynamo.reset()
    counters.clear()
    rec = _Recorder("eager" if compiler is None else compiler, op="tp_linear_forward")
    # (compiler None: the eager tensor-parallel block twice, each checked against the single process)
    run = compiled if compiler is None else torch.compile(compiled, backend=rec, fullgraph=True)
    models = (ref, eager, compiled)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    sl = [slice(None)] * len(shape)
    if seq_dim is not None:
        chunk = shape[seq_dim] // world_size
        sl[seq_dim] = slice(rank * chunk, (rank + 1) * chunk)
    sl = tuple(sl)
    diffs = []
    for step in range(2):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step))
        if seq_dim is not None:  # the last rank's tokens SKEW times larger: its rows' amax differs from the others'
            x.narrow(seq_dim, shape[seq_dim] - shape[seq_dim] // world_size, shape[seq_dim] // world_size).mul_(SKEW)
        x = x.to(device)
        got = []
        for call, opt, whole in ((ref, opts[0], True), (eager, opts[1], False), (run, opts[2], False)):
            xi = (x if whole else x[sl]).clone().requires_grad_()
            y = call(xi)
            y.float().square().sum().div(x.numel()).backward()
            got.append((y.detach(), xi.grad))
            opt.step()
        (yr, gr), (ye, ge), (yc, gc) = got
        for what, c, e, r in (("output", yc, ye, yr), ("input grad", gc, ge, gr)):
            d_ = tensor_diff(c, e, f"step {step} {what} (compiled vs eager TP)")
            if d_:
                diffs.append(d_)
            # the row-parallel layer sums partial products: its order of summation differs from one device's (and
            # after a step the parameters do by as much, which may move an element by a quantization step: step 0)
            for name, t in ((("compiled" if compiler else "eager, again"), c), ("eager", e)) if step == 0 else ():
                d_ = close_diff(t, r[sl], f"step {step} {what} ({name} TP vs one process)", 1e-5)[1]
                if d_:
                    diffs.append(d_)
        for (n, pr), (_, pe), (_, pc) in zip(*(m.named_parameters() for m in models)):
            d_ = tensor_diff(_local(pc.grad), _local(pe.grad), f"step {step} grad of {n} (compiled vs eager TP)")
            if d_:
                diffs.append(d_)
            if step == 0:
                d_ = close_diff(_full(pc.grad), pr.grad, f"step 0 grad of {n} (compiled TP vs one process)", 1e-5)[1]
                if d_:
                    diffs.append(d_)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    for (n, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
        d_ = tensor_diff(_local(pc.detach()), _local(pe.detach()), f"{n} after 2 steps (compiled vs eager TP)")
        if d_:
            diffs.append(d_)
    return {"diffs": diffs, "graph_breaks": sum(counters["graph_break"].values()), "tp_ops": rec.linear_ops,
            "error": None}


def compiled_tp_matches_eager(rank: int, world_size: int, device, cases: list) -> dict:
    """Each case: (block, preset, override, save_original_input, shape, seq_dim (None: no sequence parallelism),
    dynamo backend or None: not compiled). The block parallelized with hybridq's styles runs eagerly and compiled
    (fullgraph=True), two SGD steps each, beside the single-process hybridq block. Returns {case_key: {"diffs", "graph_breaks",
    "tp_ops", "error"}}: compiled vs eager TP bit for bit (outputs, input and parameter gradients, parameters), and
    at the first step (same parameters) compiled and eager TP vs the single process within 1e-5 of the largest
    magnitude."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for case in cases:
        try:
            out[case_key(case)] = _one_case(rank, world_size, device, mesh, case)
        except Exception as e:  # noqa: BLE001 - the failure is the result (a graph break under fullgraph=True)
            out[case_key(case)] = {"diffs": [], "graph_breaks": None, "tp_ops": 0,
                                   "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def fsdp_tp_compiled_matches_eager(rank: int, world_size: int, device, presets: list, mesh_shape: tuple,
                                   copied: bool = False) -> dict:
    """FSDP2 over tensor-parallel pieces in torchtitan's order -- apply_hybrid_fsdp, parallelize_module over "tp",
    the block compiled (fullgraph=True), fully_shard over "dp" -- against the same model run eagerly: two SGD steps,
    outputs, input gradients, parameter gradients (this rank's shards) and parameters compared bit for bit. The
    weight pieces FSDP2 gathers quantized enter the graph as their handles. Returns {preset: {"diffs",
    "graph_breaks", "tp_ops", "error"}}."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from _tp_jobs import Block, tp_plan

    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    dp, tp = mesh_shape
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    shape = (1, 128 * max(tp, 2), 64 * max(tp, 2))  # (as _tp_jobs.tp_fsdp_job: whole blocks in every TP piece)
    chunk = shape[1] // tp
    out = {}
    for preset in presets:
        try:
            torch.manual_seed(0)
            base = Block(shape[-1], 2 * shape[-1]).to(device)
            eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
            torch._dynamo.reset()
            counters.clear()
            rec = _Recorder("aot_eager", op="tp_linear_forward")
            for m in (eager, compiled):
                hybridq.apply_hybrid_fsdp(m, deterministic_recipe(preset))
                parallelize_module(m, mesh["tp"], tp_plan(1))
            if copied:  # the compiled model is a copy of a parallelized one, whose original is freed
                compiled = copy.deepcopy(compiled)
                gc.collect()
            for m in (eager, compiled):
                if m is compiled:
                    m.forward = torch.compile(m.forward, backend=rec, fullgraph=True)
                fully_shard(m, mesh=mesh["dp"])
            opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled)]
            diffs = []
            for step in range(2):
                x = torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + dp_rank)).to(device)
                got = []
                for m, opt in zip((eager, compiled), opts):
                    xi = x[:, tp_rank * chunk:(tp_rank + 1) * chunk].clone().requires_grad_()
                    y = m(xi)
                    (y.float().square().sum() / (y.numel() * tp)).backward()
                    got.append((y.detach(), xi.grad, {n: _local(p.grad).clone() for n, p in m.named_parameters()}))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                (ye, ge, pe), (yc, g_c, pc) = got
                for what, c, e in [("output", yc, ye), ("input grad", g_c, ge)] + [
                        (f"grad of {n}", pc[n], pe[n]) for n in pe]:
                    d_ = tensor_diff(c, e, f"step {step} {what} (compiled vs eager)")
                    if d_:
                        diffs.append(d_)
            for (n, p_e), (_, p_c) in zip(eager.named_parameters(), compiled.named_parameters()):
                d_ = tensor_diff(_local(p_c.detach()), _local(p_e.detach()), f"{n} after 2 steps (compiled vs eager)")
                if d_:
                    diffs.append(d_)
            out[preset] = {"diffs": diffs, "graph_breaks": sum(counters["graph_break"].values()),
                           "tp_ops": rec.linear_ops, "error": None}
        except Exception as e:  # noqa: BLE001 - the failure is the result (a graph break under fullgraph=True)
            out[preset] = {"diffs": [], "graph_breaks": None, "tp_ops": 0, "error": f"{type(e).__name__}: {e}"[:3000]}
    return out


def unsharded_hybrid_weights_compile(rank: int, world_size: int, device) -> dict:
    """apply_hybrid_fsdp and the TP styles without fully_shard: the weight pieces are never gathered, the layers
    run eagerly inside the compiled block (graph breaks) and give the eager output. Returns {"error", "diff",
    "graph_breaks"}."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from _tp_jobs import Block, tp_plan

    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    m = Block(128, 256).to(device)
    hybridq.apply_hybrid_fsdp(m, deterministic_recipe("fp8_tensorwise"))
    parallelize_module(m, mesh, tp_plan(1))
    x = torch.randn(1, 128, 128, generator=torch.Generator().manual_seed(rank)).to(device)
    torch._dynamo.reset()
    counters.clear()
    try:
        want = m(x.clone())
        got = torch.compile(m, backend="aot_eager")(x.clone())
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return {"error": f"{type(e).__name__}: {e}"[:3000], "diff": None, "graph_breaks": None}
    return {"error": None, "diff": tensor_diff(got, want, "compiled vs eager output"),
            "graph_breaks": sum(counters["graph_break"].values())}


def replicated_input_gradient_keeps_non_finite(rank: int, world_size: int, device, compiled: bool) -> dict:
    """A column-parallel Linear on a replicated input, backward in high precision (only the input gradient's
    all-reduce carries values between the ranks): a NaN in the last rank's output columns of grad_output and an
    inf in the first rank's. Returns {"nan": [NaN positions per input row], "inf": ...} of this rank's input gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.distributed import ColwiseParallel

    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False))
    hybridq.convert_linears(model, hybridq.recipe("fp8_tensorwise", backward_override="high_precision"))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    fn = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    x = torch.randn(4, 32, requires_grad=True)
    y = fn(x)  # (this rank's output columns)
    dy = torch.ones_like(y)
    if rank == world_size - 1:
        dy[1, 0] = float("nan")
    if rank == 0:
        dy[2, 0] = float("inf")
    y.backward(dy)
    g = x.grad
    return {"nan": g.isnan().any(1).tolist(), "inf": g.isinf().any(1).tolist()}
