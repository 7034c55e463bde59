"""The sharded high-precision weight FSDP2 holds (`HybridWeight`; `GroupedHybridWeight` for a grouped `[E, out, in]`
weight) and its all-gather hooks, which gather the quantized form the module's weight quantizer defines into a
`GatheredWeight` (a `GroupedGatheredWeight` of one per expert, each quantized on its own).

Flow per unshard (all format knowledge stays in the formats, reached through `payload.py`; the result keeps
[Note: sharding invariance], formats/shardable.py; the bytes are a payload, [Note: payload]):

    sharded fp32 shard --(cast to param_dtype)--> shard_stats --(MAX all-reduce, or precomputed)--> reduced
    quantize the shard with the reduced statistics --> dim-0 buffers --> one uint8 payload per rank
    FSDP2 all-gather --> per-buffer concatenation of each rank's owned block rows --> assign_gathered
    --> derive the other direction where exact --> copy into the unsharded weight's own buffers

The unsharded weight's two parts always exist as objects; their tensors are allocated and freed by FSDP2
through the list of inner tensors handed to it (`buffers.py`).

A grouped weight: per unshard every rank computes each expert's cross-shard statistics, reduces them for all
experts in one MAX all-reduce (a receiver needs the per-tensor values of experts it does not hold, e.g. an FP8
scale), quantizes its pieces exactly as the full expert would be quantized and packs them, one slot per expert,
into one payload (`transport.prepare_grouped`, laid out by `layout.ExpertLayout`). After the all-gather each
expert's slots are assembled into its full parts, held by one `ExpertWeightState` per expert (`state.py`). Experts
that share one per-tensor FP8 quantizer take the batched path (`grouped_batched.py`): one amax pass and one cast for
all experts before the gather, one copy per buffer kind into the experts' stacked buffers and one transpose after it.
Block-format experts sharing one quantizer are quantized as one tensor of the experts held and packed in one copy per
tensor kind (`grouped_blocks_payload.py`), and filled in one copy per kind (`grouped_blocks_batched.py`).
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree

from ..data_writes import LEDGER, fingerprint
from ..enums import Phase
from ..errors import RecipeError
from ..formats._sharding import RowShard, dim0_chunks
from ..formats.base import Quantizer
from ..nn.linear import Linear
from ..torch_private import local_tensor, set_grad_mode
from ..weight_forms import QuantizedGatherShard
from .checks import check_shard_layout
from .fsdp_adapter import FSDPLink
from .gathered import complete_parts, received
from .grouped_blocks_batched import fill_stacked_blocks
from .grouped_blocks_payload import _ON as stacked_block_switch
from .grouped_blocks_payload import StackedBlocks, joins_blocks, prepare_stacked_blocks
from .grouped_fast import _ON as grouped_fast
from .grouped_fast import payload_key as grouped_payload_key
from .grouped_fast import pre_flags
from .grouped_batched import StackedGather, fill_batched, fill_stacked, metas_with_scales, prepare_batched
from .lane import PreLane, derive, lookup
from .layout import ExpertLayout, transport_view
from .payload import HIGH_PRECISION, PayloadMeta, assemble_output, assemble_parts
from .plan import GatherPlan
from .state import GroupedWeightState, KeptPayload, WeightState
from .transport import GatherContext, payload_key, prepare_grouped, prepare_payload, stats_key
from .unit_cast import unit_payload
from .unit_fill import fill_unit, take_mark

__all__ = ["GroupedHybridWeight", "HybridWeight"]

aten = torch.ops.aten

# ops whose results stay HybridWeight (what FSDP2 does to shard, pad, move and alias a parameter); every other
# op returns plain tensors (optimizer states, gradients-related math, quantization)
_PRESERVE = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor,
    aten.narrow.default, aten.copy_.default, aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
    aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.clone.default, aten.detach.default, aten.alias.default,
}


def _mutates_first(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class GatherMetadata(NamedTuple):
    """What `fsdp_pre_all_gather` hands to `fsdp_post_all_gather` through FSDP2 (a tuple: made at every unshard)."""

    payload: PayloadMeta
    plan: GatherPlan
    dtype: torch.dtype  # the gather dtype
    quantizer: Quantizer


class GroupedGatherMetadata(NamedTuple):
    """What a grouped weight's `fsdp_pre_all_gather` hands to its `fsdp_post_all_gather` through FSDP2."""

    metas: tuple[PayloadMeta, ...]
    plan: GatherPlan
    dtype: torch.dtype
    quantizers: tuple[Quantizer, ...]
    layout: ExpertLayout
    slot: int
    # (a stacked gather: the metas hold no scales, these do; stacked blocks: the slots hold the replicated tensors)
    stacked: StackedGather | StackedBlocks | None = None


