"""The steady-state host work of a grouped weight's all-gather hooks: what an unshard of a grouped `[E, out, in]`
weight asks of its lane and quantizers, answered once instead of at every unshard (issue 30: the MoE job's GPU
waits for the host while FSDP2 unshards the next layer).

[Note: grouped hooks' steady state]
At every unshard the grouped weight's hooks asked, besides building the payload and filling the buffers:

- whether the E experts share one block-format quantizer (`joins_blocks` before the gather, `stacks_blocks` after
  it): `q0.local_scaling` and E-1 quantizer comparisons -- the experts' quantizers are E equal objects (one per
  expert, made by the recipe), so each comparison is a dataclass `__eq__`: ~35 Python calls per hook, ~140 per
  weight and step for FP8 blocks and MXFP8;
- which pre-all-gather path the lane takes (stacked receiver, stacked block payload) and the payload key's parts
  that do not change while the lane stays (`_grouped_payload_key`: the gather dtype, layout, directions, paths and
  quantizers);
- each stacked buffer's storage and size (`GroupedWeightState.alloc_slabs`, four calls per buffer);
- per-tensor FP8's stacked fill (`grouped_batched.fill_stacked`): where the gathered rows are, which stacked views
  each direction fills (kept per plan, as `grouped_blocks_batched._copy_kept` keeps the block formats' copies).

`one_local_quantizer` answers the first once per tuple of quantizers (a layer's weight quantizers are one tuple per
recipe, `GroupedLinear.weight_quantizers`; quantizers are not changed in place: a new recipe makes new ones, as
`float8_groups.equal_groups_apply` relies on); the entry holds the tuple, so its id is not reused while cached.
`pre_flags` answers the second once per lane (`lane.py`: one object per FSDP2 training state and inputs, replaced
whenever they change) and per setting of the switch it reads (`HYBRIDQ_STACKED_BLOCK_PAYLOAD`, read at every unshard
as before: a changed setting asks again). The payload key keeps the same parts in one tuple per lane (`payload_key`),
so a kept payload is recognised by the same values as before: the shard's version counters and storage, and every
part the lane fixes. `alloc_slabs` keeps its (storage, size) pairs beside `_slabs_of`'s answers, forgotten with them
when the buffers are made anew. The kept stacked fill runs again only for the same plan, all-gather output (storage,
offset, shape, dtype: the kept view of its rows reads this unshard's bytes; FSDP2 hands the hook the same output
storage at every unshard), slot, layout and FP8 dtype, and the same stacked views (asked of the state at every
unshard); the scales are always this unshard's.

Nothing about the bytes changes: the same paths run with the same arguments (tests/distributed/
test_fsdp_grouped_fast_hooks.py: every gathered tensor, output and gradient bitwise the switch off, over train / eval
/ train steps with optimizer updates, FP8 per-tensor and block formats, gloo world 1 and 2). The switch
`set_grouped_fast(False)` (or HYBRIDQ_GROUPED_FAST_HOOKS=0 at start-up) asks everything at every unshard, as
before; it is read at every unshard.
"""

from __future__ import annotations

from ..switches import Switch
from .payload import HIGH_PRECISION

__all__ = ["ENV", "PreFlags", "grouped_fast", "one_local_quantizer", "payload_key", "pre_flags", "set_grouped_fast"]

ENV = "HYBRIDQ_GROUPED_FAST_HOOKS"
_ON = Switch(ENV)


def set_grouped_fast(on: bool) -> bool:
    """Turn the grouped hooks' steady state on (default) or off (everything asked at every unshard, as before); the
    previous setting."""
    return _ON.set(on)


def grouped_fast() -> bool:
    """Whether the grouped weights' hooks answer their steady-state questions once (`set_grouped_fast`)."""
    return _ON.on


_ONE: dict[int, tuple] = {}


def one_local_quantizer(qs) -> bool:
    """Whether the quantizers `qs` are one block format shared by every expert: `qs[0].local_scaling` (no
    tensor-wide statistic, no state, no random draws) and every other one `qs[0]` or equal to it. A tuple is answered
    once while the switch is on ([Note: grouped hooks' steady state]); anything else, or the switch off, at every
    call."""
    if not qs:
        return False
    cached = _ON.on and type(qs) is tuple
    if cached:
        hit = _ONE.get(id(qs))
        if hit is not None and hit[0] is qs:  # (the entry holds the tuple it answers: a new tuple is asked anew)
            return hit[1]
    q0 = qs[0]
    ok = bool(q0.local_scaling) and all(q is q0 or q == q0 for q in qs[1:])
    if cached:
        if len(_ONE) >= 256:
            _ONE.clear()
        _ONE[id(qs)] = (qs, ok)
    return ok


class PreFlags:
    """What a lane's pre-all-gather hook decides once ([Note: grouped hooks' steady state]): `stacked` (the receiver
    fills the stacked buffers straight from the gathered bytes), `blocks` (the stacked block payload builds the
    payload) and `tail`, the payload key's parts the lane fixes."""

    __slots__ = ("lane", "switch", "stacked", "blocks", "tail")

    def __init__(self, lane, switch: bool, stacked: bool, blocks: bool, tail: tuple):
        self.lane, self.switch, self.stacked, self.blocks, self.tail = lane, switch, stacked, blocks, tail


def pre_flags(st, lane, joins_blocks, payload_switch) -> PreFlags:
    """The lane's `PreFlags`, made once per lane and setting of the stacked block payload's switch
    (`payload_switch.on`, which `joins_blocks` reads); kept by the weight's state (a few lanes per weight: one per
    FSDP2 training state)."""
    kept = st.__dict__.setdefault("pre_flags", {})
    hit = kept.get(id(lane))
    on = payload_switch.on
    if hit is not None and hit.lane is lane and hit.switch is on:
        return hit
    plan, qs, layout = lane.setup.plan, lane.quant, lane.layout
    stacked = not plan.local and HIGH_PRECISION not in plan.materialize
    blocks = joins_blocks(qs, plan.send, layout)
    send = tuple(plan.send)
    flags = PreFlags(lane, on, stacked, blocks, (lane.dtype, layout, send, stacked, blocks, tuple(map(id, qs))))
    if len(kept) >= 8:
        kept.clear()
    kept[id(lane)] = flags
    return flags


def payload_key(param, local, flags: PreFlags) -> tuple | None:
    """Identifies the payload of a lane whose weight `local` is its parameter's local tensor: what
    `weights._grouped_payload_key` identifies it by (the shard's values through `transport.stats_key`'s version
    counters and storage; the gather dtype, layout, directions, paths and quantizers), the lane's parts as one tuple.
    None: not reusable."""
    if param is None:
        return None
    return (id(param), param._version, id(local), local._version, local._data.data_ptr(), flags.tail)
