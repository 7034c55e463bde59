"""Jobs of test_fsdp_compile_dense_shared_input.py: compiled transformer-like blocks whose per-tensor FP8 Linears FSDP2
all-gathers quantized, where q/k/v read one tensor and the MLP's w1/w3 another. The compiled step quantizes each
tensor a Linear reads once ([Note: one dense input quantization in the graph], hybridq/nn/float8_graph.py) and
computes bit for bit what the eager model computes."""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq
import hybridq.nn.float8_graph as float8_graph

from _compile_jobs import _ACTS, _Recorder, _shard  # (puts tests/ on sys.path for _compare, _aot_graphs)
from _aot_graphs import recording_backend
from _compare import parameter_diffs, step_diffs

LAYERS = 2
# the tensors the Linears of one block read: x (wq, wk, wv), the attention mix (wo), h (w1, w3), the MLP's product (w2)
READ_TENSORS, LINEARS = 4, 7


class AttentionMlpBlock(nn.Module):
    """h = x + wo(wq x + wk x + wv x); h + w2(act(w1 h) * w3 h): three Linears read x, two read h. (Sums and one
    product: no fusable multiply-add Inductor may round otherwise than eager.)"""

    def __init__(self, d: int, hidden: int, act):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1 = nn.Linear(d, hidden)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.act = act

    def forward(self, x):
        h = x + self.wo(self.wq(x) + self.wk(x) + self.wv(x))
        return h + self.w2(self.act(self.w1(h)) * self.w3(h))


class SharedInputNet(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 128, act=F.silu):
        super().__init__()
        self.blocks = nn.ModuleList(AttentionMlpBlock(d, hidden, act) for _ in range(LAYERS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _step(model, opt, x, seed: int) -> tuple[torch.Tensor, dict]:
    """_compile_jobs._step's step, the gradients of the parameters that take one."""
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _counting_input_casts(calls: dict):
    """float8_graph._quantize, counting in `calls["casts"]` (while `calls["on"]`) the casts of a Linear's input: those
    of `linear_input_quantize` and of the gathered fast path's forward (`_fprop`, x quantized inside)."""
    real = float8_graph._quantize

    def counted(*args, **kwargs):
        if calls["on"] and sys._getframe(1).f_code.co_name in ("linear_input_quantize", "_fprop"):
            calls["casts"] += 1
        return real(*args, **kwargs)
    return real, counted


def _quantize_nodes(graphs: list) -> list[int]:
    op = torch.ops.hybridq.linear_input_quantize.default
    return [sum(n.target is op for n in gm.graph.nodes) for gm in graphs]


def shared_input_step(rank, world_size, device, compiler="aot_eager", act="silu", steps=2,
                      save_original_input=False, frozen=(), no_grad=False):
    """An eager and a compiled (per block) copy of one model, `steps` AdamW steps (or, `no_grad`, forward passes under
    torch.no_grad). Returns the input casts per compiled step after the first (`casts`: a list per step), the
    `linear_input_quantize` nodes of each forward graph (aot_eager: the graphs AOTAutograd's min-cut partitioner
    made), graph breaks, and what differed from the eager model (losses / outputs, every gradient, the parameters
    after the last step). `frozen`: names of Linears (e.g. "wk") whose weight takes no gradient."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = SharedInputNet(act=_ACTS[act]).to(device)
    for b in base.blocks:
        for name in frozen:
            getattr(b, name).weight.requires_grad_(False)
    torch._dynamo.reset()
    counters.clear()
    forward_graphs: list = []
    backend = recording_backend(forward_graphs) if compiler == "aot_eager" else _Recorder(compiler)
    eager = _shard(copy.deepcopy(base), "fp8_tensorwise", device, world_size)
    compiled = _shard(copy.deepcopy(base), "fp8_tensorwise", device, world_size, compile_with=backend)
    for model in (eager, compiled):
        linears = [m for m in model.modules() if isinstance(m, hybridq.Linear)]
        assert len(linears) == LINEARS * LAYERS, f"apply_hybrid_fsdp converted {len(linears)} Linears"
        for m in linears:
            m.save_original_input = save_original_input
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=False)
            for m in (eager, compiled)]
    calls = {"on": False, "casts": 0}
    real, counted = _counting_input_casts(calls)
    float8_graph._quantize = counted
    diffs, casts = [], []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(2, 16, 64, generator=g).to(device).requires_grad_(not no_grad)
            results = []
            for model, opt in zip((eager, compiled), opts):
                calls.update(on=model is compiled and step > 0, casts=0)
                if no_grad:
                    with torch.no_grad():
                        results.append((model(x), {}))
                else:
                    results.append(_step(model, opt, x, 100 * step + rank))
                if model is compiled and step > 0:
                    casts.append(calls["casts"])
                calls["on"] = False
            diffs += step_diffs(step, results[1], results[0], "output / loss")
    finally:
        float8_graph._quantize = real
    diffs += parameter_diffs(compiled, eager, f"after {steps} steps")
    return {"diffs": diffs, "casts": casts, "quantize_nodes": _quantize_nodes(forward_graphs),
            "graph_breaks": sum(counters["graph_break"].values())}
