"""Jobs of test_fsdp_compile_known_amax.py: compiled blocks whose per-tensor FP8 Linears FSDP2 all-gathers quantized
read hq.RMSNorm / SwiGLU outputs; under Inductor the Linears' shared input cast takes the norm's / SwiGLU's max|y|
from the graph ([Note: known max|y| in the graph], hybridq/nn/compiled_amax.py) and the step is bit for bit the eager
model's."""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn as nn

import hybridq
import hybridq.nn.float8_graph as float8_graph
from hybridq.nn import compiled_amax

from _compile_jobs import _Recorder, _shard  # (puts tests/ on sys.path for _compare)
from _compare import parameter_diffs, step_diffs

LAYERS = 2
# per block: the attention norm's y (read by wq, wk, wv), the MLP norm's (w1, w3), SwiGLU's (w2); wo reads a sum
KNOWN_PER_BLOCK, CASTS_PER_BLOCK = 3, 4


class NormBlock(nn.Module):
    """a = wo(wq n1 + wk n1 + wv n1), n1 = norm1(x); w2(swiglu(w1 n2, w3 n2)), n2 = norm2(a). (fp32, no residual: a
    norm's fp32 input read by another op too gets a dx that may differ in the last bit on the CPU, compiled_norms.py;
    sums and opaque ops only, nothing Inductor may round otherwise than eager.)"""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = hybridq.RMSNorm(d, eps=1e-5), hybridq.RMSNorm(d, eps=1e-5)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        n1 = self.norm1(x)
        n2 = self.norm2(self.wo(self.wq(n1) + self.wk(n1) + self.wv(n1)))
        return self.w2(hybridq.nn.swiglu(self.w1(n2), self.w3(n2)))


class NormNet(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 128):
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock(d, hidden) for _ in range(LAYERS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _counting_input_casts(calls: dict):
    """float8_graph._quantize counting, while `calls["on"]`, the casts `linear_input_quantize` runs: all, and those
    handed a max|x|."""
    real = float8_graph._quantize

    def counted(*args, **kwargs):
        if calls["on"] and sys._getframe(1).f_code.co_name == "linear_input_quantize":
            calls["casts"] += 1
            amax = args[4] if len(args) > 4 else kwargs.get("amax")
            calls["known"] += amax is not None
        return real(*args, **kwargs)
    return real, counted


def known_amax_step(rank, world_size, device, compiler="inductor", switch=True, steps=2, nonfinite=False):
    """An eager and a compiled (per block) copy of one model, `steps` AdamW steps; returns per compiled step after
    the first the input casts and how many of them were handed a max|x| (`casts`, `known`), and what differed from
    the eager model (losses, gradients, parameters after the last step). `nonfinite`: the input holds an inf and a
    NaN (the losses, gradients and parameters are then non-finite alike)."""
    torch.manual_seed(0)
    base = NormNet().to(device)
    torch._dynamo.reset()
    before = compiled_amax.ENABLED.set(switch)
    eager = _shard(copy.deepcopy(base), "fp8_tensorwise", device, world_size)
    compiled = _shard(copy.deepcopy(base), "fp8_tensorwise", device, world_size, compile_with=_Recorder(compiler))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (eager, compiled)]
    calls = {"on": False, "casts": 0, "known": 0}
    real, counted = _counting_input_casts(calls)
    float8_graph._quantize = counted
    diffs, casts, known = [], [], []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(2, 16, 64, generator=g)
            if nonfinite:
                x[0, 3, 5], x[1, 7, 2] = float("inf"), float("nan")
            x = x.to(device).requires_grad_()
            results = []
            for model, opt in zip((eager, compiled), opts):
                calls.update(on=model is compiled and step > 0, casts=0, known=0)
                torch.manual_seed(100 * step + rank)
                loss = model(x).square().mean()
                loss.backward()
                grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad(set_to_none=True)
                results.append((loss.detach(), grads))
                if model is compiled and step > 0:
                    casts.append(calls["casts"])
                    known.append(calls["known"])
                calls["on"] = False
            diffs += step_diffs(step, results[1], results[0])
    finally:
        float8_graph._quantize = real
        compiled_amax.ENABLED.set(before)
    diffs += parameter_diffs(compiled, eager, f"after {steps} steps")
    return {"diffs": diffs, "casts": casts, "known": known}
