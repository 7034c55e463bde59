"""torch.compile of a GroupedLinear (hybridq/nn/compiled_grouped.py): per-tensor FP8 experts on the jagged layout with
`m_splits` as a tensor compile into the graph as two custom ops (no graph break per expert layer) and compute bitwise
what eager computes with the same counts; a new routing (same shapes) reuses the compiled graph; what the ops do not
take stays a graph break and correct."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq
from hybridq.nn.grouped_packed import FP8_TENSOR, packed_quantizers

from _compare import assert_bitwise

E, D, H = 3, 64, 96
SPLITS = [17, 0, 47]  # (64 tokens: MXFP8's Linear needs rows in 32s)

# the presets whose experts take the jagged FP8 path (every expert the same per-tensor FP8 with current scaling)
JAGGED_PRESETS = [p for p in hq.preset_names()
                  if getattr(packed_quantizers(hq.GroupedLinear(1, 32, 32, recipe=p).expert_quantizers), "kind",
                             None) == FP8_TENSOR]


class MoEBlock(nn.Module):
    """A Linear, then the experts (up, SiLU, down) on tokens already sorted by expert."""

    def __init__(self, preset: str):
        super().__init__()
        self.fc = hq.Linear(D, D, bias=False, recipe=preset, name="fc")
        self.up = hq.GroupedLinear(E, D, H, recipe=preset, name="up")
        self.down = hq.GroupedLinear(E, H, D, recipe=preset, name="down")

    def forward(self, x, m_splits):
        return x + self.down(F.silu(self.up(self.fc(x), m_splits)), m_splits)


def _grads(model, call, x, m_splits):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    y = call(x, m_splits)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_same(got, want, what):
    assert_bitwise(got[0], want[0], f"{what}: output")
    if want[1] is not None:
        assert_bitwise(got[1], want[1], f"{what}: grad input")
    assert got[2].keys() == want[2].keys(), f"{what}: gradients of {sorted(got[2])} vs eager {sorted(want[2])}"
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{what}: grad {n}")


def _grouped_ops(explained) -> int:
    op = torch.ops.hybridq.grouped_linear_forward
    return sum(n.target in (op, op.default) for g in explained.graphs for n in g.graph.nodes)


def test_jagged_presets_are_listed():
    assert "fp8_tensorwise" in JAGGED_PRESETS, JAGGED_PRESETS


@pytest.mark.parametrize("x_grad, w_grad", [(True, True), (False, True), (True, False)],
                         ids=["dgrad+wgrad", "wgrad-only", "frozen-experts"])
@pytest.mark.parametrize("preset", JAGGED_PRESETS)
def test_grouped_linear_in_graph_is_bitwise_eager(preset, x_grad, w_grad):
    """fullgraph=True (no graph break at either GroupedLinear): output and every gradient bit for bit eager's."""
    torch.manual_seed(0)
    model = MoEBlock(preset)
    for layer in (model.up, model.down):
        layer.weight.requires_grad_(w_grad)
    x = torch.randn(sum(SPLITS), D).requires_grad_(x_grad)
    m_splits = torch.tensor(SPLITS)
    want = _grads(model, model, x, m_splits)
    torch._dynamo.reset()
    got = _grads(model, torch.compile(model, fullgraph=True, backend="aot_eager"), x, m_splits)
    _assert_same(got, want, f"{preset}, compiled")


def test_grouped_linear_in_graph_under_no_grad_is_bitwise_eager():
    torch.manual_seed(0)
    model = MoEBlock("fp8_tensorwise")
    x, m_splits = torch.randn(sum(SPLITS), D), torch.tensor(SPLITS)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_bitwise(compiled(x, m_splits), model(x, m_splits), "no_grad output")


def test_grouped_linear_with_tensor_counts_is_in_the_graph():
    model = MoEBlock("fp8_tensorwise")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(sum(SPLITS), D), torch.tensor(SPLITS))
    assert explained.graph_break_count == 0, f"a graph break: {explained.break_reasons}"
    assert _grouped_ops(explained) == 2, f"both GroupedLinears should be custom ops in the graph: {explained}"


def test_a_new_routing_reuses_the_compiled_graph():
    """The counts are a tensor input of the graph, not constants: other counts (same token total) compile nothing
    new and compute what eager computes with them."""
    torch.manual_seed(0)
    model = MoEBlock("fp8_tensorwise")
    x = torch.randn(sum(SPLITS), D)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    _grads(model, compiled, x, torch.tensor(SPLITS))
    compiled_once = len(graphs)
    for splits in ([0, 64, 0], [32, 16, 16]):
        got = _grads(model, compiled, x, torch.tensor(splits))
        _assert_same(got, _grads(model, model, x, torch.tensor(splits)), f"routing {splits}")
    assert len(graphs) == compiled_once, f"new counts compiled {len(graphs) - compiled_once} more graph(s)"


@pytest.mark.parametrize("splits, rule", [([10, -1, 55], ">= 0"), ([10, 1, 1], "sum to")], ids=["negative", "sum"])
def test_bad_counts_in_the_graph_raise_naming_the_layer(splits, rule):
    model = MoEBlock("fp8_tensorwise")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    # (the configuration's first layer is named: layers of one configuration share the compiled graph)
    with pytest.raises(ValueError, match=rf"or a layer with its configuration, compiled\): m_splits.*{rule}"):
        compiled(torch.randn(sum(SPLITS), D), torch.tensor(splits))


@pytest.mark.parametrize("case", ["list counts", "mxfp8", "bias"])
def test_what_the_ops_do_not_take_stays_eager_and_correct(case):
    """A list m_splits (its values would be graph constants), another recipe, a bias: the GroupedLinear runs eagerly
    between compiled regions (a graph break) and computes what eager computes."""
    torch.manual_seed(0)
    preset = "mxfp8" if case == "mxfp8" else "fp8_tensorwise"
    model = MoEBlock(preset)
    if case == "bias":
        model.up = hq.GroupedLinear(E, D, H, bias=True, recipe=preset, name="up")
    m_splits = SPLITS if case == "list counts" else torch.tensor(SPLITS)
    x = torch.randn(sum(SPLITS), D)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, m_splits)
    assert explained.graph_break_count >= 1, f"{case}: expected the GroupedLinear as a graph break: {explained}"
    torch._dynamo.reset()
    _assert_same(_grads(model, torch.compile(model, backend="aot_eager"), x, m_splits),
                 _grads(model, model, x, m_splits), case)


@pytest.mark.gpu
def test_grouped_linear_in_graph_on_cuda_is_bitwise_eager():
    """On an H100/H200 (the CUDA jagged kernels) under Inductor, counts on the device: bitwise eager."""
    from hybridq.gemm import jagged_fp8_kernels
    q = hq.GroupedLinear(1, 64, 64, recipe="fp8_tensorwise").expert_quantizers[0]
    if not torch.cuda.is_available() or jagged_fp8_kernels(torch.device("cuda"), 64, 96, q) is None:
        pytest.skip("needs the CUDA jagged kernels (sm_90, Triton, the built extension)")
    torch.manual_seed(0)
    model = MoEBlock("fp8_tensorwise").cuda().to(torch.bfloat16)
    x = torch.randn(sum(SPLITS), D, device="cuda", dtype=torch.bfloat16)
    m_splits = torch.tensor(SPLITS, device="cuda")
    want = _grads(model, model, x, m_splits)
    torch._dynamo.reset()
    _assert_same(_grads(model, torch.compile(model, fullgraph=True), x, m_splits), want, "cuda, inductor")
