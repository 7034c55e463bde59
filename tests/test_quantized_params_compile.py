"""Quantized parameters (hybridq.quantized_model_init / quantize_parameters) inside torch.compile's graph: a Linear
whose weight is held quantized enters the graph as its handle (nn/weight_handle.py, nn/quantized_params.py's
HeldQuantizedWeight), with no graph break, bitwise the eager layer forward and backward; the compiled ops read the
parameter's bytes when they run, so an optimizer's in-place update between steps is what the next step reads. (A
ZeroAdamW training run on a gloo rank: tests/distributed/test_zero_adamw_compile.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.nn.quantized_params import HeldQuantizedWeight, quantized_param_info

from _compare import assert_bitwise
from test_compile import _assert_same, _grads, _ops_in_graphs

PRESETS = [p for p in hq.preset_names() if p != "fp8_delayed"]  # (the quantized-parameter tests' list)
K, N = 128, 256  # whole 128x128 tiles, MXFP8 / NVFP4 blocks


class Block(nn.Module):
    """Two Linears built under quantized_model_init (bf16, as trained), a bias on the first."""

    def __init__(self, recipe, act=nn.GELU()):
        super().__init__()
        with hq.quantized_model_init():
            self.up = hq.Linear(K, N, recipe=recipe, name="up", dtype=torch.bfloat16)
            self.down = hq.Linear(N, K, bias=False, recipe=recipe, name="down", dtype=torch.bfloat16)
        self.act = act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _block(preset: str, override: str | None = None, **kw) -> Block:
    torch.manual_seed(0)
    block = Block(hq.recipe(preset, backward_override=override), **kw)
    assert isinstance(block.up.weight, HeldQuantizedWeight) and quantized_param_info(block.up.weight) is not None
    return block


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 32, K, dtype=torch.bfloat16)


@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
@pytest.mark.parametrize("preset", PRESETS)
def test_quantized_parameters_in_graph_are_bitwise_eager(preset, override):
    """fullgraph=True (a graph break would raise): the output, the input's and every parameter's gradient bit for
    bit the eager layers' (the weights' gradients plain high-precision tensors, as eager gives them)."""
    block = _block(preset, override)
    torch._dynamo.reset()
    got = _grads(block, _x(), torch.compile(block, fullgraph=True, backend="aot_eager"))
    want = _grads(block, _x(), block)
    _assert_same(got, want, f"{preset}, backward_override={override}")
    for n in ("up.weight", "down.weight"):
        assert type(got[2][n]) is torch.Tensor and got[2][n].dtype == torch.bfloat16, f"{n}: grad {got[2][n]!r}"


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd"])
def test_quantized_parameters_are_in_the_graph(preset):
    """No graph break: both Linears are the compiled ops of the one graph."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_block(preset))(_x())
    assert explained.graph_break_count == 0 and len(explained.graphs) == 1, f"{preset}: {explained}"
    assert _ops_in_graphs(explained) == 2, f"{preset}: the quantized-parameter Linears are not in the graph"


@pytest.mark.parametrize("preset", ["fp8_block", "nvfp4"])
def test_quantized_parameters_in_graph_with_inductor(preset):
    """Inductor around the ops (the Linears back to back: Inductor may round element-wise math between them
    differently from eager; the bias gradient is a sum it may order differently)."""
    block = _block(preset, act=nn.Identity())
    torch._dynamo.reset()
    got = _grads(block, _x(), torch.compile(block, fullgraph=True))
    _assert_same(got, _grads(block, _x(), block), f"{preset}, inductor", reordered_bias_sums=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", PRESETS)
def test_quantized_parameters_in_graph_on_cuda_are_bitwise_eager(preset):
    """On the GPU (the parameters moved there by Module.cuda): the kernels' and GEMMs' fakes trace, Inductor
    compiles around the ops, results bitwise the eager layers'."""
    block = _block(preset, act=nn.Identity()).cuda()
    assert isinstance(block.up.weight, HeldQuantizedWeight) and block.up.weight.is_cuda
    x = _x().cuda()
    torch._dynamo.reset()
    got = _grads(block, x, torch.compile(block, fullgraph=True))
    _assert_same(got, _grads(block, x, block), f"{preset} on CUDA", reordered_bias_sums=True)


@pytest.mark.parametrize("case", ["no_grad", "weights_frozen"])
def test_quantized_parameters_in_graph_compute_only_the_gradients_asked_for(case):
    block = _block("mxfp8")
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    if case == "no_grad":
        with torch.no_grad():
            assert_bitwise(compiled(_x()), block(_x()), "no_grad output")
        return
    for p in block.parameters():
        p.requires_grad_(False)
    outs = []
    for call in (compiled, block):
        x = _x().requires_grad_()
        y = call(x)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad))
    assert all(p.grad is None for p in block.parameters()), "a frozen parameter got a gradient"
    assert_bitwise(outs[0][0], outs[1][0], "output, weights frozen")
    assert_bitwise(outs[0][1], outs[1][1], "grad input, weights frozen")


