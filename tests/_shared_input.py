"""Helpers of the tests that a compiled MoE layer's projections reading one input quantize it once
(test_grouped_compile_shared_input.py: per-tensor FP8 experts; test_grouped_blocks_compile_shared_input.py: block
formats): SwiGLU experts whose w1 and w3 read the same input, one training step's results, compiled against eager, and
the forward graph AOTAutograd's min-cut partitioner makes (not a test module)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq
from _aot_graphs import recording_backend
from _compare import assert_results_bitwise
from _format_cases import FORMATS

E, D, H = 3, 64, 96
# fp8_block's grouped kernels on device counts need every expert's weight rows in whole 128-row blocks: the CUDA tests
# of that path run at these sizes (at D, H the path is not taken and they would skip)
BLOCK_KERNEL_DIMS = {"d": 128, "h": 256}
SPLITS = [17, 0, 47]  # (64 tokens: MXFP8's Linear needs rows in 32s; an expert without tokens)


def recipe_of(case: str, input_case: str | None = None):
    """The preset or every tensor in format FORMATS[case]; `input_case`: the input's quantizer FORMATS[input_case]
    (a preset's other tensors stay the preset's)."""
    if input_case is None:
        return case if case in hq.preset_names() else hq.CustomRecipe(lambda role: FORMATS[case](), name=f"all_{case}")
    if case in hq.preset_names():
        base = hq.recipe(case)
        return hq.CustomRecipe(lambda role: FORMATS[input_case]() if role.tensor_type == "input"
                               else base.quantizer(role), name=f"{case}_input_{input_case}")
    return hq.CustomRecipe(lambda role: FORMATS[input_case if role.tensor_type == "input" else case](),
                           name=f"{case}_input_{input_case}")


class SwiGLUExperts(nn.Module):
    """y = w2(act(w1 x) * w3 x) on tokens sorted by expert: w1 and w3 read the same input tensor. `act` SiLU, or
    none under Inductor (its fused SiLU backward rounds otherwise than eager's kernels: not what is compared here)."""

    def __init__(self, recipe, w3_recipe=None, act=F.silu, d: int = D, h: int = H):
        super().__init__()
        self.w1 = hq.GroupedLinear(E, d, h, recipe=recipe, name="w1")
        self.w3 = hq.GroupedLinear(E, d, h, recipe=w3_recipe or recipe, name="w3")
        self.w2 = hq.GroupedLinear(E, h, d, recipe=recipe, name="w2")
        self.act = act or (lambda t: t)

    def forward(self, x, m_splits):
        return self.w2(self.act(self.w1(x, m_splits)) * self.w3(x, m_splits), m_splits)


def step(call, model, x, m_splits, dy) -> dict:
    """Output and every gradient of one forward + backward."""
    x = x.detach().clone().requires_grad_(True)
    y = call(x, m_splits)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad}
    out.update({f"d{n}": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return out


def inputs(device: str, dtype: torch.dtype, d: int = D):
    """(x, m_splits, dy) of SPLITS' tokens."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(SPLITS), d, generator=gen).to(device, dtype)
    dy = torch.randn(sum(SPLITS), d, generator=gen).to(device, dtype)
    return x, torch.tensor(SPLITS, device=device), dy


def compiled_vs_eager(model, device: str, dtype: torch.dtype, backend, count: Callable[[], list[str]]
                      ) -> tuple[dict, dict, list[str]]:
    """(compiled results, eager results, the compiled step's input quantizations: what `count()` -- called just
    before that step -- recorded), the compiled step the second one (the first compiles)."""
    x, m_splits, dy = inputs(device, dtype, model.w1.in_features)
    want = step(model, model, x, m_splits, dy)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    step(compiled, model, x, m_splits, dy)
    seen = count()
    got = step(compiled, model, x, m_splits, dy)
    if device == "cuda":
        torch.cuda.synchronize()
    return got, want, seen


# what the experts' input quantizations per compiled step should be, by their count
_WANT = {2: "want x once for w1 and w3, h once for w2", 3: "want w1's and w3's each, and w2's"}


def assert_quantizations_and_bitwise(model, device: str, dtype: torch.dtype, backend, count: Callable[[], list[str]],
                                     times: int, what: str) -> None:
    """The compiled step (`compiled_vs_eager`) quantizes the experts' inputs `times` times (2: w1 and w3 share x's;
    3: each projection quantizes its own) and gives eager's results bit for bit."""
    got, want, seen = compiled_vs_eager(model, device, dtype, backend, count)
    assert len(seen) == times, f"{what}: the compiled step quantized the experts' inputs {len(seen)} times: {seen} " \
                               f"({_WANT[times]})"
    assert_results_bitwise(got, want, f"{what}, compiled ({backend}) vs eager")


def forward_graph(model) -> torch.fx.Graph:
    """The forward graph AOTAutograd's min-cut partitioner (Inductor's and aot_eager's) makes of one training step."""
    graphs = []
    torch._dynamo.reset()
    x, m_splits, dy = inputs("cpu", torch.float32)
    step(torch.compile(model, fullgraph=True, backend=recording_backend(graphs)), model, x, m_splits, dy)
    return graphs[0].graph


def count_block_input_quantizations(patch=setattr) -> list[str]:
    """The names of the input quantizations block experts run from now on (`grouped_device_blocks._quantize`: the
    eager path's and the compiled ops'), patched with `patch(module, name, value)` (pytest's monkeypatch.setattr, or
    setattr in a spawned job's process)."""
    from hybridq.nn import grouped_device_blocks
    seen: list[str] = []
    real = grouped_device_blocks._quantize

    def quantize(q, t, layout, rowwise, columnwise, name):
        if name.startswith("input of"):
            seen.append(name)
        return real(q, t, layout, rowwise, columnwise, name)

    patch(grouped_device_blocks, "_quantize", quantize)
    return seen
