"""hybridq's Python custom ops (the compiled Linear, GroupedLinear, norms and SwiGLU) registered on the dispatcher
directly, without `torch.library.custom_op`'s per-call Python layers.

A `torch.library.custom_op` runs three Python layers around its body at every call: an Autograd kernel (even for an
op without an autograd formula, or called without grad: it inspects the schema and the arguments), a backend
kernel that checks the outputs' aliasing, and a `torch._disable_dynamo` wrapper. Measured on a CPU: ~20 us per call
without grad vs ~6 us for the same body registered here (~55-80 us on the H200 machine's host, 72 calls per step of
the compiled MoE job). Inside a compiled graph (where these ops run at every step) nothing of that is needed:
AOTAutograd already split forward and backward, and the compiled code runs with dynamo disabled.

`plain_op` defines the op from the body's signature (the schema `custom_op` would infer), registers the body as
its CompositeExplicitAutograd kernel, keeps the outputs' aliasing check (a C++ call: outputs may alias neither the
inputs nor one another, the rule `custom_op` enforces), and gives the same `register_fake` / `register_autograd`
(torch.library's, on this op: the Autograd kernel then exists only for ops with a formula).

The aliasing check is handed the arguments that can hold a tensor (by the schema: Tensor, Tensor?, Tensor[] ...)
and the outputs: the same answer as on every argument (a string, an int list or a dtype aliases nothing), at about
half the cost -- the C++ check converts each argument it is handed (the gathered Linear ops: ~2.4 -> ~1.3 us per
call on a CPU, 14 arguments of which 4 hold tensors).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..torch_private import check_output_aliasing

__all__ = ["PlainOp", "plain_op"]

_LIB = torch.library.Library("hybridq", "FRAGMENT")  # (kept alive: a Library's registrations die with it)


class PlainOp:
    """An op `plain_op` registered: callable (the op itself), with `register_fake` and `register_autograd`."""

    def __init__(self, qualname: str, fn: Callable):
        namespace, name = qualname.split("::")
        if namespace != "hybridq":
            raise ValueError(f"plain_op {qualname}: hybridq's ops live in the 'hybridq' namespace")
        self.qualname, self.__doc__, self.__wrapped__ = qualname, fn.__doc__, fn
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
        self._opoverload = getattr(getattr(torch.ops.hybridq, name), "default")
        # the arguments that can hold a tensor, by position and by name (the dispatcher hands the body positional
        # arguments, trailing ones left at their defaults dropped, and keyword-only ones by name)
        held = [(i, a.name) for i, a in enumerate(self._opoverload._schema.arguments) if "Tensor" in str(a.type)]
        positions, names = tuple(i for i, _ in held), frozenset(n for _, n in held)

        def kernel(*args, **kwargs):
            result = fn(*args, **kwargs)
            n = len(args)
            check_output_aliasing(qualname, tuple([args[i] for i in positions if i < n]),
                                  {k: v for k, v in kwargs.items() if k in names} if kwargs else kwargs, result)
            return result

        _LIB.impl(name, kernel, "CompositeExplicitAutograd")

    def __call__(self, *args, **kwargs):
        return self._opoverload(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable | None = None) -> None:
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=_LIB)


def plain_op(qualname: str) -> Callable[[Callable], PlainOp]:
    """Decorator: the function (type-hinted as `torch.library.custom_op` requires; no argument mutated) as the
    dispatcher op `qualname` ("hybridq::name")."""
    return lambda fn: PlainOp(qualname, fn)
