"""A compiled MoE layer's projections that read one input (w1 and w3, the SwiGLU experts' gate and up projections,
on the dispatched tokens) quantize it once ([Note: one input quantization in the graph],
hybridq/nn/compiled_grouped.py): the input's quantization is an op of its own, `hybridq::jagged_input_quantize`,
which the training graph's common-subexpression elimination (AOTAutograd's partitioner) leaves once per input and
configuration. Results and gradients stay bitwise eager's (which shares the same way: [Note: shared jagged input]);
projections whose input quantization differs (another input format or scale rule) quantize it each for itself."""

from __future__ import annotations

import pytest
import torch

import hybridq as hq
from _compare import assert_results_bitwise
from _format_cases import FORMATS
from _shared_input import (D, H, SwiGLUExperts, assert_quantizations_and_bitwise, compiled_vs_eager, forward_graph,
                           inputs, recipe_of as _recipe)
from hybridq.enums import Scaling
from hybridq.formats import Float8Quantizer
from hybridq.gemm import jagged_fp8_kernels
from hybridq.nn import compiled_grouped

# the per-tensor FP8 formats with current scaling of the case list (every tensor of every expert), and the preset
FP8_CASES = ["fp8_tensorwise"] + [c for c, make in FORMATS.items()
                                  if type(make()) is Float8Quantizer and make().scaling == Scaling.CURRENT]


def _count_input_quantizations(monkeypatch, device: str, model: SwiGLUExperts) -> list[str]:
    """The names of the input quantizations the experts' jagged kernels run from now on (one kernels object per
    device: every projection's)."""
    quantizers = model.w1.expert_quantizers[0]
    kernels = jagged_fp8_kernels(torch.device(device), D, H, quantizers)
    assert kernels is not None and kernels is jagged_fp8_kernels(torch.device(device), H, D, quantizers)
    seen: list[str] = []
    real = kernels.quantize

    def quantize(q, x2d, groups, columnwise, name):
        if name.startswith("input of"):
            seen.append(name)
        return real(q, x2d, groups, columnwise, name)

    monkeypatch.setattr(kernels, "quantize", quantize)
    return seen


def _compiled_vs_eager(model, device, dtype, backend, monkeypatch) -> tuple[dict, dict, list[str]]:
    return compiled_vs_eager(model, device, dtype, backend, _counter(model, device, monkeypatch))


def _counter(model, device, monkeypatch):
    return lambda: _count_input_quantizations(monkeypatch, device, model)


def _assert_quantized(model, device, dtype, backend, monkeypatch, times, what):
    assert_quantizations_and_bitwise(model, device, dtype, backend, _counter(model, device, monkeypatch), times, what)


def _force_device_counts(monkeypatch, device_counts: bool) -> None:
    if device_counts:  # (the CUDA branch's Python on the CPU: counts checked and bounded by the graph)
        monkeypatch.setattr(compiled_grouped, "_device_counts", lambda d: True)


@pytest.mark.parametrize("device_counts", [False, True], ids=["host counts", "device counts (forced)"])
@pytest.mark.parametrize("case", FP8_CASES)
def test_w1_and_w3_quantize_their_input_once_in_the_compiled_graph(case, device_counts, monkeypatch):
    """(fails before the input quantize op: three input quantizations per step, w1's, w3's and w2's)"""
    _force_device_counts(monkeypatch, device_counts)
    torch.manual_seed(0)
    _assert_quantized(SwiGLUExperts(_recipe(case)), "cpu", torch.float32, "aot_eager", monkeypatch, 2, case)


def test_w1_and_w3_quantize_their_input_once_under_inductor_on_the_cpu(monkeypatch):
    torch.manual_seed(0)
    _assert_quantized(SwiGLUExperts("fp8_tensorwise", act=None), "cpu", torch.float32, "inductor", monkeypatch, 2,
                      "CPU")


@pytest.mark.gpu
def test_w1_and_w3_quantize_their_input_once_in_the_compiled_graph_on_cuda(monkeypatch):
    """On an H100/H200 under Inductor (the CUDA jagged kernels, bf16, counts on the device): bitwise eager."""
    q = hq.GroupedLinear(1, D, H, recipe="fp8_tensorwise").expert_quantizers[0]
    if not torch.cuda.is_available() or jagged_fp8_kernels(torch.device("cuda"), D, H, q) is None:
        pytest.skip("needs the CUDA jagged kernels (sm_90, Triton, the built extension)")
    torch.manual_seed(0)
    model = SwiGLUExperts("fp8_tensorwise", act=None).cuda().to(torch.bfloat16)
    _assert_quantized(model, "cuda", torch.bfloat16, "inductor", monkeypatch, 2, "cuda")