def _sharded_param(local: "HybridWeight", module, attr: str, link: FSDPLink | None):
    """The DTensor parameter whose local tensor is `local` (its version counter sees in-place updates), or whose
    local tensor `local` was copied from (CPU offload moves it to the GPU before each all-gather)."""
    for p in (module._parameters.get(attr), link.sharded_param() if link is not None else None):
        mine = local_tensor(p)
        if mine is local or (isinstance(mine, HybridWeight) and mine._hq is local._hq):
            return p
    return None


def _mesh_info(st, mesh) -> tuple[int, int, object]:
    """(world size, this rank, process group: None for one rank) of FSDP2's shard mesh, asked once per mesh."""
    hit = st.mesh_info
    if hit is not None and hit[0] is mesh:
        return hit[1]
    ws = mesh.size()
    info = ws, (mesh.get_local_rank() if ws > 1 else 0), (mesh.get_group() if ws > 1 else None)
    st.mesh_info = (mesh, info)
    return info


_GATHER_COUNTER = {p: f"gather_{p}" for p in Phase}  # (formatting an enum per unshard costs more than the lookup)


def _sent(st, link: FSDPLink | None, inp: torch.Tensor, phase: str, ws: int) -> None:
    """Bookkeeping of an all-gather input about to be sent (to `ws` ranks)."""
    sig = (inp.shape, inp.dtype)  # (a torch.Size: a tuple, compared as one)
    if link is not None and st.last_sig is not None and sig != st.last_sig:
        link.renew_all_gather_outputs(inp, ws)  # the payload changed size: new outputs
    st.last_sig = sig
    st.counters[_GATHER_COUNTER[phase]] += 1
    st.counters["bytes_sent"] += inp.nbytes


@dataclasses.dataclass(frozen=True)
class _ShardLayout:
    """A Linear weight's layout under one quantizer, shape, world size, rank, gather dtype and override, checked once
    (`check_shard_layout`) and kept by the weight's state (`_shard_layout`)."""

    quantizer: Quantizer
    shape: tuple[int, ...]
    shard: RowShard
    derivable: bool
    halves: bool = True  # its padded all-gather input may be float16 items (layout.py, [Note: 16-bit items])


def _shard_layout(st, q, outer_size, ws: int, rank: int, dtype, override, halves: bool = True) -> _ShardLayout:
    """The weight's `_ShardLayout` for this unshard: looked up (one per quantizer and sharding; a new quantizer, e.g.
    after a recipe change, is a new entry: the entry holds it and is compared by identity), else checked before
    anything is quantized, sent or kept, and remembered."""
    key = (id(q), outer_size, ws, rank, dtype, override, halves)
    hit = st.shard_layouts.get(key)
    if hit is not None and hit.quantizer is q:
        return hit
    shape = tuple(outer_size)
    derivable = st.is_derivable(q, shape, dtype)
    check_shard_layout(q, st.name, shape, ws, dtype, override, derivable)
    if len(st.shard_layouts) >= 16:
        st.shard_layouts.clear()
    hit = st.shard_layouts[key] = _ShardLayout(q, shape, dim0_chunks(shape, ws)[rank], derivable, halves)
    return hit


