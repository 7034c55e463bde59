"""Markers that let the layers recognise the distributed code's weight types without importing it.

- `HighPrecisionSource`: a quantized weight that can also give its high-precision form on demand.
- `QuantizedGatherShard`: a sharded parameter whose all-gather sends bytes laid out by its weight quantizer
  (FSDP2's `HybridWeight`), so that quantizer's format can no longer change.
- `GroupedGatheredForm`: an unsharded `[E, out, in]` grouped weight whose experts are quantized tensors
  (`unbind(0)` gives them), gathered by FSDP2 (`GroupedGatheredWeight`).

`backward_override="high_precision"` needs the weight in high precision in backward. A weight that implements
`HighPrecisionSource` (FSDP2's gathered weight, whose backward unshard gathers it in param_dtype) is saved as a
handle and asked for `high_precision()` in backward; any other quantized weight is dequantized in forward.
Kept in a leaf module so the layers can recognise such weights without importing the distributed code.
"""

from __future__ import annotations

import torch

__all__ = ["ExpertsTensor", "GroupedGatheredForm", "HighPrecisionSource", "QuantizedGatherShard"]


class HighPrecisionSource:
    """Mixin for a QuantizedTensor that can return the weight in high precision (its gather dtype)."""

    def high_precision(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement high_precision()")


class QuantizedGatherShard:
    """Mixin for a sharded parameter that FSDP2 all-gathers in its weight quantizer's format."""


class GroupedGatheredForm:
    """Mixin for an unsharded grouped weight `[E, out, in]` whose `unbind(0)` gives each expert's quantized weight."""

    def ensure_direction(self, direction: str) -> None:
        """Make `direction` of every expert available (a collective when it was not gathered: every rank calls
        it, whatever its token counts)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement ensure_direction()")

    def stacked_part(self, direction: str):
        """(expert 0's part, {tensor name: `[E, ...]` view}) of `direction` when every expert's part tensors are
        equally spaced views of one buffer per kind (no copy), else None."""
        return None


class ExpertsTensor(torch.Tensor):
    """Base of the `[E, out, in]` tensors whose experts are quantized tensors (`_experts`; `_alias()` gives another
    tensor over the same experts): detach / alias give an alias, `unbind(0)` each expert's quantized weight
    (detached: autograd stacks their gradients into a plain `[E, out, in]` gradient); any other op goes to the
    subclass's `_other_op`."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        t = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return t._alias()
        if func is aten.unbind.int and (args[1] if len(args) > 1 else kwargs.get("dim", 0)) == 0:
            return tuple(e._alias() if hasattr(e, "_alias") else e.detach() for e in t._experts)
        return t._other_op(func, args, kwargs)

    def _other_op(self, func, args, kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not support {func}")
