"""FSDP2 for grouped (mixture-of-experts) weights `[E, out, in]`: each expert is quantized on its own, as a
hybridq Linear's `[out, in]` weight, and all-gathered quantized.

FSDP2 shards a grouped weight in one of two ways, and each expert's local piece is a `RowShard` of that expert's
`[out, in]` matrix either way (`ExpertLayout`):

- `Shard(0)` (the default): whole experts per rank (`ceil(E / world)` per rank, the last ranks fewer or none).
  An expert is whole on its owner and empty elsewhere.
- `Shard(1)` (`fully_shard(..., shard_placement_fn=lambda p: Shard(1))`, what torchtitan uses when there are
  more ranks than experts): every rank holds the same rows of every expert, FSDP2's chunking of `out`.

Per unshard every rank computes each expert's cross-shard statistics (`Quantizer.shard_stats` of its piece),
reduces them for all experts in one MAX all-reduce (a receiver needs the per-tensor values of experts it does
not hold, e.g. an FP8 scale), quantizes its pieces exactly as the full expert would be quantized and packs
them, one slot per expert, into one payload (`payload.py`, per expert). After the all-gather each expert's
slots are assembled into its full parts, held by one `ExpertWeightState` per expert (the same unsharded
buffers, derivation and lazy gathering a Linear's weight has) and exposed to `GroupedLinear` as a
`GroupedGatheredWeight` whose `unbind(0)` gives the experts' `GatheredWeight`s.

Transport: with `Shard(0)`, FSDP2 concatenates the ranks' payloads (rank-major). With `Shard(1)`, FSDP2 views
each rank's all-gather input as its padded shard `[E, out / world, in]` and concatenates the ranks along dim 1
("chunk-cat", torch 2.11 and 2.13 alike), so the payload is laid out as E equal slots that this view keeps
whole: after the gather, expert e's slots of all ranks are contiguous (expert-major).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import RecipeError
from ..formats._sharding import RowShard, dim0_chunks
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats._reduce import amax_all_reduce_
from ..nn.grouped import GroupedLinear, converted_experts, expert_name, expert_weight_names, plan_expert_module, \
    install_expert_module
from ..recipe import CustomRecipe, Role
from ..weight_forms import ExpertsTensor, GroupedGatheredForm
from .checks import check_shard_layout
from .fsdp_adapter import FSDPLink, in_backward, phase_of
from .payload import ALIGN, DIRECTIONS, HIGH_PRECISION, PayloadMeta, assemble_parts, build_payload, quantize_shard
from .plan import GatherPlan, make_plan
from .state import WeightState
from .transport import stats_key, transport_view
from .weights import HybridWeight

__all__ = ["ExpertLayout", "GroupedHybridWeight", "GroupedGatheredWeight", "GroupedWeightState"]

log = logging.getLogger("hybridq")
aten = torch.ops.aten

_ITEM_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where each expert's rows of a grouped weight `[E, out, in]` live on `world_size` ranks: FSDP2's `Shard(dim)`
    chunking along dim 0 (whole experts) or dim 1 (rows of every expert)."""

    dim: int
    experts: int
    rows: int  # out
    cols: int  # in
    world_size: int
    rank: int

    @classmethod
    def infer(cls, name: str, shape, local_shape, world_size: int, rank: int, describe: str) -> "ExpertLayout":
        """The layout FSDP2 chose, told by the local shard's shape (public information, same in torch 2.11 and
        2.13). Sharding along `in` (dim 2) is refused: the rowwise blocks run along it."""
        e, n, k = shape
        if world_size == 1 or tuple(local_shape[1:]) == (n, k):
            return cls(0, e, n, k, world_size, rank)
        if local_shape[0] == e and local_shape[2] == k:
            return cls(1, e, n, k, world_size, rank)
        raise ValueError(
            f"apply_hybrid_fsdp: {name} {tuple(shape)} is sharded along dim 2 (in_features; local shard "
            f"{tuple(local_shape)}) in {describe}: hybridq gathers a grouped weight quantized only when FSDP2 shards "
            f"it along dim 0 (whole experts, the default) or dim 1 (rows of every expert, shard_placement_fn="
            f"lambda p: Shard(1)); the rowwise scaling blocks run along in_features and cannot be split by rank")

    @property
    def chunk(self) -> int:
        """Experts per rank (dim 0) or rows of every expert per rank (dim 1), as FSDP2 chunks them."""
        return _cdiv(self.experts, self.world_size) if self.dim == 0 else _cdiv(self.rows, self.world_size)

    def owner(self, e: int) -> int:
        return e // self.chunk if self.dim == 0 else self.rank

    def held(self, e: int) -> bool:
        return self.dim == 1 or self.owner(e) == self.rank

    def stats_shard(self, e: int) -> RowShard:
        """This rank's piece of expert e, for its statistics (the layout every rank agrees on)."""
        if self.dim == 1:
            return dim0_chunks((self.rows, self.cols), self.world_size)[self.rank]
        return RowShard.whole(self.rows) if self.held(e) else RowShard(self.rows, self.rows, 0)

    def payload_shards(self, e: int) -> tuple[RowShard, tuple[RowShard, ...]]:
        """(this rank's piece of expert e, the pieces of expert e that are all-gathered): with dim 0 only the
        owner sends it, whole."""
        if self.dim == 1:
            shards = dim0_chunks((self.rows, self.cols), self.world_size)
            return shards[self.rank], shards
        return self.stats_shard(e), (RowShard.whole(self.rows),)

    def local_piece(self, data: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's rows held here, `[rows, in]` (empty when not held)."""
        if self.dim == 1:
            return data[e]
        if not self.held(e):
            return data.new_empty(0, self.cols)
        return data[e - self.rank * self.chunk]

    def slots(self) -> list[int | None]:
        """The experts of this rank's payload slots, in order (None: an empty slot of the last ranks, dim 0)."""
        if self.dim == 1:
            return list(range(self.experts))
        first = self.rank * self.chunk
        return [e if e < self.experts else None for e in range(first, first + self.chunk)]

    def slot_bytes(self, metas: list[PayloadMeta]) -> int:
        """Bytes of one payload slot (same on every rank). With dim 1 a slot is one expert's share of the padded
        shard `[chunk, in]` in an item type of 1-8 bytes, so that FSDP2's chunk-cat keeps slots whole."""
        need = max((m.nbytes for m in metas), default=0)
        need = -(-need // ALIGN) * ALIGN
        if self.dim == 0:
            return need
        for size in _ITEM_DTYPES:
            if size * self.chunk * self.cols >= need:
                return size * self.chunk * self.cols
        raise ValueError(f"hybridq FSDP: an expert's quantized payload ({need} bytes) exceeds 8 bytes per element "
                         f"of its shard [{self.chunk}, {self.cols}]")

    def transport(self, payload: torch.Tensor, slot: int) -> torch.Tensor:
        """The all-gather input FSDP2 accepts for this layout."""
        if self.dim == 0:
            return transport_view(payload, (self.experts, self.rows, self.cols), self.world_size)
        dt = _ITEM_DTYPES[slot // (self.chunk * self.cols)] if slot else torch.uint8
        return payload.view(dt).view(self.experts, self.chunk, self.cols) if slot else payload

    def expert_bytes(self, gathered: torch.Tensor, slot: int, e: int, meta: PayloadMeta,
                     expert_major: bool) -> torch.Tensor:
        """Expert e's gathered payloads `[pieces, nbytes]` (uint8) out of the gathered bytes of all ranks.
        expert_major: FSDP2's chunk-cat output (dim 1); else the ranks' payloads one after another."""
        flat = gathered.reshape(-1).view(torch.uint8)
        ws = self.world_size
        if self.dim == 1:
            g = flat.view(self.experts, ws, -1)[e] if expert_major else flat.view(ws, self.experts, -1)[:, e]
            g = g[:, :meta.nbytes]
        else:
            per_rank = flat.view(ws, -1)
            j = e - self.owner(e) * self.chunk
            g = per_rank[self.owner(e), j * slot:j * slot + meta.nbytes].unsqueeze(0)
        if g.storage_offset() % ALIGN or (g.shape[0] > 1 and g.stride(0) % ALIGN):
            g = g.contiguous()  # each buffer is read in its own dtype at 16-byte aligned offsets
        return g


@dataclasses.dataclass(frozen=True)
class GroupedGatherMetadata:
    """What `fsdp_pre_all_gather` hands to `fsdp_post_all_gather` through FSDP2."""

    metas: tuple[PayloadMeta, ...]
    plan: GatherPlan
    dtype: torch.dtype
    quantizers: tuple[Quantizer, ...]
    layout: ExpertLayout
    slot: int


@dataclasses.dataclass
class GroupedContext:
    """What the last FSDP2 unshard knew, to gather a direction later on the same ranks."""

    local: weakref.ref
    module: weakref.ref
    layout: ExpertLayout
    dtype: torch.dtype
    group: object
    device: torch.device
    param: weakref.ref | None


class ExpertWeightState(WeightState):
    """One expert's unsharded buffers (a Linear weight's, `state.py`); a direction nobody planned for is gathered
    for every expert at once by the grouped weight's state."""

    def __init__(self, grouped: "GroupedWeightState", name: str):
        super().__init__(None, name)
        self.grouped = weakref.ref(grouped)

    def ensure(self, d: str) -> None:
        if not self.parts or self.parts.get(d) is None or d in self.deferred or self.materialized(d):
            return
        self.grouped().ensure(d)


class GroupedWeightState:
    """State shared by every alias of one sharded grouped weight (see WeightState for a Linear's)."""

    def __init__(self, root: nn.Module | None = None, name: str = "weight", attr: str = "weight"):
        self.root = weakref.ref(root) if root is not None else None
        self.name = name  # the parameter's name in the model, for error messages
        self.attr = attr  # the parameter's attribute on the module FSDP2 registers it on
        self.fsdp: FSDPLink | bool | None = None
        self.stats_key = None
        self.stats: torch.Tensor | None = None
        self.param_dtype: torch.dtype | None = None
        self.layouts_checked: set = set()
        self.quantizers: tuple[Quantizer, ...] | None = None  # the weight formats the unsharded buffers hold
        self.experts: list[ExpertWeightState] = []
        self.gathered: GroupedGatheredWeight | None = None
        self.inner: list[torch.Tensor] = []  # handed to FSDP2: allocated before, freed at reshard
        self.deferred: set[str] = set()
        self.backward_extra: set[str] = set()
        self.last_sig = None
        self.ctx: GroupedContext | None = None
        self.counters: dict = {}

    def __deepcopy__(self, memo):
        return GroupedWeightState(self.root() if self.root is not None else None, self.name, self.attr)

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def layer(self, module: nn.Module) -> GroupedLinear:
        """The GroupedLinear that computes with this weight: `module` itself or, for an expert module converted by
        convert_experts, its GroupedLinear for this attribute."""
        if isinstance(module, GroupedLinear):
            return module
        layer = converted_experts(module).get(self.attr)
        if layer is None:
            raise TypeError(f"hybridq FSDP: {self.name} belongs to a GroupedLinear or a converted expert module, got "
                            f"{type(module).__name__} without a converted {self.attr!r}")
        return layer

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

    def is_derivable(self, qs, shape, dtype) -> bool:
        if not self.experts:
            self.experts = [ExpertWeightState(self, f"{self.name} expert {e}") for e in range(len(qs))]
        return all(st.is_derivable(q, shape, dtype) for st, q in zip(self.experts, qs))

    # the unsharded weight ----------------------------------------------------------------------------------
    def create(self, qs, layout: ExpertLayout, dtype, device) -> None:
        self.quantizers = tuple(qs)
        shape = (layout.rows, layout.cols)
        experts = [st.create(q, shape, dtype, device) for st, q in zip(self.experts, qs)]
        self.gathered = GroupedGatheredWeight(experts, shape=(layout.experts,) + shape, dtype=dtype, state=self)

    def set_inner(self, dirs) -> None:
        inner: list[torch.Tensor] = []
        for st in self.experts:
            st.set_inner(dirs)
            inner += st.inner
        self.inner[:] = inner

    def set_deferred(self, dirs) -> None:
        self.deferred = set(dirs)
        for st in self.experts:
            st.deferred = set(dirs)

    # statistics ---------------------------------------------------------------------------------------------
    def reduced_stats(self, qs, pieces, layout: ExpertLayout, key, group) -> list[torch.Tensor | None]:
        """Each expert's statistics reduced across ranks: one MAX all-reduce for all experts (or the values
        precompute_scales reduced for these shard values)."""
        local = [q.shard_stats(x, layout.stats_shard(e)) for e, (q, x) in enumerate(zip(qs, pieces))]
        if key is not None and self.stats_key == key:
            self.count("stats_precomputed")
            flat = self.stats
        else:
            flat = pack_stats(local)
            if flat is not None:
                amax_all_reduce_(flat, group)
                self.count("stats_allreduce")
            self.stats_key, self.stats = key, flat
        out, i = [], 0
        for s in local:
            if s is None:
                out.append(None)
                continue
            out.append(flat[i:i + s.numel()].view(s.shape))
            i += s.numel()
        return out

    # lazy materialization of a direction nobody planned for (activation recompute, ...) ----------------------
    def ensure(self, d: str) -> None:
        ctx = self.ctx
        param = ctx.param() if ctx is not None and ctx.param is not None else None
        local = param._local_tensor.to(ctx.device) if param is not None else (ctx.local() if ctx else None)
        module = ctx.module() if ctx else None
        if local is None or module is None:
            raise RuntimeError(f"hybridq FSDP: the unsharded {self.name} has no {d} form and the sharded weight it "
                               f"came from is gone")
        qs = self.quantizers
        layout = ctx.layout
        shape = (layout.rows, layout.cols)
        derivable = d == COLUMNWISE and all(st.is_derivable(q, shape, ctx.dtype) for st, q in zip(self.experts, qs))
        send = (ROWWISE,) if derivable else (d,)
        with torch.no_grad():
            payload, metas, slot = prepare_grouped(local, param, qs, send, layout, ctx.dtype, ctx.group)
            ws = layout.world_size
            if ws == 1:
                gathered = payload
            else:
                gathered = payload.new_empty(ws * payload.numel())
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    dist.all_gather_into_tensor(gathered, payload, group=ctx.group)
            for e, (st, q, meta) in enumerate(zip(self.experts, qs, metas)):
                if st.parts.get(d) is None:
                    continue
                parts = assemble_parts(meta, layout.expert_bytes(gathered, slot, e, meta, expert_major=False))
                st.fill(d, q.derive_part(parts[ROWWISE], COLUMNWISE, ctx.dtype) if derivable else parts[d])
        self.set_inner([x for x in DIRECTIONS if all(st.materialized(x) for st in self.experts)])
        self.count("lazy_gathers")
        if in_backward():  # e.g. activation recompute: gather it with backward's from now on
            self.backward_extra.add(d)


def pack_stats(stats) -> torch.Tensor | None:
    """The experts' statistics (None where a format has none) as one fp32 vector (layout the same on every rank)."""
    present = [s.reshape(-1).float() for s in stats if s is not None]
    return torch.cat(present) if present else None


def prepare_grouped(local, param, qs, send, layout: ExpertLayout, dtype, group
                    ) -> tuple[torch.Tensor, list[PayloadMeta], int]:
    """This rank's payload (one slot per expert it sends), every expert's metadata and the slot size."""
    data = local._data.to(dtype)
    pieces = [layout.local_piece(data, e) for e in range(layout.experts)]
    stats: list = [None] * layout.experts
    if layout.world_size > 1 and any(d != HIGH_PRECISION for d in send):
        key = stats_key(param, dtype, layout)
        stats = local._hq.reduced_stats(qs, pieces, layout, key, group)
    payloads, metas = [], []
    shape = (layout.rows, layout.cols)
    for e, (q, x) in enumerate(zip(qs, pieces)):
        shard, shards = layout.payload_shards(e)
        parts = quantize_shard(q, x, shard, send, stats[e])
        payload, meta = build_payload(q, parts, shard, shards, shape, data.device, pack=layout.held(e))
        payloads.append(payload)
        metas.append(meta)
    slot = layout.slot_bytes(metas)
    chunks = []
    for e in layout.slots():
        p = payloads[e] if e is not None else data.new_empty(0, dtype=torch.uint8)
        chunks.append(p)
        if slot > p.numel():
            chunks.append(torch.zeros(slot - p.numel(), dtype=torch.uint8, device=data.device))
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=data.device)
    return payload, metas, slot


def _sharded_param(local, module, attr: str, link: FSDPLink | None):
    for p in (module._parameters.get(attr), link.sharded_param() if link is not None else None):
        mine = getattr(p, "_local_tensor", None)
        if mine is local or (isinstance(mine, GroupedHybridWeight) and mine._hq is local._hq):
            return p
    return None


class GroupedHybridWeight(HybridWeight):
    """The high-precision `[E, out, in]` weight of a GroupedLinear (or of a converted expert module) as FSDP2
    shards it. Every op runs on the plain tensor; FSDP2's all-gather hooks gather each expert quantized."""

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return GroupedHybridWeight(inner["_data"], ctx["state"])

    def __repr__(self, *, tensor_contents=None):
        return f"GroupedHybridWeight({self._data!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        st: GroupedWeightState = self._hq
        layer = st.layer(module)
        qs = tuple(q["weight"] for q in layer.expert_quantizers)
        if st.quantizers is not None and qs != st.quantizers:
            raise RecipeError(
                f"{layer.name}: its weight is already sharded by fully_shard with quantized all-gathers in "
                f"{st.quantizers[0].describe()}; a recipe with another weight format ({qs[0].describe()}) must be set "
                f"before fully_shard (apply_hybrid_fsdp, convert_experts, or GroupedLinear.recipe)")
        ws = mesh.size()
        rank = mesh.get_local_rank() if ws > 1 else 0
        group = mesh.get_group() if ws > 1 else None
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        shape = tuple(outer_size)
        layout = ExpertLayout.infer(st.name, shape, tuple(self.shape), ws, rank, qs[0].describe())
        override = layer.recipe.backward_override
        derivable = st.is_derivable(qs, shape[1:], dtype)
        check = (tuple(map(id, qs)), shape, layout.dim, ws, dtype, override)
        if check not in st.layouts_checked:  # before anything is quantized or sent
            if layout.dim == 1:  # (dim 0: every expert is whole on one rank, nothing can straddle)
                for e, q in enumerate(qs):
                    if q not in qs[:e]:
                        check_shard_layout(q, f"{st.name} (Shard(1): rows of every expert)", shape[1:], ws, dtype,
                                           override, derivable)
            st.layouts_checked.add(check)
        st.param_dtype = dtype
        link = st.link(module)
        phase = phase_of(link.group if link is not None else None)
        ra = link.reshard_after_forward() if link is not None else None
        extra = set(st.backward_extra)
        if link is not None and not link.reshard_after_backward():
            extra.add(ROWWISE)
        plan = make_plan(phase=phase, reshard_after_forward=ra, backward_override=override, derivable=derivable,
                         known=link is not None, backward_extra=extra)
        with torch.no_grad():
            param = _sharded_param(self, module, st.attr, link)
            payload, metas, slot = prepare_grouped(self, param, qs, plan.send, layout, dtype, group)
            inp = layout.transport(payload, slot)
        sig = (tuple(inp.shape), inp.dtype)
        if link is not None and st.last_sig is not None and sig != st.last_sig:
            link.drop_all_gather_outputs()
        st.last_sig = sig
        st.set_deferred(plan.deferred)
        if st.gathered is not None:
            st.set_inner(plan.materialize)
        st.ctx = GroupedContext(local=weakref.ref(self), module=weakref.ref(module), layout=layout, dtype=dtype,
                                group=group, device=self.device,
                                param=weakref.ref(param) if param is not None else None)
        st.count(f"gather_{phase}")
        st.count("bytes_sent", inp.numel() * inp.element_size())
        return (inp,), GroupedGatherMetadata(tuple(metas), plan, dtype, qs, layout, slot)

    def fsdp_post_all_gather(self, outputs, metadata: GroupedGatherMetadata, param_dtype, *, out=None):
        plan, dtype, qs, layout = metadata.plan, metadata.dtype, metadata.quantizers, metadata.layout
        st: GroupedWeightState = self._hq
        with torch.no_grad():
            gathered = outputs[0]
            if gathered.is_cuda:  # replicated tensors were made on FSDP2's copy-in stream (see weights.py)
                stream = torch.cuda.current_stream(gathered.device)
                for meta in metadata.metas:
                    for rep in meta.replicated.values():
                        for t in rep.values():
                            if t is not None and t.is_cuda:
                                t.record_stream(stream)
            first = st.gathered is None
            if first:
                st.create(qs, layout, dtype, gathered.device)
            adopt = {"forbidden": {gathered.untyped_storage().data_ptr()} | {
                t.untyped_storage().data_ptr() for meta in metadata.metas for rep in meta.replicated.values()
                for t in rep.values() if t is not None}}
            for e, (est, q, meta) in enumerate(zip(st.experts, qs, metadata.metas)):
                parts = assemble_parts(meta, layout.expert_bytes(gathered, metadata.slot, e, meta,
                                                                 expert_major=layout.dim == 1))
                if plan.local:
                    r, c = q.quantize_parts(parts[HIGH_PRECISION].data, ROWWISE in plan.local,
                                            COLUMNWISE in plan.local)
                    parts.update({d: p for d, p in ((ROWWISE, r), (COLUMNWISE, c)) if d in plan.local})
                elif plan.derive:
                    parts[COLUMNWISE] = q.derive_part(parts[ROWWISE], COLUMNWISE, dtype)
                if HIGH_PRECISION in plan.materialize:
                    est.create_high_precision()
                for d in plan.materialize:
                    est.fill(d, parts[d], adopt)
                if first:
                    est.free_others(plan.materialize)
            st.set_inner(plan.materialize)
        if out is not None:
            return None
        return st.gathered._alias(), st.inner


GroupedHybridWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(GroupedHybridWeight.fsdp_pre_all_gather)


class GroupedGatheredWeight(GroupedGatheredForm, ExpertsTensor):
    """The unsharded grouped weight FSDP2 registers on the module between unshard and reshard: `[E, out, in]`
    whose `unbind(0)` gives each expert's `GatheredWeight` (a QuantizedTensor; autograd stacks the experts'
    weight gradients into a plain `[E, out, in]` gradient). Other ops raise: the experts are quantized."""

    @staticmethod
    def __new__(cls, experts, *, shape, dtype, state):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=experts[0].device,
                                                   requires_grad=False)
        self._experts = list(experts)
        self._hq = state
        return self

    def _alias(self) -> "GroupedGatheredWeight":
        return GroupedGatheredWeight(self._experts, shape=self.shape, dtype=self.dtype, state=self._hq)

    def ensure_direction(self, direction: str) -> None:
        for g in self._experts:
            g.part(direction)

    def _other_op(self, func, args, kwargs):
        if func is aten.as_strided.default:
            size, stride = args[1], args[2]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if tuple(size) == tuple(self.shape) and tuple(stride) == tuple(self.stride()) and not offset:
                return self._alias()
        raise TypeError(f"GroupedGatheredWeight (the unsharded quantized weight {self._hq.name}) supports only "
                        f"unbind(0) (each expert's quantized weight), detach and alias; got {func}")

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"GroupedGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"experts={len(self._experts)}, formats={self._experts[0].formats})")


