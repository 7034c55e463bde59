"""What the compiled layers' custom ops keep per configuration instead of redoing at every call (host time), and how
they are registered (hybridq/nn/plain_ops.py): every cached answer is reused only for the inputs it was computed
for, and the ops keep custom_op's rules without its per-call layers."""

from __future__ import annotations

import pytest
import torch

import hybridq as hq
from hybridq import dispatch
from hybridq.formats.float8 import Float8Quantizer
from hybridq.gemm import REFERENCE_JAGGED_FP8, JaggedFP8Kernels
from hybridq.kernels import native_gemm
from hybridq.nn import compiled_grouped
from hybridq.nn.plain_ops import plain_op

CPU = torch.device("cpu")


# ---- registration ---------------------------------------------------------------------------------------------

@plain_op("hybridq::_test_plain_op_returns_input")
def _returns_input(x: torch.Tensor, alias: bool) -> list[torch.Tensor]:
    return [x if alias else x * 2]


@_returns_input.register_fake
def _(x, alias):
    return [torch.empty_like(x)]


def test_plain_op_rejects_an_output_aliasing_its_input():
    x = torch.randn(4)
    assert torch.equal(torch.ops.hybridq._test_plain_op_returns_input(x, False)[0], x * 2)
    with pytest.raises(RuntimeError, match="alias"):
        torch.ops.hybridq._test_plain_op_returns_input(x, True)


@pytest.mark.parametrize("op", ["gathered_linear_forward", "gathered_linear_backward", "linear_backward",
                                "jagged_input_quantize", "grouped_blocks_input_quantize", "grouped_linear_backward",
                                "gathered_grouped_linear_forward",
                                "gathered_grouped_linear_backward", "compiled_norm_backward",
                                "compiled_swiglu_backward"])
def test_ops_without_an_autograd_formula_have_no_python_autograd_kernel(op):
    # (a compiled graph calls them at every step: torch.library.custom_op would run its Python autograd layer first)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"hybridq::{op}", "Autograd"), \
        f"hybridq::{op} has an Autograd kernel: each call runs it before the op's body"


# ---- the grouped ops' jagged kernels, asked once per configuration --------------------------------------------

def _key(grad_dtype: str) -> str:
    def factory(role):
        return Float8Quantizer("e5m2" if role.tensor_type == "grad_output" and grad_dtype == "e5m2" else "e4m3")
    layer = hq.GroupedLinear(2, 64, 96, recipe=hq.CustomRecipe(factory), name=f"moe_{grad_dtype}")
    key = compiled_grouped.graph_key(layer)
    assert key is not None, "a per-tensor FP8 recipe has a compiled configuration"
    return key


class _OnlySome(JaggedFP8Kernels):
    """The reference kernels, taking only in_features 64, native GEMMs on and an e5m2 grad_output (each a part of
    the cache's key)."""

    def supports(self, device, in_features, out_features, quantizers):
        return (device.type == "cpu" and in_features == 64 and native_gemm.native_enabled()
                and quantizers["grad_output"].dtype == torch.float8_e5m2)


def test_jagged_kernels_are_reused_only_for_their_configuration_shape_and_registration():
    e5m2, e4m3 = _key("e5m2"), _key("e4m3")
    assert e5m2 != e4m3
    assert compiled_grouped._kernels(e5m2, CPU, 64, 96) is REFERENCE_JAGGED_FP8
    before = dispatch.jagged_fp8_kernels("cpu")
    some = _OnlySome()
    dispatch.register_jagged_fp8("cpu", some)
    try:
        assert compiled_grouped._kernels(e5m2, CPU, 64, 96) is some, "a newly registered kernel was not asked"
        assert compiled_grouped._kernels(e5m2, CPU, 96, 64) is REFERENCE_JAGGED_FP8, "another shape reused an answer"
        assert compiled_grouped._kernels(e4m3, CPU, 64, 96) is REFERENCE_JAGGED_FP8, \
            "another configuration reused an answer"
        with native_gemm.disabled():
            assert compiled_grouped._kernels(e5m2, CPU, 64, 96) is REFERENCE_JAGGED_FP8, \
                "native GEMMs switched off reused an answer"
        assert compiled_grouped._kernels(e5m2, CPU, 64, 96) is some
    finally:
        if before is None:
            dispatch._JAGGED_FP8.pop("cpu", None)
        else:
            dispatch.register_jagged_fp8("cpu", before)
    assert compiled_grouped._kernels(e5m2, CPU, 64, 96) is REFERENCE_JAGGED_FP8, \
        "the unregistered kernel was still used"


