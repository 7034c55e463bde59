"""The pre-all-gather hook's steady-state lane: what one unshard of a weight derived from its inputs, kept per FSDP2
training state, so that the next unshard in the same state with the same inputs (every step after the first) goes
straight to the payload.

An unshard derives, from FSDP2's mesh, the unsharded shape, the module, the mixed-precision policy, the weight's
quantizer(s), the backward override, FSDP2's phase and resharding settings and the sharded parameter: the world
size, rank and process group, the gather dtype, the checked shard layout and the unshard's plan (`PreLane`). Each
of these steps is cached on its own already (`weights._shard_layout`, `plan.setup_of`, ...); asking all of them
costs ~25 Python calls per unshard, ~140 unshards per step of a 20-layer model, twice (forward and backward). A lane
is one object per training state (FORWARD, PRE_BACKWARD, POST_BACKWARD: the phase each names is fixed) whose inputs
are compared by identity (the override, read from the environment at every unshard, and the resharding flags by
value); any difference derives a new lane. Only states that name a phase get a lane (elsewhere the phase comes from
autograd's state), and only where FSDP2's internals were found and the module holds the sharded parameter.

The payload itself is never part of a lane: its values change at every optimizer step (`transport.payload_key`).
"""

from __future__ import annotations

import dataclasses
import weakref

from ..torch_private import local_tensor
from .fsdp_adapter import FSDPLink, phase_of, reshard_flags, state_phase, training_state
from .plan import UnshardSetup, setup_of

__all__ = ["PreLane", "lookup", "derive"]


@dataclasses.dataclass(eq=False)
class PreLane:
    """One unshard's inputs (compared by `lookup`) and what they give."""

    # inputs
    ts: object  # the param group's FSDP2 training state (None: FSDP2 internals not found)
    module: weakref.ref  # the module FSDP2 passes (a hybridq Linear, a GroupedLinear or a converted expert module)
    local: weakref.ref  # the sharded HybridWeight
    param: weakref.ref | None  # FSDP2's sharded parameter: `module._parameters[attr]`, whose local tensor is `local`
    mesh: object
    outer_size: object
    mp_policy: object
    quant: object  # the weight quantizer (a grouped weight: the experts' tuple, one object per recipe)
    override: object  # the backward override (by value)
    link: FSDPLink | None
    ra: bool | None  # reshard_after_forward (None: unknown)
    rab: bool
    extra: frozenset  # the weight's backward extras (a new frozenset when they change)
    # what they give
    ws: int
    rank: int
    group: object  # the process group, None for one rank
    dtype: object  # the gather dtype
    shape: tuple
    layout: object  # a Linear weight's checked `weights._ShardLayout`; a grouped weight's `ExpertLayout`
    setup: UnshardSetup
    own: bool  # `local` is the parameter's local tensor (not a copy of it: CPU offload)
    ctx: object = None  # the GatherContext this lane's unshards keep (weights._set_context)


def lookup(st, local, mesh, outer_size, module, mp_policy, attr: str) -> PreLane | None:
    """The lane of the unshard running now when all its inputs but the quantizer and the override (the caller
    compares those) are the ones it was made for; else None."""
    link = st.fsdp
    if type(link) is not FSDPLink:
        return None
    g = link._group()
    if g is None or link._param() is None:
        return None
    ts = training_state(g)
    lane = st.pre_lanes.get(id(ts))
    if (lane is None or lane.ts is not ts or lane.link is not link or lane.local() is not local
            or lane.module() is not module or lane.mesh is not mesh or lane.outer_size is not outer_size
            or lane.mp_policy is not mp_policy or lane.extra is not st.backward_extra
            or (lane.ra, lane.rab) != reshard_flags(g)):
        return None
    p = module._parameters.get(attr)
    if p is None or p is not lane.param() or local_tensor(p) is not local:
        return None
    return lane


def derive(st, local, mesh, outer_size, module, mp_policy, attr: str, *, quant, override, link, param, ws, rank,
           group, dtype, shape, layout, derivable: bool) -> PreLane:
    """The lane of these inputs (the setup from FSDP2's state now, as `plan.unshard_setup`), kept for the next
    unshard in the same training state where its inputs can be compared (see the module's note)."""
    if link is not None:
        g = link.group
        ts = training_state(g)
        phase = phase_of(g)
        ra, rab = reshard_flags(g)
    else:
        ts, phase, ra, rab = None, phase_of(None), None, True
    extra = st.backward_extra
    setup = setup_of(phase, ra, rab, override, derivable, link is not None, extra)
    own = param is not None and local_tensor(param) is local
    lane = PreLane(ts, weakref.ref(module), weakref.ref(local), weakref.ref(param) if param is not None else None,
                   mesh, outer_size, mp_policy, quant, override, link, ra, rab, extra, ws, rank, group, dtype,
                   tuple(shape), layout, setup, own)
    if link is not None and own and state_phase(ts) is not None and module._parameters.get(attr) is param:
        st.pre_lanes[id(ts)] = lane
    return lane
