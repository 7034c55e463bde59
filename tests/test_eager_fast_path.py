"""An eager FP8 Linear (per-tensor with current scaling, or FP8 blocks) runs as the few ops of nn/float8_graph.py
instead of the general path of linear_function.py (the host cost of a Linear step: issue 33): bitwise the general
path in every case it takes, sharing one input's quantization with layers on either path, using a norm's max|x|,
and declining (the general path runs, with its errors and warnings) wherever the general path would do anything
else."""

from __future__ import annotations

import pytest
import torch

import hybridq as hq
from hybridq import dispatch
from hybridq.formats import Float8TensorPart
from hybridq.nn.float8_graph import eager_fast_path, graph_spec
from hybridq.nn.linear import shared_input_quantization
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _compare import assert_bitwise
from _format_cases import FORMATS
from _linear_paths import assert_same, node_name, step, step_sharing_input, step_with_known_amax

IN, OUT, TOKENS = 256, 128, (2, 64)  # K, N and M multiples of 128: every FP8 block shape rule holds
FAST, GENERAL = "_Float8GraphLinearBackward", "_LinearFunctionBackward"
ONE_OP = "torch::autograd::CppNode<hybridq::ops::Fp8Linear>"  # per-tensor on CUDA: one op, a C++ node
BLOCK_OP = "torch::autograd::CppNode<hybridq::ops::Fp8BlockLinear>"  # FP8 blocks on sm_90 (the block GEMM op's shapes)


def _roles(q) -> dict:
    return {t: q for t in ("input", "weight", "grad_output")}


# the format cases whose quantizer, in all three roles, the fast path implements, and the preset whose weights are
# in 128x128 tiles (a tile-scaled input is not: the GEMMs read 1x128 blocks of it)
FAST_CASES = [n for n, make in FORMATS.items() if graph_spec(_roles(make()), False) is not None] + ["fp8_block"]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    with shared_input_quantization(False), eager_fast_path(True):
        yield


def _recipe(case: str) -> hq.CustomRecipe:
    """A format case in all three roles, or a preset by name (fp8_block: 1x128 inputs, 128x128 weight tiles)."""
    if case not in FORMATS:
        return hq.recipe(case)
    return hq.CustomRecipe(lambda role: FORMATS[case](), name=f"all-{case}")


def _layer(case: str, device="cpu", dtype=torch.float32, bias=True, name="fc", seed=0, **kw) -> hq.Linear:
    torch.manual_seed(seed)
    return hq.Linear(IN, OUT, bias=bias, recipe=_recipe(case), name=name, device=device, dtype=dtype, **kw)


def _inputs(device="cpu", dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*TOKENS, IN, generator=g).to(device, dtype),
            torch.randn(*TOKENS, OUT, generator=g).to(device, dtype))


def _both_paths(layer, x, gy, **kw):
    """((results, grad_fn) of the fast path, (results, grad_fn) of the general path)."""
    fast = step(layer, x, gy, **kw)
    with eager_fast_path(False):
        general = step(layer, x, gy, **kw)
    return fast, general


@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "frozen_weight", "input_no_grad",
                                     "bf16"])
