"""`quantize_master_weights`: refresh a model's weights from fp32 master fragments owned by different ranks (ZeRO
optimizers), so that every rank's weight is bitwise the quantization of the whole master cast to the model dtype
(each fragment a piece: see [Note: piece], pieces.py, and [Note: sharding invariance], formats/shardable.py).

Per call: each fragment is cast to the model dtype (as FSDP2's param_dtype cast); one MAX all-reduce carries every
per-tensor statistic (global amaxes) and the partial amaxes of the blocks that fragments share
(`fragments.edge_block_rows`); each rank quantizes the rows its fragment touches, widened to whole block rows,
with every element it does not own set to its block's full amax -- so each block's amax, hence its scale, is the
whole weight's, and every owned element is encoded as the whole weight's quantization encodes it; then one
all-gather carries the owned elements' codes and each rank's share of the scale rows (`owned_block_rows`), from
which every rank assembles the weight's parts and copies them into the parameter's buffers.

Directions by what their blocks allow:
- "elementwise": per-tensor FP8 and identity (no blocks): the fragment is quantized as it is;
- "blocks": 1-D blocks and 2-D tiles (FP8 1x128 / 128x128, MXFP8, NVFP4 without the Hadamard transform), and
  per-axis scales (rowwise FP8: a row's scale covers a 1 x K block, a column's an M x 1 one; `fragment_block`);
- "high_precision": NVFP4's Hadamard-transformed columnwise form mixes 16 rows of a column: the fragments are
  gathered in the model dtype and every rank quantizes the whole weight in that direction (exact, 2 bytes per
  element on the wire);
- "plain": a parameter held in high precision (norms, biases, embeddings): the cast fragment is gathered.
A direction the format derives exactly from the other (per-tensor FP8, 2-D tiles, double quantization) is not
stored by a quantized parameter (`quantized_params`), so nothing is sent for it. Each direction's plan (a `Task`)
is made in `master_tasks.py`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..enums import FragmentKind
from ..formats._numerics import pack_nibbles, unpack_nibbles
from ..formats._reduce import amax_all_reduce_
from ..formats._sharding import cdiv
from ..nn.quantized_experts import QuantizedExpertWeights
from ..nn.quantized_params import copy_part_into, quantized_param_info
from .fragments import FragmentLayout, edge_block_rows, gather_layouts, owned_block_rows, padded_rows
from .master_tasks import Task, as_bytes, build_part, piece_sizes, plan_tasks, row_buffers

__all__ = ["quantize_master_weights"]


def quantize_master_weights(model_weights: Sequence[torch.Tensor], master_weights: Sequence[torch.Tensor | None],
                            start_offsets: Sequence[int | None], group=None, *,
                            layouts: Sequence[FragmentLayout] | None = None) -> None:
    """Refresh `model_weights` from this rank's fp32 master fragments.

    `master_weights[i]`: this rank's fragment of weight i (a 1-D tensor: a contiguous range of the flattened
    weight), or None; `start_offsets[i]`: its first element in the flattened weight. Each fragment is cast to
    the weight's dtype; a quantized parameter (hybridq.quantized_model_init) gets every direction it stores,
    bitwise equal to quantizing the whole cast master on one device; a plain parameter gets the cast values. All
    ranks of `group` must call it with the same weights. `layouts` (every rank's fragment of each weight, as
    `FragmentLayout`) saves the all-gather of the layout; ZeroAdamW passes it.

    Raises before anything changes: a fragment that does not fit its weight, fragments that do not partition a
    weight, a quantized weight whose format cannot be rebuilt from fragments (delayed scaling, stochastic
    rounding)."""
    if not (len(model_weights) == len(master_weights) == len(start_offsets)):
        raise ValueError(f"hybridq quantize_master_weights: {len(model_weights)} model weights, "
                         f"{len(master_weights)} master weights and {len(start_offsets)} offsets")
    names = [quantized_param_info(w).layer if quantized_param_info(w) else f"model weight {i}"
             for i, w in enumerate(model_weights)]
    starts, lengths = [], []
    for i, (w, mw, s) in enumerate(zip(model_weights, master_weights, start_offsets)):
        if mw is None:
            starts.append(0)
            lengths.append(0)
            continue
        if mw.dim() != 1 or not mw.is_floating_point():
            raise ValueError(f"hybridq quantize_master_weights: the master fragment of {names[i]} must be a 1-D "
                             f"floating-point tensor, got {tuple(mw.shape)} {mw.dtype}")
        if s is None or s < 0 or s + mw.numel() > w.numel():
            raise ValueError(f"hybridq quantize_master_weights: the master fragment of {names[i]} "
                             f"[{s}, {None if s is None else s + mw.numel()}) does not fit its {w.numel()} elements")
        starts.append(int(s))
        lengths.append(mw.numel())
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if any(isinstance(w, QuantizedExpertWeights) for w in model_weights):
        model_weights, master_weights, starts, lengths, layouts, names = _per_expert(
            model_weights, master_weights, starts, lengths, layouts, names)
    tasks = [t for i, w in enumerate(model_weights) for t in plan_tasks(i, w, names[i])]
    if layouts is None:
        layouts = (gather_layouts([w.numel() for w in model_weights], starts, lengths, group) if world > 1 else
                   [FragmentLayout(w.numel(), ((s, n),)) for w, s, n in zip(model_weights, starts, lengths)])
    for i, lay in enumerate(layouts):
        lay.check(names[i])
        if lay.ranges[rank] != (starts[i], lengths[i]):
            raise ValueError(f"hybridq quantize_master_weights: layout of {names[i]} gives rank {rank} "
                             f"{lay.ranges[rank]}, its master fragment is ({starts[i]}, {lengths[i]})")

    with torch.no_grad():
        frags = [None if mw is None else mw.to(device=w.device, dtype=w.dtype)
                 for w, mw in zip(model_weights, master_weights)]
        stats = _local_stats(tasks, frags, starts, lengths, layouts, model_weights)
        if stats is not None and world > 1:
            amax_all_reduce_(stats, group)
        payload = _local_payload(tasks, frags, starts, lengths, stats, model_weights)
        payloads = _all_gather(payload, tasks, layouts, world, group)
        _assemble(tasks, payloads, layouts, model_weights, stats)


def _per_expert(weights, masters, starts, lengths, layouts, names):
    """A GroupedLinear's quantized weight (`QuantizedExpertWeights`) as its E experts, each a weight of its own
    with its share of the fragment (and of every rank's fragment in `layouts`): experts are quantized alone."""
    out = ([], [], [], [], [] if layouts is not None else None, [])

    def cut(span: tuple[int, int], lo: int, size: int) -> tuple[int, int]:
        a, b = max(span[0], lo), min(span[0] + span[1], lo + size)
        return (a - lo, b - a) if b > a else (0, 0)

    for i, (w, mw, s, n) in enumerate(zip(weights, masters, starts, lengths)):
        parts = ([(w, mw, s, n, None if layouts is None else layouts[i], names[i])]
                 if not isinstance(w, QuantizedExpertWeights) else [])
        for e, ex in enumerate(w.experts if isinstance(w, QuantizedExpertWeights) else ()):
            size = ex.numel()
            es, en = cut((s, n), e * size, size)
            lay = None if layouts is None else FragmentLayout(size, tuple(cut(r, e * size, size)
                                                                          for r in layouts[i].ranges))
            frag = mw[e * size + es - s:e * size + es - s + en] if en else None
            parts.append((ex, frag, es, en, lay, quantized_param_info(ex).layer))
        for w_, mw_, s_, n_, lay, name in parts:
            out[0].append(w_)
            out[1].append(mw_)
            out[2].append(s_)
            out[3].append(n_)
            if layouts is not None:
                out[4].append(lay)
            out[5].append(name)
    return out


# ---- the local side: statistics, then the quantized payload -------------------------------------------------

def _local_stats(tasks, frags, starts, lengths, layouts, weights) -> torch.Tensor | None:
    pieces, at = [], 0
    for t in tasks:
        if t.kind not in (FragmentKind.ELEMENTWISE, FragmentKind.BLOCKS):
            continue
        x = frags[t.index]
        device = weights[t.index].device
        t.stats_at = at
        if t.n_global:
            flat = (x if x is not None else torch.zeros(0, dtype=t.dtype, device=device)).reshape(1, -1)
            pieces.append(t.q.global_stats(flat, not t.columnwise, t.columnwise).reshape(-1).float())
            at += t.n_global
        if t.kind != FragmentKind.BLOCKS:
            continue
        t.edges = edge_block_rows(layouts[t.index], t.m, t.k, t.gr)
        if _spans_rows(t):  # (every rank, one without a fragment too, computes the columns' scales it keeps)
            t.edges = (0,)
        ncb = cdiv(t.k, t.gc)
        part = torch.zeros(len(t.edges), ncb, device=device)
        s, n = starts[t.index], lengths[t.index]
        if n:
            r0, r1 = padded_rows(s, n, t.m, t.k, t.gr)
            p = torch.zeros(r1 - r0, t.k, dtype=t.dtype, device=device)
            p.view(-1)[s - r0 * t.k:s - r0 * t.k + n] = x
            t.local = p
            for j, b in enumerate(t.edges):
                if r0 <= b * t.gr < r1:
                    part[j] = _block_amax(p[b * t.gr - r0:min((b + 1) * t.gr, t.m) - r0], t.gc)
        pieces.append(part.reshape(-1))
        at += part.numel()
    return torch.cat(pieces) if pieces and at else None


def _spans_rows(t: Task) -> bool:
    """A per-axis direction whose one block row holds every row (a column's scale): its scales are replicated."""
    return t.q.stats_per_axis and t.gr >= t.m > 0


def _block_amax(rows: torch.Tensor, gc: int) -> torch.Tensor:
    a = rows.float().abs().amax(dim=0)
    a = torch.nn.functional.pad(a, (0, cdiv(a.numel(), gc) * gc - a.numel()))
    return a.view(-1, gc).amax(dim=1)


def _global_kw(t: Task, stats) -> dict:
    if not t.n_global:
        return {}
    return {"global_stats": stats[t.stats_at:t.stats_at + t.n_global]}


def _local_part(t: Task, x, s: int, n: int, stats, device):
    """This rank's part of the task's direction (over its padded rows, or its fragment as one row)."""
    row, col = not t.columnwise, t.columnwise
    if t.kind == FragmentKind.ELEMENTWISE:
        flat = (x if x is not None else torch.zeros(0, dtype=t.dtype, device=device)).reshape(1, -1)
        parts = t.q.quantize_parts(flat, row, col, **_global_kw(t, stats))
        return parts[0] if row else parts[1]
    p = t.local if n else torch.zeros(0, t.k, dtype=t.dtype, device=device)
    if (n or _spans_rows(t)) and t.edges:
        r0, r1 = padded_rows(s, n, t.m, t.k, t.gr) if n else (0, t.m)
        if not n:  # nothing owned: every element its column's amax (only the replicated scales are kept)
            p = torch.zeros(t.m, t.k, dtype=t.dtype, device=device)
        owned = torch.zeros(r1 - r0, t.k, dtype=torch.bool, device=device)
        owned.view(-1)[s - r0 * t.k:s - r0 * t.k + n] = True
        amax = stats[t.stats_at + t.n_global:].view(len(t.edges), -1)
        p = p.clone()
        for j, b in enumerate(t.edges):
            if r0 <= b * t.gr < r1:
                lo, hi = b * t.gr - r0, min((b + 1) * t.gr, t.m) - r0
                fill = amax[j].repeat_interleave(t.gc)[:t.k].to(t.dtype)  # exact: an amax of model-dtype values
                p[lo:hi] = torch.where(owned[lo:hi], p[lo:hi], fill)
    parts = t.q.quantize_parts(p, row, col, **_global_kw(t, stats))
    return parts[0] if row else parts[1]


def _local_payload(tasks, frags, starts, lengths, stats, weights) -> torch.Tensor:
    out = []
    for t in tasks:
        x, s, n = frags[t.index], starts[t.index], lengths[t.index]
        device = weights[t.index].device
        if t.kind in (FragmentKind.PLAIN, FragmentKind.HIGH_PRECISION):
            out.append(as_bytes(x) if n else torch.zeros(0, dtype=torch.uint8, device=device))
            continue
        part = _local_part(t, x, s, n, stats, device)
        bufs, replicated = row_buffers(part, t.hints)
        t.replicated = replicated
        by_name = {name: (tensor, rb) for name, tensor, rb in bufs}
        data = by_name["data"][0]
        if t.kind == FragmentKind.BLOCKS and n:
            r0 = padded_rows(s, n, t.m, t.k, t.gr)[0]
            codes = unpack_nibbles(data) if t.packed else data
            codes = codes.reshape(-1)[s - r0 * t.k:s - r0 * t.k + n]
            out.append(as_bytes(pack_nibbles(torch.nn.functional.pad(codes, (0, n % 2)).view(1, -1)))
                       if t.packed else as_bytes(codes))
        else:
            out.append(as_bytes(data) if n else torch.zeros(0, dtype=torch.uint8, device=device))
        for name, rb, _, _ in t.scales:
            tensor = by_name[name][0]
            if not n:
                out.append(torch.zeros(0, dtype=torch.uint8, device=device))
                continue
            first = padded_rows(s, n, t.m, t.k, t.gr)[0] // rb
            a, b = owned_block_rows(s, n, t.k, rb)
            out.append(as_bytes(tensor[a - first:b - first]))
    device = weights[0].device if len(weights) else torch.device("cpu")
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8, device=device)


