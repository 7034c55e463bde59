"""A quantized weight inside torch.compile's graph as a handle: a weight FSDP2 all-gathered quantized, or a quantized
parameter (shared by the compiled Linear, nn/compiled_linear.py, and the compiled GroupedLinear,
nn/compiled_grouped.py).

The gathered weight (`GatheredWeight` of a Linear, `GroupedGatheredWeight` of a grouped weight) and a Linear's
quantized parameter (`HeldQuantizedWeight`, nn/quantized_params.py) are `HandledWeight`s: each flattens for dynamo
to one inner tensor, its handle: a small int64 CPU tensor naming the weight's state (or the parameter itself) in a
table here (`weight_handle`). So a graph neither copies nor saves the quantized bytes, whose storage FSDP2 frees at
reshard and refills at the backward unshard, and which an optimizer rewrites in place between steps. A compiled
layer calls its custom op on the weight itself (so that autograd reaches it); while compile traces, the weight's
__torch_dispatch__ hands that call to `handle_ops`, which turns it into the op's `gathered_` twin taking the handle
instead (registered with `redirect`); the twin reads the weight's parts through the handle (`weight_of`) when it
runs.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch

__all__ = ["HandledWeight", "handle_ops", "handled_weight", "redirect", "redirect_to_handle", "weight_handle", "weight_of"]

# weights read through a handle: handle value -> (weak reference to its owner, how the owner gives the weight)
_HANDLES: dict[int, tuple[weakref.ref, Callable]] = {}
_NEXT_HANDLE = itertools.count()
# custom op (OpOverload) -> what it becomes on a handled weight: fn(args, kwargs) -> the op's result
_REDIRECTS: dict = {}


def weight_handle(owner, weight_of: Callable) -> torch.Tensor:
    """A new handle (an int64 CPU scalar: the inner tensor a weight subclass flattens to for dynamo) through which
    the compiled ops find `weight_of(owner)`, the quantized weight as it is when they run. Kept while `owner`
    lives."""
    n = next(_NEXT_HANDLE)
    entry = _HANDLES[n] = (weakref.ref(owner, lambda _, n=n: _HANDLES.pop(n, None)), weight_of)
    handle = torch.tensor(n, dtype=torch.int64)
    # (the entry kept on the handle too, with the handle's version: the compiled ops get this very tensor at every
    # call, and reading its value is an aten op -- ~3-5 us of host on the GPU machine, every gathered op call)
    handle._hq_entry = (handle._version, entry)
    return handle


def weight_of(handle: torch.Tensor):
    """The weight `handle` names, as it is now (raises once its owner is gone)."""
    kept = handle.__dict__.get("_hq_entry")
    entry = kept[1] if kept is not None and kept[0] == handle._version else _HANDLES.get(int(handle.item()))
    owner = entry[0]() if entry is not None else None
    if owner is None:
        raise RuntimeError(f"hybridq compiled layer: the quantized weight of handle {int(handle.item())} is gone "
                           f"(its module was deleted while a compiled graph still ran it)")
    return entry[1](owner)


def handled_weight(weight: torch.Tensor) -> bool:
    """Whether `weight` enters a compiled graph as a handle. Traced by dynamo."""
    return isinstance(weight, HandledWeight)


def redirect(op, fn: Callable) -> None:
    """Register what the custom op `op` (its default overload) becomes when called on a handled weight while
    compile traces: `fn(args, kwargs)`, which calls the op's `gathered_` twin with the handle."""
    _REDIRECTS[op] = fn


def redirect_to_handle(op, twin, weight_arg: int, with_shape: bool) -> None:
    """`redirect` custom op `op` (the decorated function) to `twin`, its `gathered_` op: the same arguments with the
    weight (argument `weight_arg`) replaced by its handle, and with `with_shape` the weight's shape and dtype
    appended (the twin's fake builds the gradient from them)."""

    def call(args, kwargs):
        bound = bound_args(op, args, kwargs)
        weight = bound[weight_arg]
        bound[weight_arg] = weight._handle
        return twin(*bound, *((list(weight.shape), weight.dtype) if with_shape else ()))

    redirect(op._opoverload, call)


def handle_ops(func, args, kwargs):
    """The redirected call of `func` (a handled weight's __torch_dispatch__ asks first), or None for any other op."""
    fn = _REDIRECTS.get(func)
    return fn(args, kwargs) if fn is not None else None


def bound_args(op, args, kwargs) -> list:
    """A custom op's arguments in schema order."""
    names = [a.name for a in op._opoverload._schema.arguments]
    return list(args) + [kwargs[n] for n in names[len(args):]]


class HandledWeight:
    """Mixin of a wrapper-subclass weight whose state `_hq` (the weight's per-parameter FSDP state, with the
    unsharded weight as `gathered`) is what the compiled ops read: under torch.compile the weight is its handle.
    The subclass gives `_traced_fields()`: the attributes a traced stand-in (no parts, no state) sets to None. (A
    quantized parameter, which has no such state, gives its own `_handle`: one naming the parameter.)"""

    _hq: object | None  # set by the subclass (None on a traced stand-in)
    _traced_handle: torch.Tensor

    @property
    def _handle(self) -> torch.Tensor:
        """The int64 tensor naming this weight's state in the compiled ops' table (made on first use)."""
        if self._hq is None:
            return self._traced_handle
        h = self._hq.__dict__.get("compile_handle")
        if h is None:
            h = self._hq.compile_handle = weight_handle(self._hq, lambda st: st.gathered)
        return h

    @classmethod
    def _traced(cls, handle: torch.Tensor, shape, dtype, device):
        """What compile traces with: the weight's shape, dtype and device, and its handle (no parts, no state)."""
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        for name in cls._traced_fields():
            setattr(self, name, None)
        self._hq = None
        self._traced_handle = handle
        return self

    @classmethod
    def _traced_fields(cls) -> tuple[str, ...]:
        return ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = handle_ops(func, args, kwargs)  # a compiled layer's ops, traced: they take the handle
        if out is not None:
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)  # the weight's own ops (next in the MRO)

    def _traced_alias(self):
        return type(self)._traced(self._traced_handle, self.shape, self.dtype, self.device)

    def __tensor_flatten__(self):
        # (the context holds nothing per layer: blocks of one configuration share one compiled graph)
        return ["_handle"], (self.dtype, self.device)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls._traced(inner["_handle"], outer_size, *ctx)