@pytest.mark.parametrize("case", FAST_CASES)
def test_fast_path_is_bitwise_the_general_path(case, variant):
    layer = _layer(case, bias=variant != "no_bias", save_original_input=variant == "save_original_input",
                   dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
    if variant == "frozen_weight":
        layer.weight.requires_grad_(False)
    x, gy = _inputs(dtype=layer.weight.dtype)
    (fast, fast_kind), (general, general_kind) = _both_paths(layer, x, gy, x_grad=variant != "input_no_grad")
    assert (fast_kind, general_kind) == (FAST, GENERAL), f"{case}/{variant}: paths taken {fast_kind}, {general_kind}"
    assert_same(fast, general, f"{case}/{variant}", path="the fast path")


@pytest.mark.parametrize("case", FAST_CASES)
def test_fast_path_without_gradients_is_bitwise_the_general_path(case):
    layer = _layer(case)
    x, _ = _inputs()
    with torch.no_grad():
        fast = layer(x)
        with eager_fast_path(False):
            general = layer(x)
    assert_bitwise(fast, general, f"{case} under no_grad")
    with torch.inference_mode():
        fast = layer(x)
        with eager_fast_path(False):
            general = layer(x)
    assert_bitwise(fast, general, f"{case} under inference_mode")


@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8blk_1x128_e4m3"])
def test_layers_on_either_path_share_one_quantization_of_their_input(case):
    """q on the fast path, k on the general path (its input quantizer wrapped), v on the fast path: the input is
    quantized once, by q, and k and v reuse it; results bitwise those without sharing."""
    layers = [_layer(case, name=n, seed=i) for i, n in enumerate("qkv")]
    calls = []
    orig = layers[1].input_quantizer.quantize

    def spy(x, **kw):  # (an instance attribute: k's layer takes the general path)
        calls.append(kw)
        return orig(x, **kw)

    layers[1].input_quantizer.quantize = spy
    x, gy = _inputs()
    want, kinds = step_sharing_input(layers, x, gy)
    assert kinds == [FAST, GENERAL, FAST] and len(calls) == 1, f"paths {kinds}, k's quantize calls {calls}"
    with shared_input_quantization(True):
        got, _ = step_sharing_input(layers, x, gy)
    assert len(calls) == 1, f"k quantized the input again although q had: {calls[1:]}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"{case}: result {i} with the input shared")


@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8blk_1x128_e4m3"])
def test_fast_path_layers_share_an_input_without_building_a_quantized_tensor(case, monkeypatch):
    """q, k, v all on the fast path: x is quantized once and shared as its tensors; no QuantizedTensor (a wrapper
    subclass, ~20 us of host time to build with its parts) is made, which only a general-path reader needs."""
    from hybridq.nn import float8_graph
    layers = [_layer(case, name=n, seed=i) for i, n in enumerate("qkv")]
    from hybridq.tensor import QuantizedTensor
    built, casts = [], []
    new, quantize = QuantizedTensor.__new__, float8_graph._quantize
    monkeypatch.setattr(QuantizedTensor, "__new__", staticmethod(lambda *a, **kw: built.append(1) or new(*a, **kw)))
    x, gy = _inputs()
    xg = x.clone().requires_grad_()
    monkeypatch.setattr(float8_graph, "_quantize",  # (the casts of x, not of the weights)
                        lambda t, *a: casts.extend([1] * (t.data_ptr() == xg.data_ptr())) or quantize(t, *a))
    with shared_input_quantization(True):
        ys = [layer(xg) for layer in layers]
    assert [node_name(y) for y in ys] == [FAST] * 3
    assert len(casts) == 1, f"x was cast {len(casts)} times by three layers sharing it"
    assert not built, f"{len(built)} QuantizedTensor built for layers that all read the shared tensors directly"


def test_fast_path_uses_a_known_max_of_its_input():
    """A norm's max|x| (known_amax) is what the cast uses: a value 3x the real one changes the scale, as on the
    general path."""
    layer = _layer("fp8_e4m3")
    x, gy = _inputs()
    results = [step_with_known_amax(layer, x, gy, fast=enabled)[0] for enabled in (True, False)]
    with eager_fast_path(False):
        plain = step(layer, x, gy)[0]
    assert not torch.equal(results[0][0], plain[0]), "the known max|x| was not used (same output as without it)"
    for n, a, b in zip(("output", "grad_input", "grad_weight"), *results):
        assert_bitwise(a, b, f"with a known max|x|: {n}")


def _kind(layer, x, **kw) -> str:
    return node_name(layer(x.clone().requires_grad_(), **kw))


def test_calls_the_general_path_must_run_decline(monkeypatch):
    layer = _layer("fp8_e4m3")
    x, _ = _inputs()
    assert _kind(layer, x) == FAST
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "dequantized")
    assert _kind(layer, x) == GENERAL, "a backward override must run the general path"
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV)
    layer.weight_quantizer.quantize = layer.weight_quantizer.quantize  # (an instance attribute: a wrapper)
    assert _kind(layer, x) == GENERAL, "a quantizer with a replaced quantize must run the general path"


def test_a_user_gemm_for_the_part_types_runs_on_the_general_path():
    layer = _layer("fp8_e4m3")
    x, _ = _inputs()
    seen = []
    dispatch.register_native_gemm(Float8TensorPart, Float8TensorPart, "test-spy",
                                  lambda a, b, dt: seen.append(1), lambda a, b: False)
    try:
        assert _kind(layer, x) == GENERAL, "a user's GEMM registered for the part types was bypassed"
    finally:
        dispatch.unregister_native_gemm(Float8TensorPart, Float8TensorPart, "test-spy")
    assert _kind(layer, x) == FAST


def test_an_input_without_rows_runs_the_general_path():
    layer = _layer("fp8_e4m3")
    x = torch.randn(0, IN, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == GENERAL and y.shape == (0, OUT), (type(y.grad_fn).__name__, y.shape)


# ---- CUDA ------------------------------------------------------------------------------------------------------

def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.kernels import _ext
    return _ext.available_for(torch.device("cuda")) and torch.cuda.get_device_capability() >= (8, 9)


CUDA = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores and the extension")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("variant", ["plain", "save_original_input", "frozen_weight"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8_e4m3_pow2", "fp8blk_1x128_e4m3", "fp8_block"])
def test_fast_path_on_cuda_is_bitwise_the_general_path(case, variant):
    layer = _layer(case, device="cuda", dtype=torch.bfloat16, save_original_input=variant == "save_original_input")
    if variant == "frozen_weight":
        layer.weight.requires_grad_(False)
    x, gy = _inputs("cuda", torch.bfloat16)
    (fast, fast_kind), (general, general_kind) = _both_paths(layer, x, gy)
    # (per-tensor: the one op of csrc/linear_fp8.cpp; blocks on sm_90, E4M3 at these shapes: csrc/linear_fp8_block.cpp)
    blocks = BLOCK_OP if torch.cuda.get_device_capability() == (9, 0) else FAST
    want = ONE_OP if case.startswith("fp8_e") else blocks
    assert (fast_kind, general_kind) == (want, GENERAL), f"{case}/{variant}: paths taken {fast_kind}, {general_kind}"
    assert_same(fast, general, f"{case}/{variant} on CUDA", path="the fast path")


@pytest.mark.gpu
@CUDA
def test_rows_the_fp8_gemm_cannot_take_decline_on_cuda():
    """M = 2 x 36 (not a multiple of 16): the general path emulates that GEMM (and warns); the fast path declines."""
    layer = _layer("fp8_e4m3", device="cuda", dtype=torch.bfloat16)
    assert _kind(layer, torch.randn(2, 36, IN, device="cuda", dtype=torch.bfloat16)) == GENERAL
