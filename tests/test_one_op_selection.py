"""Which eager fast-path calls run as the extension's one op `hybridq::fp8_linear` (nn/float8_graph.py `_one_op`):
per-tensor FP8 on a CUDA device, on a plain weight and on FSDP2's gathered one (outside inference mode, where no
autograd kernel would keep the op away from the gathered weight's __torch_dispatch__), never under a
TorchDispatchMode, never for block scaling or on the CPU; and what the op is handed of a gathered weight: the
columnwise part's own tensors themselves (by reference: the backward unshard refills those tensors in place).

CPU only: the CUDA tensors are fake (FakeTensorMode makes CUDA tensors without a GPU; the decision reads only
devices and the modes active). The one op's results are tests/test_fp8_linear_op.py (plain weights) and
tests/distributed/test_fsdp_one_op.py (FSDP2's gathered weights), on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hybridq.formats import Float8BlockQuantizer, Float8Quantizer, Float8TensorPart
from hybridq.nn import float8_graph
from hybridq.nn.float8_graph import graph_spec

PER_TENSOR = graph_spec({r: Float8Quantizer() for r in ("input", "weight", "grad_output")}, False)
BLOCKS = graph_spec({r: Float8BlockQuantizer() for r in ("input", "weight", "grad_output")}, False)


def _tensors(device: str) -> dict:
    """x, and a gathered weight's parts as `_gathered_parts` gives them, on `device` (CUDA: fake tensors)."""
    def make():
        e4 = torch.float8_e4m3fn
        col = Float8TensorPart(rows=64, cols=32, columnwise=True, data=torch.empty(64, 32, dtype=e4, device=device),
                               scale_inv=torch.ones(1, device=device))
        return {"x": torch.empty(4, 8, 64, device=device),
                "w_parts": (torch.empty(32, 64, dtype=e4, device=device), torch.ones(1, device=device), col)}
    if device == "cpu":
        return make()
    with FakeTensorMode():
        return make()


class _Counting(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("weight", ["plain", "gathered"])
def test_per_tensor_call_on_cuda_takes_the_one_op(weight):
    t = _tensors("cuda")
    w_parts = t["w_parts"] if weight == "gathered" else None
    assert float8_graph._one_op(t["x"], PER_TENSOR, w_parts), f"a per-tensor call on a {weight} weight (CUDA) " \
                                                               f"did not take the one op"


@pytest.mark.parametrize("weight", ["plain", "gathered"])
def test_a_dispatch_mode_keeps_the_python_node(weight):
    t = _tensors("cuda")
    w_parts = t["w_parts"] if weight == "gathered" else None
    with _Counting():
        taken = float8_graph._one_op(t["x"], PER_TENSOR, w_parts)
    assert not taken, f"{weight} weight: the one op ran under a TorchDispatchMode (it would not see the quantize ops)"


def test_inference_mode_keeps_a_gathered_weight_on_the_python_node():
    t = _tensors("cuda")
    with torch.inference_mode():
        gathered = float8_graph._one_op(t["x"], PER_TENSOR, t["w_parts"])
        plain = float8_graph._one_op(t["x"], PER_TENSOR, None)
    assert not gathered, "inference mode: the one op was taken on a gathered weight (no autograd kernel keeps it " \
                         "away from the weight's __torch_dispatch__)"
    assert plain, "inference mode: a plain weight no longer takes the one op (its backend kernel runs the forward)"


@pytest.mark.parametrize("weight", ["plain", "gathered"])
@pytest.mark.parametrize("why", ["block scaling", "CPU"])
def test_other_calls_keep_the_python_node(why, weight):
    t = _tensors("cpu" if why == "CPU" else "cuda")
    spec = BLOCKS if why == "block scaling" else PER_TENSOR
    w_parts = t["w_parts"] if weight == "gathered" else None
    assert not float8_graph._one_op(t["x"], spec, w_parts), f"{why}, {weight} weight: the one op was taken"


def test_the_op_holds_the_gathered_columnwise_tensors_themselves():
    wr, wrs, col = _tensors("cpu")["w_parts"]
    got = float8_graph._op_weight_parts((wr, wrs, col))
    want = (wr, wrs, col.data, col.scale_inv)
    assert all(a is b for a, b in zip(got, want)), \
        "the op is not handed the gathered part's own tensors (a copy would miss the backward unshard's refill)"
    assert float8_graph._op_weight_parts((wr, wrs, None)) == (wr, wrs, None, None), \
        "without dgrad the op must get no columnwise part"
    assert float8_graph._op_weight_parts(None) == (None,) * 4, "a plain weight must hand the op no weight parts"
