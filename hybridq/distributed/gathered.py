"""The unsharded weight FSDP2 registers on the module between unshard and reshard."""

from __future__ import annotations

import torch

from ..tensor import QuantizedTensor
from ..weight_forms import HighPrecisionSource
from .payload import DIRECTIONS, HIGH_PRECISION

__all__ = ["GatheredWeight"]

aten = torch.ops.aten


class GatheredWeight(QuantizedTensor, HighPrecisionSource):
    """A QuantizedTensor whose directions are filled by the all-gathers (or, for a direction nobody planned
    for, gathered on first use). Its buffers belong to the weight's `WeightState` (`state.py`)."""

    @staticmethod
    def __new__(cls, rowwise, columnwise, *, shape, dtype, state, requires_grad: bool = False):
        self = QuantizedTensor.__new__(cls, rowwise, columnwise, shape=shape, dtype=dtype,
                                       requires_grad=requires_grad)
        self._hq = state
        return self

    def _alias(self) -> "GatheredWeight":
        return GatheredWeight(self._rowwise, self._columnwise, shape=self.shape, dtype=self.dtype, state=self._hq)

    def part(self, direction: str):
        self._hq.ensure(direction)
        return super().part(direction)

    def high_precision(self) -> torch.Tensor:
        """The unsharded weight in the gather dtype (FSDP's param_dtype), for backward_override="high_precision":
        the backward unshard gathers it (or, unplanned, it is gathered on first use)."""
        st = self._hq
        st.create_high_precision()
        st.ensure(HIGH_PRECISION)
        return st.parts[HIGH_PRECISION].data.view(self.shape)

    @property
    def materialized(self) -> str:
        st = self._hq
        return "+".join(d for d in DIRECTIONS
                        if (d != HIGH_PRECISION or st.parts.get(d) is not None) and st.materialized(d))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._alias()
        if func is aten.view.default and tuple(args[1]) == tuple(args[0].shape):
            return args[0]._alias()  # DTensor.to_local() of a tensor-parallel piece (2-D meshes)
        if func is aten.as_strided.default:
            t, size, stride = args[0], args[1], args[2]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if tuple(size) == tuple(t.shape) and tuple(stride) == tuple(t.stride()) and not offset:
                return t._alias()
        return QuantizedTensor.__torch_dispatch__(func, types, args, kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, formats={self.formats}, "
                f"materialized={self.materialized or 'none'})")
