"""Per-weight state shared by every alias of one sharded weight: the FSDP2 link, the reduced statistics, the
unsharded weight's own buffers (`buffers.py`), the reduced statistics (`stats.py`), the payload kept from forward to
backward, and lazy materialization of a direction nobody planned for.

A Linear weight has one `WeightState`. A grouped weight `[E, out, in]` has one `GroupedWeightState`, which holds
one `ExpertWeightState` per expert (each the unsharded buffers, derivation and lazy gathering a Linear's weight
has) and reduces the statistics of all experts in one all-reduce.
"""

from __future__ import annotations

import collections
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn

from ..data_writes import QueuedChecks
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats._stacking import stacked_view
from ..formats.float8_groups import equal_groups_apply
from ..nn.expert_layers import converted_layer
from ..nn.grouped import GroupedLinear
from ..torch_private import local_tensor
from .buffers import UnshardedBuffers
from .fsdp_adapter import FSDPLink, in_backward
from .gathered import GroupedGatheredWeight
from .grouped_blocks_batched import stacks_blocks
from .grouped_fast import _ON as grouped_fast
from .layout import ExpertLayout
from .payload import DIRECTIONS, HIGH_PRECISION, GatheredViews, PayloadMeta, assemble_parts
from .stats import GroupedStats, WeightStats
from .transport import GatherContext, gather_grouped_now, gather_now

__all__ = ["ExpertWeightState", "GroupedWeightState", "KeptPayload", "WeightState"]


class KeptPayload(NamedTuple):
    """A forward unshard's payload kept for the backward unshard that sends the same directions. (A NamedTuple: one
    is made per weight per forward unshard; a frozen dataclass's __init__ costs about three times as much host time.)"""

    key: tuple
    payload: torch.Tensor
    meta: object  # a Linear weight's PayloadMeta; a grouped weight's (metas, slot size, StackedGather | None)
    fp: torch.Tensor | None = None  # the fingerprint of the values it came from ([Note: data-write check])


class SharedState:
    """What every kind of sharded weight keeps between unshards (the FSDP2 link, the statistics, the plan's
    bookkeeping, the context of the last unshard, counters for tests and reports)."""

    def __init__(self, root: nn.Module | None = None, name: str = "weight", attr: str = "weight"):
        self.root = weakref.ref(root) if root is not None else None
        self.name = name  # the parameter's name in the model, for error messages
        self.attr = attr  # the parameter's attribute on the module FSDP2 registers it on
        self.fsdp: FSDPLink | bool | None = None  # None: not looked up yet; False: not found
        self.stats_key = None
        self.stats: torch.Tensor | None = None
        self.stats_fp: torch.Tensor | None = None  # the fingerprint of the shard values `stats` came from
        self.data_checks = QueuedChecks(name)  # data-write checks of world > 1 reuses: precompute_scales reports them
        self.param_dtype: torch.dtype | None = None
        self.shard_layouts: dict = {}  # the checked layouts (weights._shard_layout, weights._grouped_layout)
        self.payload_layouts: dict = {}  # its payloads' layouts (payload.build_payload's memo)
        self.inner: list[torch.Tensor] = []  # handed to FSDP2: allocated before, freed at reshard
        self.deferred: frozenset[str] = frozenset()
        self.backward_extra: frozenset[str] = frozenset()  # (immutable: part of the unshard setup's cache key)
        self.last_sig = None
        self.ctx: GatherContext | None = None
        self.mesh_info: tuple | None = None  # (FSDP2's shard mesh, its (world size, rank, group)): weights.py
        self.pre_lanes: dict = {}  # id(FSDP2 training state) -> lane.PreLane of the last unshard in that state
        self.gathered_views = GatheredViews()  # views of FSDP2's all-gather output, kept across unshards
        self.counters: collections.Counter = collections.Counter()

    def link(self, module) -> FSDPLink | None:
        if self.fsdp is None:
            self.fsdp = FSDPLink.find([module, self.root() if self.root is not None else None], module,
                                      self.attr) or False
        if self.fsdp is False:
            return None
        if not self.fsdp.alive:
            self.fsdp = None
            return None
        return self.fsdp

    def _lazy_source(self, d: str) -> tuple:
        """(the sharded weight on the gather device, its DTensor parameter or None, its module) of the last
        unshard, for a lazy gather of direction `d`."""
        ctx = self.ctx
        param = ctx.param() if ctx is not None and ctx.param is not None else None
        local = local_tensor(param).to(ctx.device) if param is not None else (ctx.local() if ctx else None)
        module = ctx.module() if ctx else None
        if local is None or module is None:
            raise RuntimeError(f"hybridq FSDP: the unsharded {self.name} has no {d} form and the sharded weight it "
                               f"came from is gone")
        return local, param, module

    def _lazy_done(self, d: str) -> None:
        self.counters["lazy_gathers"] += 1
        if in_backward():  # e.g. activation recompute: gather it with backward's from now on
            self.backward_extra = self.backward_extra | {d}


