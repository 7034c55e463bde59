"""torch.compile of a model with hybridq layers (torchtitan's per-block compile): the hybridq layers run eagerly
between compiled regions (a graph break each), so compiling works and computes what eager computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq

from _compare import assert_bitwise

SPLITS = [40, 0, 24]


class Block(nn.Module):
    def __init__(self, preset: str):
        super().__init__()
        self.norm = nn.RMSNorm(128)
        self.fc1 = hq.Linear(128, 256, bias=False, recipe=hq.recipe(preset), name="fc1")
        self.experts = hq.GroupedLinear(3, 256, 128, recipe=hq.recipe(preset), name="experts")

    def forward(self, x):
        return x + self.experts(F.silu(self.fc1(self.norm(x))), SPLITS)


def _run(block, x, call=None):
    """Output, input gradient and parameter gradients of `call` (default: the block itself)."""
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    y = (call if call is not None else block)(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8"])
def test_compiled_block_computes_what_eager_computes(preset):
    torch.manual_seed(0)
    block = Block(preset)
    x = torch.randn(sum(SPLITS), 128)
    want = _run(block, x)
    torch._dynamo.reset()
    got = _run(block, x, torch.compile(block))
    # the quantized layers run the same eager code; the compiled RMSNorm / SiLU may round their fp32 math
    # differently from eager, which moves a few quantized codes by one step
    assert_bitwise(got[0], want[0], f"{preset}: compiled forward output")
    for what, g, w in [("grad input", got[1], want[1])] + [(f"grad {n}", got[2][n], want[2][n]) for n in want[2]]:
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 2e-2, f"{preset}: compiled {what} differs from eager by {rel:.2e} (relative norm)"


def test_hybridq_layers_are_graph_breaks_not_errors():
    block = Block("fp8_tensorwise")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(torch.randn(sum(SPLITS), 128))
    assert explained.graph_break_count == 2, f"expected a break at each of the 2 hybridq layers: {explained}"
