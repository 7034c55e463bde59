"""An FP8 Linear (per-tensor or block scaling) under torch.compile runs as the ops it is made of
(nn/float8_graph.py): traced into the graph (no custom op around eager Python), bitwise the eager layer, and one cast
for a tensor that several layers read."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.formats import Float8BlockQuantizer, Float8Quantizer
from hybridq.nn.float8_graph import eager_fast_path, graph_spec

from _aot_graphs import recording_backend
from test_compile import MLP, _assert_same as assert_same, _grads

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


TRACED = ["fp8_tensorwise", "fp8_block"]


def fp8_recipe(grad: str = "e5m2", **options) -> hq.CustomRecipe:
    """Per-tensor FP8 with current scaling: E4M3 input and weight, `grad` gradients, `options` on every cast."""
    return hq.CustomRecipe(lambda role: Float8Quantizer(grad if role.tensor_type.startswith("grad") else "e4m3",
                                                        **options), name="fp8-test")


def block_recipe(weight_block_dim: int = 2, **options) -> hq.CustomRecipe:
    """FP8 block scaling: 1x128 input and gradient blocks, weights in `weight_block_dim` blocks."""
    return hq.CustomRecipe(lambda role: Float8BlockQuantizer(
        block_dim=weight_block_dim if role.tensor_type == "weight" else 1, **options), name="fp8-block-test")


RECIPES = {"fp8_tensorwise": lambda: hq.recipe("fp8_tensorwise"), "fp8_block": lambda: hq.recipe("fp8_block"),
           "tensor_pow2": lambda: fp8_recipe(power_2_scale=True), "tensor_eps": lambda: fp8_recipe(amax_epsilon=1.0),
           "tensor_e4m3_grads": lambda: fp8_recipe(grad="e4m3"),
           "block_exact_scales": lambda: block_recipe(power_2_scale=False),
           "block_1x128_weights": lambda: block_recipe(weight_block_dim=1)}


def _eager(model, x):
    """The eager layers' results on their general path (linear_function.py): eager FP8 layers otherwise run this
    module's ops themselves (eager_float8_linear), which would make the comparison with the graph circular."""
    with eager_fast_path(False):
        return _grads(model, x, model)


def _assert_same(got, want, what):
    """Bitwise eager's, the bias gradient up to its sum's order (Inductor computes it: see test_compile)."""
    assert_same(got, want, what, reordered_bias_sums=True)


def _traced_and_custom(explained) -> tuple[int, int]:
    """(traced autograd functions, hybridq custom Linear ops) in the graphs dynamo captured."""
    traced = torch.ops.higher_order.autograd_function_apply
    op = torch.ops.hybridq.linear_forward
    nodes = [n.target for g in explained.graphs for n in g.graph.nodes]
    return sum(t is traced for t in nodes), sum(t in (op, op.default) for t in nodes)


def _forward_graphs(model, x) -> list[torch.fx.GraphModule]:
    """The forward graphs AOTAutograd hands to Inductor for `model(x)` (after its partitioner and CSE)."""
    graphs = []
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=recording_backend(graphs))(x).sum().backward()
    return graphs


def _count(graphs, *targets) -> int:
    return sum(n.target in targets for g in graphs for n in g.graph.nodes)


@pytest.mark.parametrize("preset", hq.preset_names())
def test_only_fp8_presets_with_current_scaling_get_a_graph_spec(preset):
    q = {t: hq.recipe(preset).quantizer(hq.Role("linear", t, "x")) for t in ("input", "weight", "grad_output")}
    spec = graph_spec(q, False)
    assert (spec is not None) == (preset in TRACED), f"{preset}: graph spec {spec}"


def test_block_inputs_in_128x128_tiles_get_no_graph_spec():
    """The block GEMM's first operand (input in fprop, gradient in backward) must be in 1x128 blocks."""
    q = {"input": Float8BlockQuantizer(block_dim=2), "weight": Float8BlockQuantizer(block_dim=2),
         "grad_output": Float8BlockQuantizer(block_dim=1)}
    assert graph_spec(q, False) is None, "a 128x128-tiled input would be traced"


