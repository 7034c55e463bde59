"""A compiled MoE layer with block-format experts (FP8 1x128 / 128x128 blocks, MXFP8, their hybrids: the
device-count packed path) quantizes the input its w1 and w3 share once ([Note: one input quantization of block experts
in the graph], hybridq/nn/compiled_grouped_blocks.py): the input's quantization into its expert slots is an op of its
own, `hybridq::grouped_blocks_input_quantize`, which the training graph's common-subexpression elimination
(AOTAutograd's partitioner) leaves once per input and configuration. Results and gradients stay bitwise eager's;
projections that ask another quantization of the input (another input format or scale rule, a frozen projection)
quantize it each for itself."""

from __future__ import annotations

import operator

import pytest
import torch

import hybridq as hq
from _compare import assert_results_bitwise
from _format_cases import FORMATS
from _shared_input import (BLOCK_KERNEL_DIMS, D, E, H, SwiGLUExperts, assert_quantizations_and_bitwise,
                           compiled_vs_eager, count_block_input_quantizations, forward_graph, inputs, recipe_of)
from hybridq.nn import grouped_device_blocks
from hybridq.nn.grouped_packed import BLOCKS, packed_quantizers


def _block_kind(recipe) -> bool:
    return getattr(packed_quantizers(hq.GroupedLinear(E, D, H, recipe=recipe).expert_quantizers), "kind",
                   None) == BLOCKS


# the presets and the formats of the case list (every tensor of every expert) whose experts take the block path
BLOCK_CASES = ([p for p in hq.preset_names() if _block_kind(p)]
               + [c for c in FORMATS if c not in hq.preset_names() and _block_kind(recipe_of(c))])
# (by name: the test fails, not its collection, where an op is missing)
QUANTIZE_OP, FORWARD_OP = "hybridq.grouped_blocks_input_quantize.default", "hybridq.grouped_blocks_forward.default"


def _compiled_vs_eager(model, device, dtype, backend, monkeypatch) -> tuple[dict, dict, list[str]]:
    return compiled_vs_eager(model, device, dtype, backend,
                             lambda: count_block_input_quantizations(monkeypatch.setattr))


def _assert_quantized(model, device, dtype, backend, monkeypatch, times, what):
    assert_quantizations_and_bitwise(model, device, dtype, backend,
                                     lambda: count_block_input_quantizations(monkeypatch.setattr), times, what)


def test_the_block_cases_are_listed():
    assert {"fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd", "fp8blk_128x128_e4m3", "mxfp8_32x32_e4m3"} <= set(
        BLOCK_CASES), BLOCK_CASES


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_w1_and_w3_quantize_their_input_once_in_the_compiled_graph(case, monkeypatch):
    """(fails before the input quantize op: three input quantizations per step, w1's, w3's and w2's)"""
    torch.manual_seed(0)
    _assert_quantized(SwiGLUExperts(recipe_of(case)), "cpu", torch.float32, "aot_eager", monkeypatch, 2, case)


def test_w1_and_w3_quantize_their_input_once_under_inductor_on_the_cpu(monkeypatch):
    torch.manual_seed(0)
    _assert_quantized(SwiGLUExperts("fp8_block", act=None), "cpu", torch.float32, "inductor", monkeypatch, 2, "CPU")


def _cuda_dims(preset: str) -> dict:
    return BLOCK_KERNEL_DIMS if preset == "fp8_block" else {"d": D, "h": H}


def _block_path_on_cuda(preset: str) -> bool:
    d, h = _cuda_dims(preset)["d"], _cuda_dims(preset)["h"]
    qs = packed_quantizers(hq.GroupedLinear(E, d, h, recipe=preset).expert_quantizers).quantizers
    return torch.cuda.is_available() and all(grouped_device_blocks.device_path_runs(qs, torch.device("cuda"), E, n, k)
                                             for n, k in ((h, d), (d, h)))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fp8_block", "mxfp8"])
def test_w1_and_w3_quantize_their_input_once_in_the_compiled_graph_on_cuda(preset, monkeypatch):
    """On an H100/H200 under Inductor (the grouped slot quantize and grouped GEMMs, bf16, counts on the device):
    bitwise eager."""
    if not _block_path_on_cuda(preset):
        pytest.skip("needs CUDA sm_90 with the grouped block kernels (Triton, the built extension)")
    torch.manual_seed(0)
    model = SwiGLUExperts(preset, act=None, **_cuda_dims(preset)).cuda().to(torch.bfloat16)
    _assert_quantized(model, "cuda", torch.bfloat16, "inductor", monkeypatch, 2, f"{preset} cuda")


