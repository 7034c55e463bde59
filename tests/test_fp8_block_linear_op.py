"""An eager FP8 block Linear on CUDA (1x128 input and gradient blocks, 128x128 or 1x128 weights) whose three GEMMs all
run as the extension's block GEMM op runs as ONE op, `hybridq::fp8_block_linear` (csrc/linear_fp8_block.cpp), whose
autograd node is C++ (the host cost of a Linear step: issue 33): bitwise its Python node (nn/float8_graph.py
`_Float8GraphLinear`, HYBRIDQ_BLOCK_LINEAR_OP off) and the general path (outputs, dx, dw, db) for every block cast the
op takes, on random and on non-finite data, with and without gradients, with its input shared by other layers, and
under saved-tensor hooks (offload, recompute); the Python node runs instead where a GEMM would not be the block op
(E5M2, a dimension the GEMM does not take) or a TorchDispatchMode is active. The op refuses inconsistent arguments
with errors naming it. (sm_90 only: the block GEMM. Which calls take the op: also tests/test_block_one_op_selection.py,
on the CPU; the C++ node's logic on the host: tests/test_fp8_block_linear_host.py; FSDP2's gathered block weights:
tests/distributed/test_fsdp_block_one_op.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridq as hq
from hybridq.nn import float8_graph
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _compare import assert_bitwise
from _format_cases import case_recipe
from _linear_paths import (assert_one_quantization_shared_by_the_op, assert_same, put_non_finite, step,
                           step_under_dispatch_mode, step_under_saved_tensor_hooks)

IN, OUT, TOKENS = 256, 128, (2, 64)  # (M = 128: every GEMM dimension the block GEMM takes)
ONE_OP, PYTHON, GENERAL = ("torch::autograd::CppNode<hybridq::ops::Fp8BlockLinear>", "_Float8GraphLinearBackward",
                           "_LinearFunctionBackward")


def _sm90_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.kernels import _ext
    return _ext.available_for(torch.device("cuda")) and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _sm90_ready(), reason="needs an sm_90 CUDA device (the block GEMM) and the "
                                                           "extension")]

# the block casts the op takes: the preset (128x128 weight tiles), 1x128 weights, without power-of-2 scales
CASES = ["fp8_block", "fp8blk_1x128_e4m3", "fp8blk_1x128_e4m3_nopow2"]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    with shared_input_quantization(False), eager_fast_path(True), float8_graph._BLOCK_OP.turned(True):
        yield


def _layer(case: str, dtype=torch.bfloat16, bias=True, name="fc", seed=0, in_features=IN, **kw) -> hq.Linear:
    torch.manual_seed(seed)
    return hq.Linear(in_features, OUT, bias=bias, recipe=case_recipe(case), name=name, device="cuda", dtype=dtype,
                     **kw)


def _inputs(dtype=torch.bfloat16, seed=1, tokens=TOKENS, in_features=IN):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*tokens, in_features, generator=g).to("cuda", dtype),
            torch.randn(*tokens, OUT, generator=g).to("cuda", dtype))


def _three(layer, x, gy, **kw):
    """The one op's, the Python node's and the general path's results, each path checked by its node."""
    got, node = step(layer, x, gy, **kw)
    with float8_graph._BLOCK_OP.turned(False):
        python, python_node = step(layer, x, gy, **kw)
    with eager_fast_path(False):
        general, general_node = step(layer, x, gy, **kw)
    assert (node, python_node, general_node) == (ONE_OP, PYTHON, GENERAL), \
        f"paths taken: {node}, {python_node}, {general_node}"
    return got, python, general


@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "frozen_weight", "input_no_grad",
                                     "fp32", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_one_block_op_is_bitwise_the_python_node_and_the_general_path(case, variant):
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(variant, torch.bfloat16)
    layer = _layer(case, dtype=dtype, bias=variant != "no_bias", save_original_input=variant == "save_original_input")
    if variant == "frozen_weight":
        layer.weight.requires_grad_(False)
    x, gy = _inputs(dtype)
    got, python, general = _three(layer, x, gy, x_grad=variant != "input_no_grad")
    assert_same(got, python, f"{case}/{variant}: one op vs Python node")
    assert_same(got, general, f"{case}/{variant}: one op vs general path")


@pytest.mark.parametrize("where", ["input", "grad_output", "weight"])
def test_one_block_op_on_non_finite_values_is_bitwise_the_python_node(where):
    """inf and NaN in x, dy or the weight: every result as the Python node's (NaN where it has NaN; payloads aside)."""
    layer = _layer("fp8_block")
    x, gy = _inputs()
    put_non_finite({"input": x, "grad_output": gy, "weight": layer.weight.data}[where])
    got, python, _ = _three(layer, x, gy)
    assert_same(got, python, f"inf/NaN in {where}", nan_payload=True)
    i, n = (1, "grad_input") if where == "grad_output" else (0, "output")
    assert not torch.isfinite(got[i]).all(), f"the {n} became finite with inf/NaN in {where}"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_one_block_op_without_gradients_is_bitwise_the_general_path(mode):
    layer = _layer("fp8_block")
    x, _ = _inputs()
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        fast = layer(x)
        with eager_fast_path(False):
            general = layer(x)
    assert fast.grad_fn is None
    assert_bitwise(fast, general, f"output under {mode}")


