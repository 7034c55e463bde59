"""An eager per-tensor FP8 Linear on CUDA runs as ONE op, `hybridq::fp8_linear` (csrc/linear_fp8.cpp), whose autograd
node is C++ (the host cost of a Linear step: issue 33): bitwise the general path (outputs, dx, dw, db) for every
per-tensor cast the fast path takes, on random and on non-finite data, with and without gradients, with its input
shared by other layers or cast from a known max|x|, and under saved-tensor hooks (offload, recompute); the Python
node of nn/float8_graph.py runs instead where a TorchDispatchMode is active. The op refuses inconsistent arguments
with errors naming it. (CUDA only: the extension is CUDA-only; the CPU fast path is tests/test_eager_fast_path.py.)"""

from __future__ import annotations

import pytest
import torch

import hybridq as hq
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _compare import assert_bitwise
from _format_cases import case_recipe
from _linear_paths import (assert_one_quantization_shared_by_the_op, assert_same, node_name, put_non_finite, step,
                           step_under_dispatch_mode, step_under_saved_tensor_hooks, step_with_known_amax)

IN, OUT, TOKENS = 256, 128, (2, 64)
ONE_OP, PYTHON, GENERAL = ("torch::autograd::CppNode<hybridq::ops::Fp8Linear>", "_Float8GraphLinearBackward",
                           "_LinearFunctionBackward")


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.kernels import _ext
    return _ext.available_for(torch.device("cuda")) and torch.cuda.get_device_capability() >= (8, 9)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores and the extension")]

# per-tensor casts with current scaling in the three roles: each format case the FP8 GEMM takes in every role (E4M3:
# E5M2 x E5M2 has no GEMM), the preset, and "mixed", whose three casts all differ (_format_cases.MIXED_PER_TENSOR)
CASES = ["fp8_e4m3", "fp8_e4m3_pow2", "fp8_tensorwise", "mixed"]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    with shared_input_quantization(False), eager_fast_path(True):
        yield


def _layer(case: str, dtype=torch.bfloat16, bias=True, name="fc", seed=0, **kw) -> hq.Linear:
    torch.manual_seed(seed)
    return hq.Linear(IN, OUT, bias=bias, recipe=case_recipe(case), name=name, device="cuda", dtype=dtype, **kw)


def _inputs(dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*TOKENS, IN, generator=g).to("cuda", dtype),
            torch.randn(*TOKENS, OUT, generator=g).to("cuda", dtype))


def _both(layer, x, gy, want_node=ONE_OP, **kw):
    fast, node = step(layer, x, gy, **kw)
    with eager_fast_path(False):
        general, general_node = step(layer, x, gy, **kw)
    assert (node, general_node) == (want_node, GENERAL), f"paths taken: {node}, {general_node}"
    return fast, general


@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "frozen_weight", "input_no_grad",
                                     "fp32", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_one_op_is_bitwise_the_general_path(case, variant):
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(variant, torch.bfloat16)
    layer = _layer(case, dtype=dtype, bias=variant != "no_bias", save_original_input=variant == "save_original_input")
    if variant == "frozen_weight":
        layer.weight.requires_grad_(False)
    x, gy = _inputs(dtype)
    fast, general = _both(layer, x, gy, x_grad=variant != "input_no_grad")
    assert_same(fast, general, f"{case}/{variant}")


@pytest.mark.parametrize("variant", ["plain", "save_original_input", "frozen_weight", "input_no_grad", "shared_input"])
@pytest.mark.parametrize("case", ["fp8_tensorwise", "mixed"])
def test_packed_allocations_are_bitwise_the_unpacked(case, variant):
    """The op's tensors packed into fewer allocations (csrc/linear_fp8.cpp, [Note: packed allocations of the Linear
    op]) give the bits of one allocation each (the code before; the same kernels and GEMMs), with the x cast here or
    handed in (another layer's, shared), the weight's columnwise part made or not, x's saved or x kept."""
    from hybridq import _C
    layer = _layer(case, save_original_input=variant == "save_original_input")
    if variant == "frozen_weight":
        layer.weight.requires_grad_(False)
    x, gy = _inputs()
    results = []
    for packed in (True, False):
        was = _C.linear_packed_allocations(packed)
        try:
            with shared_input_quantization(variant == "shared_input"):
                results.append(step(layer, x, gy, x_grad=variant != "input_no_grad"))
        finally:
            _C.linear_packed_allocations(was)
    (got, node), (want, _) = results
    assert node == ONE_OP, f"{case}/{variant}: the call ran as {node}"
    assert_same(got, want, f"{case}/{variant}: packed vs unpacked allocations")


@pytest.mark.parametrize("sharing", [False, True])
def test_a_step_waits_for_no_gpu_work(sharing):
    """Forward + backward of the one-op layer never blocks the host on the GPU (a host sync would add the step's GPU
    time to its host time): first call (plans made) and later ones."""
    from _gpu import no_host_sync
    layer = _layer("fp8_tensorwise")
    x, gy = _inputs()
    for _ in range(2):
        xg = x.clone().requires_grad_()
        with no_host_sync(), shared_input_quantization(sharing):
            y = layer(xg)
            y.backward(gy)
        assert node_name(y) == ONE_OP, f"the call ran as {node_name(y)}"


