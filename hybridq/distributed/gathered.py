"""The unsharded weight FSDP2 registers on the module between unshard and reshard: a Linear's `GatheredWeight`, a
grouped weight's `GroupedGatheredWeight` (whose `unbind(0)` gives each expert's `GatheredWeight`); and the steps
that take FSDP2's all-gather output to the parts they hold (`received`, `complete_parts`)."""

from __future__ import annotations

import torch

from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..nn.weight_handle import HandledWeight
from ..tensor import QuantizedTensor
from ..torch_private import current_stream
from ..weight_forms import ExpertsTensor, GroupedGatheredForm, HighPrecisionSource
from .payload import DIRECTIONS, HIGH_PRECISION
from .plan import GatherPlan

__all__ = ["GatheredWeight", "GroupedGatheredWeight", "complete_parts", "keep_for_stream", "received"]

aten = torch.ops.aten


def _whole_view(args, kwargs) -> bool:
    """as_strided(t, size, stride, offset) onto t's own shape and strides (how FSDP2 views the unsharded
    parameter): an alias."""
    t, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    return tuple(size) == tuple(t.shape) and tuple(stride) == tuple(t.stride()) and not offset


# QuantizedTensor's ops that read the bytes of every part (copies); detach, alias and views read none
_READS_ALL = (aten.clone.default, aten._to_copy.default, aten._pin_memory.default)


class GatheredWeight(HandledWeight, QuantizedTensor, HighPrecisionSource):
    """A QuantizedTensor whose directions are filled by the all-gathers (or, for a direction nobody planned
    for, gathered on first use). Its buffers belong to the weight's `WeightState` (`state.py`, `buffers.py`).

    Under torch.compile it is its handle (`_handle`, nn/weight_handle.py): dynamo flattens it to that one int64
    tensor, the traced stand-in holds only the handle, and a compiled Linear's ops read the parts through it when
    they run (after FSDP2's unshard of forward or backward), never copying or saving the gathered bytes."""

    @staticmethod
    def __new__(cls, rowwise, columnwise, *, shape, dtype, state, requires_grad: bool = False):
        self = QuantizedTensor.__new__(cls, rowwise, columnwise, shape=shape, dtype=dtype,
                                       requires_grad=requires_grad)
        self._hq = state
        return self

    def _alias(self) -> "GatheredWeight":
        if self._hq is None:
            return self._traced_alias()
        return GatheredWeight(self._rowwise, self._columnwise, shape=self.shape, dtype=self.dtype, state=self._hq)

    @classmethod
    def _traced_fields(cls) -> tuple[str, ...]:
        return ("_rowwise", "_columnwise")

    # [Note: a direction pending the backward unshard]
    # A direction the gather plan defers (plan.py: with reshard_after_forward, dgrad's columnwise form, or the
    # high-precision weight of backward_override="high_precision") is filled in place by FSDP2's backward unshard;
    # until then its own tensors keep their shape over a storage FSDP2 resized to 0, and a kernel or torch op reading
    # them reads freed memory (on the CPU a segfault; on a GPU a crash or a wrong result), whether autograd is on (a
    # read in a training forward) or off (an eval forward: no backward unshard comes at all). Two ways in, so:
    # - `part(d)` (and what reads through it: `dequantize`, the `rowwise` / `columnwise` properties, the copies of
    #   `_READS_ALL`, `high_precision`, a grouped weight's `ensure_direction` / `stacked_part`) is a read:
    #   `WeightState.check_readable` raises, naming the weight and the direction, before anything reads the memory;
    # - `held_part(d)` takes the part by reference for the backward whose unshard fills it (a Linear's forward keeps
    #   dgrad's form: linear_function._only, float8_graph._gathered_parts): allowed, nothing is read until then.
    # The check costs one membership test of the plan's deferred directions (never the rowwise form) per `part`.
    def part(self, direction: str):
        """The part in `direction`, to be read now: gathered first if nobody planned it; a direction the backward
        unshard has yet to fill raises ([Note: a direction pending the backward unshard])."""
        st = self._hq
        st.ensure(direction)
        if direction in st.deferred:  # (one test on the hot path: the rowwise form is never deferred)
            st.check_readable(direction)
        return super().part(direction)

    def held_part(self, direction: str):
        """The part in `direction` taken by reference for the backward whose unshard fills it (a Linear's forward
        keeps dgrad's columnwise form so), not read now: allowed before that unshard, unlike `part`."""
        self._hq.ensure(direction)
        return super().part(direction)

    @property
    def rowwise(self):
        """The rowwise part, to be read now (as `part`), or None where the format has none."""
        return self.part(ROWWISE) if self._rowwise is not None else None

    @property
    def columnwise(self):
        """The columnwise part, to be read now (as `part`: it raises while the backward unshard has yet to fill it),
        or None where the format has none for this weight."""
        return self.part(COLUMNWISE) if self._columnwise is not None else None

    def high_precision(self) -> torch.Tensor:
        """The unsharded weight in the gather dtype (FSDP's param_dtype), for backward_override="high_precision":
        the backward unshard gathers it (or, unplanned, it is gathered on first use); read before that unshard, it
        raises as `part` does. (Its forward keeps the weight itself for backward, not this.)"""
        st = self._hq
        if HIGH_PRECISION in st.deferred:  # (before its buffer is made: made now, it would hold no values)
            st.check_readable(HIGH_PRECISION)
        st.create_high_precision()
        st.ensure(HIGH_PRECISION)
        return st.parts[HIGH_PRECISION].data.view(self.shape)

    def __reduce_ex__(self, protocol):
        if self._hq is not None:
            self._readable()  # (pickled as its parts' bytes)
        return super().__reduce_ex__(protocol)

    def _readable(self) -> "GatheredWeight":
        """Itself, every direction it holds made readable (`part`): before an op reads all their bytes."""
        for d, p in ((ROWWISE, self._rowwise), (COLUMNWISE, self._columnwise)):
            if p is not None:
                self.part(d)
        return self

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
        if func is aten.as_strided.default and _whole_view(args, kwargs):
            return args[0]._alias()
        if func in _READS_ALL and isinstance(args[0], GatheredWeight) and args[0]._hq is not None:
            args[0]._readable()  # (a copy reads every part's bytes: none may be pending the backward unshard)
        return super().__torch_dispatch__(func, types, args, kwargs)  # HandledWeight's, then QuantizedTensor's

    def __repr__(self, *, tensor_contents=None) -> str:
        if self._hq is None:
            return f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, traced)"
        return (f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, formats={self.formats}, "
                f"materialized={self.materialized or 'none'})")


