"""An eager FP8 Linear called with is_first_microbatch (the weight quantized once per step and reused by the later
micro-batches: Transformer Engine's semantics) runs on the fast path of nn/float8_graph.py -- on CUDA the one op
`hybridq::fp8_linear` / `fp8_block_linear` -- with the cache's quantized parts handed to it as FSDP2's gathered
weight's are ([Note: a cached weight on the fast path]), instead of the general path of linear_function.py (issue
33: ~1.45 ms of host time per call there against ~0.28 ms on the one op). The cache decides as before: the first
micro-batch quantizes, a changed weight is quantized again (with the warning), the columnwise form is added when first
needed (usage preservation); outputs and gradients are bitwise the general path's."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridq.nn import float8_graph
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _compare import assert_bitwise
from _linear_paths import node_name as _node
from test_eager_fast_path import BLOCK_OP, CUDA, FAST, FAST_CASES, GENERAL, ONE_OP, _inputs, _layer

WARNING = "weight changed since it was quantized"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    with shared_input_quantization(False), eager_fast_path(True):
        yield


def _call(layer, x, gy, first: bool, grad: bool = True, x_grad: bool = True):
    """(results, the output's autograd node) of one micro-batch: forward (+ backward where `grad`)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x_grad)
    with torch.set_grad_enabled(grad):
        y = layer(x, is_first_microbatch=first)
    node = _node(y)
    if y.requires_grad:
        y.backward(gy)
    grads = [x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad]
    return [y.detach(), *grads], node


def _change_in_place(layer):  # (the optimizer step: the parameter's version moves)
    with torch.no_grad():
        layer.weight.mul_(-0.75)


def _change_through_data(layer):  # (a write the cache key cannot see: the fingerprint does, on the CPU at once)
    layer.weight.data.add_(0.125)


# (what happens before the call, is_first_microbatch, gradients on): eval under no_grad quantizes rowwise only, the
# next training call adds the columnwise form; a weight changed either way is quantized again
SEQUENCE = [(None, True, False), (None, False, True), (None, False, True), (_change_in_place, False, True),
            (None, True, True), (_change_through_data, False, True), (None, False, False), (None, True, True)]


def _run_sequence(layer, x, gy, x_grad: bool, caplog):
    """[(results, node, cached quantized weight, stale-weight warnings logged) per call of SEQUENCE]."""
    out = []
    for change, first, grad in SEQUENCE:
        if change is not None:
            change(layer)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hybridq"):
            results, node = _call(layer, x, gy, first, grad, x_grad)
        out.append((results, node, layer._weight_cache[1], caplog.text.count(WARNING)))
    return out


def _assert_same_quantized(a, b, what):
    assert (a.has("columnwise"), a.has("rowwise")) == (b.has("columnwise"), b.has("rowwise")), \
        f"{what}: cached directions differ"
    for d in ("rowwise", "columnwise"):
        if a.has(d):
            pa, pb = a.part(d), b.part(d)
            assert_bitwise(pa.data, pb.data, f"{what}: cached {d} data")
            assert_bitwise(pa.scale_inv, pb.scale_inv, f"{what}: cached {d} scale_inv")


@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "frozen_weight", "input_no_grad",
                                     "bf16"])
@pytest.mark.parametrize("case", FAST_CASES)
def test_cached_weight_micro_batches_are_bitwise_the_general_path(case, variant, caplog):
    """Two identical layers through the same micro-batches, one on the fast path and one on the general path:
    every output and gradient, every cached quantized weight and every stale-weight warning are the same."""
    kw = dict(bias=variant != "no_bias", save_original_input=variant == "save_original_input",
              dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
    fast_layer, general_layer = _layer(case, **kw), _layer(case, **kw)
    for layer in (fast_layer, general_layer):
        if variant == "frozen_weight":
            layer.weight.requires_grad_(False)
    x, gy = _inputs(dtype=fast_layer.weight.dtype)
    x_grad = variant != "input_no_grad"
    fast = _run_sequence(fast_layer, x, gy, x_grad, caplog)
    with eager_fast_path(False):
        general = _run_sequence(general_layer, x, gy, x_grad, caplog)
    for i, ((fr, fn, fq, fw), (gr, gn, gq, gw), (_, first, grad)) in enumerate(zip(fast, general, SEQUENCE)):
        what = f"{case}/{variant}, call {i} (is_first_microbatch={first}, grad={grad})"
        trains = grad and (x_grad or variant != "frozen_weight")
        want = (FAST, GENERAL) if trains else (None, None)
        assert (fn, gn) == want, f"{what}: paths taken {fn}, {gn} (wanted {want})"
        assert fw == gw, f"{what}: {fw} stale-weight warnings on the fast path, {gw} on the general path"
        _assert_same_quantized(fq, gq, what)
        for n, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), fr, gr):
            assert (a is None) == (b is None), f"{what}: {n} is {'missing' if a is None else 'there'} on the fast path"
            if a is not None:
                assert_bitwise(a, b, f"{what}: {n}")