def _forward_graph(model, device_counts: bool, monkeypatch):
    _force_device_counts(monkeypatch, device_counts)
    return forward_graph(model)


@pytest.mark.parametrize("device_counts", [False, True], ids=["host counts", "device counts (forced)"])
def test_the_forward_graph_quantizes_a_shared_input_once_and_saves_its_columnwise_form_once(device_counts,
                                                                                         monkeypatch):
    """One `jagged_input_quantize` per input (x, h), read by both w1's and w3's GEMM op; x's columnwise form and
    scales are saved for backward once, for both wgrads. (fails before: no input quantize op in the graph)"""
    import operator
    graph = _forward_graph(SwiGLUExperts("fp8_tensorwise"), device_counts, monkeypatch)
    inputs = [n for n in graph.nodes if n.target is torch.ops.hybridq.jagged_input_quantize.default]
    gemms = [n for n in graph.nodes if n.target is torch.ops.hybridq.grouped_linear_forward.default]
    assert len(inputs) == 2 and len(gemms) == 3, \
        f"forward graph: {len(inputs)} input quantize ops (want 2: x, h), {len(gemms)} GEMM ops (want 3)"
    x_quantized = inputs[0]
    readers = [g for g in gemms if all(a.args[0] is x_quantized for a in g.args[1:4])]
    assert len(readers) == 2, f"{len(readers)} GEMM ops read x's quantization (want w1's and w3's)"
    saved = [o for o in graph.output_node().args[0] if isinstance(o, torch.fx.Node)]
    x_forms = [o for o in saved if o.target is operator.getitem and o.args[0] is x_quantized]
    assert sorted(o.args[1] for o in x_forms) == [1, 2], \
        f"x's quantized forms saved for backward: {[o.args[1] for o in x_forms]} (want its columnwise form and " \
        f"scales, once each)"


# (name, w3's input quantizer): projections of one input whose input quantization differs
OTHER_INPUTS = [("another input format", "fp8_e5m2"), ("another scale rule", "fp8_e4m3_pow2")]


@pytest.mark.parametrize("device_counts", [False, True], ids=["host counts", "device counts (forced)"])
@pytest.mark.parametrize("what, w3_input", OTHER_INPUTS, ids=[c[0] for c in OTHER_INPUTS])
def test_projections_with_another_input_quantization_quantize_it_each(what, w3_input, device_counts, monkeypatch):
    _force_device_counts(monkeypatch, device_counts)
    torch.manual_seed(0)
    model = SwiGLUExperts(_recipe("fp8_e4m3"), _recipe("fp8_e4m3", w3_input))
    assert model.w1.expert_quantizers[0]["input"] != model.w3.expert_quantizers[0]["input"]
    _assert_quantized(model, "cpu", torch.float32, "aot_eager", monkeypatch, 3, what)


# (name, how the layer differs from w1): calls of one input that differ in what they ask of its quantization
OTHER_CALLS = ["frozen w3 (no columnwise form)", "frozen w1", "w3 with another weight format"]


@pytest.mark.parametrize("case", OTHER_CALLS)
def test_projections_asking_another_quantization_of_the_input_are_bitwise_eager(case, monkeypatch):
    torch.manual_seed(0)
    w3_recipe = _recipe("fp8_e4m3", None) if "weight" not in case else hq.CustomRecipe(
        lambda role: FORMATS["fp8_e5m2" if role.tensor_type == "weight" else "fp8_e4m3"](), name="w3_weight_e5m2")
    model = SwiGLUExperts(_recipe("fp8_e4m3"), w3_recipe)
    if case.startswith("frozen"):
        getattr(model, case.split()[1]).weight.requires_grad_(False)
    got, want, _ = _compiled_vs_eager(model, "cpu", torch.float32, "aot_eager", monkeypatch)
    assert_results_bitwise(got, want, f"{case}, compiled vs eager")


def test_a_no_grad_graph_is_bitwise_eager(monkeypatch):
    """(Without a backward the graph is not partitioned: each projection quantizes its input, docs/known-limits.md.)"""
    torch.manual_seed(0)
    model = SwiGLUExperts("fp8_tensorwise")
    x, m_splits, _ = inputs("cpu", torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_results_bitwise({"y": compiled(x, m_splits)}, {"y": model(x, m_splits)}, "no_grad, compiled vs eager")