@pytest.mark.parametrize("case", ["fp8_block", "mxfp8"])
def test_the_forward_graph_quantizes_a_shared_input_once_and_saves_its_columnwise_form_once(case):
    """One `grouped_blocks_input_quantize` per input (x, h), read by both w1's and w3's forward op; x's columnwise
    form is saved for backward once, for both wgrads, and its rowwise form not at all. (fails before: no input
    quantize op in the graph)"""
    graph = forward_graph(SwiGLUExperts(case))
    quantizes = [n for n in graph.nodes if str(n.target) == QUANTIZE_OP]
    forwards = [n for n in graph.nodes if str(n.target) == FORWARD_OP]
    assert len(quantizes) == 2 and len(forwards) == 3, \
        f"{case} forward graph: {len(quantizes)} input quantize ops (want 2: x, h), {len(forwards)} forward ops " \
        f"(want 3)"
    x_quantized = quantizes[0]
    forms = [o for o in graph.nodes if o.target is operator.getitem and o.args[0] is x_quantized]
    readers = [f for f in forwards if set(f.args[1]) == set(forms)]
    assert len(readers) == 2, f"{case}: {len(readers)} forward ops read x's quantization (want w1's and w3's)"
    saved = [o for o in graph.output_node().args[0] if isinstance(o, torch.fx.Node)]
    x_saved = sorted(o.args[1] for o in saved if o.target is operator.getitem and o.args[0] is x_quantized)
    # (the op's outputs: the rowwise form's data and scales, then the columnwise form's)
    assert x_saved == [2, 3], \
        f"{case}: x's quantized tensors saved for backward: outputs {x_saved} (want its columnwise data and scales, " \
        f"outputs 2 and 3, once each)"


# (name, w3's input quantizer): projections of one input whose input quantization differs
OTHER_INPUTS = [("another input format", "fp8_block", "fp8blk_1x128_e5m2"),
                ("another scale rule", "fp8_block", "fp8blk_1x128_e4m3_nopow2"),
                ("another MXFP8 input format", "mxfp8", "mxfp8_e5m2")]


@pytest.mark.parametrize("what, preset, w3_input", OTHER_INPUTS, ids=[c[0] for c in OTHER_INPUTS])
def test_projections_with_another_input_quantization_quantize_it_each(what, preset, w3_input, monkeypatch):
    torch.manual_seed(0)
    model = SwiGLUExperts(preset, recipe_of(preset, w3_input))
    assert model.w1.expert_quantizers[0]["input"] != model.w3.expert_quantizers[0]["input"]
    _assert_quantized(model, "cpu", torch.float32, "aot_eager", monkeypatch, 3, what)


@pytest.mark.parametrize("frozen", ["w1", "w3"])
@pytest.mark.parametrize("preset", ["fp8_block", "mxfp8"])
def test_a_frozen_projection_quantizes_its_input_for_itself(preset, frozen, monkeypatch):
    """A frozen projection asks no columnwise form of the input (no wgrad): its quantization is another call."""
    torch.manual_seed(0)
    model = SwiGLUExperts(preset)
    getattr(model, frozen).weight.requires_grad_(False)
    _assert_quantized(model, "cpu", torch.float32, "aot_eager", monkeypatch, 3, f"{preset}, frozen {frozen}")


def test_a_projection_with_another_weight_format_is_bitwise_eager(monkeypatch):
    """(w3's 1x128 weight blocks: another configuration, so another quantize call.)"""
    torch.manual_seed(0)
    base = hq.recipe("fp8_block")
    w3_recipe = hq.CustomRecipe(lambda role: FORMATS["fp8blk_1x128_e4m3"]() if role.tensor_type == "weight"
                                else base.quantizer(role), name="fp8_block_weight_1x128")
    model = SwiGLUExperts(base, w3_recipe)
    assert model.w1.expert_quantizers[0]["weight"] != model.w3.expert_quantizers[0]["weight"]
    got, want, _ = _compiled_vs_eager(model, "cpu", torch.float32, "aot_eager", monkeypatch)
    assert_results_bitwise(got, want, "w3 with another weight format, compiled vs eager")


@pytest.mark.parametrize("preset", ["fp8_block", "mxfp8"])
def test_a_no_grad_graph_is_bitwise_eager(preset):
    """(Without a backward the graph is not partitioned: each projection quantizes its input, docs/known-limits.md.)"""
    torch.manual_seed(0)
    model = SwiGLUExperts(preset)
    x, m_splits, _ = inputs("cpu", torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_results_bitwise({"y": compiled(x, m_splits)}, {"y": model(x, m_splits)},
                               f"{preset} no_grad, compiled vs eager")


def test_the_input_quantize_op_returns_tensors_of_its_own_at_every_call():
    """Eager's sharing of a slot quantization ([Note: shared slot input]) never reaches the op: two calls on one input
    and routing give equal bytes in tensors of their own (an op's outputs may not be another call's)."""
    from hybridq.nn import compiled_grouped
    layer = hq.GroupedLinear(E, D, H, recipe="fp8_block", name="w1")
    key = compiled_grouped.graph_key(layer)
    x, m_splits, _ = inputs("cpu", torch.float32)
    first, second = (torch.ops.hybridq.grouped_blocks_input_quantize(x, m_splits, key, True, True) for _ in range(2))
    assert len(first) == len(second) == 4, f"{len(first)} and {len(second)} outputs (want rowwise and columnwise " \
                                           f"data and scales)"
    for i, (a, b) in enumerate(zip(first, second)):
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), f"output {i} shared by two calls"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs between two calls"