@pytest.mark.parametrize("case", FAST_CASES)
def test_cached_weight_calls_run_on_the_fast_path(case):
    """(Before: every call with is_first_microbatch ran the general path, _LinearFunctionBackward.)"""
    layer = _layer(case)
    x, gy = _inputs()
    nodes = [_call(layer, x, gy, first)[1] for first in (True, False, False)]
    assert nodes == [FAST] * 3, f"{case}: paths taken {nodes}"


@pytest.mark.parametrize("case", FAST_CASES)
def test_later_micro_batches_reuse_the_cached_quantization(case, monkeypatch):
    """is_first_microbatch=True quantizes the weight once, through the cache (the weight quantizer); False quantizes
    nothing of the weight, on either path: the fast path reads the cached parts."""
    layer = _layer(case)
    x, gy = _inputs()
    q_type = type(layer.weight_quantizer)
    cache_quantizes, fast_casts = [], []
    quantize, cast = q_type.quantize, float8_graph._quantize
    # (on the class, not the instance: an instance attribute sends the layer to the general path)
    monkeypatch.setattr(q_type, "quantize", lambda self, t, **kw: (
        cache_quantizes.append(1) if t.data_ptr() == layer.weight.data_ptr() else None) or quantize(self, t, **kw))
    monkeypatch.setattr(float8_graph, "_quantize", lambda t, *a: (
        fast_casts.append(1) if t.data_ptr() == layer.weight.data_ptr() else None) or cast(t, *a))
    _call(layer, x, gy, True)
    cached = layer._weight_cache[1]
    assert (len(cache_quantizes), len(fast_casts)) == (1, 0), \
        f"{case}: first micro-batch: {len(cache_quantizes)} cache quantizations, {len(fast_casts)} fast-path casts"
    for _ in range(2):
        results, node = _call(layer, x, gy, False)
    assert node == FAST and layer._weight_cache[1] is cached, f"{case}: {node}, cache replaced"
    assert (len(cache_quantizes), len(fast_casts)) == (1, 0), \
        f"{case}: later micro-batches quantized the weight again ({len(cache_quantizes)}, {len(fast_casts)})"


@pytest.mark.parametrize("case", FAST_CASES)
def test_columnwise_form_is_added_when_first_needed(case):
    """Usage preservation: a first micro-batch under no_grad caches the rowwise form only; the next training call
    (is_first_microbatch=False) adds the columnwise form for dgrad, and later calls keep both."""
    layer = _layer(case)
    x, gy = _inputs()
    _call(layer, x, gy, True, grad=False)
    assert not layer._weight_cache[1].has("columnwise"), f"{case}: no_grad cached a columnwise form"
    _, node = _call(layer, x, gy, False)
    assert node == FAST and layer._weight_cache[1].has("columnwise"), f"{case}: {node}, columnwise not added"
    _call(layer, x, gy, True, grad=False)
    assert layer._weight_cache[1].has("columnwise"), f"{case}: a no_grad first micro-batch dropped the columnwise form"


def _inference_then_training(case, device="cpu", dtype=torch.float32):
    """(inference-mode outputs, training call's results and node) of the fast path, then of the general path."""
    layers = [_layer(case, device=device, dtype=dtype), _layer(case, device=device, dtype=dtype)]
    x, gy = _inputs(device, dtype)
    got = []
    for layer, fast in zip(layers, (True, False)):
        with eager_fast_path(fast):
            with torch.inference_mode():
                ys = [layer(x, is_first_microbatch=first) for first in (True, False)]
            got.append((ys, _call(layer, x, gy, False)))
    return got


@pytest.mark.parametrize("case", FAST_CASES)
def test_cached_weight_under_inference_mode_is_bitwise_the_general_path(case):
    """Evaluation under torch.inference_mode (first micro-batch, then reuse): the fast path's Python node on the
    cached parts, bitwise the general path; the next training call adds the columnwise form to the cache made there."""
    (fys, (fr, fn)), (gys, (gr, gn)) = _inference_then_training(case)
    assert (fn, gn) == (FAST, GENERAL), f"{case}: paths taken after inference mode {fn}, {gn}"
    for i, (a, b) in enumerate(zip(fys, gys)):
        assert_bitwise(a, b, f"{case}: inference-mode call {i}")
    for n, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), fr, gr):
        assert_bitwise(a, b, f"{case}: training call after inference mode: {n}")


