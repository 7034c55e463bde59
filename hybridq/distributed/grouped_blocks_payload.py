"""The pre-all-gather work of a grouped weight gathered in a block format (FP8 1x128 / 128x128 blocks, MXFP8 and
hybrids of them: `Quantizer.local_scaling`) batched over the experts this rank holds, where every expert shares one
quantizer: what `transport.prepare_grouped` does expert by expert, in one quantization and one copy per tensor kind.

[Note: stacked block payload]
- FSDP2's `Shard(0)` gives each rank whole experts, `[held, out, in]`. Quantized as ONE `[held*out, in]` tensor, each
  expert's rows of that quantization are bitwise its own quantization wherever no scaling block along the rows spans
  two experts (`out` a whole number of `split_granularity(...)[0]` of the directions sent: 128x128 tiles 128, MXFP8's
  columnwise 32x1 blocks 32, 1x128 / 1x32 rowwise blocks 1): the blocks' scales depend on their own block alone
  (`local_scaling`), the same argument as the receiver's joined assembly ([Note: stacked block gather]).
- The joined parts' dim-0 buffers (`extract_buffers` of the whole joined tensor) are each expert's buffers one after
  another (the buffer protocol concatenates along dim 0 over row shards), so each tensor kind goes into every
  expert's payload slot in one copy, at the offsets of one expert's payload layout (`build_payload`), which is made
  once per layout from a quantization of zeros, and checked once to split a joined two-expert quantization evenly.
- Replicated tensors (the 128x128 tiles' scale grid, which every shard of one tensor holds alike) travel in the slot
  after the expert's payload (`StackedBlocks`): each expert's owner knows its scales, so no statistics are reduced
  across ranks (the per-expert path all-reduces every expert's tile-amax grid and quantizes an empty piece of every
  expert held elsewhere to rebuild its scales) -- the receiver reads them from the gathered bytes
  (`StackedBlocks.joined_replicated` for all experts at once, `expert_metas` for the per-expert fill).
  `precompute_scales` leaves out a weight whose every possible unshard takes this path (`joins_blocks`,
  `scales._scales_travel_in_the_payload`).
- Elsewhere (a `Shard(1)` layout, blocks that would span experts, a high-precision direction, differing quantizers,
  per-tensor or stochastic formats) the per-expert path runs, as before.

Bitwise the per-expert path: the same bytes in every expert's gathered buffers, outputs and gradients
(tests/distributed/test_fsdp_grouped_block_payload.py). The switch `set_stacked_block_payload(False)` (or
HYBRIDQ_STACKED_BLOCK_PAYLOAD=0 at start-up) keeps the per-expert payload; it is read at every unshard.
"""

from __future__ import annotations

import dataclasses

import torch

from torch._subclasses.fake_tensor import FakeTensor

from ..formats._numerics import FP8_MAX
from ..formats._sharding import RowShard
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..switches import Switch
from .grouped_fast import one_local_quantizer
from .layout import ALIGN, ExpertLayout
from .payload import DIRECTIONS, PayloadMeta, aligned, build_payload, quantize_shard

__all__ = ["ENV", "StackedBlocks", "joins_blocks", "prepare_stacked_blocks", "set_stacked_block_payload",
           "stacked_block_payload"]

ENV = "HYBRIDQ_STACKED_BLOCK_PAYLOAD"
_ON = Switch(ENV)
_SENDABLE = (ROWWISE, COLUMNWISE)


def set_stacked_block_payload(on: bool) -> None:
    """Turn the batched payload of block-format experts on (default) or off (the per-expert payload, as before)."""
    _ON.set(on)


def stacked_block_payload() -> bool:
    """Whether block-format experts' payloads are built by `prepare_stacked_blocks` (`set_stacked_block_payload`)."""
    return _ON.on