def _grouped_layout(st, qs, outer_size, local_shape, ws: int, rank: int, dtype, override, halves: bool = True
                    ) -> tuple[tuple[int, ...], ExpertLayout, bool]:
    """(shape, layout, derivable) of a grouped weight for this unshard: looked up (one entry per quantizers and
    sharding: it holds the quantizers, so their ids in the key name them), else inferred and checked before anything
    is quantized or sent, and remembered."""
    key = (tuple(map(id, qs)), outer_size, local_shape, ws, rank, dtype, override, halves)
    hit = st.shard_layouts.get(key)
    if hit is not None:
        return hit[1]
    shape = tuple(outer_size)
    layout = ExpertLayout.infer(st.name, shape, tuple(local_shape), ws, rank, qs[0].describe, halves)
    derivable = st.is_derivable(qs, shape[1:], dtype)
    if layout.dim == 1:  # (dim 0: every expert is whole on one rank, nothing can straddle)
        for e, q in enumerate(qs):
            if q not in qs[:e]:
                check_shard_layout(q, f"{st.name} (Shard(1): rows of every expert)", shape[1:], ws, dtype, override,
                                   derivable)
    if len(st.shard_layouts) >= 16:
        st.shard_layouts.clear()
    st.shard_layouts[key] = (qs, (shape, layout, derivable))
    return shape, layout, derivable


def _set_context(st, local, module, param, shape, dtype, ws: int, rank: int, group, layout=None) -> None:
    """Remember this unshard's context for a later lazy gather; the last one is kept as it is when nothing changed
    (the same sharded tensor, module, parameter and sharding: every unshard after the first)."""
    ctx = st.ctx
    if (ctx is not None and ctx.local() is local and ctx.module() is module and ctx.shape == shape
            and ctx.dtype is dtype and ctx.group is group and ctx.world_size == ws and ctx.rank == rank
            and (ctx.layout is layout or ctx.layout == layout) and (ctx.param() if ctx.param is not None else None) is param):
        return
    st.ctx = GatherContext(local=weakref.ref(local), module=weakref.ref(module), shape=shape, dtype=dtype,
                           world_size=ws, rank=rank, group=group, device=local.device,
                           param=weakref.ref(param) if param is not None else None, layout=layout)


def _grouped_payload_key(param, dtype, layout: ExpertLayout, send, stacked: bool, qs, local=None,
                         blocks: bool = False) -> tuple | None:
    """Identifies a grouped weight's payload: its shard's values (`stats_key`), the layout, the directions sent, the
    receiver's fill, the sender's (`blocks`: `prepare_stacked_blocks`) and the quantizers (by identity: a new recipe
    makes new ones); None: not reusable."""
    key = stats_key(param, dtype, layout, local)
    return None if key is None else (key, tuple(send), stacked, blocks, tuple(map(id, qs)))


