"""One replayed fill per FSDP2 unit for the Linear weights it gathers (the post-all-gather hooks' work of a whole
`fully_shard` unit done at once; see [Note: unit fill]).

`fill_unit(local, metadata, out)` is what a Linear weight's post-all-gather hook asks where its recorded fill applies
(buffers.py, [Note: replayed fill]): True where it filled this weight together with every later weight of the unit
whose recorded fill applies too (each then marked, `take_mark`), False where it did nothing (the hook replays its own
fill as before). Switch: `HYBRIDQ_UNIT_FILL=0` starts a process with it off; `set_unit_fill(on)` turns it on or off.
"""

from __future__ import annotations

import torch

from ..formats.base import COLUMNWISE, ROWWISE
from ..switches import Switch
from ..torch_private import current_stream
from .fsdp_adapter import FSDPLink, pending_post_all_gathers
from .payload import assemble_output

__all__ = ["fill_unit", "set_unit_fill", "take_mark", "unit_fill_enabled"]

# [Note: unit fill]
# FSDP2 runs a param group's (one `fully_shard` unit's) post-all-gather hooks in one loop over its parameters
# (`init_unsharded_param`), after every parameter's all-gather output is written (`FSDPParamGroup.wait_for_unshard`,
# torch 2.11 and 2.13), and keeps each parameter's pre-all-gather metadata until its own hook gets it
# (`fsdp_adapter.pending_post_all_gathers`). From the second unshard of a plan on, a Linear weight's hook only replays
# its recorded fill ([Note: replayed fill]): a copy of each replicated tensor (the FP8 scale) into its own tensor, and
# in a backward unshard the columnwise form derived in place from the gathered rowwise form -- per weight a few
# launches and ~60 us of host time on the H200 (the compiled 1B job: 140 weights, 7 per unit, twice per step). So
# the first weight of a unit whose hook replays leads: it takes the pending metadata and output of every later
# weight of the unit, asks each weight's own record whether it replays for exactly these (`replay_ready`: the same
# checks its own hook makes, after allocating its inner tensors as FSDP2's `alloc_storage` would before that hook),
# and fills all that do at once: one stream bookkeeping call, the derived directions through the format's batch
# (`derive_parts_into`, else one `derive_part_into` each), all the scale copies in one `torch._foreach_copy_`. Each
# weight filled so is marked with the metadata object its own hook will be handed (one per pre-all-gather call,
# held by the mark: no later unshard's can be it); its hook takes the mark (`take_mark`) and, where it is that
# object, only hands FSDP2 its inner tensors. A weight that does not replay, or whose metadata is not the one marked
# (an unshard that failed before its hook), fills itself as before. Every byte written comes from this unshard's
# outputs and replicated tensors, as in its own hook: the bytes are the per-weight path's.

ENABLED = Switch("HYBRIDQ_UNIT_FILL")


def set_unit_fill(on: bool) -> bool:
    """Turn the unit fill on or off (for A/B runs; `HYBRIDQ_UNIT_FILL=0` starts a process with it off); returns the
    previous setting."""
    return ENABLED.set(on)


def unit_fill_enabled() -> bool:
    return ENABLED.on


def take_mark(st, metadata) -> bool:
    """Whether a leader filled this weight for the unshard whose metadata its hook was handed; the mark is dropped
    either way (a mark is for one hook call)."""
    mark = st.unit_filled
    if mark is None:
        return False
    st.unit_filled = None
    return mark is metadata


def fill_unit(local, metadata, out: torch.Tensor, ready: tuple) -> bool:
    """Fill `local` (a HybridWeight whose recorded fill applies to `metadata` and `out`: `ready`, its `replay_ready`)
    and every later weight of its unit whose recorded fill applies (see [Note: unit fill]); False, nothing done:
    fewer than two do, or the switch is off."""
    st = local._hq
    link = st.fsdp
    if not ENABLED.on or type(link) is not FSDPLink or torch.compiler.is_compiling():
        return False
    members = [(st, metadata, out, ready)]
    kind = type(local)
    for peer, pmeta, outputs in pending_post_all_gathers(link):
        if type(peer) is not kind or type(pmeta) is not type(metadata) or len(outputs) != 1:
            continue
        pst = peer._hq
        m, p, d, pq = pmeta
        if id(p) not in pst.fill_replays:
            continue
        pready = pst.replay_ready(m, p, outputs[0], pq, d, alloc=True)
        if pready is not None:
            members.append((pst, pmeta, outputs[0], pready))
    if len(members) < 2:
        return False
    filled = _run(members)
    for pst, pmeta, _, _ in filled:
        if pst is not st:
            pst.unit_filled = pmeta
    return filled[0][0] is st if filled else False


def _run(members: list) -> list:
    """The members' replayed fills, their launches batched; the members filled (those whose format declined the
    derivation are not: their records are dropped, their hooks fill as usual)."""
    srcs = [s for *_, (_, ss) in members for s in ss]
    if srcs and srcs[0].is_cuda:  # (once: the replicated tensors of every member, read on this stream)
        stream = current_stream(srcs[0].device)
        for t in {t.untyped_storage().data_ptr(): t for t in srcs if t.is_cuda}.values():
            t.record_stream(stream)
    derived = [m for m in members if m[3][0].derived]
    declined = _derive(derived) if derived else ()
    filled, dsts, copy_srcs = [], [], []
    for m in members:
        st, _, _, (r, ss) = m
        if declined and any(m is x for x in declined):
            continue
        for (t, _, _), s in zip(r.copies, ss):
            dsts.append(t)
            copy_srcs.append(s)
        st.count_replayed(r)
        st.counters["unit_filled"] += 1
        filled.append(m)
    if dsts:
        torch._foreach_copy_(dsts, copy_srcs)  # (allocated: `replay_ready(alloc=True)`, or FSDP2 for the leader)
    return filled


def _derive(derived: list) -> list:
    """The derived directions of the members `derived`, through the format's batch (`derive_parts_into`) where its
    quantizers have one (grouped by quantizer type and gather dtype), else one `derive_part_into` each; the members
    whose format declined (nothing written for them, their records dropped)."""
    groups: dict = {}
    for m in derived:
        st, (meta, plan, dtype, q), out, _ = m
        src = assemble_output(meta, out, st.gathered_views)[ROWWISE]
        groups.setdefault((type(q), dtype), []).append((m, q, src, st.parts[COLUMNWISE]))
    declined = []
    for (_, dtype), items in groups.items():
        batch = getattr(items[0][1], "derive_parts_into", None)
        if batch is not None and batch([(q, src, into) for _, q, src, into in items], dtype):
            done = [m for m, *_ in items]
        else:
            done = []
            for m, q, src, into in items:
                if q.derive_part_into(src, into, dtype):
                    done.append(m)
                else:  # (it did on meta, `derives_in_place`: as `derive_replayed`, fill as usual)
                    m[0].fill_replays.pop(id(m[1].plan), None)
                    declined.append(m)
        for m in done:
            m[0].counters["derived_in_place"] += 1
    return declined
