"""Jobs of test_fsdp_one_op.py / test_fsdp_block_one_op.py: an eager model whose FP8 Linears (per-tensor, or FP8
blocks) FSDP2 all-gathers quantized (apply_hybrid_fsdp), trained on the fast path -- where each Linear call is the
extension's one op `hybridq::fp8_linear` / `fp8_block_linear` reading the gathered weight's parts -- and on the
general path (linear_function.py). Each job
returns what differed bit for bit, the autograd nodes the Linears' outputs had, and the gather counters."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hybridq
from hybridq.distributed import apply_hybrid_fsdp
from hybridq.nn.float8_graph import eager_fast_path

from _compile_jobs import _full  # (puts tests/ on sys.path for _compare and _format_cases)
from _compare import tensor_diff
from _format_cases import case_recipe
from _jobs import _states

D, HIDDEN = 64, 128


class Block(nn.Module):
    """x + fc2(silu(fc1(x))), optionally under non-reentrant activation checkpointing (recomputed in backward)."""

    def __init__(self, recompute: bool, d: int = D, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d, bias=False)
        self.recompute = recompute

    def _body(self, x):
        return x + self.fc2(F.silu(self.fc1(x)))

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False) if self.recompute else self._body(x)


class Net(nn.Module):
    def __init__(self, recompute: bool, d: int = D, hidden: int = HIDDEN):
        super().__init__()
        self.blocks = nn.ModuleList(Block(recompute, d, hidden) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _model(base: nn.Module, case: str, device, reshard: bool, save_original_input: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    apply_hybrid_fsdp(model, case_recipe(case))
    for mod in model.modules():
        if isinstance(mod, hybridq.Linear):
            mod.save_original_input = save_original_input
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _inputs(step: int, rank: int, device, nonfinite: bool, d: int = D, tokens: int = 16):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, gy = torch.randn(2, tokens, d, generator=g), torch.randn(2, tokens, d, generator=g)
    if nonfinite:  # inf and NaN in the input (amax, cast, GEMMs) and in the output gradient (dgrad, wgrad)
        x[0, 0, 0], x[1, 3, 5], gy[0, 1, 2] = math.inf, math.nan, -math.inf
    return x.to(device), gy.to(device)


def _train(model, device, rank: int, steps: int, nonfinite: bool, d: int = D, tokens: int = 16
           ) -> tuple[list, list[str]]:
    """[(output, grad_input, {param: grad}) per step], and the autograd node names of every hybridq Linear output."""
    nodes: list[str] = []

    def record(mod, args, out):
        fn = out.grad_fn
        nodes.append(fn.name() if type(fn).__name__ == "CppFunction" else type(fn).__name__)

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, hybridq.Linear)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    out = []
    try:
        for step in range(steps):
            x, gy = _inputs(step, rank, device, nonfinite, d, tokens)
            x.requires_grad_()
            y = model(x)
            y.backward(gy)
            out.append((y.detach(), x.grad, {n: _full(p.grad).clone() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    return out, nodes


def _counters(model) -> dict:
    total: dict = {}
    for st in _states(model).values():
        for k, v in st.counters.items():
            total[k] = total.get(k, 0) + v
    return total


def one_op_matches_general_path(rank, world_size, device, case="fp8_tensorwise", reshard=True, recompute=False,
                                nonfinite=False, save_original_input=False, steps=2, d=D, hidden=HIDDEN,
                                tokens=16) -> dict:
    """One model trained `steps` AdamW steps on the fast path (the one op on the gathered weights) and a copy on
    the general path (`d`, `hidden`: the blocks' widths; `tokens` per sequence, 2 sequences). Returns {"diffs":
    [...], "nodes": {...}, "general_nodes": {...}, "counters", "general_counters"}:
    every step's output, input gradient and parameter gradients, and the parameters after the last step, compared bit
    for bit (NaN positions, not payloads, where non-finite inputs make NaNs)."""
    torch.manual_seed(0)
    base = Net(recompute, d, hidden).to(device)
    runs = {}
    for fast in (True, False):
        model = _model(base, case, device, reshard, save_original_input)
        with eager_fast_path(fast):
            steps_out, nodes = _train(model, device, rank, 1 if nonfinite else steps, nonfinite, d, tokens)
        params = {n: _full(p.detach()) for n, p in model.named_parameters()}
        runs[fast] = (steps_out, nodes, params, _counters(model))
    (fast_steps, fast_nodes, fast_params, fast_c), (gen_steps, gen_nodes, gen_params, gen_c) = runs[True], runs[False]
    nan = nonfinite
    diffs = []
    for s, ((yf, dxf, gf), (yg, dxg, gg)) in enumerate(zip(fast_steps, gen_steps)):
        diffs += [tensor_diff(yf, yg, f"step {s} output", nan_payload=nan),
                  tensor_diff(dxf, dxg, f"step {s} grad input", nan_payload=nan)]
        diffs += [tensor_diff(gf[n], gg[n], f"step {s} grad {n}", nan_payload=nan) for n in gg]
    diffs += [tensor_diff(fast_params[n], gen_params[n], f"{n} after the steps", nan_payload=nan) for n in gen_params]
    return {"diffs": [d for d in diffs if d], "nodes": sorted(set(fast_nodes)), "calls": len(fast_nodes),
            "general_nodes": sorted(set(gen_nodes)), "counters": fast_c, "general_counters": gen_c}
