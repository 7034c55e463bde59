"""Per-weight state shared by every alias of one sharded weight: the FSDP2 link, the reduced statistics, the
unsharded weight's own buffers (allocated and freed by FSDP2 through `inner`), the payload kept from forward to
backward, and lazy materialization of a direction nobody planned for."""

from __future__ import annotations

import collections
import dataclasses
import weakref

import torch
import torch.nn as nn

from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats.identity import IdentityPart
from ..formats._reduce import amax_all_reduce_
from .fsdp_adapter import FSDPLink, in_backward
from .gathered import GatheredWeight
from .payload import DIRECTIONS, HIGH_PRECISION, PayloadMeta, rows_of
from .transport import GatherContext, gather_now

__all__ = ["KeptPayload", "WeightState"]


@dataclasses.dataclass(frozen=True)
class KeptPayload:
    """A forward unshard's payload kept for the backward unshard that sends the same directions."""

    key: tuple
    payload: torch.Tensor
    meta: PayloadMeta


class WeightState:
    def __init__(self, root: nn.Module | None = None, name: str = "weight"):
        self.root = weakref.ref(root) if root is not None else None
        self.name = name  # the parameter's name in the model, for error messages
        self.fsdp: FSDPLink | bool | None = None  # None: not looked up yet; False: not found
        self.stats_key = None
        self.stats: torch.Tensor | None = None
        self.param_dtype: torch.dtype | None = None
        self.derivable: dict = {}
        self.layouts_checked: set = set()  # (quantizer, shape, world size, dtype, override) whose shards passed
        self.gathered: GatheredWeight | None = None
        self.parts: dict[str, object] = {}  # the unsharded weight's parts (own tensors)
        self.owned: dict[str, list[torch.Tensor]] = {}
        self.inner: list[torch.Tensor] = []  # handed to FSDP2: allocated before, freed at reshard
        self.aliased: set[int] = set()  # ids of own tensors that are views of FSDP2's all-gather output
        self.deferred: set[str] = set()
        self.backward_extra: set[str] = set()
        self.last_sig = None
        self.ctx: GatherContext | None = None
        self.device: torch.device | None = None
        self.counters: collections.Counter = collections.Counter()
        self.kept_payload: KeptPayload | None = None
        self.reuse_payload = True
        self.tp_group = None  # set by hybridq's tensor-parallel styles: the weight is a TP piece (2-D meshes)

    def __deepcopy__(self, memo):
        new = WeightState(self.root() if self.root is not None else None, self.name)
        new.reuse_payload = self.reuse_payload
        new.tp_group = self.tp_group
        return new

    # FSDP2 link ---------------------------------------------------------------------------------
    def link(self, module) -> FSDPLink | None:
        if self.fsdp is None:
            self.fsdp = FSDPLink.find([module, self.root() if self.root is not None else None], module) or False
        if self.fsdp is False:
            return None
        if not self.fsdp.alive:
            self.fsdp = None
            return None
        return self.fsdp

    # the unsharded weight's own buffers ---------------------------------------------------------------
    def create(self, q: Quantizer, shape, dtype, device) -> GatheredWeight:
        m, k = rows_of(shape), shape[-1]
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
        m, k = rows_of(g.shape), g.shape[-1]
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
        as it does for a plain parameter; a fresh, exclusively owned, contiguous, 16-byte aligned allocation of
        exactly the right size (a derived direction, a concatenated or re-laid-out buffer) becomes the own
        tensor's storage (`set_`); anything else is copied."""
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
        if self.tp_group is not None and shard.is_whole:  # a whole TP piece: only per-tensor statistics
            local = self._tp_global(q, x2d, group)
            self.stats_key, self.stats = key, local
            return local
        local = q.shard_stats(x2d, shard)
        if local is not None and group is not None:
            amax_all_reduce_(local, group)
            self.counters["stats_allreduce"] += 1
        if self.tp_group is not None:  # per-tensor statistics span the TP pieces too
            g = self._tp_global(q, x2d, group)
            if g is not None:
                local = q.with_global_stats(local, shard, x2d.shape[1], g)
        self.stats_key, self.stats = key, local
        return local

    def _tp_global(self, q, x2d, group):
        """The whole weight's per-tensor statistics: MAX over this rank's rows, the dp group, the TP group."""
        g = q.global_stats(x2d, True, True)
        if g is not None:
            if group is not None:
                amax_all_reduce_(g, group)
            amax_all_reduce_(g, self.tp_group)
            self.counters["stats_allreduce"] += 1
        return g

    # lazy materialization (a direction nobody planned for: activation recompute, manual unshard, ...) ----
    def ensure(self, d: str) -> None:
        if not self.parts or self.parts.get(d) is None or d in self.deferred or self.materialized(d):
            return
        ctx = self.ctx
        param = ctx.param() if ctx is not None and ctx.param is not None else None
        local = param._local_tensor.to(ctx.device) if param is not None else (ctx.local() if ctx else None)
        module = ctx.module() if ctx else None
        if local is None or module is None:
            raise RuntimeError(f"hybridq FSDP: the unsharded weight has no {d} form and the sharded weight it "
                               f"came from is gone")
        q = module.weight_quantizer
        derivable = d == COLUMNWISE and self.is_derivable(q, ctx.shape, ctx.dtype)
        send = (ROWWISE,) if derivable else (d,)
        with torch.no_grad():
            parts = gather_now(local, q, send, ctx)
            src = q.derive_part(parts[ROWWISE], COLUMNWISE, ctx.dtype) if derivable else parts[d]
            self.fill(d, src)
        self.inner[:] = self._unique([x for x in DIRECTIONS if self.materialized(x)])
        self.counters["lazy_gathers"] += 1
        if in_backward():  # e.g. activation recompute: gather it with backward's
            self.backward_extra.add(d)

    def is_derivable(self, q, shape, dtype) -> bool:
        key = (id(q), tuple(shape), dtype)
        if key not in self.derivable:
            m, k = rows_of(shape), shape[-1]
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
