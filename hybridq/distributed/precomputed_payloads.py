"""`precompute_payloads`: the next forward unshard's all-gather payloads of a model's qualifying Linear weights
prepared after the optimizer step, in one cast + quantize per batch, so that the forward's pre-all-gather hooks
quantize nothing (see [Note: precomputed payloads]).

`precompute_scales(model, payloads=True)` calls it after reducing the statistics (its payloads need them at more
than one rank). Switch: `HYBRIDQ_PRECOMPUTED_PAYLOADS=0` starts a process with it off (a call prepares nothing);
`set_precomputed_payloads(on)` turns it on or off.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..data_writes import fingerprint
from ..enums import Phase
from ..nn.linear import Linear
from ..switches import Switch
from ..torch_private import current_raw_stream, current_stream, local_tensor, storage_id
from .fsdp_adapter import reshard_flags, state_phase
from .module_walk import modules_in_order
from .transport import payload_key
from .unit_cast import (_TENSOR, PreparedPayload, _block_parts, _entry, _Entry, _region, _tensor_parts,
                        batch_payloads)
from .weights import HybridWeight

__all__ = ["PrecomputedPayloads", "precompute_payloads", "precomputed_payloads_enabled", "set_precomputed_payloads"]

# [Note: precomputed payloads]
# The compiled 1B job's forward is host-bound (per FSDP2 unit the host issues FSDP2's pre-forward -- the pre-all-gather
# hooks, their casts, the copy-in -- and the compiled blocks, ~4 ms for ~3 ms of GPU work) and its backward GPU-bound:
# the host waits ~36 ms at the step's end. So the forward's quantization moves to the step's tail: after the optimizer
# step (and `precompute_scales`' reduction) every Linear weight whose next forward unshard the unit cast would batch
# ([Note: unit cast]: its rules, unchanged) gets that unshard's payload now, from one
# `fp8_tensors.quantize_fp8_tensors` / `fp8_block_tensors.quantize_fp8_block_tensors` call per batch, and keeps it as
# the unit cast leaves a sibling its payload (`PreparedPayload`, `WeightState.unit_prepared`): under the key its
# forward hook will compute (`transport.payload_key`: the shard's values through the parameter's and local tensor's
# version counters, the gather dtype, shape, world size, rows and directions) with its quantizer. The hook takes it
# only under its own key and quantizer -- a weight changed after this call (a second optimizer step, a load, a user's
# in-place edit) moves a version counter and is quantized anew; the payload is dropped either way. A write through
# `.data` moves none: the payload carries the fingerprint of the values it came from, which the hook compares with
# the values' now ([Note: data-write check], hybridq/data_writes.py: one CPU rank quantizes anew; on CUDA or at
# world > 1 a StaleWeightError follows).
# What the forward unshard will be is read from the weight's forward lane (`lane.py`: it exists from the first forward
# on), as the unit cast predicts its siblings; a prediction that misses costs the work, never the bytes.
# A batch is one FSDP2 unit's weights of one kind (`per_unit=True`, the default) or every such weight of the model
# (`per_unit=False`: one call per kind, gather dtype and device). The payloads are views of their batch's buffer, which
# lives until its last view is dropped: per unit, that is where the unit cast's buffer is dropped (the forward unshard
# keeps its payloads until the backward unshard re-sends them, or drops them at once where nothing is re-sent); per
# model, the whole buffer lives until the last unit's backward unshard. Between this call and the forward a rank holds
# its payloads already (about one byte per local element of the weights, plus their scales): at the forward's end it
# holds them in either case.
# Streams: the batch is quantized on the stream current at this call; FSDP2's root pre-forward orders its all-gather
# streams after that stream (`wait_stream`, torch 2.11 and 2.13), and a hook that takes a payload on another stream
# (FSDP2's copy-in stream) marks the batch's storages as used there (`_Batch.hand_over`, once per batch and stream) so
# that the allocator does not hand them out before that stream has read them.

ENABLED = Switch("HYBRIDQ_PRECOMPUTED_PAYLOADS")


def set_precomputed_payloads(on: bool) -> bool:
    """Turn the precomputed payloads on or off (for A/B runs; `HYBRIDQ_PRECOMPUTED_PAYLOADS=0` starts a process with
    them off); returns the previous setting."""
    return ENABLED.set(on)


def precomputed_payloads_enabled() -> bool:
    return ENABLED.on


@dataclasses.dataclass(frozen=True)
class PrecomputedPayloads:
    """What `precompute_payloads` prepared."""

    weights: int  # weights that hold a payload for their next forward unshard
    batches: int  # quantize calls (one per batch)
    bytes: int  # payload bytes held until those unshards (the batches' buffers; scales not counted)


class _Batch:
    """One batch's buffers (bytes, scales) and the stream it was quantized on; `hand_over` marks them as used by the
    stream a hook takes a payload on (CUDA only; once per stream)."""

    __slots__ = ("tensors", "made_on", "marked")

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        cuda = tensors[0].is_cuda
        self.made_on = current_raw_stream(tensors[0].device) if cuda else None
        self.marked = set() if cuda else None

    def hand_over(self) -> None:
        if self.marked is None:
            return
        device = self.tensors[0].device
        raw = current_raw_stream(device)
        if raw == self.made_on or raw in self.marked:
            return
        stream = current_stream(device)
        for t in self.tensors:
            t.record_stream(stream)
        self.marked.add(raw)


def _forward_lane(st):
    """The weight's lane of FSDP2's FORWARD training state, or None (no forward unshard in a lane yet)."""
    for lane in st.pre_lanes.values():
        if state_phase(lane.ts) is Phase.FORWARD:
            return lane
    return None


def _forward_entry(mod: Linear, local: HybridWeight) -> tuple[_Entry, object] | None:
    """(the unit cast's entry, the FSDP2 param group) of `mod.weight`'s next forward unshard where the unit cast's
    rules take it and nothing holds its payload already; else None."""
    st = local._hq
    lane = _forward_lane(st)
    if lane is None or lane.link is None or not lane.own or lane.local() is not local or lane.module() is not mod:
        return None
    # (the hook derives a new lane where any of these changed: the key would then differ, the payload be dropped)
    group = lane.link.group
    if (group is None or lane.quant is not mod.weight_quantizer or lane.override != mod.recipe.backward_override
            or lane.extra is not st.backward_extra or (lane.ra, lane.rab) != reshard_flags(group)):
        return None
    param = lane.param() if lane.param else None
    if param is None or mod._parameters.get("weight") is not param:
        return None
    key = payload_key(param, lane.dtype, lane.shape, lane.ws, lane.layout.shard, lane.setup.plan.send, local)
    kept, prepared = st.kept_payload, st.__dict__.get("unit_prepared")
    if key is None or (kept is not None and kept.key == key) or (prepared is not None and prepared.key == key):
        return None  # (its hook re-sends a kept payload, or one is prepared for these values already)
    e = _entry(local, lane, key, local._data.device)
    if e is None:
        return None
    # the fingerprint of the values it is made from, checked by the hook that takes it ([Note: data-write check]):
    # at world > 1 the statistics' (the same values: their reuse is what goes stale), else read now
    e.fp = st.stats_fp if lane.ws > 1 else fingerprint(local._data)
    e.region = _region(st, e.quant, e.shard, e.shards, e.shape, e.dtype)
    return (e, group) if e.region is not None else None


def _prepare(entries: list[_Entry]) -> int:
    """Quantize one batch and leave each weight its payload; returns the batch's bytes."""
    device, dtype = entries[0].local._data.device, entries[0].dtype
    data, parts = (_tensor_parts if entries[0].kind == _TENSOR else _block_parts)(entries, dtype)
    buffers = [data] + [p.scale_inv for p in parts]  # (the scales: views of the batch's scale buffers)
    seen, tensors = set(), []
    for t in buffers:
        sid = storage_id(t)
        if sid not in seen:
            seen.add(sid)
            tensors.append(t)
    batch = _Batch(tensors)
    for e, est, payload, meta in batch_payloads(entries, parts, data, device, "the precomputed payloads"):
        est.counters["payloads_precomputed"] += 1
        est.unit_prepared = PreparedPayload(e.key, e.quant, payload, meta, "payload_precomputed", batch, e.fp, True)
    return data.numel()


@torch.no_grad()
def precompute_payloads(model: nn.Module, *, per_unit: bool = True) -> PrecomputedPayloads:
    """Prepare the next forward unshard's all-gather payload of every FSDP2-sharded hybridq Linear weight of `model`
    that the unit cast takes (per-tensor FP8 with current scaling, or FP8 128x128 tiles whose shards hold whole
    tiles; rowwise sent only; no tensor parallelism; statistics of one rank or reduced for these shard values), one
    cast + quantize per batch: one FSDP2 unit's weights of one kind (`per_unit`), or every such weight of the model of
    one kind, gather dtype and device. Each weight's forward hook sends its payload where the weight is unchanged
    since (bitwise what it would have quantized), else quantizes anew. Call it after `optimizer.step()` and after the
    statistics are reduced -- `precompute_scales(model, payloads=True)` does both -- on every rank (it issues no
    collective). Weights get a payload from their second forward unshard on (their forward lanes exist from the
    first). The payloads are held until the forward unshard (about one byte per local element, [Note: precomputed
    payloads]). Does nothing where the switch is off (`HYBRIDQ_PRECOMPUTED_PAYLOADS=0`) or nothing qualifies."""
    if not ENABLED.on:
        return PrecomputedPayloads(0, 0, 0)
    batches: dict = {}
    for mod in modules_in_order(model):
        if not isinstance(mod, Linear):
            continue
        local = local_tensor(mod._parameters.get("weight"))
        if type(local) is not HybridWeight:
            continue
        hit = _forward_entry(mod, local)
        if hit is None:
            continue
        e, group = hit
        bk = (id(group) if per_unit else None, e.kind, e.dtype, e.local._data.device)
        batches.setdefault(bk, []).append(e)
    nbytes = sum(_prepare(entries) for entries in batches.values())
    return PrecomputedPayloads(weights=sum(map(len, batches.values())), batches=len(batches), bytes=nbytes)
