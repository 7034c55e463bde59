"""The all-gather hooks' work for a grouped weight whose experts all share one per-tensor FP8 quantizer with current
scaling, batched over the experts (what `transport.prepare_grouped` and the per-expert fills do expert by expert):

- before the gather: the experts' amaxes `[E]` in one pass (reduced in one all-reduce, or the values
  precompute_scales reduced), one cast of all experts held here with their scales, the payload filled in one copy
  (none where the slots are exactly the experts' bytes);
- after it: one copy of all experts' gathered bytes and one of their scales into the unsharded weight's stacked
  buffers (`GroupedWeightState.fill_experts`), and one byte transpose of all experts for the derived columnwise form.

Bitwise what the per-expert path gives (`formats/float8_groups.py`); other formats and plans (high-precision
gathers, a columnwise form sent) take the per-expert path.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats.base import COLUMNWISE, ROWWISE
from ..formats.float8 import aligned_scales
from ..formats.float8_groups import (derive_columnwise_groups, equal_groups_apply, group_amax, group_parts,
                                     quantize_equal_groups, scale_inv_from_amax, transpose_groups)
from ..torch_private import current_stream, storage_id
from .grouped_fast import _ON as grouped_fast
from .layout import ExpertLayout
from .payload import HIGH_PRECISION, PayloadMeta, assemble_parts, build_payload
from .plan import GatherPlan
from .transport import stats_key

__all__ = ["StackedGather", "fill_batched", "fill_stacked", "metas_with_scales", "prepare_batched"]


@dataclasses.dataclass(frozen=True)
class StackedGather:
    """A batched gather whose receiver reads the experts' bytes straight out of the gathered payloads (whole experts
    per rank, slots one after another): every expert's scale_inv `[E]` (each rank computes all of them), its rowwise
    data `[rows, cols]` at the start of its slot."""

    scale_inv: torch.Tensor
    dtype: torch.dtype  # the FP8 dtype


def _template_metas(local, q, layout: ExpertLayout, held: int, dtype, device) -> tuple[tuple[PayloadMeta, ...], int]:
    """Every expert's payload metadata and the slot size of a stacked gather, built once per layout (they do not
    depend on the values; the replicated scales travel in `StackedGather`, so the metas hold none)."""
    key = (layout, held, dtype, device)
    cache = local._hq.__dict__.setdefault("stacked_metas", {})
    hit = cache.get(key)
    if hit is not None and (hit[0] is q or hit[0] == q):
        return hit[1], hit[2]
    shape = (layout.rows, layout.cols)
    first = layout.rank * layout.chunk
    data = torch.empty(held, *shape, dtype=q.dtype, device="meta")  # (values do not matter: metadata only)
    scale_inv = torch.empty(layout.experts, dtype=torch.float32, device="meta")
    metas = []
    for e, part in enumerate(group_parts(data, scale_inv, first, layout.experts)):
        shard, shards = layout.payload_shards(e)
        meta = build_payload(q, {ROWWISE: part}, shard, shards, shape, device, pack=False)[1]
        metas.append(dataclasses.replace(meta, replicated={d: dict.fromkeys(r) for d, r in meta.replicated.items()}))
    slot = layout.slot_bytes(metas)
    metas = tuple(metas)  # (the gather metadata holds a tuple: `tuple(metas)` is then no copy per unshard)
    cache[key] = (q, metas, slot)
    return metas, slot


def prepare_batched(local, param, qs, send, layout: ExpertLayout, dtype, group, stacked: bool = False
                    ) -> tuple[torch.Tensor, list[PayloadMeta] | tuple[PayloadMeta, ...], int, StackedGather | None] | None:
    """`transport.prepare_grouped` batched over the experts (None: this weight or plan is not batched). `stacked`
    (whole experts per rank, and a receiver that fills the stacked buffers by `fill_batched`): the metadata is built
    once per layout and the scales travel in the returned `StackedGather`."""
    if tuple(send) != (ROWWISE,) or not equal_groups_apply(qs):
        return None
    q, e_all = qs[0], layout.experts
    x = local._data.to(dtype)  # [held experts, out, in] (Shard(0)) or [E, rows here, in] (Shard(1))
    first = layout.rank * layout.chunk if layout.dim == 0 else 0
    held = x.shape[0]
    if layout.dim == 0 and held != layout.slots_held:
        return None  # (not the layout FSDP2's Shard(0) gives: leave it to the per-expert path)
    reduced = None
    if layout.world_size > 1:
        def local_amax() -> torch.Tensor:
            amax = group_amax(x)
            if held == e_all:
                return amax
            zeros = amax.new_zeros(e_all)  # (experts held elsewhere: an empty shard's statistic)
            zeros[first:first + held] = amax
            return zeros
        reduced = local._hq.reduced_vector(local_amax, stats_key(param, dtype, layout), group, local._data)
    if layout.dim == 0:
        # whole experts: each one's own amax is the reduced one (the others' are zeros), so the cast takes its own
        # (the grouped kernel computes it); the scales of the experts held elsewhere come from the reduced amaxes
        data, scale_inv = quantize_equal_groups(q, x)
        if reduced is not None:
            scale_inv = scale_inv_from_amax(q, reduced)
    else:
        data, scale_inv = quantize_equal_groups(q, x, reduced)
    stacked = stacked and layout.dim == 0
    if stacked:
        metas, slot = _template_metas(local, q, layout, held, dtype, x.device)
    else:
        shape = (layout.rows, layout.cols)
        metas = []
        for e, part in enumerate(group_parts(data, scale_inv, first, e_all)):
            shard, shards = layout.payload_shards(e)
            metas.append(build_payload(q, {ROWWISE: part}, shard, shards, shape, x.device, pack=False)[1])
        slot = layout.slot_bytes(metas)
    n_slots = layout.experts if layout.dim == 1 else layout.chunk  # (len(layout.slots()))
    nbytes = data.numel() // held if held else 0  # (fp8: one byte per element)
    if slot == nbytes and held == n_slots:
        payload = data.view(torch.uint8).reshape(-1)
    else:
        payload = torch.zeros(n_slots, slot, dtype=torch.uint8, device=x.device)
        payload[:held, :nbytes] = data.view(torch.uint8).reshape(held, nbytes)
        payload = payload.reshape(-1)
    return payload, metas, slot, (StackedGather(scale_inv, q.dtype) if stacked else None)


def _gathered_rows(gathered: torch.Tensor, slot: int, layout: ExpertLayout, fp8: torch.dtype) -> torch.Tensor | None:
    """Every expert's gathered rowwise data `[E, rows, cols]` as a view of the gathered payloads of whole experts
    (rank-major, `chunk` slots per rank); None where a rank's payload is padded past its slots (uneven sharding)."""
    flat = gathered.reshape(-1).view(torch.uint8)
    ws, chunk = layout.world_size, layout.chunk
    if flat.numel() != ws * chunk * slot:
        return None
    nbytes = layout.rows * layout.cols
    return flat.view(ws * chunk, slot)[:layout.experts, :nbytes].view(fp8).view(layout.experts, layout.rows,
                                                                                layout.cols)