def test_tracing_the_gathered_grouped_op_keeps_no_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    key = _key("e5m2")
    with FakeTensorMode():  # (what compile's tracing runs: the op's fake)
        x, handle, m_splits = torch.randn(64, 64), torch.zeros(1, dtype=torch.int64), torch.tensor([30, 34])
        xq = torch.ops.hybridq.jagged_input_quantize(x, m_splits, None, [], key, 96, True)
        y = torch.ops.hybridq.gathered_grouped_linear_forward(x, *xq, handle, m_splits, [], key, True, True,
                                                              [2, 96, 64], torch.float32)[0]
    assert isinstance(y, FakeTensor) and list(y.shape) == [64, 96]
    kept = [t for t in compiled_grouped._STAND_INS.values() if isinstance(t, FakeTensor)]
    assert not kept, f"the real op's stand-in weights include {len(kept)} fake tensors made while tracing"


def test_gathered_grouped_stand_in_weights_have_the_asked_shape_and_dtype():
    for shape, dtype in (([2, 96, 64], torch.bfloat16), ([2, 96, 64], torch.float32), ([3, 96, 64], torch.float32)):
        w = compiled_grouped._stand_in(shape, dtype)
        assert (list(w.shape), w.dtype, w.device.type) == (shape, dtype, "meta"), \
            f"stand-in for {shape} {dtype} is {list(w.shape)} {w.dtype} on {w.device}"


# ---- the compiled Linear's gathered fast path: its checks asked once per shape ---------------------------------

def test_gathered_fast_path_checks_are_reused_only_for_their_shapes_dtypes_and_switch():
    from hybridq.nn import compiled_linear, float8_graph
    lin = hq.Linear(64, 32, bias=False, recipe="fp8_tensorwise", name="fc")
    key = lin._configuration_key
    spec, cfg = compiled_linear._fast_spec(key, None), compiled_linear._config(key, None)
    w = torch.randn(32, 64)

    def call(x):
        return float8_graph._cached_fast_call(x, w, spec, cfg, True, True)

    assert call(torch.randn(8, 64)), "a per-tensor FP8 call on the CPU takes the fast path"
    assert not call(torch.randn(0, 64)), "an input without rows reused another shape's answer"
    assert not call(torch.randn(8, 64).to(torch.int32)), "an integer input reused another dtype's answer"
    with float8_graph.eager_fast_path(False):
        assert not call(torch.randn(8, 64)), "the fast path switched off reused an answer"
    assert call(torch.randn(8, 64))


def test_gathered_fast_forward_whose_weight_part_does_not_fit_in_backward_runs_the_general_path_bitwise(monkeypatch):
    """The fast forward saves x's columnwise tensors as they are; a backward that cannot take the fast path (here
    the gathered weight's columnwise part is not contiguous) rebuilds the general path's saved input from them."""
    from hybridq.formats.float8 import Float8TensorPart
    from hybridq.nn import compiled_linear
    from hybridq.tensor import QuantizedTensor
    torch.manual_seed(0)
    layer = hq.Linear(64, 32, bias=False, recipe="fp8_tensorwise", name="fc")
    key = layer._configuration_key
    wq = compiled_linear._LAYERS[key][1]["weight"].quantize(torch.randn(32, 64), rowwise=True, columnwise=True,
                                                            name="w")

    class Owner:
        weight = wq

    owner = Owner()
    handle = compiled_linear.weight_handle(owner, lambda o: o.weight)
    x, dy = torch.randn(8, 64), torch.randn(8, 32)
    y, *saved = torch.ops.hybridq.gathered_linear_forward(x, handle, None, key, None, True, True, [32, 64],
                                                          torch.float32)
    layout = compiled_linear._LAYOUTS[compiled_linear._layout_key(key, None, True, True, x.shape, [32, 64], x.dtype,
                                                                  True)]
    assert layout[1], "the gathered forward did not take the fast path"
    general = []
    monkeypatch.setattr(compiled_linear, "linear_grads",
                        lambda *a, real=compiled_linear.linear_grads: general.append(1) or real(*a))

    def backward():
        return torch.ops.hybridq.gathered_linear_backward(dy, None, handle, saved, key, None, True, True, False,
                                                          [8, 64], [32, 64], x.dtype, torch.float32, torch.float32)

    fast = backward()
    assert not general, "a fitting weight part did not take the fast backward"
    col = wq.part("columnwise")
    strided = Float8TensorPart(rows=col.rows, cols=col.cols, columnwise=True, data=col.data.t().contiguous().t(),
                               scale_inv=col.scale_inv)
    owner.weight = QuantizedTensor(wq.part("rowwise"), strided, shape=wq.shape, dtype=wq.dtype)
    slow = backward()
    assert general, "a non-contiguous weight part took the fast backward"
    for what, a, b in (("dx", fast[0], slow[0]), ("dW", fast[1], slow[1])):
        assert torch.equal(a, b), f"{what}: general path differs from the fast path by {(a - b).abs().max()}"