class HybridWeight(QuantizedGatherShard, torch.Tensor):
    """The high-precision weight of a converted Linear, as FSDP2 shards it: a thin wrapper around a plain
    tensor. Every op runs on the plain tensor (the optimizer, gradient clipping and state_dict see ordinary
    high-precision values; `state_dict()` returns the plain tensor); only FSDP2's all-gather hooks differ:
    they gather the quantized form the module's weight quantizer defines."""

    _data: torch.Tensor
    _hq: WeightState

    @staticmethod
    def __new__(cls, data: torch.Tensor, state: WeightState | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, state: WeightState | None = None):
        self._data = data
        self._hq = state if state is not None else WeightState()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = None

        def unwrap(t):
            nonlocal state
            if state is None:
                state = t._hq
            return t._data

        unwrapped = _unwrap_shallow(args, kwargs, unwrap)
        u_args, u_kwargs = unwrapped if unwrapped is not None else pytree.tree_map_only(HybridWeight, unwrap,
                                                                                          (args, kwargs))
        out = func(*u_args, **u_kwargs)
        if func in _PRESERVE:
            if isinstance(out, torch.Tensor):
                return cls(out, state)
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, state), out)  # (subclasses stay theirs)
        if _mutates_first(func) and args and isinstance(args[0], HybridWeight):
            return args[0]
        return out

    def __tensor_flatten__(self):
        return ["_data"], {"state": self._hq}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return HybridWeight(inner["_data"], ctx["state"])

    def __repr__(self, *, tensor_contents=None):
        return f"HybridWeight({self._data!r})"

    # -- FSDP2 all-gather extension ---------------------------------------------------------------
    @property
    def fsdp_pre_all_gather(self) -> "_PreAllGatherHook":
        return _PreAllGatherHook(self)

    # [Note: hooks outside inference mode]
    # The buffers an unshard allocates (the gathered parts, stacked expert slabs, FSDP2's all-gather outputs that
    # `_sent` renews) are kept for the later unshards. An evaluation under `torch.inference_mode()` would make them
    # inference tensors, which a later training unshard cannot write in place nor preserve the version of: so the hooks
    # run outside inference mode (under no_grad) where they are called inside it -- the same values, a bool test per
    # call otherwise.

    def _pre_hook(self, mesh, outer_size, module, mp_policy):
        if torch.is_grad_enabled():  # (FSDP2 calls the hooks under no_grad, except on its world-1 path)
            set_grad_mode(False)  # (a fraction of the host time of a `with torch.no_grad()`; twice per unshard)
            try:
                return self._pre_all_gather(mesh, outer_size, module, mp_policy)
            finally:
                set_grad_mode(True)
        if torch.is_inference_mode_enabled():  # ([Note: hooks outside inference mode])
            with torch.inference_mode(False), torch.no_grad():
                return self._pre_all_gather(mesh, outer_size, module, mp_policy)
        return self._pre_all_gather(mesh, outer_size, module, mp_policy)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if torch.is_grad_enabled():
            set_grad_mode(False)
            try:
                self._post_all_gather(outputs, metadata)
            finally:
                set_grad_mode(True)
        elif torch.is_inference_mode_enabled():  # ([Note: hooks outside inference mode])
            with torch.inference_mode(False), torch.no_grad():
                self._post_all_gather(outputs, metadata)
        else:
            self._post_all_gather(outputs, metadata)
        if out is not None:
            return None
        return self._hq.gathered._alias(), self._hq.inner

    def _pre_all_gather(self, mesh, outer_size, module, mp_policy):
        st = self._hq
        lane = lookup(st, self, mesh, outer_size, module, mp_policy, "weight")
        if lane is None or lane.quant is not module.weight_quantizer or lane.override != module.recipe.backward_override:
            lane = self._derive_lane(mesh, outer_size, module, mp_policy)
        setup, param, dtype, shape, ws = lane.setup, lane.param() if lane.param else None, lane.dtype, lane.shape, lane.ws
        plan = setup.plan
        key = payload_key(param, dtype, shape, ws, lane.layout.shard, plan.send, self if lane.own else None)
        kept, st.kept_payload = st.kept_payload, None
        got = None
        if key is not None and kept is not None and kept.key == key:  # same shard values, same directions
            own = st.tp_group is None  # (a tensor-parallel piece's decisions span two groups: not checked)
            rederive, fp = LEDGER.reused(st.name, self._data, kept.fp, st.data_checks if own else None, ws == 1 and own,
                                         "an all-gather payload kept from forward") if kept.fp is not None \
                else (False, None)
            if not rederive:  # (a write through `.data` since, seen at once: [Note: data-write check])
                got = kept.payload, kept.meta, fp
                st.counters["payload_reused"] += 1
        keeps = setup.keeps and st.reuse_payload and key is not None  # the backward unshard re-sends it unchanged
        if got is None:  # (a unit batch's payload, or this unit's batch: [Note: unit cast]; else this weight's own)
            got = unit_payload(self, lane, key, defer_check=keeps) or (
                *prepare_payload(self, param, lane.quant, plan.send, shape, ws, lane.rank, dtype, lane.group), None)
        payload, meta, fp = got
        if keeps:
            if fp is None:  # (the statistics' fingerprint where they were reduced for these values: no second read)
                fp = st.stats_fp if ws > 1 and st.stats_fp is not None and st.stats_key == key[0] else \
                    fingerprint(self._data) if st.data_checks.will_report(ws == 1) else None
            st.kept_payload = KeptPayload(key, payload, meta, fp)
        inp = transport_view(payload, shape, ws, lane.layout.halves)
        _sent(st, lane.link, inp, setup.phase, ws)
        st.deferred = plan.deferred
        if st.parts:
            st.set_inner(plan.materialize)  # what FSDP2 allocates before fsdp_post_all_gather fills it
        if st.ctx is None or st.ctx is not lane.ctx:
            _set_context(st, self, lane.module(), param, shape, dtype, ws, lane.rank, lane.group)
            lane.ctx = st.ctx
        return (inp,), GatherMetadata(meta, plan, dtype, lane.quant)

    def _derive_lane(self, mesh, outer_size, module, mp_policy) -> PreLane:
        """What this unshard's inputs give (`lane.py`), each step cached on its own; checked before anything is
        quantized or sent."""
        st = self._hq
        if not isinstance(module, Linear):
            raise TypeError(f"hybridq FSDP: HybridWeight belongs to a hybridq Linear, got {type(module).__name__}")
        q = module.weight_quantizer
        ws, rank, group = _mesh_info(st, mesh)
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        override = module.recipe.backward_override
        link = st.link(module)
        lay = _shard_layout(st, q, outer_size, ws, rank, dtype, override,  # (checked before anything is quantized)
                            link is not None and link.gathers_as_bytes())
        st.param_dtype = dtype
        param = _sharded_param(self, module, "weight", link)
        return derive(st, self, mesh, outer_size, module, mp_policy, "weight", quant=q, override=override, link=link,
                      param=param, ws=ws, rank=rank, group=group, dtype=dtype, shape=lay.shape, layout=lay,
                      derivable=lay.derivable)

    def _post_all_gather(self, outputs, metadata: GatherMetadata) -> None:
        meta, plan, dtype, q = metadata
        st = self._hq
        out = outputs[0]
        if st.unit_filled is not None and take_mark(st, metadata):  # (filled by its unit's leader: [Note: unit fill])
            st.set_inner(plan.materialize)
            return
        if id(plan) in st.fill_replays:  # (like the last unshard: its fill replayed, with the unit's or alone)
            ready = st.replay_ready(meta, plan, out, q, dtype)
            if ready is not None and (fill_unit(self, metadata, out, ready) or
                                      st.replay_fill(meta, plan, out, q, dtype, ready)):
                st.set_inner(plan.materialize)
                return
        adopt = received(out, (meta,))
        parts = complete_parts(q, assemble_output(meta, out, st.gathered_views), plan, dtype)
        first = st.gathered is None
        if first:
            st.create(q, meta.shape, dtype, out.device)
        if HIGH_PRECISION in plan.materialize:
            st.create_high_precision()
        out_ptr = out.untyped_storage().data_ptr()
        for d in plan.materialize:  # (a derived direction is never aliased, even where it is a view)
            st.fill(d, parts[d], adopt, alias=out_ptr if d in plan.send else None)
        if first:
            st.free_others(plan.materialize)
        st.set_inner(plan.materialize)  # (what aliases the all-gather output is FSDP2's to free, not ours)
        if not plan.local:  # (quantized here: never replayed, `record_fill`)
            st.record_fill(meta, plan, out, parts, q, dtype)


