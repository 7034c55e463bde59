"""hybridq's autograd functions have first derivatives only: a backward that asks for a graph of its gradients
(`create_graph=True`) through one raises, naming the layer and its formats.

[Note: no double backward through quantized GEMMs]
A hybridq layer's backward computes its gradients from quantized operands (the forward's saved parts, the output
gradient quantized in its format) or with kernels that have no derivative. Differentiating that computation again
is not the second derivative of anything: a cast's rounding has zero or undefined derivative, scales computed from
amaxes are differentiated as data, a kernel's output is a constant. Left alone, `create_graph=True` recorded those
ops and a second backward returned finite numbers silently (zeros on the per-expert path, the rounding's derivative
elsewhere) or failed deep in a custom op. A node that raises only when the second backward reaches it (torch's
`once_differentiable`) is not enough: its inputs are the gradients, not the layer's inputs, so
`torch.autograd.grad(g, [weight])` prunes it and returns None (or zeros) without running it. So the backward
refuses `create_graph=True` itself, before it computes anything: a graph of gradients through a quantized layer is
only ever asked for to differentiate them. (Compiled graphs: torch.compile refuses double backward itself.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["first_order_only", "describe_quantizers"]


def first_order_only(what: Callable[[Any], str]) -> Callable:
    """Decorate an autograd.Function's `backward(ctx, *grads)`: under `create_graph=True` (grad mode on inside a
    backward) it raises NotImplementedError, `what(ctx)` naming the layer and its formats ([Note: no double backward
    through quantized GEMMs])."""

    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def run(ctx, *grads):
            if torch.is_grad_enabled():
                raise NotImplementedError(
                    f"hybridq: {what(ctx)} has no second derivative: its backward computes the gradients from "
                    f"quantized operands (or with a kernel that has no derivative), so it cannot run under "
                    f"create_graph=True (double backward, gradient penalties through it); keep the layers whose "
                    f"second derivative you need out of the conversion (module_filter_fn)")
            return backward(ctx, *grads)
        return run

    return wrap


def describe_quantizers(quantizers: dict) -> str:
    """`input ..., weight ..., grad_output ...` of a layer's quantizers (for messages)."""
    return ", ".join(f"{t} {q.describe()}" for t, q in quantizers.items() if q is not None)
