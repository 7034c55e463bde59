"""Jobs of test_fsdp_compile_fast_path.py: a compiled block whose FP8 Linears (per-tensor or fp8_block) FSDP2
all-gathers quantized runs its gathered ops (`hybridq::gathered_linear_forward` / `gathered_linear_backward`) as
float8_graph's fast path, not as linear_function's general path, and computes bit for bit what the general path
computes."""

from __future__ import annotations

import copy

import torch

import hybridq.nn.compiled_linear as compiled_linear
import hybridq.nn.float8_graph as float8_graph
from hybridq.nn.float8_graph import eager_fast_path

from _compile_jobs import Net, _ACTS, _Recorder, _shard, _step  # (puts tests/ on sys.path for _compare)
from _compare import tensor_diff


def _counting(calls: dict, name: str, fn):
    """`fn`, counting its calls in `calls[name]` while `calls["on"]` (the steps after compiling: the fake
    implementations run the general path on fake tensors while compile traces)."""
    def counted(*args, **kwargs):
        if calls["on"]:
            calls[name] += 1
        return fn(*args, **kwargs)
    return counted


def gathered_ops_fast_path(rank, world_size, device, preset="fp8_tensorwise", compiler="aot_eager", act="silu",
                           steps=2, save_original_input=False, d=64, hidden=128, tokens=16):
    """One model compiled per block, trained `steps` AdamW steps with the fast path on and off (`eager_fast_path`,
    which the gathered ops honour). Returns, per setting, how often the ops' bodies called the general path's
    forward and backward in the steps after the first, the graph breaks and Linear ops, and what differed between
    the two settings (losses, every gradient, the parameters after the last step) and from the eager model.
    `save_original_input`: set on every hybridq Linear (wgrad quantizes the saved input in backward). `d`, `hidden`:
    the blocks' widths (fp8_block's 128x128 weight tiles whole on each of 2 ranks: multiples of 256); `tokens`: per
    sequence (2 sequences). Also counted: float8_graph's Python phases (`_fprop`, `_grads`), which the C++ phase ops
    replace on CUDA, and the plans the gathered forward op made (compiled_linear.py's [Note: a gathered call site's
    plans]: none after the first step, where each call site reuses its plan)."""
    import hybridq
    from torch._dynamo.utils import counters

    calls = {"on": False, "forward_and_saved": 0, "linear_grads": 0, "_fprop": 0, "_grads": 0, "forward_plan": 0}
    real = {(compiled_linear, n): getattr(compiled_linear, n)
            for n in ("forward_and_saved", "linear_grads", "forward_plan")}
    real.update({(float8_graph, n): getattr(float8_graph, n) for n in ("_fprop", "_grads")})
    for (module, n), fn in real.items():
        setattr(module, n, _counting(calls, n, fn))
    torch.manual_seed(0)
    base = Net(d=d, hidden=hidden, act=_ACTS[act]).to(device)
    runs, out = {}, {"diffs": []}
    try:
        for fast in (True, False, "eager"):
            torch._dynamo.reset()
            counters.clear()
            rec = _Recorder(compiler)
            model = _shard(copy.deepcopy(base), preset, device, world_size,
                           compile_with=None if fast == "eager" else rec)
            linears = [mod for mod in model.modules() if isinstance(mod, hybridq.Linear)]
            assert len(linears) == 4, f"apply_hybrid_fsdp converted {len(linears)} of the 4 Linears"
            for mod in linears:
                mod.save_original_input = save_original_input
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            calls.update(forward_and_saved=0, linear_grads=0, _fprop=0, _grads=0, forward_plan=0)
            losses, grads = [], []
            with eager_fast_path(fast is not False):
                for step in range(steps):
                    calls["on"] = step > 0
                    g = torch.Generator().manual_seed(100 * step + rank)
                    x = torch.randn(2, tokens, d, generator=g).to(device).requires_grad_()
                    loss, gr = _step(model, opt, x, 100 * step + rank)
                    losses.append(loss)
                    grads.append(gr)
                    calls["on"] = False
            params = {n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
                      for n, p in model.named_parameters()}
            runs[fast] = (losses, grads, params)
            out[str(fast)] = {"forward_and_saved": calls["forward_and_saved"], "linear_grads": calls["linear_grads"],
                              "python_phases": calls["_fprop"] + calls["_grads"],
                              "plans_made": calls["forward_plan"],
                              "graph_breaks": sum(counters["graph_break"].values()), "linear_ops": rec.linear_ops}
    finally:
        for (module, n), fn in real.items():
            setattr(module, n, fn)
    (l_on, g_on, p_on) = runs[True]
    for other in (False, "eager"):
        lo, go, po = runs[other]
        what = f"fast path vs {'general path' if other is False else 'eager model'}"
        diffs = [tensor_diff(a, b, f"{what}: step {s} loss") for s, (a, b) in enumerate(zip(l_on, lo))]
        diffs += [tensor_diff(g_on[s][n], go[s][n], f"{what}: step {s} grad {n}") for s in range(steps) for n in go[s]]
        diffs += [tensor_diff(p_on[n], po[n], f"{what}: {n} after {steps} steps") for n in po]
        out["diffs"] += [d for d in diffs if d]
    return out