@pytest.mark.parametrize("why", ["e5m2", "rows", "in_features"])
def test_calls_whose_gemms_are_not_the_block_op_keep_the_python_node(why):
    """E5M2 (the block GEMM takes E4M3), 144 rows (wgrad contracts M: not a multiple of 128), 320 in_features (fprop
    contracts K): the Python node runs (its GEMM dispatch emulates where the block GEMM declines, with a warning)."""
    case = "fp8blk_1x128_e5m2" if why == "e5m2" else "fp8_block"
    in_features = 320 if why == "in_features" else IN
    layer = _layer(case, in_features=in_features)
    x, gy = _inputs(tokens=(144,) if why == "rows" else TOKENS, in_features=in_features)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the emulated GEMM's one-time warning)
        _, node = step(layer, x, gy)
    assert node == PYTHON, f"{why}: the call ran as {node}"


def test_layers_share_one_quantization_of_their_input_through_the_op(monkeypatch):
    """q, k, v read one tensor: with sharing on, x is quantized once (by q, outside the op) and the op of each layer
    reads those parts; every result is bitwise the run without sharing."""
    layers = [_layer("fp8_block", name=n, seed=i) for i, n in enumerate("qkv")]
    assert_one_quantization_shared_by_the_op(layers, *_inputs(), monkeypatch, ONE_OP)


def test_a_dispatch_mode_sees_the_python_node_and_the_same_results():
    layer = _layer("fp8_block")
    x, gy = _inputs()
    want, node = step(layer, x, gy)
    got, mode_node, seen = step_under_dispatch_mode(layer, x, gy)
    assert (node, mode_node) == (ONE_OP, PYTHON), f"nodes {node}, under the mode {mode_node}"
    assert seen.count(torch.ops.hybridq.fp8_block_mm.default) == 3, f"GEMMs the mode saw: {seen}"
    assert_same(got, want, "under a TorchDispatchMode")


@pytest.mark.parametrize("how", ["saved_tensors_hooks", "checkpoint"])
def test_saved_tensors_go_through_the_hooks(how):
    """The C++ node's saved tensors (x's columnwise part, the weight's, their scales) go through saved-tensor hooks
    (offload and recompute use them); the gradients are those of the run without the hooks."""
    layer = _layer("fp8_block", bias=False)
    x, gy = _inputs()
    want, _ = step(layer, x, gy)
    got, node, packed = step_under_saved_tensor_hooks(layer, x, gy, how)
    if how == "saved_tensors_hooks":
        assert packed.count(torch.float8_e4m3fn) == 2 and packed.count(torch.float32) == 2, packed
    assert node == ONE_OP, f"under {how} the call ran as {node}"
    assert_same(got, want, f"under {how}")


def test_the_op_refuses_inconsistent_arguments():
    x = torch.randn(128, IN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16)
    e4 = torch.float8_e4m3fn
    casts = (e4, 0.0, True, e4, 2, 0.0, True, e4, 0.0, True)
    op = torch.ops.hybridq.fp8_block_linear
    xr = x.to(e4)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear: input of shape \[128, 256\] and weight of "):
        op(x, w[:, :128], None, None, None, None, None, *casts, True, True, False)
    with pytest.raises(RuntimeError, match="hybridq::fp8_block_linear: w_block_dim must be 1"):
        op(x, w, None, None, None, None, None, e4, 0.0, True, e4, 3, 0.0, True, e4, 0.0, True, True, True, False)
    with pytest.raises(RuntimeError, match="hybridq::fp8_block_linear: x_row given without x_row_scale_inv"):
        op(x, w, None, xr, None, None, None, *casts, True, True, False)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear: a quantized input needs its columnwise part"):
        op(x, w, None, xr, torch.ones(128, 2, device="cuda"), None, None, *casts, True, True, False)
    with pytest.raises(RuntimeError, match="hybridq::fp8_block_quantize: input x must be a CUDA tensor"):
        op(x.cpu(), w.cpu(), None, None, None, None, None, *casts, False, False, False)
    # the weight handed over quantized (FSDP2's gathered weight)
    wr, ws = w.to(e4), torch.ones(1, 2, device="cuda")
    wc, wcs = w.t().contiguous().to(e4), torch.ones(2, 1, device="cuda")
    none4 = (None, None, None, None)
    with pytest.raises(RuntimeError, match="hybridq::fp8_block_linear: w_col given without w_row"):
        op(x, w, None, *none4, *casts, True, True, False, None, None, wc, wcs)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear: a quantized weight needs its columnwise part"):
        op(x, w, None, *none4, *casts, True, True, False, wr, ws)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear: w_row is \[256, 128\]"):
        op(x, w, None, *none4, *casts, False, True, False, wc, wcs)