class GroupedGatheredWeight(HandledWeight, GroupedGatheredForm, ExpertsTensor):
    """The unsharded grouped weight FSDP2 registers on the module between unshard and reshard: `[E, out, in]`
    whose `unbind(0)` gives each expert's `GatheredWeight` (a QuantizedTensor; autograd stacks the experts'
    weight gradients into a plain `[E, out, in]` gradient). Other ops raise: the experts are quantized.

    Under torch.compile it is its handle, as a GatheredWeight (nn/weight_handle.py): a compiled GroupedLinear's ops
    read the experts' stacked buffers through it when they run (nn/compiled_grouped.py)."""

    @staticmethod
    def __new__(cls, experts, *, shape, dtype, state):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=experts[0].device,
                                                   requires_grad=False)
        self._experts = list(experts)
        self._hq = state
        return self

    def _alias(self) -> "GroupedGatheredWeight":
        if self._hq is None:
            return self._traced_alias()
        return GroupedGatheredWeight(self._experts, shape=self.shape, dtype=self.dtype, state=self._hq)

    @classmethod
    def _traced_fields(cls) -> tuple[str, ...]:
        return ("_experts",)

    def ensure_direction(self, direction: str) -> None:
        """Make `direction` of every expert readable now (a collective where it was not gathered yet: every rank
        asks); raises where the backward unshard has yet to fill it ([Note: a direction pending the backward
        unshard])."""
        if self._hq.slabs and direction in (ROWWISE, COLUMNWISE):
            # stacked buffers: the experts are gathered, filled and freed together, so expert 0 speaks for all
            self._experts[0].part(direction)
            return
        for g in self._experts:
            g.part(direction)

    def stacked_part(self, direction: str):
        """(expert 0's part, {tensor name: `[E, ...]`}) of `direction` made available (as `ensure_direction`): the
        experts' tensors as one view of their stacked buffer each (`GroupedWeightState.stacked`), or None."""
        self.ensure_direction(direction)
        return self._hq.stacked(direction)

    def _other_op(self, func, args, kwargs):
        if func is aten.as_strided.default and _whole_view(args, kwargs):
            return self._alias()
        name = self._hq.name if self._hq is not None else "traced by torch.compile"
        raise TypeError(f"GroupedGatheredWeight (the unsharded quantized weight {name}) supports only "
                        f"unbind(0) (each expert's quantized weight), detach and alias; got {func}")

    def __repr__(self, *, tensor_contents=None) -> str:
        if self._hq is None:
            return f"GroupedGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, traced)"
        return (f"GroupedGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"experts={len(self._experts)}, formats={self._experts[0].formats})")


def keep_for_stream(replicated) -> None:
    """Keep the replicated tensors alive for the current stream.

    fsdp_pre_all_gather ran on FSDP2's all-gather copy-in stream: the replicated tensors (per-tensor scales,
    tile-scale grids, global amaxes) were allocated there and are read here on the current stream. Without this, once
    the metadata is dropped the caching allocator hands their blocks to the next weight's pre-all-gather (copy-in
    stream) while this stream's reads are still queued. (once per storage: the experts' scales of a batched gather are
    views of one tensor, and record_stream marks the whole block)"""
    cuda = [t for t in replicated if t.is_cuda]
    if cuda:
        stream = current_stream(cuda[0].device)
        for t in {t.untyped_storage().data_ptr(): t for t in cuda}.values():
            t.record_stream(stream)


def received(gathered: torch.Tensor, metas) -> dict:
    """After the all-gather: keep the replicated tensors alive for this stream; the storages never to adopt."""
    # never adopt the all-gather output or a replicated tensor (a kept payload's metadata may be reused)
    forbidden = {gathered.untyped_storage().data_ptr()}
    replicated = []
    for meta in metas:  # (loops, not comprehensions: each of those is a Python call, twice per unshard)
        for rep in meta.replicated.values():
            for t in rep.values():
                if t is not None:
                    replicated.append(t)
                    forbidden.add(t.untyped_storage().data_ptr())
    if gathered.is_cuda:
        keep_for_stream(replicated)
    return {"forbidden": forbidden}


def complete_parts(q: Quantizer, parts: dict, plan: GatherPlan, dtype) -> dict:
    """The gathered parts plus what this unshard makes locally: quantized from the gathered high-precision weight
    (the full weight), or the columnwise form derived from the rowwise one."""
    if plan.local:
        r, c = q.quantize_parts(parts[HIGH_PRECISION].data, ROWWISE in plan.local, COLUMNWISE in plan.local)
        parts.update({d: p for d, p in ((ROWWISE, r), (COLUMNWISE, c)) if d in plan.local})
    elif plan.derive:
        parts[COLUMNWISE] = q.derive_part(parts[ROWWISE], COLUMNWISE, dtype)
    return parts
