"""FSDP2 integration: `apply_hybrid_fsdp`, the sharded weight subclass with quantized all-gather, and
`precompute_scales`.

Flow per converted weight (all format knowledge stays in the formats, reached through the quantizer's
`shard_stats` / `reference_parts(shard=, stats=)` / `derive_part` / `buffer_hints` and the parts'
`extract_buffers` / `assign_gathered`):

    sharded fp32 shard --(cast to param_dtype)--> shard_stats --(MAX all-reduce, or precomputed)--> reduced
    quantize the shard with the reduced statistics --> dim-0 buffers --> one uint8 payload per rank
    FSDP2 all-gather --> per-buffer concatenation of each rank's owned block rows --> assign_gathered
    --> derive the other direction where exact --> copy into the unsharded weight's own buffers

The unsharded parameter FSDP2 registers on the module is a `GatheredWeight` (a QuantizedTensor) whose two
parts always exist as objects; their tensors are allocated and freed by FSDP2 through the list of inner
tensors this module hands it (storage resize, as FSDP2 does for plain parameters), so autograd's saved views
stay valid across reshard / re-gather and nothing quantized outlives a reshard.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import math
import warnings
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..formats._sharding import dim0_chunks
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats.identity import IdentityPart
from ..nn.convert import ConversionReport, convert_linears
from ..nn.linear import Linear
from ..recipe import CustomRecipe, Role
from ..tensor import QuantizedTensor
from .payload import DIRECTIONS, HIGH_PRECISION, assemble_parts, build_payload, gather_bytes_for, quantize_shard

log = logging.getLogger("hybridq")
aten = torch.ops.aten

__all__ = ["apply_hybrid_fsdp", "precompute_scales", "HybridWeight", "GatheredWeight", "gather_bytes_per_step",
           "bytes_table"]

# payload element types for an unevenly sharded weight (FSDP2 then wants every all-gather input to have the
# padded shard's shape); gloo has no int16 all-gather, float16 views are only copied, never computed on
_ITEM_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


# ---- the plan: what one unshard gathers, derives and materializes -------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    send: tuple[str, ...]  # directions quantized on each rank and all-gathered
    materialize: tuple[str, ...]  # directions filled into the unsharded weight
    derive: bool  # columnwise computed from the gathered rowwise after the gather
    deferred: tuple[str, ...]  # directions a later (backward) unshard will fill
    local: tuple[str, ...] = ()  # quantized on every rank from the gathered high-precision weight (not sent)


def _order(dirs) -> tuple[str, ...]:
    return tuple(d for d in DIRECTIONS if d in dirs)


def make_plan(*, phase: str, reshard_after_forward: bool | None, backward_override: str | None,
              derivable: bool, known: bool, backward_extra=()) -> _Plan:
    return _make_plan(phase, reshard_after_forward, backward_override, derivable, known, frozenset(backward_extra))


@functools.lru_cache(maxsize=256)  # (a handful of distinct arguments; asked for on every all-gather)
def _make_plan(phase: str, reshard_after_forward: bool | None, backward_override: str | None, derivable: bool,
               known: bool, backward_extra: frozenset) -> _Plan:
    """phase: "forward" or "backward". reshard_after_forward None = unknown (conservative). derivable: the
    columnwise form is an exact transform of the rowwise one. known=False: FSDP2 internals were not found, so
    the payload must not change between unshards (every unshard sends the same directions). backward_extra:
    directions an earlier backward had to gather lazily (activation recompute reads the rowwise form).

    backward_override="high_precision": backward reads the weight in the gather dtype (FSDP's param_dtype), so the
    HIGH_PRECISION "direction" (the shard itself) is what backward gathers. When it is gathered, any quantized
    direction of the same unshard is quantized from it on every rank (bitwise the one-device quantization of
    the full weight) instead of being sent too: reshard_after_forward=False then sends param_dtype bytes only."""
    bwd = {COLUMNWISE} if backward_override is None else (
        {ROWWISE} if backward_override == "dequantized" else {HIGH_PRECISION})
    deferred: set[str] = set()
    if phase == "backward":
        mat = set(bwd) | set(backward_extra)
    else:
        mat = {ROWWISE}
        if reshard_after_forward:
            deferred = bwd - mat  # backward re-gathers them
        else:
            mat |= bwd  # no backward unshard: everything backward reads comes now

    def sends(dirs):
        if HIGH_PRECISION in dirs:
            return {HIGH_PRECISION}
        return {ROWWISE if (d == COLUMNWISE and derivable) else d for d in dirs}

    send = sends(mat) or {ROWWISE}
    if not known:
        send = sends({ROWWISE} | bwd)
    local = (mat - {HIGH_PRECISION}) if HIGH_PRECISION in send else set()
    derive = COLUMNWISE in mat and COLUMNWISE not in send and not local
    return _Plan(_order(send), _order(mat), derive, _order(deferred), _order(local))


# ---- FSDP2 internals (looked up defensively; absent -> conservative constant payload) ------------------

def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12 (grouped fully_shard)
    if groups is None:
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return [g for g in groups if g is not None]


def _find_fsdp_param(roots, module: nn.Module):
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return None
    seen = set()
    for root in roots:
        if root is None:
            continue
        for m in root.modules():
            if id(m) in seen or not isinstance(m, FSDPModule):
                continue
            seen.add(id(m))
            try:
                groups = _param_groups(m._get_fsdp_state())
            except Exception:  # noqa: BLE001 - internals differ: fall back
                continue
            for g in groups:
                for p in getattr(g, "fsdp_params", ()):
                    info = getattr(p, "_module_info", None)
                    if info is not None and info.module is module and info.param_name == "weight":
                        return p, g
    return None


def _phase_of(group) -> str:
    name = getattr(getattr(group, "_training_state", None), "name", "") if group is not None else ""
    if name in ("PRE_BACKWARD", "POST_BACKWARD"):
        return "backward"
    if name == "FORWARD":
        return "forward"
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


# ---- per-parameter state shared by every alias of one sharded weight ---------------------------------

class _WeightState:
    def __init__(self, root: nn.Module | None = None):
        self.root = weakref.ref(root) if root is not None else None
        self.fsdp = None  # None: not looked up yet; False: not found; (weakref FSDPParam, weakref group)
        self.stats_key = None
        self.stats: torch.Tensor | None = None
        self.param_dtype: torch.dtype | None = None
        self.derivable: dict = {}
        self.gathered: GatheredWeight | None = None
        self.parts: dict[str, object] = {}  # the unsharded weight's parts (own tensors)
        self.owned: dict[str, list[torch.Tensor]] = {}
        self.inner: list[torch.Tensor] = []  # handed to FSDP2: allocated before, freed at reshard
        self.aliased: set[int] = set()  # ids of own tensors that are views of FSDP2's all-gather output
        self.deferred: set[str] = set()
        self.backward_extra: set[str] = set()
        self.last_sig = None
        self.ctx: dict | None = None
        self.device: torch.device | None = None
        self.counters: collections.Counter = collections.Counter()
        self.kept_payload: tuple | None = None  # (key, payload, meta) of the forward unshard, for the backward one
        self.reuse_payload = True

    def __deepcopy__(self, memo):
        new = _WeightState(self.root() if self.root is not None else None)
        new.reuse_payload = self.reuse_payload
        return new

    # FSDP2 handles ------------------------------------------------------------------------------
    def handle(self, module):
        if self.fsdp is None:
            found = _find_fsdp_param([module, self.root() if self.root is not None else None], module)
            self.fsdp = (weakref.ref(found[0]), weakref.ref(found[1])) if found else False
        if self.fsdp is False:
            return None
        p, g = self.fsdp[0](), self.fsdp[1]()
        if p is None or g is None:
            self.fsdp = None
            return None
        return p, g

    # the unsharded weight's own buffers ---------------------------------------------------------------
    def create(self, q: Quantizer, shape, dtype, device) -> "GatheredWeight":
        m, k = _rows(shape), shape[-1]
        # a direction the format cannot take for this shape (e.g. columnwise with a backward override) has no part
        can = [q.shape_rule(m, k, d == ROWWISE, d == COLUMNWISE) is None for d in (ROWWISE, COLUMNWISE)]
        desc = q.quantize_parts(torch.empty(m, k, dtype=dtype, device="meta"), *can)
        owned_by_id: dict[int, torch.Tensor] = {}
        for d, p in zip((ROWWISE, COLUMNWISE), desc):
            if p is None:
                self.parts[d], self.owned[d] = None, []
                continue
            fields, mine = {}, []
            for n, t in p.tensors().items():
                if t is None:
                    fields[n] = None
                    continue
                if id(t) not in owned_by_id:
                    owned_by_id[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
                fields[n] = owned_by_id[id(t)]
                if not any(fields[n] is x for x in mine):
                    mine.append(fields[n])
            self.parts[d] = type(p)(rows=p.rows, cols=p.cols, columnwise=p.columnwise, **fields, **p.meta())
            self.owned[d] = mine
        self.parts[HIGH_PRECISION], self.owned[HIGH_PRECISION] = None, []  # created when first gathered
        self.device = device
        self.gathered = GatheredWeight(self.parts[ROWWISE], self.parts[COLUMNWISE], shape=shape, dtype=dtype,
                                       state=self)
        return self.gathered

    def create_high_precision(self) -> None:
        """The unsharded weight's high-precision buffer ([rows, K] in the gather dtype), allocated on first use
        (its storage is then allocated and freed with the others)."""
        if self.parts.get(HIGH_PRECISION) is not None:
            return
        g = self.gathered
        m, k = _rows(g.shape), g.shape[-1]
        data = torch.empty(m, k, dtype=g.dtype, device=self.device)
        self.parts[HIGH_PRECISION] = IdentityPart(rows=m, cols=k, columnwise=False, data=data)
        self.owned[HIGH_PRECISION] = [data]

    def materialized(self, d: str) -> bool:
        return all(t.numel() == 0 or t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
                   for t in self.owned.get(d, ()))

    def _unique(self, dirs) -> list[torch.Tensor]:
        """The own tensors of `dirs` whose storage is ours (not those aliasing FSDP2's all-gather output)."""
        out: list[torch.Tensor] = []
        for d in dirs:
            for t in self.owned.get(d, ()):
                if id(t) not in self.aliased and not any(t is x for x in out):
                    out.append(t)
        return out

    def set_inner(self, dirs) -> None:
        self.inner[:] = self._unique(dirs)

    def free_others(self, keep) -> None:
        keep_t = self._unique(keep)
        for t in self._unique(DIRECTIONS):
            if not any(t is x for x in keep_t) and t.untyped_storage().nbytes():
                t.untyped_storage().resize_(0)

    def fill(self, d: str, src, adopt: dict | None = None, alias: int | None = None) -> None:
        """Put `src`'s tensors into the unsharded weight's own tensors of direction `d`. With `adopt` (a dict of
        storages already taken in this unshard, "forbidden": storages never to take) and `alias` (the storage of
        FSDP2's all-gather output, for a direction that was gathered): a source tensor that is a view of the
        all-gather output (a payload of one buffer: per-tensor FP8 or 128x128-tile data, the high-precision shard)
        is aliased -- the own tensor points at it, and FSDP2 allocates and frees that storage around each unshard
        as it does for a plain parameter; a fresh, exclusively owned, contiguous, 16-byte aligned allocation of exactly the right size (a derived
        direction, a concatenated or re-laid-out buffer) becomes the own tensor's storage (`set_`); anything
        else is copied."""
        dst = self.parts[d]
        for n, t in dst.tensors().items():
            if t is None:
                continue
            s = getattr(src, n)
            if tuple(s.shape) != tuple(t.shape) or s.dtype != t.dtype:
                raise RuntimeError(f"hybridq FSDP: gathered {d} {n} is {tuple(s.shape)} {s.dtype}, the unsharded "
                                   f"weight holds {tuple(t.shape)} {t.dtype}")
            if alias is not None and type(s) is torch.Tensor and s.untyped_storage().data_ptr() == alias \
                    and s.device == t.device:
                if not (t.untyped_storage().data_ptr() == alias and t.storage_offset() == s.storage_offset()
                        and t.stride() == s.stride()):
                    t.set_(s.untyped_storage(), s.storage_offset(), s.shape, s.stride())
                self.aliased.add(id(t))
                self.counters["aliased"] += 1
                continue
            if id(t) in self.aliased:  # it pointed at an all-gather output: it gets its own storage again
                self.aliased.discard(id(t))
                t.set_(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
            need = t.numel() * t.element_size()
            if adopt is not None and _adoptable(s, t, need, adopt):
                adopt[s.untyped_storage().data_ptr()] = True
                t.set_(s.untyped_storage(), 0, t.shape, t.stride())
                self.counters["adopted"] += 1
                continue
            if t.untyped_storage().nbytes() < need:
                t.untyped_storage().resize_(need)
            t.copy_(s)

    # statistics ---------------------------------------------------------------------------------
    def reduced_stats(self, q, x2d, shard, key, group):
        if key is not None and self.stats_key == key:
            self.counters["stats_precomputed"] += 1
            return self.stats
        local = q.shard_stats(x2d, shard)
        if local is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            self.counters["stats_allreduce"] += 1
        self.stats_key, self.stats = key, local
        return local

    # lazy materialization (a direction nobody planned for: activation recompute, manual unshard, ...) ----
    def ensure(self, d: str) -> None:
        if not self.parts or self.parts.get(d) is None or d in self.deferred or self.materialized(d):
            return
        ctx = self.ctx
        param = ctx["param"]() if ctx and ctx.get("param") is not None else None
        local = param._local_tensor.to(ctx["device"]) if param is not None else (ctx["local"]() if ctx else None)
        module = ctx["module"]() if ctx else None
        if local is None or module is None:
            raise RuntimeError(f"hybridq FSDP: the unsharded weight has no {d} form and the sharded weight it "
                               f"came from is gone")
        q = module.weight_quantizer
        derivable = d == COLUMNWISE and self.is_derivable(q, ctx["shape"], ctx["dtype"])
        send = (ROWWISE,) if derivable else (d,)
        with torch.no_grad():
            parts = _gather_now(local, q, send, ctx)
            src = q.derive_part(parts[ROWWISE], COLUMNWISE, ctx["dtype"]) if derivable else parts[d]
            self.fill(d, src)
        self.inner[:] = self._unique([x for x in DIRECTIONS if self.materialized(x)])
        self.counters["lazy_gathers"] += 1
        if torch._C._current_graph_task_id() != -1:  # e.g. activation recompute: gather it with backward's
            self.backward_extra.add(d)

    def is_derivable(self, q, shape, dtype) -> bool:
        key = (id(q), tuple(shape), dtype)
        if key not in self.derivable:
            m, k = _rows(shape), shape[-1]
            r, _ = q.quantize_parts(torch.empty(m, k, dtype=dtype, device="meta"), True, False)
            try:
                self.derivable[key] = q.derive_part(r, COLUMNWISE, dtype) is not None
            except Exception:  # noqa: BLE001 - a derivation that cannot run on meta: gather it
                self.derivable[key] = False
        return self.derivable[key]


def _adoptable(s: torch.Tensor, t: torch.Tensor, need: int, adopt: dict) -> bool:
    if s is t or type(s) is not torch.Tensor or s.device != t.device or need == 0 or s.storage_offset() != 0:
        return False
    st = s.untyped_storage()
    ptr = st.data_ptr()
    if st.nbytes() != need or ptr in adopt or ptr in adopt.get("forbidden", ()) or ptr % 16:
        return False
    if t.untyped_storage().data_ptr() == ptr or not s.is_contiguous() or tuple(s.stride()) != tuple(t.stride()):
        return False
    return torch._C._storage_Use_Count(st._cdata) <= 2  # no other tensor (view) shares it


def _rows(shape) -> int:
    return math.prod(shape[:-1]) if len(shape) > 1 else 1


def _transport(payload: torch.Tensor, shape, ws: int) -> torch.Tensor:
    """The all-gather input: the flat payload, or (uneven dim-0 sharding) a view with the padded shard's shape,
    which FSDP2 requires of every input then."""
    if shape[0] % ws == 0:
        return payload
    chunk = -(-shape[0] // ws)
    n = chunk * math.prod(shape[1:])
    for size, dt in _ITEM_DTYPES.items():
        if size * n >= payload.numel():
            buf = payload
            if size * n > payload.numel():
                buf = torch.cat([payload, payload.new_zeros(size * n - payload.numel())])
            return buf.view(dt).view((chunk,) + tuple(shape[1:]))
    raise RuntimeError(f"hybridq FSDP: quantized payload ({payload.numel()} bytes) exceeds 8 bytes per element "
                       f"of the padded shard {chunk}x{tuple(shape[1:])}")


def _stats_key(param, dtype, shard):
    """Identifies the values the statistics were computed from. In-place updates (optimizer, load_state_dict)
    bump the version counter of the tensor they are called on: the DTensor parameter (FSDP2), or its local
    tensor; never the wrapped plain tensor (it is updated below the autograd / version-counter keys). Without
    the parameter the statistics are not cached."""
    if param is None:
        return None
    local = param._local_tensor
    return (id(param), param._version, id(local), local._version, local._data.data_ptr(), dtype, shard)


def _payload_key(param, dtype, shape, ws: int, rank: int, send) -> tuple | None:
    """Identifies a payload: the shard's values (see `_stats_key`) and the directions sent; None: not reusable."""
    key = _stats_key(param, dtype, dim0_chunks(shape, ws)[rank])
    return None if key is None else (key, tuple(shape), ws, tuple(send))


def _prepare(local: "HybridWeight", param, q: Quantizer, send, shape, ws: int, rank: int, dtype, group):
    shards = dim0_chunks(shape, ws)
    shard = shards[rank]
    data = local._data
    x2d = data.to(dtype).reshape(shard.length, shape[-1])
    stats = None
    if ws > 1 and any(d != HIGH_PRECISION for d in send):
        # every rank takes part in the reduction (a whole shard beside empty ones included)
        key = _stats_key(param, dtype, shard)
        stats = local._hq.reduced_stats(q, x2d, shard, key, group)
    parts = quantize_shard(q, x2d, shard, send, stats)
    return build_payload(q, parts, shard, shards, shape, x2d.device)


def _gather_now(local: "HybridWeight", q: Quantizer, send, ctx) -> dict:
    """An all-gather outside FSDP2 (lazy materialization): every rank must take the same path."""
    ws, rank, group = ctx["ws"], ctx["rank"], ctx["group"]
    param = ctx["param"]() if ctx.get("param") is not None else None
    payload, meta = _prepare(local, param, q, send, ctx["shape"], ws, rank, ctx["dtype"], group)
    if ws == 1:
        gathered = payload.view(1, -1)
    else:
        gathered = payload.new_empty(ws * payload.numel())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(gathered, payload, group=group)
        gathered = gathered.view(ws, -1)
    return assemble_parts(meta, gathered)


def _sharded_param(local: "HybridWeight", module, handle):
    """The DTensor parameter whose local tensor is `local` (its version counter sees in-place updates), or whose
    local tensor `local` was copied from (CPU offload moves it to the GPU before each all-gather)."""
    for p in (module._parameters.get("weight"), getattr(handle[0], "sharded_param", None) if handle else None):
        mine = getattr(p, "_local_tensor", None)
        if mine is local or (isinstance(mine, HybridWeight) and mine._hq is local._hq):
            return p
    return None


# ---- the sharded high-precision weight ---------------------------------------------------------------

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


class HybridWeight(torch.Tensor):
    """The high-precision weight of a converted Linear, as FSDP2 shards it: a thin wrapper around a plain
    tensor. Every op runs on the plain tensor (the optimizer, gradient clipping and state_dict see ordinary
    high-precision values; `state_dict()` returns the plain tensor); only FSDP2's all-gather hooks differ:
    they gather the quantized form the module's weight quantizer defines."""

    _data: torch.Tensor
    _hq: _WeightState

    @staticmethod
    def __new__(cls, data: torch.Tensor, state: _WeightState | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, state: _WeightState | None = None):
        self._data = data
        self._hq = state if state is not None else _WeightState()

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
            return pytree.tree_map_only(torch.Tensor, lambda t: HybridWeight(t, state), out)
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
        st.param_dtype = dtype
        handle = st.handle(module)
        group_state = handle[1] if handle else None
        phase = _phase_of(group_state)
        ra = (getattr(group_state, "post_forward_mesh_info", None) is not None) if group_state is not None else None
        extra = set(st.backward_extra)
        if group_state is not None and getattr(group_state, "reshard_after_backward", True) is False:
            extra.add(ROWWISE)  # parameters stay unsharded into the next forward
        override = module.recipe.backward_override
        derivable = st.is_derivable(q, shape, dtype)
        plan = make_plan(phase=phase, reshard_after_forward=ra, backward_override=override, derivable=derivable,
                         known=handle is not None, backward_extra=extra)
        with torch.no_grad():
            param = _sharded_param(self, module, handle)
            key = _payload_key(param, dtype, shape, ws, rank, plan.send)
            kept, st.kept_payload = st.kept_payload, None
            if key is not None and kept is not None and kept[0] == key:
                payload, meta = kept[1], kept[2]  # same shard values, same directions: nothing to quantize
                st.counters["payload_reused"] += 1
            else:
                payload, meta = _prepare(self, param, q, plan.send, shape, ws, rank, dtype, group)
            if st.reuse_payload and key is not None and phase == "forward" and plan.deferred and make_plan(
                    phase="backward", reshard_after_forward=ra, backward_override=override, derivable=derivable,
                    known=True, backward_extra=extra).send == plan.send:
                # the backward unshard re-gathers the same directions (e.g. per-tensor FP8 rowwise, columnwise
                # derived): keep this shard's payload until then instead of casting and quantizing it again
                st.kept_payload = (key, payload, meta)
            inp = _transport(payload, shape, ws)
        sig = (tuple(inp.shape), inp.dtype)
        if handle is not None and st.last_sig is not None and sig != st.last_sig:
            handle[0].all_gather_outputs = []  # the payload changed size: let FSDP2 allocate new outputs
        st.last_sig = sig
        st.deferred = set(plan.deferred)
        if st.parts:
            st.set_inner(plan.materialize)  # what FSDP2 allocates before fsdp_post_all_gather fills it
        st.ctx = {"local": weakref.ref(self), "module": weakref.ref(module), "shape": shape, "dtype": dtype,
                  "ws": ws, "rank": rank, "group": group, "device": self.device,
                  "param": weakref.ref(param) if param is not None else None}
        st.counters[f"gather_{phase}"] += 1
        st.counters["bytes_sent"] += inp.numel() * inp.element_size()
        return (inp,), (meta, plan, dtype, q)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        meta, plan, dtype, q = metadata
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


# ---- the unsharded (gathered) quantized weight -------------------------------------------------------

class GatheredWeight(QuantizedTensor):
    """The unsharded weight FSDP2 registers on the module between unshard and reshard: a QuantizedTensor whose
    directions are filled by the all-gathers (or, for a direction nobody planned for, gathered on first use)."""

    @staticmethod
    def __new__(cls, rowwise, columnwise, *, shape, dtype, state: _WeightState, requires_grad: bool = False):
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
        if func is aten.as_strided.default:
            t, size, stride = args[0], args[1], args[2]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if tuple(size) == tuple(t.shape) and tuple(stride) == tuple(t.stride()) and not offset:
                return t._alias()
        return QuantizedTensor.__torch_dispatch__(func, types, args, kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, formats={self.formats}, "
                f"materialized={self.materialized or 'none'})")


# ---- public entry points -----------------------------------------------------------------------------

def _unwrap_state_dict(module, state_dict, prefix, local_metadata) -> None:
    from torch.distributed.tensor import DTensor

    for key, v in list(state_dict.items()):
        if isinstance(v, DTensor) and isinstance(v._local_tensor, HybridWeight):
            state_dict[key] = DTensor.from_local(v._local_tensor._data, v.device_mesh, v.placements,
                                                 run_check=False, shape=v.shape, stride=v.stride())
        elif isinstance(v, HybridWeight):
            state_dict[key] = v._data


def apply_hybrid_fsdp(model: nn.Module, recipe: CustomRecipe,
                      module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                      on_incompatible: str = "skip", reuse_forward_payload: bool = True) -> ConversionReport:
    """Prepare `model` for FSDP2 with quantized all-gathers; call it before `fully_shard`.

    Converts the eligible nn.Linear layers (`convert_linears`, same filter and `on_incompatible` semantics) and
    wraps the weight of every hybridq Linear in a `HybridWeight`, so that FSDP2 all-gathers the weight in the
    recipe's weight format: rowwise in forward, only what dgrad reads in backward, a direction that is an exact
    transform of the other derived after the gather. The gathered weight is bitwise the quantization of the
    full weight (global amaxes and split blocks are reduced across shards; see README "FSDP2"). Call
    `hybridq.precompute_scales(model)` after each `optimizer.step()` to fuse those reductions into one
    all-reduce (optional). Delayed-scaling weight quantizers are rejected (use current scaling). A weight shared
    with another module (tied embeddings) stays a plain parameter (gathered in high precision).

    reuse_forward_payload: when the backward unshard gathers the same directions as the forward one (per-tensor
    FP8 and 128x128 blocks: rowwise, the columnwise form derived after the gather), each rank keeps its quantized
    shard from forward to backward (1 byte per local FP8 element) instead of casting and quantizing it again.
    """
    for fqn, mod in model.named_modules():
        candidates = [(f"{fqn}.{n}" if fqn else n, c) for n, c in mod.named_children() if isinstance(c, nn.Linear)]
        for full, child in candidates:
            if module_filter_fn is not None and not module_filter_fn(child, full):
                continue
            if hasattr(child.weight, "device_mesh"):
                raise ValueError(f"apply_hybrid_fsdp: {full}.weight is already a DTensor; call apply_hybrid_fsdp "
                                 f"before fully_shard (tensor parallelism is not supported by it yet)")
            q = recipe.quantizer(Role("linear", "weight", full))  # what convert_linears gives it, converted or not
            if q.is_stateful:
                raise ValueError(
                    f"apply_hybrid_fsdp: the weight of {full} uses delayed scaling ({q.describe()}); under FSDP2 "
                    f"every rank quantizes its shard and backward re-gathers the weight, so a scale that changes "
                    f"between casts cannot give the single-device result. Use current scaling (e.g. the "
                    f"'fp8_tensorwise' preset: its global amax costs one fused all-reduce per step).")
    report = convert_linears(model, recipe, module_filter_fn, on_incompatible=on_incompatible)
    counts = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for fqn, mod in model.named_modules():
        if not isinstance(mod, Linear) or isinstance(mod.weight, HybridWeight):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        w = mod.weight
        if counts[id(w)] > 1:
            log.warning("hybridq: %s.weight is shared with another module; FSDP2 gathers it in high precision", fqn)
            continue
        state = _WeightState(model)
        state.reuse_payload = reuse_forward_payload
        mod.weight = nn.Parameter(HybridWeight(w.data, state), requires_grad=w.requires_grad)
    if not getattr(model, "_hybridq_state_dict_hook", False):
        if hasattr(model, "register_state_dict_post_hook"):
            model.register_state_dict_post_hook(_unwrap_state_dict)
        else:  # pragma: no cover - older torch
            model._register_state_dict_hook(lambda m, sd, p, lm: _unwrap_state_dict(m, sd, p, lm))
        model._hybridq_state_dict_hook = True
    return report


def _shard_info(p):
    """(mesh, shard mesh dim, world size, rank) of a DTensor parameter sharded on dim 0, else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 0]
    if len(dims) != 1:
        return None
    mesh, i = p.device_mesh, dims[0]
    return mesh, i, mesh.size(i), mesh.get_local_rank(i)


@torch.no_grad()
def precompute_scales(model: nn.Module) -> dict:
    """Reduce the cross-shard statistics of every converted FSDP2-sharded weight of `model` in one fused
    all-reduce per process group; call it after `optimizer.step()` on every rank (it is a collective). The
    next all-gathers use them instead of one all-reduce per weight. A harmless no-op on a model that is not
    sharded. Returns {"weights": n, "values": reduced fp32 values, "all_reduces": collectives issued}."""
    per_group: dict = {}
    for mod in model.modules():
        if not isinstance(mod, Linear):
            continue
        p = mod._parameters.get("weight")
        info = _shard_info(p)
        if info is None or not isinstance(p._local_tensor, HybridWeight):
            continue
        mesh, i, ws, rank = info
        if ws == 1:
            continue
        local = p._local_tensor
        st = local._hq
        dtype = st.param_dtype or local.dtype
        shape = tuple(p.shape)
        shard = dim0_chunks(shape, ws)[rank]
        data = local._data
        x2d = data.to(dtype).reshape(shard.length, shape[-1])
        s = mod.weight_quantizer.shard_stats(x2d, shard)
        if s is None:
            continue
        key = _stats_key(p, dtype, shard)
        group = mesh.get_group(i)
        device = (torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda"
                  else torch.device(mesh.device_type))
        per_group.setdefault(id(group), (group, [], device))[1].append((st, key, s.reshape(-1).float()))
    values = 0
    for group, items, device in per_group.values():
        flat = torch.cat([s for _, _, s in items]).to(device)  # CPU-offloaded shards: reduce on the PG's device
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        i = 0
        for st, key, s in items:
            st.stats_key, st.stats = key, flat[i:i + s.numel()]  # views of one fresh vector: no copy per weight
            i += s.numel()
        values += flat.numel()
    return {"weights": sum(len(v[1]) for v in per_group.values()), "values": values,
            "all_reduces": len(per_group)}


# ---- bytes on the wire -------------------------------------------------------------------------------

def gather_bytes_per_step(quantizer: Quantizer, shape, world_size: int = 2, *, param_dtype=torch.bfloat16,
                          reshard_after_forward: bool = True, backward_override: str | None = None) -> dict:
    """Bytes each rank contributes to the all-gathers of one weight in one training step (forward, and backward
    when it re-gathers), against a bf16 FSDP2 all-gather of the same weight. Counts the transport padding
    of unevenly sharded weights; the statistics all-reduce (a few fp32 per weight) is not included."""
    shape = tuple(shape)
    if quantizer.is_stateful:
        raise ValueError(f"{quantizer.describe()}: delayed scaling is rejected under FSDP2")
    st = _WeightState()
    derivable = st.is_derivable(quantizer, shape, param_dtype)
    out = {}
    phases = ("forward", "backward") if reshard_after_forward else ("forward",)
    for phase in phases:
        plan = make_plan(phase=phase, reshard_after_forward=reshard_after_forward,
                         backward_override=backward_override, derivable=derivable, known=True)
        b = gather_bytes_for(quantizer, shape, world_size, plan.send, param_dtype)
        payload = torch.empty(b, dtype=torch.uint8, device="meta")
        t = _transport(payload, shape, world_size)
        out[phase] = t.numel() * t.element_size()
        out[f"{phase}_sends"] = "+".join(plan.send)
    out["total"] = sum(out[p] for p in phases)
    chunk = -(-shape[0] // world_size) * math.prod(shape[1:])
    out["bf16_total"] = chunk * 2 * len(phases)
    out["ratio"] = out["total"] / out["bf16_total"]
    return out


def bytes_table(shapes=((4096, 4096), (50257, 4096)), world_size: int = 2, presets=None) -> str:
    """Markdown table of per-step all-gather bytes per element of the weight (per rank, forward + backward with
    reshard_after_forward=True) for each preset's weight format vs bf16."""
    from ..recipe import preset_names, recipe

    presets = presets or preset_names()
    head = "| preset | weight format | " + " | ".join(f"{s[0]}x{s[1]} B/elem (fwd+bwd) | vs bf16" for s in shapes) + " |"
    rows = [head, "|" + "---|" * (2 + 2 * len(shapes))]
    for name in presets:
        q = recipe(name).quantizer(Role("linear", "weight"))
        cells = []
        for shape in shapes:
            if q.is_stateful:
                cells += ["rejected (delayed scaling)", "-"]
                continue
            why = q.shape_rule(_rows(shape), shape[-1], True, True)
            if why is not None:
                cells += [f"kept in bf16 ({why})", "1.000"]
                continue
            r = gather_bytes_per_step(q, shape, world_size)
            per_elem = r["total"] / (math.prod(shape) / world_size)
            cells += [f"{per_elem:.4f} ({r['forward_sends']} / {r['backward_sends']})", f"{r['ratio']:.3f}"]
        rows.append(f"| {name} | {q.describe()} | " + " | ".join(cells) + " |")
    bf = ["4.0000", "1.000"] * len(shapes)
    rows.append("| (bf16 FSDP2) | bfloat16 | " + " | ".join(bf) + " |")
    return "\n".join(rows)