def fill_stacked(st, stacked: StackedGather, gathered: torch.Tensor, slot: int, layout: ExpertLayout,
                 plan: GatherPlan) -> bool:
    """The post-all-gather fill of a stacked gather: one copy of all experts' bytes and one of their scales into the
    stacked buffers, one transpose for the derived columnwise form; no per-expert work (False, nothing done: another
    fill runs). With the steady state on, the plan's last fill runs again where this unshard is like it
    (`_fill_kept`)."""
    fast = grouped_fast.on
    if fast and _fill_kept(st, stacked, gathered, slot, layout, plan):
        return True
    memo = st.gathered_views
    key, tag = memo.key_of(gathered), (slot, layout, stacked.dtype)
    rows = memo.get(tag, key)
    if rows is None:
        rows = _gathered_rows(gathered, slot, layout, stacked.dtype)
        memo.put(tag, key, rows if rows is not None and storage_id(rows) == key[0] else None)
    if rows is None or not st.slabs or plan.send != (ROWWISE,) or plan.local or HIGH_PRECISION in plan.materialize:
        return False
    todo = []  # (loops, not comprehensions: each of those is a Python call, at every unshard)
    for d in (ROWWISE, COLUMNWISE):
        if d in plan.materialize:
            v = st.stacked(d)
            if v is None:
                return False
            todo.append((d, v[1]))
    st.alloc_slabs(plan.materialize)  # (FSDP2 allocated them already, except where it reuses nothing)
    _run_fill(stacked, rows, todo)
    if fast and storage_id(rows) == key[0]:  # (a view of the output: it reads the next unshard's bytes too)
        kept = st.__dict__.setdefault("stacked_fills", {})  # (per plan: forward and backward unshards alternate)
        if len(kept) >= 8:
            kept.clear()
        kept[id(plan)] = (plan, key, slot, layout, stacked.dtype, rows, tuple(todo))
    return True


