"""Jobs of test_fsdp_grouped_compile.py: mixture-of-experts blocks compiled with torch.compile (per block, before
fully_shard, as train.py --compile) whose grouped weights FSDP2 all-gathers quantized (apply_hybrid_fsdp), against the
same model run eagerly. Each job returns what differed (lists of messages) and what the compiled graphs hold (graph
breaks, hybridq grouped ops, inputs or saved tensors of a grouped weight's shape); the tests assert on them."""

from __future__ import annotations

import copy
import functools
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq
from hybridq.distributed import apply_hybrid_fsdp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import tensor_diff  # noqa: E402
from _format_cases import FORMATS  # noqa: E402

E, D, H, TOP_K = 4, 64, 96, 2


def recipe_of(case: str):
    """A preset by name, or every tensor of every expert in the per-tensor FP8 format FORMATS[case]."""
    if case in hybridq.preset_names():
        return case
    return hybridq.CustomRecipe(lambda role: FORMATS[case](), name=f"all_{case}")


class Experts(nn.Module):
    """SwiGLU experts in the expert protocol (w1 / w3 / w2 `[E, out, in]`); `act` between the projections."""

    hybridq_grouped_weights = ("w1", "w3", "w2")

    def __init__(self, act):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, D) / D ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H) / H ** 0.5)
        self.act = act

    def forward(self, x, m_splits):
        hid = self.act(hybridq.grouped_mm(self, "w1", x, m_splits)) * hybridq.grouped_mm(self, "w3", x, m_splits)
        return hybridq.grouped_mm(self, "w2", hid, m_splits)


def _identity(t):
    return t


class Block(nn.Module):
    """proj(experts(x)) on the tokens sorted by expert: routed top-2 in the block (a high-precision router, counts
    as a device tensor, as launch/model.py's MoE) plus the residual, or (`routed=False`) on the given counts, no
    residual: then no tensor's gradient sums more than two terms (Inductor adds three bf16 terms in fp32 and rounds
    once, eager after each add: FP8's rounding of the next gradient magnifies that). `proj` is a GroupedLinear
    itself; the experts an expert module apply_hybrid_fsdp converts."""

    def __init__(self, routed: bool, act):
        super().__init__()
        self.routed = routed
        self.router = nn.Parameter(torch.randn(E, D) / D ** 0.5)  # (not an nn.Linear: kept in high precision)
        self.experts = Experts(act)
        self.proj = hybridq.GroupedLinear(E, D, D, recipe="fp8_tensorwise", name="proj")

    def forward(self, x, m_splits=None):
        if not self.routed:
            return self.proj(self.experts(x, m_splits), m_splits)
        flat = x.reshape(-1, D)
        top_p, top_e = (flat @ self.router.t()).float().softmax(-1).topk(TOP_K, dim=-1)
        flat_e = top_e.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat_e, torch.ones_like(flat_e))
        ys = self.proj(self.experts(flat[order // TOP_K], counts), counts)
        ys = ys * (top_p / top_p.sum(-1, keepdim=True)).reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(flat.shape[0], TOP_K, D).sum(1)
        return x + y.view_as(x)


class Net(nn.Module):
    def __init__(self, routed: bool, act, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(routed, act) for _ in range(layers))

    def forward(self, x, m_splits=None):
        for b in self.blocks:
            x = b(x, m_splits)
        return x


class _Recorder:
    """A dynamo backend that records what the compiled graphs hold: the hybridq grouped ops by name, and the graph
    inputs or forward outputs (saved for backward) whose shape is a grouped weight's (the gathered bytes entering or
    kept). "aot_eager": AOTAutograd's forward and backward graphs as they are traced (the `gathered_` ops the
    handles turn the calls into); "inductor": dynamo's graph (the layer's ops on the weight), compiled by Inductor."""

    def __init__(self, compiler: str, weight_shapes):
        self.compiler = compiler
        self.weight_shapes = {tuple(s) for s in weight_shapes}
        self.ops: dict[str, int] = {}
        self.weight_tensors: list[str] = []

    def _look(self, gm, which):
        for n in gm.graph.nodes:
            name = str(n.target)
            if name.startswith("hybridq."):
                key = name.split(".")[1]
                self.ops[key] = self.ops.get(key, 0) + 1
        if which == "dynamo":  # (its inputs are the weights themselves: AOTAutograd flattens them to handles)
            return
        outputs = [a for a in gm.graph.nodes if a.op == "output"][0].args[0] if which == "forward" else []
        for n in [n for n in gm.graph.nodes if n.op == "placeholder"] + [o for o in outputs if hasattr(o, "meta")]:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and tuple(val.shape) in self.weight_shapes:
                self.weight_tensors.append(f"{which} {n.op} {n.name} {tuple(val.shape)} {val.dtype}")

    def backend(self):
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            def inductor(gm, example_inputs):
                self._look(gm, "dynamo")
                return compile_fx(gm, example_inputs)
            return inductor

        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def recorder(which):
            def run(gm, example_inputs):
                self._look(gm, which)
                return make_boxed_func(gm.forward)
            return run

        return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))


def _shard(model: nn.Module, recipe, device, world_size: int, dtype, compile_with=None, reshard=True) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for b in model.blocks:
        b.proj.recipe = recipe
    apply_hybrid_fsdp(model, recipe)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    shard = functools.partial(fully_shard, mesh=init_device_mesh(device.type, (world_size,)),
                              reshard_after_forward=reshard, mp_policy=mp)
    for b in model.blocks:
        if compile_with is not None:  # per block, before fully_shard (as train.py --compile); a graph break raises
            b.forward = torch.compile(b.forward, backend=compile_with, fullgraph=True)
        shard(b)
    shard(model)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float | None) -> str | None:
    """tensor_diff (bit for bit), or with a `tolerance`: the largest difference relative to want's largest
    magnitude."""
    if tolerance is None:
        return tensor_diff(got, want, what)
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-30)
    return f"{what}: max |diff| / max |want| = {err:.3e} > {tolerance}" if err > tolerance else None