def test_a_call_declined_after_asking_the_cache_asks_it_once(monkeypatch, caplog):
    """Where the fast path asked the cache and then declined (cached parts it cannot read), the general path runs on
    that same quantized weight: one quantization per first micro-batch, one stale-weight warning per stale call."""
    layer, general_layer = _layer("fp8_e4m3"), _layer("fp8_e4m3")
    x, gy = _inputs()
    monkeypatch.setattr(float8_graph, "_gathered_parts", lambda *a: None)
    asked = []
    cached_weight = type(layer)._cached_weight
    monkeypatch.setattr(type(layer), "_cached_weight", lambda self, *a: asked.append(a) or cached_weight(self, *a))
    got, node = _call(layer, x, gy, True)
    assert node == GENERAL and len(asked) == 1, f"path {node}, the cache asked {len(asked)} times"
    _change_in_place(layer)
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        got, node = _call(layer, x, gy, False)
    assert len(asked) == 2 and caplog.text.count(WARNING) == 1, \
        f"the cache asked {len(asked)} times, {caplog.text.count(WARNING)} stale-weight warnings"
    with eager_fast_path(False):
        _call(general_layer, x, gy, True)
        _change_in_place(general_layer)
        want, _ = _call(general_layer, x, gy, False)
    for n, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert_bitwise(a, b, f"declined after asking the cache: {n}")


# ---- CUDA ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("variant", ["plain", "save_original_input", "frozen_weight"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8_e4m3_pow2", "fp8blk_1x128_e4m3", "fp8_block"])
def test_cached_weight_on_cuda_is_bitwise_the_general_path(case, variant):
    """The one op (per-tensor: csrc/linear_fp8.cpp; blocks on sm_90: csrc/linear_fp8_block.cpp) handed the cached
    parts, over first / later micro-batches, a no_grad first micro-batch (usage preservation) and an in-place change
    of the weight: bitwise the general path with the same cache."""
    kw = dict(device="cuda", dtype=torch.bfloat16, save_original_input=variant == "save_original_input")
    layers = [_layer(case, **kw), _layer(case, **kw)]
    for layer in layers:
        if variant == "frozen_weight":
            layer.weight.requires_grad_(False)
    x, gy = _inputs("cuda", torch.bfloat16)
    blocks = BLOCK_OP if torch.cuda.get_device_capability() == (9, 0) else FAST
    want_node = ONE_OP if case.startswith("fp8_e") else blocks
    sequence = [(None, True, False), (None, False, True), (None, False, True), (_change_in_place, False, True),
                (None, True, True), (None, False, True)]
    for i, (change, first, grad) in enumerate(sequence):
        got = []
        for layer, fast in zip(layers, (True, False)):
            if change is not None:
                change(layer)
            with eager_fast_path(fast):
                got.append(_call(layer, x, gy, first, grad))
        (fr, fn), (gr, gn) = got
        what = f"{case}/{variant} on CUDA, call {i} (is_first_microbatch={first}, grad={grad})"
        assert (fn, gn) == ((want_node, GENERAL) if grad else (None, None)), f"{what}: paths taken {fn}, {gn}"
        _assert_same_quantized(layers[0]._weight_cache[1], layers[1]._weight_cache[1], what)
        for n, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), fr, gr):
            assert (a is None) == (b is None), f"{what}: {n} is {'missing' if a is None else 'there'} on the fast path"
            if a is not None:
                assert_bitwise(a, b, f"{what}: {n}")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8_block"])
def test_cached_weight_on_cuda_under_inference_mode_is_bitwise_the_general_path(case):
    """Inference mode on CUDA: the cached parts on the Python node (no one op: see float8_graph._one_op), bitwise the
    general path; the next training call runs as the one op on the cache made there."""
    (fys, (fr, fn)), (gys, (gr, gn)) = _inference_then_training(case, "cuda", torch.bfloat16)
    blocks = BLOCK_OP if torch.cuda.get_device_capability() == (9, 0) else FAST
    want = ONE_OP if case.startswith("fp8_e") else blocks
    assert (fn, gn) == (want, GENERAL), f"{case}: paths taken after inference mode {fn}, {gn}"
    for i, (a, b) in enumerate(zip(fys, gys)):
        assert_bitwise(a, b, f"{case} on CUDA: inference-mode call {i}")
    for n, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), fr, gr):
        assert_bitwise(a, b, f"{case} on CUDA: training call after inference mode: {n}")