def _run_fill(stacked: StackedGather, rows: torch.Tensor, todo) -> None:
    """A stacked fill's copies: the rowwise bytes, the derived columnwise transpose, the scales."""
    scale = stacked.scale_inv
    if scale.is_cuda:  # made on FSDP2's all-gather copy-in stream, read here (see gathered.received)
        scale.record_stream(current_stream(scale.device))
    for d, v in todo:
        if d == ROWWISE:
            v["data"].copy_(rows)
        else:
            transpose_groups(rows, v["data"])
        v["scale_inv"].copy_(scale.view(v["scale_inv"].shape))


def _fill_kept(st, stacked: StackedGather, gathered: torch.Tensor, slot: int, layout: ExpertLayout,
               plan: GatherPlan) -> bool:
    """The plan's last stacked fill again ([Note: grouped hooks' steady state]) where this unshard is like it: the
    same all-gather output (storage, offset, shape, dtype: the kept view of its rows reads this unshard's bytes),
    slot, layout and FP8 dtype, and the same stacked views of every direction it fills (asked of the state, as the
    fill asks); the scales are this unshard's. False, nothing done: fill as usual."""
    hit = st.__dict__.get("stacked_fills", {}).get(id(plan))
    if (hit is None or hit[0] is not plan or hit[2] != slot or hit[4] != stacked.dtype
            or (hit[3] is not layout and hit[3] != layout) or hit[1] != st.gathered_views.key_of(gathered)):
        return False
    for d, v in hit[6]:
        now = st.stacked(d)
        if now is None or now[1] is not v:
            return False
    st.alloc_slabs(plan.materialize)
    _run_fill(stacked, hit[5], hit[6])
    st.counters["stacked_fills_kept"] += 1
    return True


def metas_with_scales(metas: list[PayloadMeta], stacked: StackedGather) -> list[PayloadMeta]:
    """A stacked gather's metadata with each expert's replicated scale (for a fill that reads the metas)."""
    scales = aligned_scales(stacked.scale_inv)
    return [dataclasses.replace(m, replicated={ROWWISE: {"scale_inv": scales[e, :1]}}) for e, m in enumerate(metas)]


def fill_batched(st, qs, metas, gathered: torch.Tensor, slot: int, layout: ExpertLayout, plan: GatherPlan,
                 dtype) -> bool:
    """The post-all-gather fill of every expert batched (False, nothing done: the per-expert path runs)."""
    if (not st.slabs or plan.send != (ROWWISE,) or plan.local or HIGH_PRECISION in plan.materialize
            or not equal_groups_apply(qs)):
        return False
    st.alloc_slabs(plan.materialize)  # (FSDP2 allocated them already, except where it reuses nothing)
    rows = [assemble_parts(meta, layout.expert_bytes(gathered, slot, e, meta, expert_major=layout.dim == 1))[ROWWISE]
            for e, meta in enumerate(metas)]
    if ROWWISE in plan.materialize:
        st.fill_experts(ROWWISE, rows)
        rows = [est.parts[ROWWISE] for est in st.experts]
    if COLUMNWISE in plan.materialize:
        cols = [est.parts[COLUMNWISE] for est in st.experts]
        if not derive_columnwise_groups(rows, cols):
            st.fill_experts(COLUMNWISE, [q.derive_part(r, COLUMNWISE, dtype) for q, r in zip(qs, rows)])
    return True
