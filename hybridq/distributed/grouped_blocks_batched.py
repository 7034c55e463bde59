"""The post-all-gather work of a grouped weight gathered in a block format (FP8 1x128 / 128x128 blocks, MXFP8 and
hybrids of them: `Quantizer.local_scaling`) batched over the experts, where every expert shares one quantizer.

[Note: stacked block gather]
- The experts' unsharded buffers are stacked (`GroupedWeightState._stack_buffers`: one allocation per tensor kind,
  the experts' tensors equally spaced views of it), so `GroupedGatheredForm.stacked_part` gives `[E, ...]` views and
  `GatheredExpertWeights` reads all experts without a `torch.cat` per direction per call (rowwise: no copy at all).
- After the all-gather, where each rank holds whole experts and `out` is a whole number of the format's row blocks
  in both directions (128x128 tiles: 128; MXFP8's columnwise 1x32 blocks along the rows: 32), the experts' gathered
  payloads are read as the row shards of one `[E*out, in]` weight (`payload.assemble_joined`): each expert's slice
  of that joined quantization is its own (no block spans two experts; sharding invariance), so a derived direction
  (128x128 tiles' columnwise from rowwise) is derived once for all experts, and each tensor kind of each direction
  goes into the stacked buffers in one copy -- instead of one assembly, derivation and copy per expert and kind.
- Elsewhere (out 96 under 128x128 tiles, uneven slots): one copy per kind where the experts' gathered tensors are
  equally spaced (`fill_experts`), the derivation expert by expert.
- A payload built for all experts at once (`grouped_blocks_payload.prepare_stacked_blocks`, [Note: stacked block
  payload]) carries the replicated tensors (128x128 tile scales) in the slots, not in the metadata: the joined
  assembly reads all experts' at once (`StackedBlocks.joined_replicated`), the per-expert fills each expert's.

Bitwise the per-expert fill: the same bytes and scales in every expert's buffers (tests/distributed/
test_fsdp_grouped_block_stacked.py). The switch `set_stacked_block_gather(False)` (or HYBRIDQ_STACKED_BLOCK_GATHER=0
at start-up) keeps block-format experts on per-expert buffers and fills, as before; it is read when a weight's
unsharded buffers are first made (and at every fill).
"""

from __future__ import annotations


import torch

from ..formats.base import COLUMNWISE, ROWWISE, QuantizedPart
from ..switches import Switch
from ..torch_private import storage_id
from .grouped_blocks_payload import StackedBlocks
from .grouped_fast import one_local_quantizer
from .layout import ALIGN, ExpertLayout
from .payload import HIGH_PRECISION, GatheredViews, assemble_joined, assemble_parts
from .plan import GatherPlan

__all__ = ["ENV", "fill_stacked_blocks", "set_stacked_block_gather", "stacked_block_gather", "stacks_blocks"]

ENV = "HYBRIDQ_STACKED_BLOCK_GATHER"
_ON = Switch(ENV)


def set_stacked_block_gather(on: bool) -> None:
    """Turn the stacked buffers and batched fill of block-format experts on (default) or off (the per-expert buffers
    and fill, as before; for weights whose unsharded buffers are made after the call)."""
    _ON.set(on)


def stacked_block_gather() -> bool:
    """Whether block-format experts get stacked buffers and the batched fill (`set_stacked_block_gather`)."""
    return _ON.on


def stacks_blocks(qs) -> bool:
    """Whether the experts' quantizers `qs` are one block format (equal quantizers, `local_scaling`), so that every
    expert has the same buffers, and the switch is on."""
    return _ON.on and one_local_quantizer(qs)  # (once per tuple of quantizers: [Note: grouped hooks' steady state])


