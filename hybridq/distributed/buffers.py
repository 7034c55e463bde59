"""The unsharded weight's own buffers: its parts' tensors, allocated once (on the meta layout of the weight
format) and then allocated and freed by FSDP2 through the list of inner tensors handed to it (storage resize, as
FSDP2 does for plain parameters), so autograd's saved views stay valid across reshard / re-gather and nothing
quantized outlives a reshard. Gathered parts are filled in by aliasing FSDP2's all-gather output, adopting a fresh
allocation, or copying (`UnshardedBuffers.fill`); an unshard like the last one of its plan replays that fill
([Note: replayed fill])."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats.identity import IdentityPart
from ..torch_private import storage_id, storage_use_count
from .gathered import GatheredWeight, keep_for_stream
from .payload import DIRECTIONS, HIGH_PRECISION, GatheredViews, assemble_output, rows_of

__all__ = ["UnshardedBuffers"]


class UnshardedBuffers:
    """Mixin of a weight's state: the unsharded weight's parts (`parts`, own tensors per direction in `owned`) and
    which of them FSDP2 allocates and frees (the state's `inner`)."""

    def _init_buffers(self) -> None:
        self.derivable: dict = {}
        self.gathered: GatheredWeight | None = None
        self.parts: dict[str, object] = {}  # the unsharded weight's parts (own tensors)
        self.owned: dict[str, list[torch.Tensor]] = {}
        self.aliased: set[int] = set()  # ids of own tensors that are views of FSDP2's all-gather output
        self.device: torch.device | None = None
        self.buffers_version = 0  # bumped when `owned` or `aliased` change (what `set_inner` lists)
        self._inner_of: dict = {}  # directions -> (version, the list): `set_inner`'s answers
        self.fill_replays: dict = {}  # id(plan) -> FillReplay: the last fill of that plan, where replayable
        self.in_place: dict = {}  # (id(q), shape, dtype) -> (q, whether q derives the columnwise form in place)

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
        self.buffers_version += 1
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
        self.buffers_version += 1

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
        dirs = tuple(dirs)
        hit = self._inner_of.get(dirs)
        if hit is None or hit[0] != self.buffers_version:  # (the same list at every unshard while the buffers stay)
            hit = self._inner_of[dirs] = (self.buffers_version, self._unique(dirs))
        self.inner[:] = hit[1]

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
                if id(t) not in self.aliased:
                    self.aliased.add(id(t))
                    self.buffers_version += 1
                self.counters["aliased"] += 1
                continue
            if id(t) in self.aliased:  # it pointed at an all-gather output: it gets its own storage again
                self.aliased.discard(id(t))
                self.buffers_version += 1
                t.set_(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
            need = t.numel() * t.element_size()
            if adopt is not None and _adoptable(s, t, need, adopt):
                adopt[s.untyped_storage().data_ptr()] = True
                t.set_(s.untyped_storage(), 0, t.shape, t.stride())
                self.counters["adopted"] += 1
                continue
            _copy_into(t, s)

    # [Note: replayed fill]
    # FSDP2 hands the post-all-gather hook the same all-gather output storage at every unshard (it frees and
    # re-allocates its bytes) and allocates the weight's inner tensors (`set_inner`) before the hook, freeing them at
    # reshard. So an unshard like the last one of its plan -- the same output storage at the same place, the same
    # payload layout, plan and own tensors -- needs none of the fill's work of finding out what goes where: the own
    # tensors that aliased the output still do, the ones copied from a replicated tensor (an FP8 scale) are copied
    # again (their values change), and a derived direction (per-tensor FP8 or 128x128 tiles: columnwise the
    # transpose of the gathered rowwise form) is derived again, in place, into its own tensors' storages -- the ones
    # FSDP2 just allocated -- instead of into a fresh allocation the fill then adopts (`set_`), dropping FSDP2's.
    # Values are never replayed: every byte written comes from this unshard's output and replicated tensors. A
    # derived direction is replayed only where its own tensors still hold the storages recorded (a tensor given
    # another storage since -- an adopting fill, a lazy gather -- is filled as usual) and those are allocated.
    def record_fill(self, meta, plan, out: torch.Tensor, parts: dict, q: Quantizer | None = None,
                    dtype: torch.dtype | None = None) -> None:
        """After a fill of every direction of `plan` from the parts the all-gather output `out` gave: remember it as a
        `FillReplay` where every own tensor was either left aliasing `out` or copied from a replicated tensor of
        `meta` (the parts came straight from the gathered buffers and the payload's replicated tensors: nothing was
        quantized here, concatenated or re-laid out), or, for the columnwise form `plan` derives, is written by
        `q.derive_part_into` from the rowwise part `out` gives (its tensors views of `out` or replicated tensors);
        else forget any earlier one of this plan. (One per plan: forward and backward unshards alternate.)"""
        self.fill_replays.pop(id(plan), None)
        derived_dir = COLUMNWISE if plan.derive else None
        if plan.local or any(d not in plan.send and d != derived_dir for d in plan.materialize):
            return
        out_storage = storage_id(out)
        derived = ()
        if derived_dir is not None:
            if q is None or not self.derives_in_place(q, meta.shape, dtype):
                return
            rep = meta.replicated.get(ROWWISE, {})
            for s in parts[ROWWISE].tensors().values():  # (the source the replay rebuilds from this unshard's output)
                if s is not None and not (type(s) is torch.Tensor and storage_id(s) == out_storage) \
                        and not any(r is s for r in rep.values()):
                    return
            derived = tuple((t, storage_id(t), (t.storage_offset() + t.numel()) * t.element_size())
                            for t in self.parts[COLUMNWISE].tensors().values() if t is not None)
            if any(id(t) in self.aliased for t, _, _ in derived):
                return
        copies, aliased = [], 0
        for d in plan.materialize:
            if d == derived_dir:
                continue
            rep = meta.replicated.get(d, {})
            for n, t in self.parts[d].tensors().items():
                if t is None:
                    continue
                s = getattr(parts[d], n)
                if id(t) in self.aliased and storage_id(t) == out_storage:
                    aliased += 1
                    continue
                name = next((k for k, r in rep.items() if r is s), None)
                if name is None:
                    return
                copies.append((t, d, name))
        if len(self.fill_replays) >= 8:
            self.fill_replays.clear()
        self.fill_replays[id(plan)] = FillReplay(meta.buffers, plan, GatheredViews.key_of(out), self.buffers_version,
                                                 tuple(copies), aliased, derived, q, dtype)

    def replay_fill(self, meta, plan, out: torch.Tensor, q: Quantizer | None = None,
                    dtype: torch.dtype | None = None, ready: tuple | None = None) -> bool:
        """The recorded fill (`record_fill`) again, where the all-gather output is the same storage at the same place,
        the payload's layout (its list of buffers: one object per quantizer, shard, shape and directions,
        `payload.build_payload(memo=)`) and the plan are the ones it was made for and no own tensor was re-pointed
        since: the aliased tensors still view `out`, the replicated tensors are copied again (their values change),
        a derived direction is derived again into its own tensors (which must still hold the storages recorded, now
        allocated: FSDP2's inner tensors). False, nothing done: fill as usual. `ready`: `replay_ready`'s answer for
        these arguments, where the caller asked it already."""
        if ready is None:
            ready = self.replay_ready(meta, plan, out, q, dtype)
        if ready is None:
            return False
        r, srcs = ready
        if out.is_cuda:
            keep_for_stream(srcs)
        if r.derived and not self.derive_replayed(meta, plan, out, q, dtype):
            return False
        for (t, _, _), s in zip(r.copies, srcs):
            _copy_into(t, s)
        self.count_replayed(r)
        return True

    def replay_ready(self, meta, plan, out: torch.Tensor, q: Quantizer | None = None,
                     dtype: torch.dtype | None = None, alloc: bool = False) -> tuple | None:
        """(the recorded fill, the tensors it reads: its copies' sources, then the derivation's replicated sources)
        where `replay_fill` may replay it for this unshard (see there); None: it may not. Writes nothing, except with
        `alloc` (a unit fill, [Note: unit fill], before FSDP2 allocated this weight's inner tensors): the inner
        tensors are allocated first, as FSDP2's `alloc_storage` would (it then finds them so)."""
        r = self.fill_replays.get(id(plan))
        if (r is None or r.buffers is not meta.buffers or r.plan is not plan or r.version != self.buffers_version
                or r.out_key != GatheredViews.key_of(out)):
            return None
        rep = meta.replicated
        srcs = []
        for t, d, n in r.copies:
            s = rep[d].get(n)
            if s is None or s.shape != t.shape or s.dtype != t.dtype or s.device != t.device:
                return None
            srcs.append(s)
        if r.derived and (r.quantizer is not q or r.dtype != dtype):
            return None
        if alloc:
            for t in self.inner:
                need = t.numel() * t.element_size()
                if t.untyped_storage().nbytes() != need:
                    t.untyped_storage().resize_(need)
        if r.derived:
            for t, sid, need in r.derived:  # (allocated: FSDP2 did, as inner tensors)
                if storage_id(t) != sid or t.untyped_storage().nbytes() < need:
                    return None
            srcs.extend(s for s in rep.get(ROWWISE, {}).values() if s is not None)
        return r, srcs

    def derive_replayed(self, meta, plan, out: torch.Tensor, q: Quantizer, dtype) -> bool:
        """A replayed fill's derived direction written in place (`replay_ready` said so); False, nothing written and
        the record dropped: the format declined (fill as usual)."""
        src = assemble_output(meta, out, self.gathered_views)[ROWWISE]
        if not q.derive_part_into(src, self.parts[COLUMNWISE], dtype):  # (it did on meta: `derives_in_place`)
            self.fill_replays.pop(id(plan), None)
            return False
        self.counters["derived_in_place"] += 1
        return True

    def count_replayed(self, r: "FillReplay") -> None:
        if r.aliased:
            self.counters["aliased"] += r.aliased
        self.counters["fill_replayed"] += 1

    def derives_in_place(self, q: Quantizer, shape, dtype) -> bool:
        """Whether `q` derives the columnwise form of a weight of `shape` in place (`derive_part_into`), asked on meta
        tensors once per quantizer, shape and dtype."""
        key = (id(q), tuple(shape), dtype)
        hit = self.in_place.get(key)
        if hit is None or hit[0] is not q:
            m, k = rows_of(shape), shape[-1]
            try:
                r, c = q.quantize_parts(torch.empty(m, k, dtype=dtype, device="meta"), True, True)
                ok = r is not None and c is not None and bool(q.derive_part_into(r, c, dtype))
            except Exception:  # noqa: BLE001 - a derivation that cannot run on meta: fill as usual
                ok = False
            if len(self.in_place) >= 16:
                self.in_place.clear()
            hit = self.in_place[key] = (q, ok)
        return hit[1]

    def is_derivable(self, q, shape, dtype) -> bool:
        """Whether `q`'s columnwise form of a weight of `shape` is derived exactly from its rowwise form (then
        only the rowwise form is gathered)."""
        key = (id(q), tuple(shape), dtype)
        if key not in self.derivable:
            m, k = rows_of(shape), shape[-1]
            r, _ = q.quantize_parts(torch.empty(m, k, dtype=dtype, device="meta"), True, False)
            try:
                self.derivable[key] = q.derive_part(r, COLUMNWISE, dtype) is not None
            except Exception:  # noqa: BLE001 - a derivation that cannot run on meta: gather it
                self.derivable[key] = False
        return self.derivable[key]


class FillReplay(NamedTuple):
    """A weight's last fill whose every own tensor aliases the all-gather output, copies a replicated tensor or is
    derived in place from the gathered rowwise form, and what it was made for (`UnshardedBuffers.record_fill` / `replay_fill`)."""

    buffers: list  # the payload's BufferSpecs (the layout's list, one per quantizer: compared by identity)
    plan: object
    out_key: tuple  # `GatheredViews.key_of` the all-gather output
    version: int  # the buffers' version (bumped whenever an own tensor is aliased or re-pointed)
    copies: tuple  # (own tensor, direction, name of the replicated tensor copied into it)
    aliased: int  # own tensors left aliasing the output (the "aliased" counter)
    derived: tuple = ()  # (own tensor, its storage's id, bytes it needs) of the direction derived in place, or ()
    quantizer: object = None  # (what derives it, and from the rowwise form of which gather dtype)
    dtype: object = None


def _copy_into(t: torch.Tensor, s: torch.Tensor) -> None:
    """Copy `s` into the own tensor `t`, first giving back the storage FSDP2's reshard freed (resized to 0)."""
    need = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() < need:
        t.untyped_storage().resize_(need)
    t.copy_(s)


def _adoptable(s: torch.Tensor, t: torch.Tensor, need: int, adopt: dict) -> bool:
    if s is t or type(s) is not torch.Tensor or s.device != t.device or need == 0 or s.storage_offset() != 0:
        return False
    st = s.untyped_storage()
    ptr = st.data_ptr()
    if st.nbytes() != need or ptr in adopt or ptr in adopt.get("forbidden", ()) or ptr % 16:
        return False
    if t.untyped_storage().data_ptr() == ptr or not s.is_contiguous() or tuple(s.stride()) != tuple(t.stride()):
        return False
    return storage_use_count(st) <= 2  # no other tensor (view) shares it