@pytest.mark.parametrize("where", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "mixed"])
def test_one_op_on_non_finite_values_is_bitwise_the_general_path(case, where):
    """inf and NaN in x, dy or the weight: every result as the general path's (NaN where it has NaN; payloads aside)."""
    layer = _layer(case)
    x, gy = _inputs()
    put_non_finite({"input": x, "grad_output": gy, "weight": layer.weight.data}[where])
    fast, general = _both(layer, x, gy)
    assert_same(fast, general, f"{case} with inf/NaN in {where}", nan_payload=True)
    i, n = (1, "grad_input") if where == "grad_output" else (0, "output")
    assert not torch.isfinite(fast[i]).all(), f"{case}: the {n} became finite with inf/NaN in {where}"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_one_op_without_gradients_is_bitwise_the_general_path(mode):
    layer = _layer("fp8_e4m3")
    x, _ = _inputs()
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        fast = layer(x)
        with eager_fast_path(False):
            general = layer(x)
    assert fast.grad_fn is None
    assert_bitwise(fast, general, f"output under {mode}")


def test_layers_share_one_quantization_of_their_input_through_the_op(monkeypatch):
    """q, k, v read one tensor: with sharing on, x is quantized once (by q, outside the op) and the op of each layer
    reads those parts; every result is bitwise the run without sharing."""
    layers = [_layer("fp8_e4m3", name=n, seed=i) for i, n in enumerate("qkv")]
    assert_one_quantization_shared_by_the_op(layers, *_inputs(), monkeypatch, ONE_OP)


def test_one_op_uses_a_known_max_of_its_input():
    """A norm's max|x| (known_amax), 3x the real one: the op casts with it, as the general path does."""
    layer = _layer("fp8_e4m3")
    x, gy = _inputs()
    results = []
    for enabled in (True, False):
        got, node = step_with_known_amax(layer, x, gy, fast=enabled)
        assert node == (ONE_OP if enabled else GENERAL), node
        results.append(got)
    plain = step(layer, x, gy)[0]
    assert not torch.equal(results[0][0], plain[0]), "the known max|x| was not used (same output as without it)"
    for n, a, b in zip(("output", "grad_input", "grad_weight"), *results):
        assert_bitwise(a, b, f"with a known max|x|: {n}")


def test_a_dispatch_mode_sees_the_python_node_and_the_same_results():
    """Under a TorchDispatchMode (selective checkpointing's policy, an op counter) the layer runs the Python node,
    whose quantize ops and GEMMs the mode sees one by one; the results are those of the one op."""
    layer = _layer("fp8_e4m3")
    x, gy = _inputs()
    want, node = step(layer, x, gy)
    got, mode_node, seen = step_under_dispatch_mode(layer, x, gy)
    assert (node, mode_node) == (ONE_OP, PYTHON), f"nodes {node}, under the mode {mode_node}"
    assert seen.count(torch.ops.aten._scaled_mm.default) == 3, f"GEMMs the mode saw: {seen}"
    assert_same(got, want, "under a TorchDispatchMode")


@pytest.mark.parametrize("how", ["saved_tensors_hooks", "checkpoint"])
def test_saved_tensors_go_through_the_hooks(how):
    """The C++ node's saved tensors (x's columnwise part, the weight's, their scales) go through saved-tensor hooks
    (offload and recompute use them); the gradients are those of the run without the hooks."""
    layer = _layer("fp8_e4m3", bias=False)
    x, gy = _inputs()
    want, _ = step(layer, x, gy)
    got, _, packed = step_under_saved_tensor_hooks(layer, x, gy, how)
    if how == "saved_tensors_hooks":
        assert packed.count(torch.float8_e4m3fn) == 2 and packed.count(torch.float32) == 2, packed
    assert_same(got, want, f"under {how}")


def test_the_op_refuses_inconsistent_arguments():
    x = torch.randn(32, IN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16)
    e4 = torch.float8_e4m3fn
    casts = (e4, 0.0, False, e4, 0.0, False, e4, 0.0, False)
    op = torch.ops.hybridq.fp8_linear
    xr = x.to(e4)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_linear: input of shape \[32, 256\] and weight of shape "):
        op(x, w[:, :128], None, None, None, None, None, *casts, True, True, False, True)
    with pytest.raises(RuntimeError, match="hybridq::fp8_linear: x_row given without x_row_scale_inv"):
        op(x, w, None, xr, None, None, None, *casts, True, True, False, True)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_linear: a quantized input needs its columnwise part"):
        op(x, w, None, xr, torch.ones(1, device="cuda"), None, None, *casts, True, True, False, True)
    with pytest.raises(RuntimeError, match="hybridq::fp8_tensor_quantize: input x must be a CUDA tensor"):
        op(x.cpu(), w.cpu(), None, None, None, None, None, *casts, False, False, False, True)