class WeightState(SharedState, WeightStats, UnshardedBuffers):
    """A Linear weight's state."""

    def __init__(self, root: nn.Module | None = None, name: str = "weight"):
        super().__init__(root, name)
        self._init_buffers()
        self.kept_payload: KeptPayload | None = None
        self.reuse_payload = True
        self.unit_filled = None  # the metadata of the unshard a unit leader filled this weight for ([Note: unit fill])
        self.tp_group = None  # set by hybridq's tensor-parallel styles: the weight is a TP piece (2-D meshes)
        self.tp_cut = None  # and the dim the TP pieces cut: "M" (rows, Shard(0)) or "K" (columns, Shard(1))

    def __deepcopy__(self, memo):
        new = WeightState(self.root() if self.root is not None else None, self.name)
        new.reuse_payload = self.reuse_payload
        new.tp_group, new.tp_cut = self.tp_group, self.tp_cut
        return new

    # lazy materialization (a direction nobody planned for: activation recompute, manual unshard, ...) ----
    def needs(self, d: str) -> bool:
        """Whether direction `d` exists for this weight but is neither filled nor due from a later unshard."""
        return bool(self.parts) and self.parts.get(d) is not None and d not in self.deferred and \
            not self.materialized(d)

    def ensure(self, d: str) -> None:
        if not self.needs(d):
            return
        local, _, module = self._lazy_source(d)
        ctx = self.ctx
        q = module.weight_quantizer
        derivable = d == COLUMNWISE and self.is_derivable(q, ctx.shape, ctx.dtype)
        send = (ROWWISE,) if derivable else (d,)
        with torch.no_grad():
            parts = gather_now(local, q, send, ctx)
            src = q.derive_part(parts[ROWWISE], COLUMNWISE, ctx.dtype) if derivable else parts[d]
            self.fill(d, src)
        self.inner[:] = self._unique([x for x in DIRECTIONS if self.materialized(x)])
        self._lazy_done(d)

    def check_readable(self, d: str) -> None:
        """Raise, naming the weight and the direction, where direction `d` is due from the backward unshard and not
        filled yet: read now, it would read FSDP2's freed buffer ([Note: a direction pending the backward unshard],
        gathered.py). Nothing changes before the error. (The high-precision form's buffer is made on first use: not
        made yet, it is pending too.)"""
        if d not in self.deferred:
            return
        if self.parts.get(d) is None:
            if d != HIGH_PRECISION:  # (the format has no such form for this weight: `part` says so)
                return
        elif self.materialized(d):
            return
        when = " (with autograd off, as in an eval forward, no backward unshard comes at all)" \
            if not torch.is_grad_enabled() else ""
        read = "+".join(x for x in DIRECTIONS if x not in self.deferred and self.parts.get(x) is not None
                        and self.materialized(x)) or "none"
        raise RuntimeError(
            f"hybridq FSDP: the {d} form of {self.name} is gathered by FSDP2's backward unshard (the gather plan "
            f"defers it); it is read before that unshard{when}, when its storage is FSDP2's freed buffer. Before the "
            f"backward read only what the forward unshard gathered ({read}); code that keeps the {d} part for the "
            f"backward that fills it takes it with held_part('{d}'), which does not read it")


class ExpertWeightState(WeightState):
    """One expert's unsharded buffers (a Linear weight's); a direction nobody planned for is gathered for every
    expert at once by the grouped weight's state."""

    def __init__(self, grouped: "GroupedWeightState", name: str):
        super().__init__(None, name)
        self.grouped = weakref.ref(grouped)

    def ensure(self, d: str) -> None:
        if self.needs(d):
            self.grouped().ensure(d)


