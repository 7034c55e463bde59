"""One Linear layer's forward + backward on whichever eager path it takes, and the comparisons the tests of those
paths make (not a test module): the general path (linear_function.py), float8_graph's Python node and the one-op C++
nodes (hybridq::fp8_linear, hybridq::fp8_block_linear). Users: tests/test_eager_fast_path.py,
tests/test_fp8_linear_op.py, tests/test_fp8_block_linear_op.py.

A step's results are [output, grad_input, grad_weight, grad_bias] (None where there is none); its node is the name
of the output's autograd node (`node_name`), which says which path ran."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.known_amax import remember_amax

from _compare import assert_bitwise

RESULTS = ("output", "grad_input", "grad_weight", "grad_bias")


def node_name(y: torch.Tensor) -> str | None:
    """The name of y's autograd node: its Python class, or for a C++ node (class CppFunction) its C++ name."""
    if y.grad_fn is None:
        return None
    name = type(y.grad_fn).__name__
    return y.grad_fn.name() if name == "CppFunction" else name


def step(layer, x: torch.Tensor, gy: torch.Tensor, x_grad: bool = True, **kw) -> tuple[list, str | None]:
    """(results, node) of forward + backward (backward where the output needs a gradient); kw go to the layer."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x_grad)
    y = layer(x, **kw)
    node = node_name(y)
    if y.requires_grad:
        y.backward(gy)
    return [y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad], node


def assert_same(got: list, want: list, what: str, nan_payload: bool = False, path: str = "the one-op path") -> None:
    """Two steps' results bit for bit (`path`: the side `got` ran on, for the message)."""
    for n, a, b in zip(RESULTS, got, want):
        assert (a is None) == (b is None), f"{what}: {n} is {'missing' if a is None else 'there'} on {path}"
        if a is not None:
            assert_bitwise(a, b, f"{what}: {n}", nan_payload=nan_payload)


def put_non_finite(t: torch.Tensor) -> None:
    """inf, -inf and NaN at three places of t (in place)."""
    t.view(-1)[3] = float("inf")
    t.view(-1)[100] = float("-inf")
    t.view(-1)[257] = float("nan")


def step_sharing_input(layers: list, x: torch.Tensor, gy: torch.Tensor) -> tuple[list, list]:
    """Layers reading one tensor (q, k, v): (their outputs, x's gradient and their weights' gradients, in one list;
    their nodes) of one forward + backward of them all."""
    xg = x.clone().requires_grad_()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    ys = [layer(xg) for layer in layers]
    torch.autograd.backward(ys, [gy] * len(layers))
    return [y.detach() for y in ys] + [xg.grad] + [layer.weight.grad for layer in layers], [node_name(y) for y in ys]


def assert_one_quantization_shared_by_the_op(layers: list, x: torch.Tensor, gy: torch.Tensor, monkeypatch,
                                             node: str) -> None:
    """Layers reading one tensor (q, k, v), each on the one-op path (`node`): with sharing on, x is quantized once
    outside the op (by q: `float8_graph._quantize`) and every op reads those parts; every result is bitwise the run
    without sharing."""
    from hybridq.nn import float8_graph
    from hybridq.nn.linear import shared_input_quantization
    want, nodes = step_sharing_input(layers, x, gy)
    calls = []
    quantize = float8_graph._quantize
    monkeypatch.setattr(float8_graph, "_quantize", lambda *a, **kw: calls.append(a[0].shape) or quantize(*a, **kw))
    with shared_input_quantization(True):
        got, shared_nodes = step_sharing_input(layers, x, gy)
    assert nodes == shared_nodes == [node] * len(layers), f"nodes {nodes}, with sharing {shared_nodes}"
    assert len(calls) == 1, f"x was quantized outside the op {len(calls)} times, expected once (by q): {calls}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"result {i} with the input shared")


def step_with_known_amax(layer, x: torch.Tensor, gy: torch.Tensor, fast: bool) -> tuple[list, str | None]:
    """([output, grad_input, grad_weight], node) of a step whose input carries a known max|x| (a norm's) 3x its
    real one, on the fast path (`fast`) or the general path."""
    with eager_fast_path(fast):
        xg = x.clone().requires_grad_()
        remember_amax(xg, xg.detach().abs().amax() * 3)
        layer.zero_grad(set_to_none=True)
        y = layer(xg)
        node = node_name(y)
        y.backward(gy)
    return [y.detach(), xg.grad, layer.weight.grad], node


def step_under_dispatch_mode(layer, x: torch.Tensor, gy: torch.Tensor) -> tuple[list, str | None, list]:
    """(results, node, the ops it saw) of a step under a TorchDispatchMode that counts the ops (as selective
    checkpointing's policy or an op counter would see them)."""
    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        got, node = step(layer, x, gy)
    return got, node, seen


def step_under_saved_tensor_hooks(layer, x: torch.Tensor, gy: torch.Tensor, how: str) -> tuple[list, str | None,
                                                                                                  list]:
    """(results without grad_bias, node, the dtypes the pack hook saw) of a step whose forward runs under
    saved-tensor hooks that move what is saved to the CPU and back (how="saved_tensors_hooks": offload), or under
    non-reentrant activation checkpointing (how="checkpoint": recompute; the hook saw nothing then)."""
    packed = []

    def pack(t):
        packed.append(t.dtype)
        return t.cpu()

    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    if how == "saved_tensors_hooks":
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to(x.device)):
            y = layer(xg)
    elif how == "checkpoint":
        y = checkpoint(layer, xg, use_reentrant=False)
    else:
        raise ValueError(f"how must be 'saved_tensors_hooks' or 'checkpoint', got {how!r}")
    node = node_name(y)
    y.backward(gy)
    return [y.detach(), xg.grad, layer.weight.grad, None], node, packed
