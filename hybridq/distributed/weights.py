"""The sharded high-precision weight FSDP2 holds (`HybridWeight`) and its all-gather hooks, which gather the
quantized form the module's weight quantizer defines into a `GatheredWeight`.

Flow per unshard (all format knowledge stays in the formats, reached through `payload.py`):

    sharded fp32 shard --(cast to param_dtype)--> shard_stats --(MAX all-reduce, or precomputed)--> reduced
    quantize the shard with the reduced statistics --> dim-0 buffers --> one uint8 payload per rank
    FSDP2 all-gather --> per-buffer concatenation of each rank's owned block rows --> assign_gathered
    --> derive the other direction where exact --> copy into the unsharded weight's own buffers

The unsharded weight's two parts always exist as objects; their tensors are allocated and freed by FSDP2
through the list of inner tensors handed to it (storage resize, as FSDP2 does for plain parameters), so
autograd's saved views stay valid across reshard / re-gather and nothing quantized outlives a reshard.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref

import torch
from torch.utils import _pytree as pytree

from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..nn.linear import Linear
from ..weight_forms import QuantizedGatherShard
from .checks import check_shard_layout
from .fsdp_adapter import FSDPLink, phase_of
from .payload import HIGH_PRECISION, PayloadMeta, assemble_parts
from .plan import GatherPlan, make_plan
from .state import KeptPayload, WeightState
from .transport import GatherContext, payload_key, prepare_payload, transport_view

__all__ = ["HybridWeight"]

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


@dataclasses.dataclass(frozen=True)
class GatherMetadata:
    """What `fsdp_pre_all_gather` hands to `fsdp_post_all_gather` through FSDP2."""

    payload: PayloadMeta
    plan: GatherPlan
    dtype: torch.dtype  # the gather dtype
    quantizer: Quantizer


def _sharded_param(local: "HybridWeight", module, link: FSDPLink | None):
    """The DTensor parameter whose local tensor is `local` (its version counter sees in-place updates), or whose
    local tensor `local` was copied from (CPU offload moves it to the GPU before each all-gather)."""
    for p in (module._parameters.get("weight"), link.sharded_param() if link is not None else None):
        mine = getattr(p, "_local_tensor", None)
        if mine is local or (isinstance(mine, HybridWeight) and mine._hq is local._hq):
            return p
    return None


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

        u_args, u_kwargs = pytree.tree_map_only(HybridWeight, unwrap, (args, kwargs))
        out = func(*u_args, **u_kwargs)
        if func in _PRESERVE:
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
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        st = self._hq
        if not isinstance(module, Linear):
            raise TypeError(f"hybridq FSDP: HybridWeight belongs to a hybridq Linear, got {type(module).__name__}")
        q = module.weight_quantizer
        ws = mesh.size()
        rank = mesh.get_local_rank() if ws > 1 else 0
        group = mesh.get_group() if ws > 1 else None
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        shape = tuple(outer_size)
        override = module.recipe.backward_override
        derivable = st.is_derivable(q, shape, dtype)
        layout = (id(q), shape, ws, dtype, override)
        if layout not in st.layouts_checked:  # before anything is quantized, sent or kept
            check_shard_layout(q, st.name, shape, ws, dtype, override, derivable)
            st.layouts_checked.add(layout)
        st.param_dtype = dtype
        link = st.link(module)
        group_state = link.group if link is not None else None
        phase = phase_of(group_state)
        ra = link.reshard_after_forward() if link is not None else None
        extra = set(st.backward_extra)
        if link is not None and not link.reshard_after_backward():
            extra.add(ROWWISE)  # parameters stay unsharded into the next forward
        plan = make_plan(phase=phase, reshard_after_forward=ra, backward_override=override, derivable=derivable,
                         known=link is not None, backward_extra=extra)
        with torch.no_grad():
            param = _sharded_param(self, module, link)
            key = payload_key(param, dtype, shape, ws, rank, plan.send)
            kept, st.kept_payload = st.kept_payload, None
            if key is not None and kept is not None and kept.key == key:
                payload, meta = kept.payload, kept.meta  # same shard values, same directions: nothing to quantize
                st.counters["payload_reused"] += 1
            else:
                payload, meta = prepare_payload(self, param, q, plan.send, shape, ws, rank, dtype, group)
            if st.reuse_payload and key is not None and phase == "forward" and plan.deferred and make_plan(
                    phase="backward", reshard_after_forward=ra, backward_override=override, derivable=derivable,
                    known=True, backward_extra=extra).send == plan.send:
                # the backward unshard re-gathers the same directions (e.g. per-tensor FP8 rowwise, columnwise
                # derived): keep this shard's payload until then instead of casting and quantizing it again
                st.kept_payload = KeptPayload(key, payload, meta)
            inp = transport_view(payload, shape, ws)
        sig = (tuple(inp.shape), inp.dtype)
        if link is not None and st.last_sig is not None and sig != st.last_sig:
            link.drop_all_gather_outputs()  # the payload changed size: let FSDP2 allocate new outputs
        st.last_sig = sig
        st.deferred = set(plan.deferred)
        if st.parts:
            st.set_inner(plan.materialize)  # what FSDP2 allocates before fsdp_post_all_gather fills it
        st.ctx = GatherContext(local=weakref.ref(self), module=weakref.ref(module), shape=shape, dtype=dtype,
                               world_size=ws, rank=rank, group=group, device=self.device,
                               param=weakref.ref(param) if param is not None else None)
        st.counters[f"gather_{phase}"] += 1
        st.counters["bytes_sent"] += inp.numel() * inp.element_size()
        return (inp,), GatherMetadata(meta, plan, dtype, q)

    def fsdp_post_all_gather(self, outputs, metadata: GatherMetadata, param_dtype, *, out=None):
        meta, plan, dtype, q = metadata.payload, metadata.plan, metadata.dtype, metadata.quantizer
        st = self._hq
        with torch.no_grad():
            gathered = outputs[0].reshape(-1).view(torch.uint8).view(meta.world_size, -1)
            if gathered.is_cuda:
                # fsdp_pre_all_gather ran on FSDP2's all-gather copy-in stream: the replicated tensors (per-tensor
                # scales, tile-scale grids, global amaxes) were allocated there and are read here on the current
                # stream. Without this, once the metadata is dropped the caching allocator hands their blocks to
                # the next weight's pre-all-gather (copy-in stream) while this stream's reads are still queued.
                stream = torch.cuda.current_stream(gathered.device)
                for rep in meta.replicated.values():
                    for t in rep.values():
                        if t is not None and t.is_cuda:
                            t.record_stream(stream)
            parts = assemble_parts(meta, gathered)
            if plan.local:  # quantized here from the gathered high-precision weight (the full weight)
                r, c = q.quantize_parts(parts[HIGH_PRECISION].data, ROWWISE in plan.local, COLUMNWISE in plan.local)
                parts.update({d: p for d, p in ((ROWWISE, r), (COLUMNWISE, c)) if d in plan.local})
            elif plan.derive:
                parts[COLUMNWISE] = q.derive_part(parts[ROWWISE], COLUMNWISE, dtype)
            first = st.gathered is None
            if first:
                st.create(q, meta.shape, dtype, gathered.device)
            if HIGH_PRECISION in plan.materialize:
                st.create_high_precision()
            # never adopt the all-gather output or a replicated tensor (a kept payload's metadata may be reused)
            out_ptr = outputs[0].untyped_storage().data_ptr()
            adopt = {"forbidden": {out_ptr} | {
                t.untyped_storage().data_ptr() for rep in meta.replicated.values() for t in rep.values()
                if t is not None}}
            for d in plan.materialize:  # (a derived direction is never aliased, even where it is a view)
                st.fill(d, parts[d], adopt, alias=out_ptr if d in plan.send else None)
            if first:
                st.free_others(plan.materialize)
            st.set_inner(plan.materialize)  # (what aliases the all-gather output is FSDP2's to free, not ours)
        if out is not None:
            return None
        return st.gathered._alias(), st.inner


# FSDP2 inspects the hook's signature on every all-gather; a precomputed __signature__ makes that a lookup
HybridWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(HybridWeight.fsdp_pre_all_gather)