class GroupedWeightState(SharedState, GroupedStats):
    """State shared by every alias of one sharded grouped weight `[E, out, in]`."""

    def __init__(self, root: nn.Module | None = None, name: str = "weight", attr: str = "weight"):
        super().__init__(root, name, attr)
        self.quantizers: tuple[Quantizer, ...] | None = None  # the weight formats the unsharded buffers hold
        self.experts: list[ExpertWeightState] = []
        self.gathered: GroupedGatheredWeight | None = None
        self.slabs: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []  # (one allocation, its expert views)
        self.slabs_of: dict = {}  # (directions, ...) -> the slabs of those directions (`_slabs_of`)
        self.kept_payload: KeptPayload | None = None  # (meta: the experts' metadata, slot size, stacked gather)
        self.reuse_payload = True

    def __deepcopy__(self, memo):
        new = GroupedWeightState(self.root() if self.root is not None else None, self.name, self.attr)
        new.reuse_payload = self.reuse_payload
        return new

    def layer(self, module: nn.Module) -> GroupedLinear:
        """The GroupedLinear that computes with this weight: `module` itself or, for an expert module converted by
        convert_experts, its GroupedLinear for this attribute."""
        if isinstance(module, GroupedLinear):
            return module
        layer = converted_layer(module, self.attr)  # (no copy of the module's dict: asked at every unshard)
        if layer is None:
            raise TypeError(f"hybridq FSDP: {self.name} belongs to a GroupedLinear or a converted expert module, got "
                            f"{type(module).__name__} without a converted {self.attr!r}")
        return layer

    def is_derivable(self, qs, shape, dtype) -> bool:
        if not self.experts:
            self.experts = [ExpertWeightState(self, f"{self.name} expert {e}") for e in range(len(qs))]
        key = (tuple(map(id, qs)), tuple(shape), dtype)  # (asked at every unshard: once per quantizers and shape)
        cache = self.__dict__.setdefault("derivable_all", {})
        if key not in cache:
            cache[key] = (qs, all(st.is_derivable(q, shape, dtype) for st, q in zip(self.experts, qs)))
        return cache[key][1]

    # the unsharded weight: one set of buffers per expert ----------------------------------------------------
    def create(self, qs, layout: ExpertLayout, dtype, device) -> None:
        self.quantizers = tuple(qs)
        shape = (layout.rows, layout.cols)
        experts = [st.create(q, shape, dtype, device) for st, q in zip(self.experts, qs)]
        if equal_groups_apply(self.quantizers) or stacks_blocks(self.quantizers):  # (grouped_blocks_batched.py)
            self._stack_buffers()
        self.gathered = GroupedGatheredWeight(experts, shape=(layout.experts,) + shape, dtype=dtype, state=self)

    def _stack_buffers(self) -> None:
        """Every expert's own tensor of one kind (e.g. the rowwise data) becomes a view of one allocation `[E, pitch]`
        (16-byte aligned per expert: cuBLASLt's operand and scale pointers), so that one copy fills all experts
        (`fill_experts`) and FSDP2 allocates and frees one tensor per kind. Only where every expert has the same
        buffers (one quantizer); a fill that would take another storage (adopt, alias) is then never used."""
        per_expert = [st._unique((ROWWISE, COLUMNWISE)) for st in self.experts]
        self.slabs = []
        self.slabs_of.clear()
        for members in zip(*per_expert):
            t0 = members[0]
            pitch = -(-t0.numel() * t0.element_size() // 16) * 16 // t0.element_size()
            slab = torch.empty(len(members) * pitch, dtype=t0.dtype, device=t0.device)
            for e, t in enumerate(members):
                t.set_(slab.untyped_storage(), e * pitch, t.shape, t.stride())
            self.slabs.append((slab, members))

    def stacked(self, d: str):
        """(expert 0's part, {tensor name: `[E, ...]`}) of direction `d`: every expert's tensors of its part as one
        view of their stacked buffer (no copy), or None where they are not so laid out. Cached: the experts' tensors
        keep their storage and offsets across unshards (FSDP2 resizes the storage, the views stay valid)."""
        part0 = self.experts[0].parts.get(d) if self.experts and self.slabs else None
        if part0 is None:
            return None
        hit = self.__dict__.setdefault("stacked_views", {}).get(d)
        if hit is not None and hit[0] is part0:
            for n, t in hit[1].items():  # (a loop: no generator call per unshard)
                if getattr(part0, n) is not t:
                    break
            else:
                return hit[0], hit[2]
        first = part0.tensors()
        views = {}
        for n, t in first.items():
            if t is not None:
                views[n] = stacked_view([st.parts[d].tensors()[n] for st in self.experts])
                if views[n] is None:
                    return None
        hit = self.stacked_views[d] = (part0, {n: first[n] for n in views}, views)
        return hit[0], hit[2]

    def _slabs_of(self, dirs) -> list[torch.Tensor]:
        # (asked two or three times per unshard: remembered per directions while the slabs and aliases stay)
        key = (tuple(dirs), len(self.slabs), len(self.experts[0].aliased) if self.experts else 0)
        hit = self.slabs_of.get(key)
        if hit is None:
            mine = self.experts[0]._unique(dirs) if self.experts else []
            hit = self.slabs_of[key] = [slab for slab, members in self.slabs if any(members[0] is t for t in mine)]
        return hit

    def alloc_slabs(self, dirs) -> None:
        """Allocate the stacked buffers of `dirs` (before a fill outside the ones FSDP2 allocates)."""
        if grouped_fast.on:  # (each slab's storage and size asked once: [Note: grouped hooks' steady state])
            key = ("sizes", tuple(dirs), len(self.slabs), len(self.experts[0].aliased) if self.experts else 0)
            sizes = self.slabs_of.get(key)
            if sizes is None:
                sizes = self.slabs_of[key] = [(slab.untyped_storage(), slab.numel() * slab.element_size())
                                              for slab in self._slabs_of(dirs)]
            for storage, need in sizes:
                if storage.nbytes() < need:
                    storage.resize_(need)
            return
        for slab in self._slabs_of(dirs):
            need = slab.numel() * slab.element_size()
            if slab.untyped_storage().nbytes() < need:
                slab.untyped_storage().resize_(need)

    def set_inner(self, dirs) -> None:
        if self.slabs and HIGH_PRECISION not in dirs:  # (every expert tensor of these directions is a slab's view)
            self.inner[:] = self._slabs_of(dirs)
            return
        inner: list[torch.Tensor] = []
        stacked = {id(t) for _, members in self.slabs for t in members}
        for st in self.experts:
            st.set_inner(dirs)
            inner += [t for t in st.inner if id(t) not in stacked]
        self.inner[:] = self._slabs_of(dirs) + inner

    def fill_experts(self, d: str, srcs) -> None:
        """Copy the experts' gathered parts `srcs` into their own buffers of direction `d`: one copy per tensor kind
        for all experts where both sides are equally spaced views of one storage (the stacked buffers; the experts'
        slices of one all-gather output), that kind expert by expert where only the source is not (block formats'
        replicated scales: a tensor per expert), else expert by expert."""
        dst0 = self.experts[0].parts[d]
        if self.slabs and dst0 is not None:
            pairs = []
            for n, t in dst0.tensors().items():
                if t is None:
                    continue
                dst = stacked_view([st.parts[d].tensors()[n] for st in self.experts])
                src = stacked_view([getattr(p, n) for p in srcs])
                if dst is None or (src is not None and (dst.shape != src.shape or dst.dtype != src.dtype)):
                    break
                pairs.append((n, dst, src))
            else:
                for n, dst, src in pairs:
                    if src is not None:
                        dst.copy_(src)
                        continue
                    for g, p in enumerate(srcs):  # (checked as a fill checks it: shape and dtype)
                        s = getattr(p, n)
                        if s.shape != dst.shape[1:] or s.dtype != dst.dtype:
                            raise RuntimeError(f"hybridq FSDP: gathered {d} {n} of expert {g} is {tuple(s.shape)} "
                                               f"{s.dtype}, the unsharded weight holds {tuple(dst.shape[1:])} "
                                               f"{dst.dtype}")
                        dst[g].copy_(s)
                return
        for st, src in zip(self.experts, srcs):
            st.fill(d, src)

    def set_deferred(self, dirs) -> None:
        # (every unshard sets it: the experts share one frozenset, rewritten only when the directions or the experts
        # change -- nothing else writes an expert's `deferred`)
        d = frozenset(dirs)
        if d == self.deferred and self.__dict__.get("deferred_of") is self.experts:
            return
        self.deferred = d
        for st in self.experts:
            st.deferred = d
        self.deferred_of = self.experts

    # lazy materialization of a direction nobody planned for (activation recompute, ...) ----------------------
    def ensure(self, d: str) -> None:
        local, param, _ = self._lazy_source(d)
        ctx = self.ctx
        qs, layout = self.quantizers, ctx.layout
        shape = (layout.rows, layout.cols)
        derivable = d == COLUMNWISE and all(st.is_derivable(q, shape, ctx.dtype) for st, q in zip(self.experts, qs))
        send = (ROWWISE,) if derivable else (d,)
        with torch.no_grad():
            gathered, metas, slot = gather_grouped_now(local, param, qs, send, ctx)
            self.alloc_slabs((d,))
            for e, (st, q, meta) in enumerate(zip(self.experts, qs, metas)):
                if st.parts.get(d) is None:
                    continue
                parts = assemble_parts(meta, layout.expert_bytes(gathered, slot, e, meta, expert_major=False))
                st.fill(d, q.derive_part(parts[ROWWISE], COLUMNWISE, ctx.dtype) if derivable else parts[d])
        self.set_inner([x for x in DIRECTIONS if all(st.materialized(x) for st in self.experts)])
        self._lazy_done(d)