def _train_both(eager: nn.Module, compiled: nn.Module, batch, steps: int, tolerance: float | None = None) -> list[str]:
    """`steps` AdamW steps of both models on `batch(step)` = (input, m_splits or None): what differed bit for bit in
    each step's output, input gradient (a float input) and every parameter gradient, and the parameters after
    (`tolerance`: all but the first output within it, see _close)."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (eager, compiled)]
    diffs = []
    for step in range(steps):
        x, splits = batch(step)
        got = []
        for m, opt in zip((eager, compiled), opts):
            xi = x.clone().requires_grad_() if x.is_floating_point() else x
            y = m(xi) if splits is None else m(xi, splits)
            y.float().square().mean().backward()
            got.append((y.detach(), xi.grad, {n: _full(p.grad).clone() for n, p in m.named_parameters()
                                               if p.grad is not None}))  # (unrouted: the router has none)
            opt.step()
            opt.zero_grad(set_to_none=True)
        (y_e, dx_e, g_e), (y_c, dx_c, g_c) = got
        if g_c.keys() != g_e.keys():
            diffs.append(f"step {step}: gradients of {sorted(g_c)}, eager {sorted(g_e)}")
        checks = [(y_c, y_e, "output")] + ([(dx_c, dx_e, "input grad")] if dx_e is not None else [])
        checks += [(g_c[n], g_e[n], f"grad {n}") for n in g_e if n in g_c]
        diffs += [d for i, (c, e, what) in enumerate(checks)
                  for d in [_close(c, e, f"step {step} {what}", None if step == i == 0 else tolerance)] if d]
    for (n, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
        d = _close(_full(pc.detach()), _full(pe.detach()), f"{n} after {steps} steps", tolerance)
        if d:
            diffs.append(d)
    return diffs


def compiled_experts_match_eager(rank, world_size, device, cases, compiler="aot_eager", steps=2, reshard=True,
                                 routed=True, dtype="float32"):
    """For each case (recipe_of): an eager and a compiled copy of one MoE model under FSDP2, `steps` AdamW steps on
    this rank's batches. Returns {case: {"diffs": [...], "ops": {op: count}, "weight_tensors": [...]}}: each
    step's output, input gradient and every parameter gradient, and the parameters after the last step, compared
    bit for bit."""
    dt = getattr(torch, dtype)
    act = F.silu if routed else _identity  # (Inductor may round a fused SiLU otherwise than eager)

    def batch(step):
        x = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)
        if routed:
            return x, None
        return x.reshape(-1, D), torch.tensor([7, 0, 16 + step, 9 - step], device=device)  # (an expert idle)

    out = {}
    for case in cases:
        torch.manual_seed(0)
        base = Net(routed, act).to(device)
        torch._dynamo.reset()
        recipe = recipe_of(case)
        rec = _Recorder(compiler, [(E, H, D), (E, D, H), (E, D, D)])
        eager = _shard(copy.deepcopy(base), recipe, device, world_size, dt, reshard=reshard)
        compiled = _shard(copy.deepcopy(base), recipe, device, world_size, dt, rec.backend(), reshard=reshard)
        out[case] = {"diffs": _train_both(eager, compiled, batch, steps), "ops": rec.ops,
                     "weight_tensors": rec.weight_tensors}
    return out


def launch_moe_model_compiles(rank, world_size, device, steps=2):
    """The training job's MoE model (launch/model.py: 2 blocks, 4 experts top-2) converted as train.py converts it
    (fp8_tensorwise, FSDP2-gathered, router and head high precision), each block compiled whole (fullgraph=True: a
    graph break raises), against its eager twin. Returns {"fp8_tensorwise": {"diffs", "ops", "weight_tensors"}}:
    the first output bit for bit, the rest within 1e-3 (the gradients of the attention and norm weights differ from
    eager's in the last bits under AOTAutograd from the first step, the experts' do not: the experts' ops are
    compared bitwise above)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "launch"))
    import model as job_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = job_model.ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=2, hidden=64, max_seq=32,
                                moe_experts=4, moe_top_k=2)
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = job_model.Transformer(cfg).to(device)
    rec = _Recorder("aot_eager", [(4, 64, 64)])
    mesh = init_device_mesh(device.type, (world_size,))
    models = []
    for compile_with in (None, rec.backend()):
        m = copy.deepcopy(base)
        apply_hybrid_fsdp(m, hybridq.recipe("fp8_tensorwise"),
                          module_filter_fn=lambda mod, fqn: fqn != "output" and not fqn.endswith("router"))
        for block in m.layers:
            if compile_with is not None:
                block.forward = torch.compile(block.forward, backend=compile_with, fullgraph=True)
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        models.append(m)

    def batch(step):
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randint(0, cfg.vocab_size, (2, 32), generator=g).to(device), None

    return {"fp8_tensorwise": {"diffs": _train_both(*models, batch, steps, tolerance=1e-3), "ops": rec.ops,
                               "weight_tensors": rec.weight_tensors}}