# ---- apply_hybrid_fsdp's part: convert and wrap the grouped weights ----------------------------------------------

def grouped_weight_modules(model: nn.Module, module_filter_fn=None) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every GroupedLinear and expert module (`hybridq_grouped_weights`) the filter accepts."""
    out = []
    for fqn, mod in model.named_modules():
        if not (isinstance(mod, GroupedLinear) or expert_weight_names(mod) is not None):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        out.append((fqn, mod))
    return out


def check_grouped_recipe(model: nn.Module, recipe: CustomRecipe, module_filter_fn=None) -> None:
    """Reject delayed scaling on any expert weight (as apply_hybrid_fsdp does for Linear weights)."""
    for fqn, mod in grouped_weight_modules(model, module_filter_fn):
        if isinstance(mod, GroupedLinear):
            names, weights = [mod._role_name or fqn], [mod.weight]
        else:
            names = [f"{fqn}.{n}" if fqn else n for n in expert_weight_names(mod)]
            weights = [getattr(mod, n, None) for n in expert_weight_names(mod)]
        for name, w in zip(names, weights):
            if hasattr(w, "device_mesh"):
                raise ValueError(f"apply_hybrid_fsdp: {name} is already a DTensor; call apply_hybrid_fsdp before "
                                 f"fully_shard")
            for e in range(w.shape[0] if w is not None and w.dim() == 3 else 0):
                q = recipe.quantizer(Role("grouped_linear", "weight", expert_name(name, e)))
                if q.is_stateful:
                    raise ValueError(
                        f"apply_hybrid_fsdp: the weight of expert {e} of {name} uses delayed scaling "
                        f"({q.describe()}); under FSDP2 every rank quantizes its shard and backward re-gathers the "
                        f"weight, so a scale that changes between casts cannot give the single-device result. Use "
                        f"current scaling.")


def plan_grouped(model: nn.Module, recipe: CustomRecipe, module_filter_fn=None, on_incompatible: str = "skip"):
    """Check every grouped weight against `recipe` before anything changes. Returns the work `apply_grouped`
    does and the report rows of the layers kept in their precision."""
    from ..errors import FormatShapeError
    from ..nn.convert import LayerReport

    todo, skipped = [], []
    for fqn, mod in grouped_weight_modules(model, module_filter_fn):
        try:
            if isinstance(mod, GroupedLinear):
                quantizers = None if mod.recipe == recipe else mod.quantizers_for(recipe)
                todo.append((fqn, mod, quantizers))
            else:
                todo.append((fqn, mod, plan_expert_module(fqn, mod, recipe)))
        except FormatShapeError as e:
            if on_incompatible != "skip":
                raise
            log.warning("hybridq: keeping grouped layer %r in its precision: %s", fqn, e)
            prev = mod.recipe.name if isinstance(mod, GroupedLinear) else None
            skipped.append(LayerReport(fqn, False, reason=str(e), previous_recipe=prev))
    return todo, skipped


def apply_grouped(model: nn.Module, recipe: CustomRecipe, todo, counts) -> list:
    """Install the planned recipes and wrap each grouped weight in a GroupedHybridWeight. Returns report rows."""
    from ..nn.convert import LayerReport

    rows = []
    for fqn, mod, plan in todo:
        if isinstance(mod, GroupedLinear):
            prev = mod.recipe.name
            if plan is not None:
                mod.install_recipe(recipe, plan)
            rows.append(LayerReport(fqn, True, mod.describe_formats(), previous_recipe=prev, unchanged=plan is None))
            targets = [("weight", f"{fqn or mod.name}.weight", mod)]
        else:
            install_expert_module(mod, plan)
            layers = converted_experts(mod)
            rows += [LayerReport(g.name, True, g.describe_formats()) for g in layers.values()]
            targets = [(n, g.name, g) for n, g in layers.items()]
        for attr, name, layer in targets:
            w = getattr(mod, attr)
            if isinstance(w, GroupedHybridWeight):
                continue
            if counts[id(w)] > 1:
                log.warning("hybridq: %s is shared with another module; FSDP2 gathers it in high precision", name)
                continue
            new = nn.Parameter(GroupedHybridWeight(w.data, GroupedWeightState(model, name, attr)),
                               requires_grad=w.requires_grad)
            setattr(mod, attr, new)
            layer._parameters["weight"] = new
    return rows


def grouped_stats_items(model: nn.Module) -> list:
    """For precompute_scales: (process group, device, state, key, local statistics) of every FSDP2-sharded grouped
    weight of `model` whose formats reduce statistics."""
    from torch.distributed.tensor import DTensor, Shard

    items = []
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if not isinstance(p, DTensor) or not isinstance(p._local_tensor, GroupedHybridWeight):
                continue
            dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
            if len(dims) != 1:
                continue
            mesh, i = p.device_mesh, dims[0]
            ws = mesh.size(i)
            if ws == 1:
                continue
            local = p._local_tensor
            st: GroupedWeightState = local._hq
            try:
                layer = st.layer(mod)
            except TypeError:
                continue
            qs = tuple(q["weight"] for q in layer.expert_quantizers)
            dtype = st.param_dtype or local.dtype
            layout = ExpertLayout.infer(st.name, tuple(p.shape), tuple(local.shape), ws, mesh.get_local_rank(i),
                                        qs[0].describe())
            data = local._data.to(dtype)
            flat = pack_stats([q.shard_stats(layout.local_piece(data, e), layout.stats_shard(e))
                               for e, q in enumerate(qs)])
            if flat is None:
                continue
            device = (torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda"
                      else torch.device(mesh.device_type))
            items.append((mesh.get_group(i), device, st, stats_key(p, dtype, layout), flat))
    return items