def _split(part: QuantizedPart, e: int) -> dict[str, torch.Tensor] | None:
    """Each tensor of a part of `E` experts joined (`assemble_joined`; rowwise: the experts' rows one after another,
    columnwise: their columns) as `[E, ...]` whose `[g]` is expert g's tensor -- the inverse of the join
    GatheredExpertWeights reads (grouped_packed_blocks._joined); None where a tensor does not split evenly."""
    out = {}
    for n, t in part.tensors().items():
        if t is None:
            continue
        if t.dim() != 2 or t.shape[1 if part.columnwise else 0] % e:
            return None
        a, b = t.shape
        out[n] = t.view(a, e, b // e).permute(1, 0, 2) if part.columnwise else t.view(e, a // e, b)
    return out


def _fill_joined(st, q, metas, gathered: torch.Tensor, slot: int, layout: ExpertLayout, plan: GatherPlan,
                 dtype, stacked: StackedBlocks | None) -> bool:
    """Whole experts, one slot each, no scaling block along the rows spanning two experts: all experts' gathered
    parts assembled as one `[E*out, in]` tensor's (`assemble_joined`; `stacked`: the replicated tensors read from the
    slots), a derived direction derived once from it, and each tensor kind copied into the stacked buffers in one
    copy. False (nothing done) where that does not apply."""
    e, n, ws, chunk = layout.experts, layout.rows, layout.world_size, layout.chunk
    if _copy_kept(st, q, metas, gathered, slot, layout, plan, stacked, dtype):
        return True
    flat = gathered.reshape(-1).view(torch.uint8)
    if (layout.dim != 0 or len(metas) != e or n % q.split_granularity(True, True)[0] or slot % ALIGN
            or flat.numel() % ws or flat.numel() // ws < chunk * slot or flat.storage_offset() % ALIGN):
        return False
    dst = {d: st.stacked(d) for d in plan.materialize}
    if any(v is None for v in dst.values()):
        return False
    # the experts' slots, rank-major (a view; a copy where uneven sharding pads each rank's payload past its slots)
    per_expert = flat.view(ws, -1)[:, :chunk * slot].reshape(ws * chunk, slot)[:e]
    if stacked is not None and _fill_direct(st, q, metas, gathered, per_expert, slot, layout, plan, stacked, dst,
                                            dtype):
        return True
    joined = assemble_joined(metas, per_expert, stacked.joined_replicated(per_expert) if stacked else None)
    if joined is None:
        return False
    if plan.derive:
        joined[COLUMNWISE] = q.derive_part(joined[ROWWISE], COLUMNWISE, dtype)
    srcs = {}
    for d in plan.materialize:
        srcs[d] = _split(joined[d], e)
        if srcs[d] is None or any(srcs[d][k].shape != v.shape or srcs[d][k].dtype != v.dtype
                                  for k, v in dst[d][1].items()):
            return False
    for d in plan.materialize:
        for k, v in dst[d][1].items():
            v.copy_(srcs[d][k])
    return True


def _direct_sources(st, m0, e: int, plan: GatherPlan, stacked: StackedBlocks, dst, q, dtype) -> tuple | None:
    """For each stacked tensor the joined fill writes, where its experts' values are one buffer or replicated tensor
    of their payloads as sent ([Note: direct joined fill]): (copies: ((direction, tensor name, source), ...), derived:
    ((rowwise tensor name, source), ...) or None), a source ("buffer", spec) | ("replica", replica); derived: the
    rowwise tensors a derived columnwise direction is derived from, expert by expert in one call
    (`Quantizer.derive_experts_into`). None where any tensor is not so (a buffer the part re-lays out, a format that
    does not derive experts at once). Asked once per payload metadata, replicas, plan, quantizer and dtype (kept in
    the state), on meta tensors."""
    key = (id(m0), id(stacked), id(plan), e, id(q), dtype)
    kept = st.__dict__.setdefault("direct_fills", {})
    hit = kept.get(key)
    if hit is not None and hit[0] is m0 and hit[1] is stacked and hit[2] is plan and hit[3] is q:
        return hit[4]
    out = _probe_direct(m0, e, plan, stacked, dst, q, dtype)
    if len(kept) >= 8:
        kept.clear()
    kept[key] = (m0, stacked, plan, q, out)
    return out


def _part_sources(m0, e: int, d: str, stacked: StackedBlocks) -> dict | None:
    """{tensor name: (source, one expert's shape, dtype)} of every tensor of the joined part `d` that is, as
    `assemble_joined` rebuilds it, a gathered buffer of the rowwise layout (the experts' rows one after another) or a
    replicated tensor carried in the slots; None where the part is not rebuilt from them as they are (hints, a
    tensor made anew, a columnwise buffer). The joined part is rebuilt on meta tensors (`assign_gathered`)."""
    ps = m0.parts.get(d)
    if ps is None or ps.hints:
        return None
    meta = torch.device("meta")
    specs = {b.name: b for b in m0.buffers if b.direction == d}
    reps = {r.name: r for r in stacked.replicas if r.direction == d}
    full = {n: torch.empty((e * b.capacity,) + b.row_shape, dtype=b.dtype, device=meta) for n, b in specs.items()}
    rep = {n: torch.empty((r.shape[0], e * r.shape[1]) if r.columnwise else (e * r.shape[0], r.shape[1]),
                          dtype=r.dtype, device=meta) for n, r in reps.items()}
    rep = {**dict.fromkeys(m0.replicated.get(d, {})), **rep}
    try:
        part = ps.cls.assign_gathered(full, rep, rows=ps.rows if ps.columnwise else e * ps.rows,
                                      cols=e * ps.cols if ps.columnwise else ps.cols, columnwise=ps.columnwise,
                                      meta=ps.meta)
    except Exception:  # noqa: BLE001 - a part that cannot be rebuilt on meta: the joined fill as before
        return None
    out = {}
    for k, t in part.tensors().items():
        if t is None:
            continue
        b = next((b for n, b in specs.items() if full[n] is t), None)
        r = next((r for n, r in reps.items() if rep[n] is t), None)
        if b is not None and not ps.columnwise:
            out[k] = (("buffer", b), (b.capacity,) + b.row_shape, b.dtype)
        elif r is not None:
            out[k] = (("replica", r), r.shape, r.dtype)
        else:
            return None
    return out


def _probe_direct(m0, e: int, plan: GatherPlan, stacked: StackedBlocks, dst, q, dtype) -> tuple | None:
    derived = plan.derive and COLUMNWISE in plan.materialize
    copies = []
    for d in plan.materialize:
        if derived and d == COLUMNWISE:
            continue
        sources = _part_sources(m0, e, d, stacked)
        if sources is None:
            return None
        for k, v in dst[d][1].items():
            s = sources.get(k)
            if s is None or tuple(v.shape) != (e,) + tuple(s[1]) or v.dtype != s[2]:
                return None
            copies.append((d, k, s[0]))
    rows = None
    if derived:  # (the rowwise tensors as sent, derived into the stacked columnwise views by the format)
        sources = _part_sources(m0, e, ROWWISE, stacked)
        if not sources:
            return None
        meta = torch.device("meta")
        try:
            ok = q.derive_experts_into(
                {k: torch.empty((e,) + tuple(shape), dtype=dt, device=meta) for k, (_, shape, dt) in sources.items()},
                {k: torch.empty(v.shape, dtype=v.dtype, device=meta) for k, v in dst[COLUMNWISE][1].items()}, dtype)
        except Exception:  # noqa: BLE001 - a derivation that cannot run on meta: the joined fill as before
            ok = False
        if not ok:
            return None
        rows = tuple((k, src) for k, (src, _, _) in sources.items())
    return tuple(copies), rows


def _source_view(per_expert: torch.Tensor, stacked: StackedBlocks, src: tuple) -> torch.Tensor:
    """`[E, ...]`: every expert's tensor of one payload buffer or replicated tensor, out of the `[E, slot]` slots."""
    kind, what = src
    if kind == "buffer":
        e = per_expert.shape[0]
        return per_expert[:, what.offset:what.offset + what.nbytes].view(what.dtype).view(
            (e, what.capacity) + what.row_shape)
    return stacked._views(per_expert, what)


def _fill_direct(st, q, metas, gathered: torch.Tensor, per_expert: torch.Tensor, slot: int, layout: ExpertLayout,
                 plan: GatherPlan, stacked: StackedBlocks, dst, dtype) -> bool:
    """The joined fill as one copy per stacked tensor straight from the experts' slots, and a derived columnwise
    direction derived from them by one `derive_experts_into` (`_direct_sources`), without assembling the joined
    parts; False (nothing done) where it does not apply. The work is kept for the next unshard of the same output
    where every source is a view of it (`_copy_kept`)."""
    e = per_expert.shape[0]
    sources = _direct_sources(st, metas[0], e, plan, stacked, dst, q, dtype)
    if sources is None:
        return False
    copies = tuple(_words(dst[d][1][k], _source_view(per_expert, stacked, src)) for d, k, src in sources[0])
    derive = None
    if sources[1] is not None:
        derive = ({k: _source_view(per_expert, stacked, src) for k, src in sources[1]}, dst[COLUMNWISE][1])
    _run_direct(st, q, copies, derive, dtype)
    out = storage_id(gathered)
    kept = st.__dict__.setdefault("direct_copies", {})  # (per plan: forward and backward / eval unshards alternate)
    kept.pop(id(plan), None)
    read = [src for _, src in copies] + (list(derive[0].values()) if derive is not None else [])
    if all(storage_id(src) == out for src in read):
        if len(kept) >= 8:
            kept.clear()
        kept[id(plan)] = ((GatheredViews.key_of(gathered), slot, layout), (metas, plan, stacked, q, dtype),
                          tuple((d, dst[d][1]) for d in plan.materialize), copies, derive)
    return True


def _words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) as views of the same bytes in the widest integer elements both layouts allow (8, 4 or 2 bytes),
    else as they are: a copy between them writes the same bytes. The slots' views are strided (an expert stride of
    the slot), and a strided copy of 1-byte elements runs CUDA's element-by-element kernel (~75 us per MoE weight of
    32 MiB on an H200, 2026-11-28 profile): 8-byte words move 8 bytes per element."""
    if dst.shape != src.shape or dst.dim() == 0 or dst.element_size() != src.element_size() \
            or dst.stride(-1) != 1 or src.stride(-1) != 1:
        return dst, src
    a, b = dst, src
    while a.dim() > 1 and a.stride(-2) == a.shape[-1] and b.stride(-2) == b.shape[-1]:  # (fold contiguous dims)
        a = a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])
        b = b.reshape(*b.shape[:-2], b.shape[-2] * b.shape[-1])
    for wide in (torch.int64, torch.int32, torch.int16):
        ratio = wide.itemsize // dst.element_size()
        if ratio <= 1:
            break
        if all(t.shape[-1] % ratio == 0 and t.storage_offset() % ratio == 0
               and all(st % ratio == 0 for st in t.stride()[:-1]) for t in (a, b)):
            return a.view(wide), b.view(wide)
    return dst, src


def _run_direct(st, q, copies, derive, dtype) -> None:
    """A direct fill's copies, then its derivation (the format's, into the stacked columnwise views)."""
    for t, src in copies:
        t.copy_(src)
    if derive is not None:
        if not q.derive_experts_into(derive[0], derive[1], dtype):  # (it did on meta: `_probe_direct`)
            raise RuntimeError(f"hybridq FSDP: {q.describe()} refused to derive the experts' columnwise form it "
                               f"derived on meta tensors")
        st.counters["stacked_block_derived_direct"] += 1
    st.counters["stacked_block_fills_direct"] += 1


def _copy_kept(st, q, metas, gathered: torch.Tensor, slot: int, layout: ExpertLayout, plan: GatherPlan,
               stacked: StackedBlocks | None, dtype) -> bool:
    """The last direct fill's copies and derivation again where this unshard is like it: the same all-gather output
    (storage, offset, shape, dtype: its views hold this unshard's bytes), slot, layout, payload metadata, plan,
    replicas, quantizer and dtype, and the same stacked views. False, nothing done: fill as usual."""
    hit = st.__dict__.get("direct_copies", {}).get(id(plan))
    if (hit is None or hit[1][0] is not metas or hit[1][1] is not plan or hit[1][2] is not stacked
            or hit[1][3] is not q or hit[1][4] != dtype or hit[0] != (GatheredViews.key_of(gathered), slot, layout)):
        return False
    for d, views in hit[2]:
        now = st.stacked(d)
        if now is None or now[1] is not views:
            return False
    _run_direct(st, q, hit[3], hit[4], dtype)
    st.counters["stacked_block_fills_kept"] += 1
    return True


# [Note: direct joined fill]
# The joined fill assembles all experts' payloads as one `[E*out, in]` tensor's parts (each buffer kind joined across
# the experts' slots: a copy, the slots being apart) and splits them into the stacked buffers (another copy). Where a
# stacked tensor's experts are, byte for byte, one buffer of their payloads (a rowwise part whose `assign_gathered`
# takes that buffer as it is: FP8 blocks' data, 1x128 scales) or one replicated tensor carried in the slots (128x128
# tile scales: `StackedBlocks`), the same bytes go straight from the slots into the stacked views: one copy per
# tensor and none of the assembly's ~20 dispatcher calls. Which tensors are so is a matter of the payload layout and
# the format alone: asked once per payload metadata, replicas and plan by rebuilding the joined part on meta tensors
# (the protocol's `assign_gathered`, no values) and checking that each stacked tensor is a gathered buffer or a
# replicated tensor itself (not a copy, transpose or repeat of one). The copies (stacked view, view of the output)
# are kept per plan for the next unshard of the same output, slot, layout, metadata, plan, replicas and stacked
# views: FSDP2 hands the hook the same output storage at every unshard, whose views then hold the new bytes (kept
# only where every source is such a view: a payload padded per rank is sliced by a copy). Every byte is read from
# this unshard's all-gather output. A derived direction (the backward unshard's columnwise 128x128 tiles, the
# transposes of the rowwise ones gathered) is written by the format from the rowwise tensors in the slots straight
# into the stacked columnwise views, all experts in one call (`Quantizer.derive_experts_into`: one launch of the
# tiled transpose over the slots' expert stride, one copy of the transposed tile scales), where the assembled fill
# joined the experts (a copy), derived the joined weight (a transposed copy into a new buffer) and split it into the
# stacked buffers (a strided copy, ~0.36 TB/s on an H200) with ~29 dispatcher calls. Each expert's slice of the
# joined derivation is the derivation of its own part (no tile spans two experts), so the bytes are the same. A
# re-laid-out buffer (a columnwise part's transposed rows) or a format that derives no experts at once keeps the
# assembled fill.


def fill_stacked_blocks(st, qs, metas, gathered: torch.Tensor, slot: int, layout: ExpertLayout, plan: GatherPlan,
                        dtype, stacked: StackedBlocks | None = None) -> bool:
    """The post-all-gather fill of a block-format grouped weight with stacked buffers: all experts joined, one copy
    per tensor kind (`_fill_joined`), or, where the experts' blocks or slots do not allow that, one copy per kind
    where the experts' gathered tensors are equally spaced and the derivation per expert (False, nothing done: the
    per-expert fill runs). `stacked`: the payload came from `prepare_stacked_blocks` (the metas hold no replicated
    tensors; the slots do)."""
    if (not st.slabs or plan.local or HIGH_PRECISION in plan.materialize or not stacks_blocks(qs)
            or any(d not in (ROWWISE, COLUMNWISE) for d in plan.send) or (plan.derive and ROWWISE not in plan.send)):
        return False
    st.alloc_slabs(plan.materialize)  # (FSDP2 allocated them already, except where it reuses nothing)
    q = qs[0]
    if _fill_joined(st, q, metas, gathered, slot, layout, plan, dtype, stacked):
        st.counters["stacked_block_fills"] += 1
        return True
    if stacked is not None:
        metas = stacked.expert_metas(metas, gathered, slot, layout)
    parts = [assemble_parts(meta, layout.expert_bytes(gathered, slot, g, meta, expert_major=layout.dim == 1))
             for g, meta in enumerate(metas)]
    for d in plan.send:
        if d in plan.materialize:
            st.fill_experts(d, [p[d] for p in parts])
    if plan.derive and COLUMNWISE in plan.materialize:
        st.fill_experts(COLUMNWISE, [q.derive_part(p[ROWWISE], COLUMNWISE, dtype) for p in parts])
    return True
