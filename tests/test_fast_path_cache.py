"""The eager FP8 fast path asks its checks (`takes`, the shape rules: nn/float8_graph.py `_fast_call`) once per call
shape and configuration (`_cached_fast_call`), and answers again wherever one of them changes: the input's shape,
dtype and device, the layer's recipe (a new spec and config), whether native GEMMs are on; the switch and the
dispatch tables are read at every call. Each case below first caches an answer, then changes one thing and needs
the other answer (a cache that missed the change would give the first one).

The CUDA cases run on the CPU with fake CUDA tensors (FakeTensorMode: the checks read only devices, dtypes and
shapes) and the machine fact `_cuda_fp8_ready` set, so they need no GPU; that the layer itself then takes the path
the answer names is tests/test_eager_fast_path.py's (GPU) and the module-level cases here (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hybridq as hq
from hybridq.kernels import native_gemm
from hybridq.nn import float8_graph
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization

IN, OUT = 64, 32
FAST, GENERAL = "_Float8GraphLinearBackward", "_LinearFunctionBackward"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(float8_graph, "_FAST_CALLS", {})
    with shared_input_quantization(False), eager_fast_path(True):
        yield


def _layer(recipe: str = "fp8_tensorwise") -> hq.Linear:
    torch.manual_seed(0)
    return hq.Linear(IN, OUT, bias=False, recipe=recipe, name="fc")


def _answer(layer: hq.Linear, x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """The cached fast-path answer for `layer` called on `x` (with gradients)."""
    w = layer.weight if weight is None else weight
    return float8_graph._cached_fast_call(x, w, layer._float8_graph_spec, layer._config(None), True, True)


def _fake_cuda(*shapes, dtype=torch.float32) -> list[torch.Tensor]:
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=dtype) for s in shapes]


@pytest.fixture
def cuda_ready(monkeypatch):
    """The machine fact `takes` reads: a CUDA device 0 with the extension and FP8 tensor cores."""
    monkeypatch.setitem(float8_graph._FP8_READY, 0, True)


def test_a_call_shape_is_checked_once(monkeypatch):
    layer = _layer()
    asked = []
    check = float8_graph._fast_call
    monkeypatch.setattr(float8_graph, "_fast_call", lambda *a: asked.append(a[0].shape) or check(*a))
    for _ in range(3):
        layer(torch.randn(8, IN, requires_grad=True)).sum().backward()
    layer(torch.randn(16, IN, requires_grad=True))
    assert asked == [torch.Size([8, IN]), torch.Size([16, IN])], f"checks asked for {asked}, not once per shape"


@pytest.mark.parametrize("change", ["rows", "dtype"])
def test_layer_takes_the_general_path_for_a_call_the_cached_answer_does_not_cover(change):
    """After a fast call: an input without rows (M = 0) or an integer input must run the general path (there: its
    empty product / its error), as without the cache."""
    layer = _layer()
    y = layer(torch.randn(8, IN, requires_grad=True))
    assert type(y.grad_fn).__name__ == FAST
    if change == "rows":
        y = layer(torch.randn(0, IN, requires_grad=True))
        assert type(y.grad_fn).__name__ == GENERAL and y.shape == (0, OUT), (type(y.grad_fn).__name__, y.shape)
        return
    x = torch.randint(0, 3, (8, IN), dtype=torch.int32)
    with eager_fast_path(False), pytest.raises(Exception) as general:
        layer(x)
    with pytest.raises(type(general.value)) as got:
        layer(x)
    assert str(got.value) == str(general.value), f"an integer input after a cached answer: {got.value!r}, the " \
                                                 f"general path raises {general.value!r}"


def test_a_recipe_swap_is_answered_again(cuda_ready):
    """72 rows (not a multiple of 16): the per-tensor FP8 GEMM declines them, the block GEMM op takes any rows."""
    layer = _layer("fp8_tensorwise")
    x, w = _fake_cuda((72, IN), (OUT, IN))
    assert not _answer(layer, x, w), "72 rows of a per-tensor layer on CUDA took the fast path"
    layer.recipe = "fp8_block"
    assert _answer(layer, x, w), "after the swap to fp8_block the per-tensor layer's answer was reused"


def test_cuda_rows_the_gemm_cannot_take_are_answered_again(cuda_ready):
    layer = _layer()
    ok, odd, w = _fake_cuda((128, IN), (72, IN), (OUT, IN))
    assert _answer(layer, ok, w), "128 rows on CUDA declined"
    assert not _answer(layer, odd, w), "72 rows reused the answer for 128"


def test_a_device_move_is_answered_again(cuda_ready):
    layer = _layer()
    assert _answer(layer, torch.randn(72, IN)), "72 rows on the CPU declined (the CPU path takes any rows)"
    x, w = _fake_cuda((72, IN), (OUT, IN))
    assert not _answer(layer, x, w), "72 rows on CUDA reused the CPU's answer"


def test_an_input_dtype_is_answered_again(cuda_ready):
    layer = _layer()
    (w,) = _fake_cuda((OUT, IN))
    (x32,) = _fake_cuda((128, IN))
    (x64,) = _fake_cuda((128, IN), dtype=torch.float64)
    assert _answer(layer, x32, w), "a float32 input on CUDA declined"
    assert not _answer(layer, x64, w), "a float64 input (the kernels read fp32 / bf16 / fp16) reused float32's answer"


def test_native_gemms_off_is_answered_again(cuda_ready):
    layer = _layer()
    x, w = _fake_cuda((128, IN), (OUT, IN))
    assert _answer(layer, x, w)
    with native_gemm.disabled():
        assert not _answer(layer, x, w), "with native GEMMs off the cached answer was reused"
    assert _answer(layer, x, w)


def test_the_switch_and_the_dispatch_tables_are_read_at_every_call():
    layer = _layer()
    x = torch.randn(8, IN)
    assert _answer(layer, x)
    with eager_fast_path(False):
        assert not _answer(layer, x), "the fast path switched off reused the cached answer"
    layer.input_quantizer.quantize = layer.input_quantizer.quantize  # (an instance attribute: a wrapper)
    assert not _answer(layer, x), "a quantizer with a replaced quantize reused the cached answer"
