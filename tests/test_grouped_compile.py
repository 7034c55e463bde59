"""torch.compile of a GroupedLinear (hybridq/nn/compiled_grouped.py, compiled_grouped_blocks.py): per-tensor FP8
experts on the jagged layout, and block-format experts (FP8 blocks, MXFP8, their hybrid) on the device-count packed
path, with `m_splits` as a tensor compile into the graph as two custom ops (no graph break per expert layer) and
compute bitwise what eager computes with the same counts; a new routing (same shapes) reuses the compiled graph; what
the ops do not take stays a graph break and correct."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq
from hybridq.nn.compiled_grouped import experts_in_graph
from hybridq.nn.grouped_device_blocks import device_path_runs
from hybridq.nn.grouped_packed import BLOCKS, FP8_TENSOR, packed_quantizers

from _compare import assert_bitwise

E, D, H = 3, 64, 96
SPLITS = [17, 0, 47]  # (64 tokens: MXFP8's Linear needs rows in 32s)

# the presets whose experts take the jagged FP8 path (every expert the same per-tensor FP8 with current scaling)
def _presets(kind):
    return [p for p in hq.preset_names()
            if getattr(packed_quantizers(hq.GroupedLinear(1, 32, 32, recipe=p).expert_quantizers), "kind", None) == kind]


JAGGED_PRESETS = _presets(FP8_TENSOR)
# the presets whose experts take the device-count packed block path (block formats without tensor-wide statistics)
BLOCK_PRESETS = _presets(BLOCKS)
IN_GRAPH_PRESETS = JAGGED_PRESETS + BLOCK_PRESETS


class MoEBlock(nn.Module):
    """A Linear, then the experts (up, SiLU, down) on tokens already sorted by expert."""

    def __init__(self, preset: str, d: int = D, h: int = H):
        super().__init__()
        self.fc = hq.Linear(d, d, bias=False, recipe=preset, name="fc")
        self.up = hq.GroupedLinear(E, d, h, recipe=preset, name="up")
        self.down = hq.GroupedLinear(E, h, d, recipe=preset, name="down")

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
    ops = [torch.ops.hybridq.grouped_linear_forward, torch.ops.hybridq.grouped_blocks_forward]
    targets = {t for op in ops for t in (op, op.default)}
    return sum(n.target in targets for g in explained.graphs for n in g.graph.nodes)


def test_jagged_presets_are_listed():
    assert "fp8_tensorwise" in JAGGED_PRESETS, JAGGED_PRESETS
    assert {"fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"} <= set(BLOCK_PRESETS), BLOCK_PRESETS


@pytest.mark.parametrize("preset", IN_GRAPH_PRESETS)
def test_experts_in_graph_for_the_recipes_the_ops_take(preset):
    """What the training job asks before compiling an expert module's products (launch/model.py)."""
    assert experts_in_graph(MoEBlock(preset).up), preset


@pytest.mark.parametrize("x_grad, w_grad", [(True, True), (False, True), (True, False)],
                         ids=["dgrad+wgrad", "wgrad-only", "frozen-experts"])
@pytest.mark.parametrize("preset", IN_GRAPH_PRESETS)
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


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block"])
def test_grouped_linear_in_graph_under_no_grad_is_bitwise_eager(preset):
    torch.manual_seed(0)
    model = MoEBlock(preset)
    x, m_splits = torch.randn(sum(SPLITS), D), torch.tensor(SPLITS)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_bitwise(compiled(x, m_splits), model(x, m_splits), "no_grad output")


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "mxfp8"])
def test_grouped_linear_with_tensor_counts_is_in_the_graph(preset):
    model = MoEBlock(preset)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(sum(SPLITS), D), torch.tensor(SPLITS))
    assert explained.graph_break_count == 0, f"a graph break: {explained.break_reasons}"
    assert _grouped_ops(explained) == 2, f"both GroupedLinears should be custom ops in the graph: {explained}"


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "mxfp8"])
def test_a_new_routing_reuses_the_compiled_graph(preset):
    """The counts are a tensor input of the graph, not constants: other counts (same token total) compile nothing
    new and compute what eager computes with them."""
    torch.manual_seed(0)
    model = MoEBlock(preset)
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


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block"])
@pytest.mark.parametrize("splits, rule", [([10, -1, 55], ">= 0"), ([10, 1, 1], "sum to")], ids=["negative", "sum"])
def test_bad_counts_in_the_graph_raise_naming_the_layer(splits, rule, preset):
    model = MoEBlock(preset)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    # (the configuration's first layer is named: layers of one configuration share the compiled graph)
    with pytest.raises(ValueError, match=rf"or a layer with its configuration, compiled\): m_splits.*{rule}"):
        compiled(torch.randn(sum(SPLITS), D), torch.tensor(splits))