def _refresh(block: Block, step: int) -> None:
    """An optimizer step's effect on the weights: new fp32 masters quantized into the parameters in place
    (quantize_master_weights, one process owning every element)."""
    weights = [block.up.weight, block.down.weight]
    torch.manual_seed(100 + step)
    masters = [w.dequantize(torch.float32).reshape(-1) + 0.05 * torch.randn(w.numel()) for w in weights]
    hq.distributed.quantize_master_weights(weights, masters, [0] * len(weights))


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "mxfp8_fwd_nvfp4_bwd"])
def test_compiled_step_reads_the_weights_the_optimizer_wrote(preset):
    """After quantize_master_weights rewrote the parameters' bytes in place, the compiled block computes what the
    eager block computes on the new weights (and not what it computed before: the graph holds no copy)."""
    block = _block(preset)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    before = _grads(block, _x(), compiled)
    for step in range(2):
        ptrs = [block.up.weight.rowwise.data.data_ptr(), block.down.weight.rowwise.data.data_ptr()]
        _refresh(block, step)
        assert ptrs == [block.up.weight.rowwise.data.data_ptr(), block.down.weight.rowwise.data.data_ptr()], \
            "the refresh was meant to write the parameters in place"
        got = _grads(block, _x(), compiled)
        assert not torch.equal(got[0], before[0]), f"{preset}, step {step}: the output did not change with the weights"
        _assert_same(got, _grads(block, _x(), block), f"{preset}, after refresh {step}")
        before = got


def test_a_copied_model_reads_its_own_weights():
    """copy.deepcopy gives the copy a handle of its own: the two models share one compiled graph (one
    configuration) and each reads its own parameters."""
    block = _block("fp8_tensorwise")
    torch._dynamo.reset()
    _assert_same(_grads(block, _x(), torch.compile(block, backend="aot_eager")), _grads(block, _x(), block),
                 "original")  # (its handles made: the copy is taken after)
    twin = copy.deepcopy(block)
    assert isinstance(twin.up.weight, HeldQuantizedWeight)
    _refresh(twin, 0)
    assert not torch.equal(block(_x()), twin(_x())), "the copy's refresh changed nothing"
    for m, what in ((twin, "copy"), (block, "original, after the copy's refresh")):
        _assert_same(_grads(m, _x(), torch.compile(m, backend="aot_eager")), _grads(m, _x(), m), what)


def test_the_parameter_keeps_its_type_through_moves_and_state_dict():
    """detach, clone, Module.to / _apply and load_state_dict(assign=True) keep a HeldQuantizedWeight (else the
    layer would fall back to a graph break)."""
    block = _block("mxfp8")
    block._apply(lambda t: t.to("cpu", copy=True))  # (what Module.to does with a move: new Parameters)
    assert type(block.up.weight.detach()) is HeldQuantizedWeight
    assert type(block.up.weight.clone()) is HeldQuantizedWeight
    fresh = _block("mxfp8")
    fresh.load_state_dict(block.state_dict(), assign=True)
    for layer in (block.up, fresh.up, fresh.down):
        assert type(layer.weight) is HeldQuantizedWeight, f"{layer.name}: {type(layer.weight).__name__}"
        assert isinstance(layer.weight, nn.Parameter) and quantized_param_info(layer.weight) is not None
