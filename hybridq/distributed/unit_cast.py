"""One cast + quantize per FSDP2 unit for the per-tensor FP8 or FP8 128x128-tile dense weights it gathers (the
pre-all-gather hook's payloads of a whole `fully_shard` unit prepared at once; see [Note: unit cast]).

`unit_payload(local, lane, key)` is what a Linear weight's pre-all-gather hook asks before it prepares its own
payload (`transport.prepare_payload`): the payload a unit batch prepared for it, or -- as the first weight of its
unit to ask -- the batch itself, or None (then the hook prepares its payload as it always did).
Switch: `HYBRIDQ_UNIT_CAST=0` starts a process with it off; `set_unit_cast(on)` turns it on or off.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..data_writes import LEDGER
from ..formats._sharding import RowShard, dim0_chunks
from ..formats.base import ROWWISE
from ..kernels import fp8_block_tensors, fp8_tensors
from ..switches import Switch
from .fsdp_adapter import later_params, training_state
from .payload import PayloadMeta, build_payload, quantize_shard
from .transport import payload_key, stats_key

__all__ = ["PreparedPayload", "set_unit_cast", "unit_cast_enabled", "unit_payload"]

# [Note: unit cast]
# FSDP2 asks each parameter of a param group (one `fully_shard` unit) for its all-gather inputs in one loop over
# `FSDPParamGroup.fsdp_params` (`_get_param_all_gather_inputs`, torch 2.11 and 2.13), before the group's one
# all-gather. Per weight, preparing a payload costs a cast of the fp32 master shard to the gather dtype, an amax, the
# FP8 cast, their allocations and ~100 us of Python (the compiled 1B job: 140 weights, 7 per unit). So the first
# hybridq weight of a unit to be asked prepares the payloads of every weight after it in that loop that qualifies,
# in one `fp8_tensors.quantize_fp8_tensors` call (one amax launch and one cast launch, one output allocation; each
# payload a view of it), and leaves each sibling its payload with the key its own hook will compute
# (`transport.payload_key`: the shard's values through the parameter's version counters, the gather dtype, shape,
# world size, rows and directions) and its quantizer. A sibling's hook uses it only where its own key and
# quantizer are those (else it prepares its own, as without the batch: a stale payload is never sent); it drops it
# either way.
# Which siblings, and with what: FSDP2's param group and its order come from `fsdp_adapter.later_params`; what each
# sibling's hook will do comes from its lane of the same FSDP2 training state (`lane.py`), which exists from the
# second unshard in that state on (the first unshard of a unit is per weight). A weight qualifies where its quantizer
# is per-tensor FP8 with current scaling (`fp8_tensors.takes`), its unshard sends the rowwise form only, it is no
# tensor-parallel piece, its shard is on the leader's device in the same gather dtype and process group, its payload
# is its FP8 elements in row order (the format's buffer protocol says so: `_region`), and its statistics need no
# collective now: one rank (its own max|x|) or the values `precompute_scales` / an earlier unshard reduced for these
# shard values (`stats_key`) -- so every rank issues the collectives it issued without the batch. A weight whose
# kept forward payload its backward unshard re-sends is left to that. The bytes are bitwise the per-weight path's
# (`quantize_fp8_tensors` is that path looped on the CPU; its CUDA kernel is checked against it).
# FP8 128x128 tiles (`Float8BlockQuantizer(block_dim=2)`, the fp8_block preset's weights, which send the rowwise form
# only: the columnwise one is its transpose, derived after the gather) batch the same way, one kind per batch (the
# leader's): `fp8_block_tensors.quantize_fp8_block_tensors` quantizes each weight's shard rows in their own tiles (one
# launch: a tile table over the unit's weights) into its payload and its tile-scale grid into one fp32 buffer. A
# shard holds whole tiles where its row boundaries fall on tile rows (or end the tensor): its tiles' amaxes are its
# own, so their bytes are the plain quantization of its rows (what the per-weight path's device kernel does too);
# the scale grid it carries is then the whole tensor's, every tile's, from the reduced statistics (what
# `shard_scale_inv` gives; the grids of a unit's weights with equal quantizers computed in one set of elementwise
# ops: `tile_scale_inv`). A shard whose boundary splits a tile (rows not a multiple of 128 at a rank's edge: a
# tile's amax spans two ranks) is left to the per-weight path, as is an empty one. The bytes and scales are bitwise
# the per-weight path's (`quantize_fp8_block_tensors` is that path looped on the CPU; its CUDA kernel is checked
# against the per-weight CUDA path: tests/test_fp8_block_tensors.py). The switch covers both kinds.

ENABLED = Switch("HYBRIDQ_UNIT_CAST")


def set_unit_cast(on: bool) -> bool:
    """Turn the unit batch on or off (for A/B runs; `HYBRIDQ_UNIT_CAST=0` starts a process with it off); returns the
    previous setting."""
    return ENABLED.set(on)


def unit_cast_enabled() -> bool:
    return ENABLED.on


@dataclasses.dataclass(frozen=True)
class PreparedPayload:
    """A payload a unit batch prepared for a weight, used by its hook only under the same key and quantizer."""

    key: tuple
    quant: object
    payload: torch.Tensor
    meta: PayloadMeta
    counter: str = "payload_unit"  # the counter its use adds to (precomputed_payloads.py: "payload_precomputed")
    batch: object = None  # made before the unshard, on another stream maybe: `batch.hand_over()` as it is taken
    fp: torch.Tensor | None = None  # the fingerprint of the values it came from (hybridq/data_writes.py)
    checked: bool = False  # made before the unshard: its hook checks `fp` ([Note: data-write check])


_TENSOR, _BLOCK = "fp8_tensor", "fp8_block"  # the kinds a batch casts (one per batch)


@dataclasses.dataclass
class _Entry:
    local: torch.Tensor  # the sharded HybridWeight
    key: tuple
    quant: object
    shape: tuple
    shard: RowShard
    shards: list
    stats: torch.Tensor | None  # the reduced statistics (per-tensor: the amax; tiles: the tile-amax grid), None: own
    region: int  # its payload's bytes (`_region`)
    precomputed: bool
    dtype: torch.dtype  # the gather dtype
    kind: str  # _TENSOR or _BLOCK
    fp: torch.Tensor | None = None  # the fingerprint of its values now, where its statistics' reuse was checked


def unit_payload(local, lane, key, defer_check: bool = False
                 ) -> tuple[torch.Tensor, PayloadMeta, torch.Tensor | None] | None:
    """(payload, metadata, the fingerprint of the values it came from or None) of `local` (a HybridWeight whose hook
    runs with `lane` and payload key `key`) from a unit batch, or None: the hook prepares its own. A payload prepared
    before this unshard (`precompute_payloads`) is checked against a write through `.data` since ([Note: data-write
    check]): on one CPU rank a changed weight's payload is dropped (None). `defer_check`: the payload is kept for
    the backward unshard, whose check of the kept payload compares with the same fingerprint (the one it was prepared
    from): a check that would only be queued (CUDA, world > 1) is left to it -- one read of the weight per step
    instead of two, the same writes seen, reported as late."""
    st = local._hq
    prepared = st.__dict__.pop("unit_prepared", None)
    if prepared is not None and key is not None and prepared.key == key and prepared.quant is lane.quant:
        fp = prepared.fp
        at_once = lane.ws == 1 and st.tp_group is None and not local._data.is_cuda  # (decided here: derived anew)
        if prepared.checked and (at_once or not defer_check):
            rederive, fp = LEDGER.reused(st.name, local._data, fp, st.data_checks if st.tp_group is None else None,
                                         lane.ws == 1 and st.tp_group is None, "a prepared all-gather payload")
            if rederive:
                return None
        st.counters[prepared.counter] += 1
        if prepared.batch is not None:
            prepared.batch.hand_over()
        return prepared.payload, prepared.meta, fp
    if not ENABLED.on or key is None or lane.link is None:
        return None
    return _prepare_unit(local, lane, key)


def _region(st, q, shard: RowShard, shards, shape, dtype) -> int | None:
    """Bytes of the payload of a `shape` weight's `shard` under `q` where that payload is the shard's rowwise elements
    in row order (one byte each) and zeros after them; None where it is laid out otherwise. Asked of the buffer
    protocol on the meta device, once per quantizer and sharding."""
    cache = st.__dict__.setdefault("unit_regions", {})
    ck = (id(q), shard, tuple(shape), dtype)
    hit = cache.get(ck)
    if hit is not None and hit[0] is q:
        return hit[1]
    k = shape[-1]
    x = torch.empty(shard.length, k, dtype=dtype, device="meta")
    stats = None if shard.is_whole else q.shard_stats(x, shard)
    parts = quantize_shard(q, x, shard, (ROWWISE,), stats)
    meta = build_payload(q, parts, shard, shards, shape, x.device, pack=False)[1]
    region = None
    if len(meta.buffers) == 1 and len(meta.parts) == 1:
        b = meta.buffers[0]
        if (b.offset == 0 and b.direction == ROWWISE and b.dtype == q.dtype and b.dtype.itemsize == 1
                and b.row_shape == (k,) and b.row_block == 1 and meta.nbytes % 16 == 0):
            region = meta.nbytes
    if len(cache) >= 16:
        cache.clear()
    cache[ck] = (q, region)
    return region


def _kind(q) -> str | None:
    if fp8_tensors.takes(q):
        return _TENSOR
    if fp8_block_tensors.takes(q):
        return _BLOCK
    return None


def _entry(local, lane, key, device) -> _Entry | None:
    """What the batch needs of one weight, or None where it does not qualify (see [Note: unit cast])."""
    st = local._hq
    q = lane.quant
    kind = _kind(q)
    if kind is None or st.tp_group is not None or tuple(lane.setup.plan.send) != (ROWWISE,):
        return None
    x = local._data
    shape, shard = lane.shape, lane.layout.shard
    if x.device != device or x.numel() != shard.length * shape[-1]:
        return None
    if kind == _BLOCK and (shard.length == 0 or not (shard.is_whole or q.tiles_inside(shard))):
        return None  # (a tile split by a shard boundary, or no rows: the per-weight path)
    stats, precomputed = None, False
    if lane.ws > 1:  # (statistics that need no collective now, on every rank alike)
        param = lane.param() if lane.param else None
        skey = stats_key(param, lane.dtype, shard)
        if skey is None or st.stats_key != skey or st.stats is None:
            return None
        precomputed = True
        if not q.shard_is_plain(shard, True, False):
            stats = st.stats
            if kind == _BLOCK and stats.numel() != math.prod(fp8_block_tensors.tiles_of(shard.rows, shape[-1])):
                return None  # (not the tile-amax grid of this weight: the per-weight path says so)
    return _Entry(local, key, q, shape, shard, dim0_chunks(shape, lane.ws), stats, 0, precomputed, lane.dtype, kind)


def _siblings(local, lane, device) -> list[_Entry]:
    """The qualifying weights after `local` in its unit's all-gather order, predicted from their lanes of the
    current training state."""
    ts = training_state(lane.link.group)
    out = []
    for module, name, sib in later_params(lane.link):
        if type(sib) is not type(local):
            continue
        sst = sib._hq
        sl = sst.pre_lanes.get(id(ts))
        # (a prediction: the sibling's hook checks the key and quantizer; the backward override, read from the
        # environment, is left to that -- a new one changes the directions sent, which the key holds)
        if (sl is None or sl.ts is not ts or not sl.own or sl.local() is not sib or sl.module() is not module
                or getattr(module, "weight_quantizer", None) is not sl.quant or sl.extra is not sst.backward_extra
                or sl.group is not lane.group or sl.dtype is not lane.dtype):
            continue
        param = sl.param() if sl.param else None
        if param is None or module._parameters.get(name) is not param:
            continue
        key = payload_key(param, sl.dtype, sl.shape, sl.ws, sl.layout.shard, sl.setup.plan.send, sib)
        kept, prepared = sst.kept_payload, sst.__dict__.get("unit_prepared")
        if key is None or (kept is not None and kept.key == key) or (prepared is not None and prepared.key == key):
            continue  # (it re-sends its kept payload, or an earlier batch of this unshard prepared its own)
        e = _entry(sib, sl, key, device)
        if e is not None:
            out.append(e)
    return out


def _prepare_unit(local, lane, key) -> tuple[torch.Tensor, PayloadMeta, torch.Tensor | None] | None:
    device = local._data.device
    mine = _entry(local, lane, key, device)
    if mine is None:
        return None
    siblings = [e for e in _siblings(local, lane, device) if e.kind == mine.kind]
    if not siblings:  # (a unit of one weight: nothing to batch, no layout asked for)
        return None
    entries = []
    for e in [mine] + siblings:
        e.region = _region(e.local._hq, e.quant, e.shard, e.shards, e.shape, e.dtype)
        if e.region is not None:
            entries.append(e)
    if len(entries) < 2 or entries[0] is not mine:
        return None
    for e in entries:  # (the batch reuses their reduced statistics: each reuse checked, once it is certain)
        if e.precomputed:
            st = e.local._hq
            e.fp = LEDGER.reused(st.name, e.local._data, st.stats_fp, st.data_checks, False, "reduced statistics")[1]
    data, parts = (_tensor_parts if mine.kind == _TENSOR else _block_parts)(entries, lane.dtype)
    out = None
    for i, (e, est, payload, meta) in enumerate(batch_payloads(entries, parts, data, device, "the unit cast")):
        if i == 0:
            out = (payload, meta, e.fp)
            est.counters["unit_batches"] += 1
            est.counters["payload_unit"] += 1
        else:  # (taken by its hook in this FSDP2 loop: no code of the user's runs in between, nothing to check)
            est.unit_prepared = PreparedPayload(e.key, e.quant, payload, meta, fp=e.fp)
    return out


def batch_payloads(entries: list[_Entry], parts: list, data: torch.Tensor, device, who: str):
    """(entry, its weight's state, its payload -- a view of the batch's bytes `data` --, its PayloadMeta) for each
    weight of a batch (the unit cast's or the precomputed payloads'), in order; each layout checked against the
    bytes the batch laid out for it."""
    offset = 0
    for e, part in zip(entries, parts):
        est = e.local._hq
        meta = build_payload(e.quant, {ROWWISE: part}, e.shard, e.shards, e.shape, device, pack=False,
                             memo=est.payload_layouts)[1]
        if meta.nbytes != e.region:
            raise RuntimeError(f"hybridq FSDP: {who} laid out {e.region} payload bytes for {est.name}, its payload "
                               f"layout has {meta.nbytes}")
        if e.precomputed:
            est.counters["stats_precomputed"] += 1  # (what its `reduced_stats` would have counted)
        yield e, est, data[offset:offset + e.region], meta
        offset += e.region


def _tensor_parts(entries: list[_Entry], dtype) -> tuple[torch.Tensor, list]:
    """(the batch's bytes, each weight's rowwise part) of per-tensor FP8 weights: one `quantize_fp8_tensors` call."""
    data, scale_inv = fp8_tensors.quantize_fp8_tensors([e.local._data for e in entries], dtype,
                                                       [e.quant for e in entries], [e.stats for e in entries],
                                                       [e.region for e in entries])
    out, offset = [], 0
    for i, e in enumerate(entries):
        rows, k = e.shard.length, e.shape[-1]
        out.append(fp8_tensors.rowwise_part(e.quant, data[offset:offset + rows * k], scale_inv[i, :1], rows, k))
        offset += e.region
    return data, out


def _block_parts(entries: list[_Entry], dtype) -> tuple[torch.Tensor, list]:
    """(the batch's bytes, each weight's rowwise part) of FP8 128x128-tile weights: one `quantize_fp8_block_tensors`
    call; a sharded weight's part carries the whole tensor's tile scales from the reduced statistics (as
    `quantize_shard` gives it), a whole one its own."""
    xs = []
    for e in entries:
        x, rows_k = e.local._data, (e.shard.length, e.shape[-1])
        xs.append(x if x.shape == rows_k else x.view(rows_k))
    data, scales = fp8_block_tensors.quantize_fp8_block_tensors(xs, dtype, [e.quant for e in entries],
                                                                [e.region for e in entries])
    slots = fp8_block_tensors.scale_slots([tuple(x.shape) for x in xs])[0]
    reduced = _reduced_grids(entries, data.device)
    out, offset = [], 0
    for i, (e, x, slot) in enumerate(zip(entries, xs, slots)):
        rows, k = x.shape
        grid = reduced.get(i)
        if grid is None:
            tm, tk = fp8_block_tensors.tiles_of(rows, k)
            grid = scales[slot:slot + tm * tk].view(tm, tk)
        out.append(fp8_block_tensors.rowwise_part(e.quant, data[offset:offset + rows * k], grid, rows, k))
        offset += e.region
    return data, out


def _reduced_grids(entries: list[_Entry], device) -> dict[int, torch.Tensor]:
    """{i: the whole tile scale_inv grid of sharded entry i} from the reduced tile-amax grids, as `shard_scale_inv`
    gives it: the grids of entries with equal quantizers computed at once (`tile_scale_inv` is elementwise: each
    grid bitwise its own), one set of scale ops per unit instead of one per weight."""
    groups: list[list[int]] = []
    for i, e in enumerate(entries):
        if e.stats is None:
            continue
        for g in groups:
            if entries[g[0]].quant == e.quant:
                g.append(i)
                break
        else:
            groups.append([i])
    out = {}
    for g in groups:
        flat = [entries[i].stats.reshape(-1) for i in g]
        s_inv = entries[g[0]].quant.tile_scale_inv((torch.cat(flat) if len(flat) > 1 else flat[0]).to(device))
        offset = 0
        for i in g:
            e = entries[i]
            tm, tk = fp8_block_tensors.tiles_of(e.shard.rows, e.shape[-1])
            out[i] = s_inv[offset:offset + tm * tk].view(tm, tk)
            offset += tm * tk
    return out