class GroupedHybridWeight(HybridWeight):
    """The high-precision `[E, out, in]` weight of a GroupedLinear (or of a converted expert module) as FSDP2
    shards it. Every op runs on the plain tensor; FSDP2's all-gather hooks gather each expert quantized."""

    _hq: GroupedWeightState

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return GroupedHybridWeight(inner["_data"], ctx["state"])

    def __repr__(self, *, tensor_contents=None):
        return f"GroupedHybridWeight({self._data!r})"

    def _pre_all_gather(self, mesh, outer_size, module, mp_policy):
        st: GroupedWeightState = self._hq
        layer = st.layer(module)
        lane = lookup(st, self, mesh, outer_size, module, mp_policy, st.attr)
        if lane is None or lane.quant is not layer.weight_quantizers() or lane.override != layer.recipe.backward_override:
            lane = self._derive_lane(mesh, outer_size, module, mp_policy, layer)
        setup, param, dtype, layout, qs = lane.setup, lane.param() if lane.param else None, lane.dtype, lane.layout, lane.quant
        plan = setup.plan
        if grouped_fast.on:  # (asked once per lane: [Note: grouped hooks' steady state])
            flags = pre_flags(st, lane, joins_blocks, stacked_block_switch)
            stacked, blocks = flags.stacked, flags.blocks
            key = grouped_payload_key(param, self, flags) if lane.own else _grouped_payload_key(
                param, dtype, layout, plan.send, stacked, qs, None, blocks=blocks)
        else:
            # (the receiver fills the stacked buffers straight from the gathered bytes: no per-expert metadata)
            stacked = not plan.local and HIGH_PRECISION not in plan.materialize
            blocks = joins_blocks(qs, plan.send, layout)  # (block-format experts: [Note: stacked block payload])
            key = _grouped_payload_key(param, dtype, layout, plan.send, stacked, qs, self if lane.own else None,
                                       blocks=blocks)
        kept, st.kept_payload = st.kept_payload, None
        rederive = fp = None
        if key is not None and kept is not None and kept.key == key:  # same expert values, same directions
            rederive, fp = LEDGER.reused(st.name, self._data, kept.fp, st.data_checks, lane.ws == 1,
                                         "an all-gather payload kept from forward") if kept.fp is not None \
                else (False, None)
        if rederive is False:  # (a write through `.data` since, seen at once: [Note: data-write check])
            payload, (metas, slot, stacked) = kept.payload, kept.meta
            st.counters["payload_reused"] += 1
        else:
            batched = (prepare_stacked_blocks(self, qs, plan.send, layout, dtype) if blocks else None) or \
                prepare_batched(self, param, qs, plan.send, layout, dtype, lane.group, stacked)
            payload, metas, slot, stacked = batched if batched is not None else (
                *prepare_grouped(self, param, qs, plan.send, layout, dtype, lane.group), None)
        if setup.keeps and st.reuse_payload and key is not None:  # the backward unshard re-sends it unchanged
            st.kept_payload = KeptPayload(key, payload, (metas, slot, stacked),
                                          fp if fp is not None else fingerprint(self._data)
                                          if st.data_checks.will_report(lane.ws == 1) else None)
        inp = layout.transport(payload, slot)
        _sent(st, lane.link, inp, setup.phase, lane.ws)
        st.set_deferred(plan.deferred)
        if st.gathered is not None:
            st.set_inner(plan.materialize)
        if st.ctx is None or st.ctx is not lane.ctx:
            _set_context(st, self, lane.module(), param, lane.shape, dtype, lane.ws, lane.rank, lane.group, layout)
            lane.ctx = st.ctx
        return (inp,), GroupedGatherMetadata(tuple(metas), plan, dtype, qs, layout, slot, stacked)

    def _derive_lane(self, mesh, outer_size, module, mp_policy, layer) -> PreLane:
        """What this unshard's inputs give (`lane.py`), each step cached on its own; checked before anything is
        quantized or sent."""
        st: GroupedWeightState = self._hq
        qs = layer.weight_quantizers()
        if st.quantizers is not None and qs != st.quantizers:
            raise RecipeError(
                f"{layer.name}: its weight is already sharded by fully_shard with quantized all-gathers in "
                f"{st.quantizers[0].describe()}; a recipe with another weight format ({qs[0].describe()}) must be set "
                f"before fully_shard (apply_hybrid_fsdp, convert_experts, or GroupedLinear.recipe)")
        ws, rank, group = _mesh_info(st, mesh)
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        override = layer.recipe.backward_override
        link = st.link(module)
        shape, layout, derivable = _grouped_layout(st, qs, outer_size, self.shape, ws, rank, dtype, override,
                                                   link is not None and link.gathers_as_bytes())
        st.param_dtype = dtype
        param = _sharded_param(self, module, st.attr, link)
        return derive(st, self, mesh, outer_size, module, mp_policy, st.attr, quant=qs, override=override, link=link,
                      param=param, ws=ws, rank=rank, group=group, dtype=dtype, shape=shape, layout=layout,
                      derivable=derivable)

    def _post_all_gather(self, outputs, metadata: GroupedGatherMetadata) -> None:
        plan, dtype, qs, layout = metadata.plan, metadata.dtype, metadata.quantizers, metadata.layout
        st: GroupedWeightState = self._hq
        gathered = outputs[0]
        first = st.gathered is None
        if first:
            st.create(qs, layout, dtype, gathered.device)
        metas = metadata.metas
        if isinstance(metadata.stacked, StackedBlocks):
            if fill_stacked_blocks(st, qs, metas, gathered, metadata.slot, layout, plan, dtype, metadata.stacked):
                metas = None
            else:
                metas = metadata.stacked.expert_metas(metas, gathered, metadata.slot, layout)
        elif metadata.stacked is not None:
            if fill_stacked(st, metadata.stacked, gathered, metadata.slot, layout, plan):
                metas = None
            else:
                metas = metas_with_scales(metas, metadata.stacked)
        adopt = received(gathered, metas) if metas is not None else None
        if (metas is not None and not fill_batched(st, qs, metas, gathered, metadata.slot, layout, plan, dtype)
                and not fill_stacked_blocks(st, qs, metas, gathered, metadata.slot, layout, plan, dtype)):
            if st.slabs:  # (experts' buffers are views of one allocation: filled by copies, never re-pointed)
                st.alloc_slabs(plan.materialize)
                adopt = None
            for e, (est, q, meta) in enumerate(zip(st.experts, qs, metas)):
                parts = assemble_parts(meta, layout.expert_bytes(gathered, metadata.slot, e, meta,
                                                                 expert_major=layout.dim == 1))
                parts = complete_parts(q, parts, plan, dtype)
                if HIGH_PRECISION in plan.materialize:
                    est.create_high_precision()
                for d in plan.materialize:
                    est.fill(d, parts[d], adopt)
        if first:
            for est in st.experts:
                est.free_others(plan.materialize)
        st.set_inner(plan.materialize)