def _all_gather(payload, tasks, layouts, world, group) -> list[torch.Tensor]:
    if world == 1:
        return [payload]
    sizes = [sum(sum(piece_sizes(t, *layouts[t.index].ranges[r])) for t in tasks) for r in range(world)]
    if payload.numel() != sizes[dist.get_rank(group)]:
        raise RuntimeError(f"hybridq quantize_master_weights: payload of {payload.numel()} bytes, the layout says "
                           f"{sizes[dist.get_rank(group)]}")
    width = max(sizes)
    buf = torch.nn.functional.pad(payload, (0, width - payload.numel()))
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [o[:n] for o, n in zip(out, sizes)]


# ---- assembling every rank's pieces into the weights ------------------------------------------------------

def _assemble(tasks, payloads, layouts, weights, stats) -> None:
    world = len(payloads)
    cursor = [0] * world
    pieces: dict[int, list[list[torch.Tensor]]] = {}
    for ti, t in enumerate(tasks):  # split every rank's payload into the tasks' pieces (payload order)
        per_rank = []
        for r in range(world):
            sizes = piece_sizes(t, *layouts[t.index].ranges[r])
            got = []
            for nbytes in sizes:
                got.append(payloads[r][cursor[r]:cursor[r] + nbytes])
                cursor[r] += nbytes
            per_rank.append(got)
        pieces[ti] = per_rank
    for ti, t in enumerate(tasks):
        w = weights[t.index]
        lay = layouts[t.index]
        order = lay.order()
        if t.kind in (FragmentKind.PLAIN, FragmentKind.HIGH_PRECISION):
            full = torch.cat([pieces[ti][r][0] for r in order]).view(t.dtype).view(t.m, t.k)
            if t.kind == FragmentKind.PLAIN:
                w.data.view(-1).copy_(full.view(-1))
                continue
            copy_part_into(w.part(t.direction), t.q.quantize_parts(full, False, True)[1])
            continue
        codes = []
        for r in order:
            s, n = lay.ranges[r]
            c = pieces[ti][r][0]
            if t.packed:
                c = unpack_nibbles(c.view(1, -1)).reshape(-1)[:n]
            codes.append(c)
        codes = torch.cat(codes)
        if t.packed:
            data = pack_nibbles(codes.view(t.m, t.k))
        else:
            data = codes.view(t.code_dtype).view(t.m, t.k)
        buffers = {"data": data}
        for j, (name, rb, shape, dtype) in enumerate(t.scales):
            buffers[name] = torch.cat([pieces[ti][r][1 + j] for r in order]).view(dtype).view(-1, *shape)
        copy_part_into(w.part(t.direction), build_part(t, buffers, t.replicated))