@pytest.mark.parametrize("case", ["list counts", "high-precision backward", "bias", "block bias"])
def test_what_the_ops_do_not_take_stays_eager_and_correct(case):
    """A list m_splits (its values would be graph constants), a recipe the ops do not take (a backward override), a bias: the GroupedLinear runs eagerly
    between compiled regions (a graph break) and computes what eager computes."""
    torch.manual_seed(0)
    preset = {"high-precision backward": "fp8_fwd_high_precision_bwd", "block bias": "fp8_block"}.get(case, "fp8_tensorwise")
    model = MoEBlock(preset)
    if case in ("bias", "block bias"):
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


# fp8_block's grouped kernels on device counts need every expert's weight rows in whole 128-row blocks: its CUDA
# test runs at these sizes (at D, H the path is not taken and the test would skip)
_CUDA_DIMS = {"fp8_block": (128, 256)}


def _block_path_on_cuda(preset) -> bool:
    d, h = _CUDA_DIMS.get(preset, (D, H))
    qs = packed_quantizers(hq.GroupedLinear(E, d, h, recipe=preset).expert_quantizers).quantizers
    return torch.cuda.is_available() and all(device_path_runs(qs, torch.device("cuda"), E, n, k)
                                             for n, k in ((h, d), (d, h)))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fp8_block", "mxfp8"])
def test_block_experts_in_graph_on_cuda_are_bitwise_eager(preset):
    """Block-format experts on an H100/H200 under Inductor, counts on the device (the device-count path's Triton
    grouped kernels / grouped MXFP8 emulation): fullgraph, bitwise eager with the same counts tensor."""
    if not _block_path_on_cuda(preset):
        pytest.skip("needs CUDA sm_90 with the grouped block kernels (Triton, the built extension)")
    torch.manual_seed(0)
    d, h = _CUDA_DIMS.get(preset, (D, H))
    model = MoEBlock(preset, d, h).cuda().to(torch.bfloat16)
    x = torch.randn(sum(SPLITS), d, device="cuda", dtype=torch.bfloat16)
    m_splits = torch.tensor(SPLITS, device="cuda")
    want = _grads(model, model, x, m_splits)
    torch._dynamo.reset()
    _assert_same(_grads(model, torch.compile(model, fullgraph=True), x, m_splits), want, f"{preset} cuda, inductor")


@pytest.mark.parametrize("preset", IN_GRAPH_PRESETS)
def test_the_override_environment_set_after_compile_takes_effect(preset, monkeypatch):
    """HYBRIDQ_BACKWARD_OVERRIDE set after the first compiled step recompiles the block: its experts leave the graph
    (an override runs eagerly) and compute what eager computes ([Note: the override's environment under
    torch.compile] in recipe.py)."""
    monkeypatch.delenv("HYBRIDQ_BACKWARD_OVERRIDE", raising=False)
    torch.manual_seed(0)
    model = MoEBlock(preset)
    x, m_splits = torch.randn(sum(SPLITS), D, requires_grad=True), torch.tensor(SPLITS)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    _grads(model, compiled, x, m_splits)
    monkeypatch.setenv("HYBRIDQ_BACKWARD_OVERRIDE", "dequantized")
    _assert_same(_grads(model, compiled, x, m_splits), _grads(model, model, x, m_splits),
                 f"{preset}: HYBRIDQ_BACKWARD_OVERRIDE=dequantized set after the first compiled step")
