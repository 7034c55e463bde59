"""Jobs for test_zero_adamw_compile.py: a model with quantized parameters trained with ZeroAdamW (docs/
quantized-parameters.md), compiled against the same model eager, on a spawned gloo rank. Each job returns failure
messages."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import hybridq as hq
from hybridq.distributed import ZeroAdamW

PRESETS = ("fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd", "fp8_block")
STEPS = 3


def _model(preset: str) -> nn.Module:
    torch.manual_seed(0)
    recipe = hq.recipe(preset)
    with hq.quantized_model_init():
        return nn.Sequential(hq.Linear(128, 256, recipe=recipe, name="up", dtype=torch.bfloat16), nn.GELU(),
                             hq.Linear(256, 128, bias=False, recipe=recipe, name="down", dtype=torch.bfloat16))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def _train(preset: str) -> list[str]:
    """STEPS ZeroAdamW steps of the compiled model and of its eager copy on the same batches: each step's loss and
    the weights after it bitwise equal; every step changes the weights (so a graph reading the first step's bytes
    would give another loss)."""
    fails = []
    model = _model(preset)
    twin = copy.deepcopy(model)
    opts = [ZeroAdamW(m, lr=1e-2, weight_decay=0.1) for m in (model, twin)]
    torch._dynamo.reset()
    calls = [torch.compile(model, fullgraph=True, backend="aot_eager"), twin]
    for step in range(STEPS):
        x = torch.randn(64, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(10 + step))
        before = model[0].weight.dequantize().clone()
        losses = []
        for call, opt in zip(calls, opts):
            torch.manual_seed(step)  # (stochastic rounding of gradients draws alike)
            loss = call(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if not torch.equal(losses[0], losses[1]):
            fails.append(f"{preset}, step {step}: compiled loss {losses[0].item()!r} vs eager {losses[1].item()!r}")
        if torch.equal(model[0].weight.dequantize(), before):
            fails.append(f"{preset}, step {step}: the optimizer step left up.weight unchanged")
        for name, p in model.named_parameters():
            q = dict(twin.named_parameters())[name]
            a, b = (t.dequantize() if isinstance(t, hq.QuantizedTensor) else t for t in (p, q))
            if not torch.equal(_bits(a), _bits(b)):
                fails.append(f"{preset}, step {step}: {name} after the step differs from the eager run's")
    return fails


def job_checks(rank, world_size, device, **_):
    out = {}
    for preset in PRESETS:
        try:
            out[preset] = _train(preset)
        except Exception as e:  # noqa: BLE001 - the check's failure; the next presets still run
            out[preset] = [f"raised {type(e).__name__}: {e}"]
    return out