def test_mixed_per_tensor_and_block_quantizers_get_no_graph_spec():
    q = {"input": Float8Quantizer(), "weight": Float8BlockQuantizer(block_dim=2), "grad_output": Float8Quantizer()}
    assert graph_spec(q, False) is None, "a per-tensor x block pairing would be traced"


def test_a_float8_quantizer_subclass_gets_no_graph_spec():
    """A subclass may change the numerics: it runs through the custom ops (the eager code) instead."""

    class Custom(Float8Quantizer):
        pass

    q = {t: Custom() for t in ("input", "weight", "grad_output")}
    assert graph_spec(q, False) is None, "a Float8Quantizer subclass would be traced as plain per-tensor FP8"


@pytest.mark.parametrize("preset", TRACED)
def test_fp8_layer_traces_as_its_ops_not_the_custom_op(preset):
    model = MLP(hq.recipe(preset))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(2, 32, 64))
    assert explained.graph_break_count == 0, f"graph breaks: {explained.break_reasons}"
    assert _traced_and_custom(explained) == (2, 0), f"(traced, custom ops) = {_traced_and_custom(explained)}"


@pytest.mark.parametrize("recipe, save_original_input, bias", [
    ("fp8_tensorwise", True, True), ("tensor_pow2", False, False), ("tensor_eps", False, True),
    ("tensor_e4m3_grads", False, True), ("fp8_block", True, False), ("block_exact_scales", False, True),
    ("block_1x128_weights", False, True)])
def test_fp8_layer_under_inductor_is_bitwise_eager(recipe, save_original_input, bias):
    """Inductor compiles the casts' reference ops (CPU) or calls the kernels (CUDA) and the GEMMs as eager does.
    (Sizes not multiples of 128: the block formats' partial edge blocks.)"""
    torch.manual_seed(0)
    model = MLP(RECIPES[recipe](), save_original_input, bias=bias, act=lambda t: t)
    x = torch.randn(2, 40, 64)
    torch._dynamo.reset()
    got = _grads(model, x, torch.compile(model, fullgraph=True))
    _assert_same(got, _eager(model, x), f"{recipe}, save_original_input={save_original_input}, bias={bias}")


class QKV(nn.Module):
    """Three layers reading one input (attention's q/k/v projections)."""

    def __init__(self, recipe, d: int = 64):
        super().__init__()
        self.q, self.k, self.v = (hq.Linear(d, d, bias=False, recipe=recipe, name=n) for n in "qkv")

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)  # (exact: no rounding of its own)


@pytest.mark.parametrize("preset", TRACED)
def test_layers_reading_one_input_share_its_cast_in_the_graph(preset):
    """As the eager path shares the quantized input of q/k/v, the graph casts it once: AOTAutograd's CSE merges
    the three identical casts. Forward casts: the input once and the three weights (on the CPU: one max|x|
    reduction per per-tensor cast; the block reference is one op per cast)."""
    cast = {"fp8_tensorwise": torch.ops.aten.amax.default,
            "fp8_block": torch.ops.hybridq.fp8_block_quantize_reference.default}[preset]
    torch.manual_seed(0)
    model = QKV(hq.recipe(preset))
    x = torch.randn(2, 32, 64)
    graphs = _forward_graphs(model, x.clone().requires_grad_())
    model.zero_grad(set_to_none=True)
    casts = _count(graphs, cast)
    assert casts == 4, f"{preset}: {casts} casts in the forward graph, want 4 (x once, three weights)"
    torch._dynamo.reset()
    _assert_same(_grads(model, x, torch.compile(model, fullgraph=True)), _eager(model, x), "q/k/v")


