"""Jobs of test_fsdp_fast_path.py: an FP8 model whose Linears FSDP2 all-gathers quantized (apply_hybrid_fsdp), run
eagerly on the fast path (nn/float8_graph.py's ops reading the gathered weight's parts) and on the general path
(linear_function.py). Each job returns what differed and how many Linear calls took the fast path."""

from __future__ import annotations

import copy

import torch

from hybridq.nn import float8_graph

from _compile_jobs import Net, _full, _shard, _step, tensor_diff


def fast_path_matches_general_path(rank, world_size, device, presets, steps=2) -> dict:
    """For each preset: two copies of one model, `steps` AdamW steps each on this rank's batches, one with the
    eager fast path, one without. Returns {preset: {"diffs": [...], "fast_calls": n}}: losses, every gradient of
    every step and the parameters after the last step compared bit for bit."""
    calls = {"n": 0}
    orig = float8_graph.eager_float8_linear

    def counting(*args, **kw):
        y = orig(*args, **kw)
        calls["n"] += y is not None
        return y

    float8_graph.eager_float8_linear = counting
    out = {}
    try:
        for preset in presets:
            torch.manual_seed(0)
            base = Net().to(device)
            models = [_shard(copy.deepcopy(base), preset, device, world_size) for _ in range(2)]
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in models]
            diffs = []
            calls["n"] = 0
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(2, 16, 64, generator=g).to(device).requires_grad_()
                loss_f, grads_f = _step(models[0], opts[0], x, 100 * step + rank)
                with float8_graph.eager_fast_path(False):
                    loss_g, grads_g = _step(models[1], opts[1], x, 100 * step + rank)
                diffs += [d for d in [tensor_diff(loss_f, loss_g, f"step {step} loss")] if d]
                diffs += [d for n in grads_g for d in [tensor_diff(grads_f[n], grads_g[n], f"step {step} grad {n}")]
                          if d]
            for (n, pf), (_, pg) in zip(models[0].named_parameters(), models[1].named_parameters()):
                d = tensor_diff(_full(pf.detach()), _full(pg.detach()), f"{n} after {steps} steps")
                if d:
                    diffs.append(d)
            out[preset] = {"diffs": diffs, "fast_calls": calls["n"]}
    finally:
        float8_graph.eager_float8_linear = orig
    return out