def _unwrap_shallow(args: tuple, kwargs: dict, unwrap):
    """(args, kwargs) with `unwrap(w)` for every HybridWeight `w`, where they are the arguments aten ops take: tensors
    and scalars, or flat lists / tuples of them (the optimizer's foreach ops: a list of every parameter, ~60 in a
    4-layer MoE model, where pytree costs ~0.4 ms per op); None for anything nested deeper (pytree then). Same order
    of visits as pytree's (the first HybridWeight met names the state of a preserved result)."""
    def seq(items):
        out, changed = [], False
        for x in items:
            if isinstance(x, HybridWeight):
                out.append(unwrap(x))
                changed = True
            elif isinstance(x, (list, tuple, dict)):
                return None, False
            else:
                out.append(x)
        return out, changed

    u_args = []
    for a in args:
        if isinstance(a, HybridWeight):
            u_args.append(unwrap(a))
        elif type(a) is torch.Size:  # (ints)
            u_args.append(a)
        elif type(a) in (list, tuple):  # (exact types: a subclass, e.g. a namedtuple, is left to pytree)
            inner, changed = seq(a)
            if inner is None:
                return None
            u_args.append(type(a)(inner) if changed else a)
        elif isinstance(a, (list, tuple, dict)):
            return None
        else:
            u_args.append(a)
    if not kwargs:
        return tuple(u_args), kwargs
    values, _ = seq(kwargs.values())
    return None if values is None else (tuple(u_args), dict(zip(kwargs, values)))


class _PreAllGatherHook:
    """A weight's `fsdp_pre_all_gather` as FSDP2 gets it: FSDP2 calls `inspect.signature` on the hook at every
    all-gather (to tell its one-argument form from the five-argument one), which for a bound method builds a new
    Signature each time (~25 us of host time per weight per unshard); this callable carries its signature."""

    __slots__ = ("_weight",)
    __signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                       for n in ("mesh", "outer_size", "outer_stride", "module", "mp_policy")])

    def __init__(self, weight: HybridWeight):
        self._weight = weight

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self._weight._pre_hook(mesh, outer_size, module, mp_policy)