def test_block_layer_with_partial_blocks_compiles_under_inductor():
    """K = 192 (a partial 128-wide block): Inductor's CPU code generation once failed on the traced block reference
    (an internal assertion); the reference now runs as one op on the CPU."""
    torch.manual_seed(0)
    model = QKV(hq.recipe("fp8_block"), d=192)
    x = torch.randn(2, 64, 192)
    torch._dynamo.reset()
    _assert_same(_grads(model, x, torch.compile(model, fullgraph=True)), _eager(model, x), "K=192")


# ---- CUDA ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("preset", TRACED)
def test_fp8_layer_on_cuda_calls_the_kernels_and_gemms(preset):
    """On the GPU the graph holds the extension's cast op and the GEMM op themselves (torch._scaled_mm;
    hybridq::fp8_block_gemm for blocks), the input of q/k/v is cast once, and the results are bitwise eager's."""
    cast, mm = {"fp8_tensorwise": (torch.ops.hybridq.fp8_tensor_quantize, torch.ops.aten._scaled_mm),
                "fp8_block": (torch.ops.hybridq.fp8_block_quantize, torch.ops.hybridq.fp8_block_gemm)}[preset]
    torch.manual_seed(0)
    model = QKV(hq.recipe(preset), d=128).cuda().to(torch.bfloat16)
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    graphs = _forward_graphs(model, x.clone().requires_grad_())
    model.zero_grad(set_to_none=True)
    casts, gemms = _count(graphs, cast.default), _count(graphs, mm.default)
    assert (casts, gemms) == (4, 3), f"{preset} forward graph: {casts} casts (want 4), {gemms} GEMMs (want 3)"
    torch._dynamo.reset()
    _assert_same(_grads(model, x, torch.compile(model, fullgraph=True)), _eager(model, x), "q/k/v on CUDA")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("recipe, save_original_input, d", [
    ("fp8_tensorwise", False, 64), ("fp8_tensorwise", True, 64), ("tensor_pow2", False, 64),
    ("tensor_e4m3_grads", False, 64), ("fp8_block", False, 128), ("fp8_block", True, 128),
    ("block_exact_scales", False, 128), ("block_1x128_weights", False, 128), ("fp8_block", False, 64)])
def test_fp8_layer_on_cuda_is_bitwise_eager(recipe, save_original_input, d):
    """(d=64 with blocks: K = 64 is not a multiple of 128, so the block GEMMs are emulated, as in eager.)"""
    torch.manual_seed(0)
    model = QKV(RECIPES[recipe](), d).cuda().to(torch.bfloat16)
    for layer in (model.q, model.k, model.v):
        layer.save_original_input = save_original_input
    x = torch.randn(2, 64, d, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    got = _grads(model, x, torch.compile(model, fullgraph=True))
    _assert_same(got, _eager(model, x), f"{recipe}, save_original_input={save_original_input}, d={d} on CUDA")


@pytest.mark.gpu
@CUDA
def test_dims_the_fp8_gemm_cannot_take_run_as_the_custom_ops_on_cuda(monkeypatch):
    """M = 2 x 36 rows (not a multiple of 16): the eager layer emulates that GEMM (and warns), so the compiled
    layer runs the eager code through compiled_linear's ops instead of calling torch._scaled_mm."""
    from hybridq.kernels import native_gemm

    monkeypatch.setattr(native_gemm, "_warned", set())  # (the warning is given once per process and shape)
    torch.manual_seed(0)
    model = MLP(hq.recipe("fp8_tensorwise"), act=lambda t: t).cuda().to(torch.bfloat16)
    x = torch.randn(2, 36, 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert _traced_and_custom(explained) == (0, 2), f"(traced, custom ops) = {_traced_and_custom(explained)}"
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="not divisible by 16"):
        got = _grads(model, x, torch.compile(model, fullgraph=True))
    _assert_same(got, _eager(model, x), "M=72 on CUDA")