@dataclasses.dataclass(frozen=True)
class Replica:
    """One replicated tensor of every expert's part `direction`, carried in each expert's slot at `offset` (bytes)."""

    direction: str
    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, int]  # one expert's
    columnwise: bool  # a columnwise part's: the experts' tensors join along dim 1 (their columns), else along dim 0

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class StackedBlocks:
    """What the receiver of a stacked block payload needs besides the metadata (whose replicated tensors are None):
    where each expert's replicated tensors lie in its slot. The same object for every unshard of one layout."""

    replicas: tuple[Replica, ...]

    def _views(self, per_expert: torch.Tensor, r: Replica) -> torch.Tensor:
        """`[G, *shape]` of replica `r` out of `[G, slot]` uint8 slots."""
        b = per_expert[:, r.offset:r.offset + r.nbytes]
        if b.storage_offset() % ALIGN or (b.shape[0] > 1 and b.stride(0) % ALIGN):
            b = b.contiguous()  # (read in its own dtype: aligned offsets)
        return b.view(r.dtype).view(b.shape[0], *r.shape)

    def joined_replicated(self, per_expert: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """All experts' replicated tensors joined as those of one `[E*out, in]` tensor (`payload.assemble_joined`):
        `per_expert` `[E, slot]` holds every expert's slot."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for r in self.replicas:
            v = self._views(per_expert, r)
            e, (a, b) = v.shape[0], r.shape
            out.setdefault(r.direction, {})[r.name] = (v.permute(1, 0, 2).reshape(a, e * b) if r.columnwise
                                                       else v.reshape(e * a, b))
        return out

    def expert_metas(self, metas, gathered: torch.Tensor, slot: int, layout: ExpertLayout) -> list[PayloadMeta]:
        """Every expert's metadata with its replicated tensors (views of the gathered bytes), for a fill that reads
        the experts one by one."""
        if not self.replicas:
            return list(metas)
        flat = gathered.reshape(-1).view(torch.uint8)
        per_rank = flat.view(layout.world_size, -1)
        out = []
        for e, meta in enumerate(metas):
            owner = layout.owner(e)
            start = (e - owner * layout.chunk) * slot
            one = per_rank[owner, start:start + slot].unsqueeze(0)
            rep = {d: dict(r) for d, r in meta.replicated.items()}
            for r in self.replicas:
                rep[r.direction][r.name] = self._views(one, r)[0]
            out.append(dataclasses.replace(meta, replicated=rep))
        return out


@dataclasses.dataclass(frozen=True)
class _Template:
    """One layout's payload: every expert's metadata (one object), the slot size, the replicas, whether the slots
    have bytes no buffer covers (zeroed), and the buffers' `(direction, name, dtype)` in payload order."""

    metas: tuple[PayloadMeta, ...]
    slot: int
    stacked: StackedBlocks
    gaps: bool
    order: tuple[tuple[str, str, torch.dtype], ...]
    tile: tuple[int, int] | None = None  # (data, scale offset) in a slot where the tile kernel writes it, else None


def joins_blocks(qs, send, layout: ExpertLayout) -> bool:
    """Whether `prepare_stacked_blocks` builds this unshard's payload: the switch on, whole experts per rank, one
    block-format quantizer (`local_scaling`: no tensor-wide statistic, no state, no random draws) for every expert,
    only quantized directions sent, and `out` a whole number of the row blocks of every direction sent. A function of
    what every rank shares (never of the values or of the experts held): all ranks take the same path."""
    if not (_ON.on and layout.dim == 0 and send and qs) or any(d not in _SENDABLE for d in send):
        return False
    q0 = qs[0]
    if not one_local_quantizer(qs):  # (once per tuple of quantizers: [Note: grouped hooks' steady state])
        return False
    return layout.rows % q0.split_granularity(ROWWISE in send, COLUMNWISE in send)[0] == 0


def _extract(q: Quantizer, parts: dict, rows: int) -> tuple[list, dict]:
    """The parts of a whole `rows`-row tensor as the buffer protocol gives them: [(direction, buffer name, buffer, row
    block)] in payload order, and {direction: {name: replicated tensor}}."""
    buffers, replicated = [], {}
    shard = RowShard.whole(rows)
    for d in DIRECTIONS:
        if d in parts:
            bufs, replicated[d] = parts[d].extract_buffers(shard, **q.buffer_hints(d))
            buffers += [(d, n, t, g) for n, t, g in bufs]
    return buffers, replicated


def _make_template(q: Quantizer, layout: ExpertLayout, send, dtype, device) -> _Template | None:
    """The layout's `_Template` from a quantization of one expert of zeros (values do not change the layout), or
    None where a joined quantization of two experts does not split into the experts' buffers and replicated tensors
    evenly (then the per-expert path runs)."""
    n, k = layout.rows, layout.cols
    one = quantize_shard(q, torch.zeros(n, k, dtype=dtype, device=device), RowShard.whole(n), send)
    meta = build_payload(q, one, RowShard.whole(n), [RowShard.whole(n)], (n, k), device, pack=False)[1]
    two = quantize_shard(q, torch.zeros(2 * n, k, dtype=dtype, device=device), RowShard.whole(2 * n), send)
    joined, rep2 = _extract(q, two, 2 * n)
    if len(joined) != len(meta.buffers):
        return None
    for spec, (d, name, t, _) in zip(meta.buffers, joined):
        if (spec.direction, spec.name, spec.dtype) != (d, name, t.dtype) or tuple(t.shape) != (
                2 * spec.capacity,) + spec.row_shape or spec.counts != (spec.capacity,):
            return None
    replicas, offset = [], aligned(meta.nbytes)
    for d, rep in meta.replicated.items():
        col = meta.parts[d].columnwise
        for name, t in rep.items():
            t2 = rep2[d].get(name)
            if t is None and t2 is None:
                continue
            if t is None or t2 is None or t.dim() != 2 or t2.dtype != t.dtype or tuple(t2.shape) != (
                    (t.shape[0], 2 * t.shape[1]) if col else (2 * t.shape[0], t.shape[1])):
                return None
            r = Replica(d, name, offset, t.dtype, (t.shape[0], t.shape[1]), col)
            replicas.append(r)
            offset += aligned(r.nbytes)
    slot = layout.slot_bytes([dataclasses.replace(meta, nbytes=offset)])
    covered = sum(s.nbytes for s in meta.buffers) + sum(r.nbytes for r in replicas)
    bare = dataclasses.replace(meta, replicated={d: dict.fromkeys(r) for d, r in meta.replicated.items()})
    return _Template((bare,) * layout.experts, slot, StackedBlocks(tuple(replicas)),
                     covered != slot or layout.slots_held != layout.chunk,
                     tuple((s.direction, s.name, s.dtype) for s in meta.buffers),
                     _tile_places(q, one, meta, tuple(replicas), send, n, k, slot))


def _tile_places(q: Quantizer, one: dict, meta: PayloadMeta, replicas: tuple, send, n: int, k: int, slot: int
                 ) -> tuple[int, int] | None:
    """(data offset, tile-scale offset) in each slot where the tile payload kernel writes the payload
    (kernels/triton_tile_payload.py: a quantizer it implements, the rowwise form alone sent, as one data buffer of the
    part's own `[n, K]` bytes and its tile scales carried as the one replica), else None. [Note: tile payload]"""
    from ..kernels import triton_tile_payload as tile
    if tuple(send) != (ROWWISE,) or not tile.takes(q) or len(meta.buffers) != 1 or len(replicas) != 1:
        return None
    b, r, part = meta.buffers[0], replicas[0], one[ROWWISE]
    if ((b.direction, b.name, b.dtype, b.row_shape, b.capacity, b.row_block) != (ROWWISE, "data", part.data.dtype,
                                                                                 (k,), n, 1)
            or (r.direction, r.name, r.dtype, r.columnwise) != (ROWWISE, "scale_inv", torch.float32, False)
            or r.shape != tuple(part.scale_inv.shape) or r.shape != (-(-n // tile.TILE), -(-k // tile.TILE))
            or slot % 4 or r.offset % 4):
        return None
    return b.offset, r.offset


def _template(local, q: Quantizer, layout: ExpertLayout, send, dtype, device) -> _Template | None:
    """The layout's `_Template`, made once per quantizer, layout, directions, gather dtype and device."""
    key = (layout, tuple(send), dtype, device)
    cache = local._hq.__dict__.setdefault("stacked_block_templates", {})
    hit = cache.get(key)
    if hit is not None and (hit[0] is q or hit[0] == q):
        return hit[1]
    if len(cache) >= 16:
        cache.clear()
    t = _make_template(q, layout, send, dtype, device)
    cache[key] = (q, t)
    return t


def prepare_stacked_blocks(local, qs, send, layout: ExpertLayout, dtype
                           ) -> tuple[torch.Tensor, tuple[PayloadMeta, ...], int, StackedBlocks] | None:
    """`transport.prepare_grouped` for block-format experts (`joins_blocks`): all experts held here quantized as one
    tensor, each tensor kind copied into the experts' slots in one copy, the replicated tensors into each slot after
    its payload. (payload, every expert's metadata, slot size, what the receiver reads the replicated tensors by);
    None where the layout does not split evenly (`_make_template`; the same on every rank)."""
    q = qs[0]
    x = local._data
    held, n, k = layout.slots_held, layout.rows, layout.cols
    tpl = _template(local, q, layout, send, dtype, x.device)
    if tpl is None:
        return None
    if tuple(x.shape) != (held, n, k):
        raise RuntimeError(f"hybridq FSDP: {local._hq.name}: local shard {tuple(x.shape)}, expected {held} whole "
                           f"experts of {(n, k)} (FSDP2's Shard(0))")
    local._hq.counters["stacked_block_payloads"] += 1
    alloc = torch.zeros if tpl.gaps else torch.empty
    payload = alloc(layout.chunk, tpl.slot, dtype=torch.uint8, device=x.device)
    if held and tpl.tile is not None and _tile_kernel_runs(x) and _tile_into_slots(q, x, payload, tpl, held, n, k,
                                                                                     dtype):
        local._hq.counters["tile_payloads"] += 1
    elif held:
        mine = payload[:held]
        parts = quantize_shard(q, x.to(dtype).reshape(held * n, k), RowShard.whole(held * n), send)
        joined, rep = _extract(q, parts, held * n)
        for spec, (d, name, t, _) in zip(tpl.metas[0].buffers, joined):
            dst = mine[:, spec.offset:spec.offset + spec.nbytes]
            if spec.nbytes:
                dst.view(spec.dtype).view((held, spec.capacity) + spec.row_shape).copy_(
                    t.reshape((held, spec.capacity) + spec.row_shape))
        for r in tpl.stacked.replicas:
            a, b = r.shape
            t = rep[r.direction][r.name]
            src = t.reshape(a, held, b).permute(1, 0, 2) if r.columnwise else t.reshape(held, a, b)
            mine[:, r.offset:r.offset + r.nbytes].view(r.dtype).view(held, a, b).copy_(src)
    return payload.reshape(-1), tpl.metas, tpl.slot, tpl.stacked


def _tile_kernel_runs(x: torch.Tensor) -> bool:
    """Whether the tile payload kernel takes this shard: real CUDA tensors, Triton, its switch on."""
    from ..kernels import triton_tile_payload as tile
    return tile.ENABLED.on and x.is_cuda and not isinstance(x, FakeTensor) and tile.available()


def _tile_into_slots(q: Quantizer, x: torch.Tensor, payload: torch.Tensor, tpl: _Template, held: int, n: int, k: int,
                     dtype) -> bool:
    """The held experts' rowwise bytes and tile scales written into their slots by one launch of the tile payload
    kernel ([Note: tile payload]); False where it failed (turned off with a warning: the quantize and copies run)."""
    from ..kernels import triton_tile_payload as tile
    from ..kernels.grouped_blocks import run_or_none
    data_offset, scale_offset = tpl.tile
    x2d = x.reshape(held * n, k)
    if x2d.stride(1) != 1:  # (the kernel reads rows of unit stride)
        return False

    def launch():
        tile.tile_payload(x2d, payload[:held], n, tpl.slot, data_offset, scale_offset, q.dtype, dtype,
                          fp8_max=FP8_MAX[q.dtype], eps=q.amax_epsilon, pow2=q.power_2_scale)
        return True
    return bool(run_or_none(tile.ENABLED, "tile payload kernel", launch,
                            instead="the experts are quantized, then copied into the payload"))


# [Note: tile payload]
# The stacked payload of FP8 128x128-tile experts (fp8_block's weights) is written by one Triton launch
# (kernels/triton_tile_payload.py) where the template says the payload is exactly what the kernel writes: the
# rowwise form alone sent, one data buffer holding the part's own `[out, in]` bytes and its tile scales as the one
# replicated tensor of the slot (`_tile_places`, asked once per template). The shard is read as FSDP2 holds it (fp32
# master weights cast to the gather dtype in the kernel on CUDA, by the instruction torch's cast runs), quantized in
# tiles with the CUDA tile kernel's numerics, and each expert's bytes and scales stored at their offsets in its slot
# -- where the general path casts the shard (a copy), quantizes it into fresh tensors and copies each tensor kind
# into the slots (a dozen dispatcher calls, three passes over the weight's bytes). The bytes are the same (tests/
# test_tile_payload.py: bitwise the reference under Triton's interpreter; on CUDA bitwise the general path).
# `HYBRIDQ_TILE_PAYLOAD_KERNEL=0` (or a launch that fails: one warning) keeps the general path.
