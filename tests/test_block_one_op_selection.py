"""Which eager FP8 block fast-path calls run as the extension's one op `hybridq::fp8_block_linear` (nn/float8_graph.py):
those whose every GEMM native_gemm's dispatch would run as `hybridq::fp8_block_mm` (`_block_gemms_native`: sm_90,
E4M3 operands, each GEMM's contracted dim a multiple of 128 and its other dims of 16 -- fprop contracts K, dgrad N,
wgrad M), an answer kept per call configuration in the fast path's cache (`_fast_call` -> FAST_PATH_BLOCK_GEMMS) and
asked again where the shape, the gradients or the recipe change; then, per call (`_one_block_op`), the op's switch
and the block GEMM op on, no block GEMM failed before, no TorchDispatchMode, and the parts handed over (x's; FSDP2's
gathered weight's, outside inference mode) of the layout the GEMM op takes.

CPU only: the CUDA tensors are fake (FakeTensorMode) and the machine facts (`_FP8_READY`, the capability) are set; the
decisions read only devices, dtypes and shapes. The op's results are tests/test_fp8_block_linear_op.py, on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import hybridq as hq
from hybridq.formats import Float8BlockPart, Float8BlockQuantizer
from hybridq.kernels import native_gemm
from hybridq.nn import float8_graph
from hybridq.nn.float8_graph import FAST_PATH, FAST_PATH_BLOCK_GEMMS, graph_spec
from hybridq.nn.linear import shared_input_quantization

from _format_cases import case_recipe

IN, OUT = 256, 128


def _spec(grad_fp8: str = "e4m3", weight_block_dim: int = 2):
    return graph_spec({"input": Float8BlockQuantizer(), "weight": Float8BlockQuantizer(block_dim=weight_block_dim),
                       "grad_output": Float8BlockQuantizer(fp8=grad_fp8)}, False)


@pytest.fixture(autouse=True)
def _machine(monkeypatch):
    """A CUDA device 0 with the extension, FP8 tensor cores and capability (9, 0), a fresh answer cache, the
    switches on."""
    monkeypatch.setitem(float8_graph._FP8_READY, 0, True)
    monkeypatch.setitem(native_gemm._CAPS, 0, (9, 0))
    monkeypatch.setattr(float8_graph, "_FAST_CALLS", {})
    monkeypatch.setattr(native_gemm, "_failed", set())
    monkeypatch.setattr(native_gemm.BLOCK_GEMM_OP, "on", True)
    monkeypatch.setattr(float8_graph._BLOCK_OP, "on", True)
    with shared_input_quantization(False), float8_graph.eager_fast_path(True):
        yield


def _fake_cuda(*shapes, dtype=torch.bfloat16) -> list[torch.Tensor]:
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=dtype) for s in shapes]


# (m, k, n, need_dgrad, need_wgrad, native): the contracted dims K (fprop), N (dgrad), M (wgrad) must be multiples of
# 128, and only those of the GEMMs that run
SHAPES = [(128, 256, 128, True, True, True),
          (144, 256, 128, True, True, False),   # wgrad contracts M = 144
          (144, 256, 128, True, False, True),   # (no wgrad)
          (128, 256, 144, True, True, False),   # dgrad contracts N = 144
          (128, 256, 144, False, True, True),   # (no dgrad)
          (128, 320, 128, False, False, False),  # fprop contracts K = 320
          (120, 256, 128, False, False, False)]  # M = 120: not a multiple of 16


@pytest.mark.parametrize("m, k, n, need_dgrad, need_wgrad, native", SHAPES, ids=[str(s) for s in SHAPES])
def test_block_gemms_are_native_where_every_gemm_of_the_call_is(m, k, n, need_dgrad, need_wgrad, native):
    (x,) = _fake_cuda((m, k))
    got = float8_graph._block_gemms_native(_spec(), x, m, k, n, need_dgrad, need_wgrad)
    assert got is native, f"M, K, N = {m}, {k}, {n}, dgrad {need_dgrad}, wgrad {need_wgrad}: answered {got}"


@pytest.mark.parametrize("why", ["e5m2 gradients", "capability (8, 9)", "CPU"])
def test_block_gemms_are_not_native_elsewhere(why, monkeypatch):
    spec = _spec("e5m2" if why == "e5m2 gradients" else "e4m3")
    if why == "capability (8, 9)":
        monkeypatch.setitem(native_gemm._CAPS, 0, (8, 9))
    x = torch.empty(128, 256) if why == "CPU" else _fake_cuda((128, 256))[0]
    assert not float8_graph._block_gemms_native(spec, x, 128, 256, 128, True, True), f"{why}: answered native"


def _answer(layer: hq.Linear, x: torch.Tensor, need_dgrad: bool = True, need_wgrad: bool = True) -> int:
    (w,) = _fake_cuda((OUT, x.shape[-1]))
    return float8_graph._cached_fast_call(x, w, layer._float8_graph_spec, layer._config(None), need_dgrad,
                                          need_wgrad)


def test_the_answer_is_kept_per_shape_and_gradients():
    """The cached answer of one layer: 128 rows take the block op's GEMMs, 144 rows with wgrad do not (asked again,
    not the 128 rows' answer), 144 rows without wgrad do; a per-tensor layer's calls answer FAST_PATH."""
    layer = hq.Linear(IN, OUT, bias=False, recipe="fp8_block", name="fc")
    x128, x144 = _fake_cuda((128, IN), (144, IN))
    answers = [_answer(layer, x128), _answer(layer, x144), _answer(layer, x144, need_wgrad=False),
               _answer(layer, x128)]
    assert answers == [FAST_PATH_BLOCK_GEMMS, FAST_PATH, FAST_PATH_BLOCK_GEMMS, FAST_PATH_BLOCK_GEMMS], answers
    per_tensor = hq.Linear(IN, OUT, bias=False, recipe="fp8_tensorwise", name="pt")
    assert _answer(per_tensor, x128) == FAST_PATH, "a per-tensor layer answered the block GEMMs"


def test_a_recipe_swap_is_answered_again():
    """fp8_block, then E5M2 gradients (the block GEMM takes E4M3 only): the swap's new spec and config are asked
    again (a cache that missed it would give the first answer)."""
    layer = hq.Linear(IN, OUT, bias=False, recipe="fp8_block", name="fc")
    (x,) = _fake_cuda((128, IN))
    assert _answer(layer, x) == FAST_PATH_BLOCK_GEMMS
    layer.recipe = case_recipe("fp8blk_1x128_e5m2")
    assert _answer(layer, x) == FAST_PATH, "after the swap to E5M2 the E4M3 answer was reused"


def test_native_gemms_off_is_answered_again():
    layer = hq.Linear(IN, OUT, bias=False, recipe="fp8_block", name="fc")
    (x,) = _fake_cuda((128, IN))
    assert _answer(layer, x) == FAST_PATH_BLOCK_GEMMS
    with native_gemm.disabled():
        assert _answer(layer, x) != FAST_PATH_BLOCK_GEMMS, "with native GEMMs off the block GEMM answer was reused"
    assert _answer(layer, x) == FAST_PATH_BLOCK_GEMMS


def _x_parts(m: int = 128, k: int = IN, columnwise: bool = True, scales: str = "made") -> tuple:
    """x's parts as `_quantize` makes them (fake CUDA), or with their rowwise scales strided (outer-dim-major) or
    the columnwise scales of another shape."""
    e4 = torch.float8_e4m3fn
    with FakeTensorMode():
        row, rs = torch.empty(m, k, dtype=e4, device="cuda"), torch.empty(m, k // 128, device="cuda")
        col, cs = torch.empty(k, m, dtype=e4, device="cuda"), torch.empty(k, m // 128, device="cuda")
        if scales == "strided":
            rs = torch.empty_strided((m, k // 128), (1, m), device="cuda")
        elif scales == "other shape":
            cs = torch.empty(k, m // 128 + 1, device="cuda")
    return (row, rs, col, cs) if columnwise else (row, rs, None, None)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


SPEC = _spec()


def _w_parts(tiles: bool = True, columnwise: bool = True, scales: str = "made") -> tuple:
    """A gathered weight's parts as `_gathered_parts` hands them over (fake CUDA): rowwise data and scales, the
    columnwise part (128x128 tiles: scales [ceil(rows/128), ceil(cols/128)]; 1x128: [rows, cols/128])."""
    e4, n, k = torch.float8_e4m3fn, OUT, IN
    with FakeTensorMode():
        wr, wc = torch.empty(n, k, dtype=e4, device="cuda"), torch.empty(k, n, dtype=e4, device="cuda")
        wrs = torch.empty(*((n // 128, k // 128) if tiles else (n, k // 128)), device="cuda")
        wcs = torch.empty(*((k // 128, n // 128) if tiles else (k, n // 128)), device="cuda")
        if scales == "other shape":
            wcs = torch.empty(k // 128 + 1, n // 128, device="cuda")
    col = Float8BlockPart(rows=k, cols=n, columnwise=True, data=wc, scale_inv=wcs, block_dim=2 if tiles else 1)
    return wr, wrs, col if columnwise else None


def test_a_plain_call_takes_the_block_op():
    assert float8_graph._one_block_op(SPEC, None, None), "x quantized by the op, plain weight: not taken"
    assert float8_graph._one_block_op(SPEC, None, _x_parts()), "x's parts handed over: not taken"
    assert float8_graph._one_block_op(SPEC, None, _x_parts(columnwise=False)), \
        "x's rowwise part handed over: not taken"


@pytest.mark.parametrize("tiles", [True, False], ids=["128x128 weight", "1x128 weight"])
def test_a_gathered_weight_takes_the_block_op(tiles):
    spec = _spec(weight_block_dim=2 if tiles else 1)
    assert float8_graph._one_block_op(spec, _w_parts(tiles), None), "a gathered weight: not taken"
    assert float8_graph._one_block_op(spec, _w_parts(tiles, columnwise=False), _x_parts()), \
        "a gathered weight without dgrad, x's parts handed over: not taken"


def test_a_failed_gemm_of_another_kind_changes_nothing(monkeypatch):
    monkeypatch.setattr(native_gemm, "_failed", {("triton-mxfp8", 0)})
    assert float8_graph._one_block_op(SPEC, None, None), "a failed MXFP8 GEMM kept the block op away"


@pytest.mark.parametrize("why", ["switch off", "block GEMM op off", "a block GEMM failed", "dispatch mode",
                                 "strided scales", "scales of another shape", "gathered weight, inference mode",
                                 "gathered weight, scales of another shape"])
def test_calls_keep_the_python_node(why, monkeypatch):
    w_parts, x_parts = None, None
    if why == "switch off":
        monkeypatch.setattr(float8_graph._BLOCK_OP, "on", False)
    elif why == "block GEMM op off":
        monkeypatch.setattr(native_gemm.BLOCK_GEMM_OP, "on", False)
    elif why == "a block GEMM failed":
        monkeypatch.setattr(native_gemm, "_failed", {("block", 128, 256, 128, (128, 128))})
    elif why == "gathered weight, inference mode":
        w_parts = _w_parts()
    elif why == "gathered weight, scales of another shape":
        w_parts = _w_parts(scales="other shape")
    elif why == "strided scales":
        x_parts = _x_parts(scales="strided")
    elif why == "scales of another shape":
        x_parts = _x_parts(scales="other shape")
    if why == "dispatch mode":
        with _Mode():
            taken = float8_graph._one_block_op(SPEC, w_parts, x_parts)
    elif why == "gathered weight, inference mode":
        with torch.inference_mode():
            taken = float8_graph._one_block_op(SPEC, w_parts, x_parts)
    else:
        taken = float8_graph._one_block_op(SPEC, w_parts, x_parts)
    assert not taken, f"{why}: the block op was taken"
