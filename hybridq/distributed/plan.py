"""The gather plan: which directions of a weight one FSDP2 unshard sends, materializes, derives and defers.

A pure function of the phase, the FSDP2 settings and the weight's format (no tensors, no FSDP2 state), so
it is cached and can be asked for every direction a weight will ever gather (see `checks.py`); `unshard_setup`
reads those settings from FSDP2 (through `fsdp_adapter.FSDPLink`) for the unshard running now.
"""

from __future__ import annotations

import dataclasses
import functools

from ..enums import COLUMNWISE, ROWWISE, BackwardOverride, Phase
from .fsdp_adapter import FSDPLink, phase_of
from .payload import DIRECTIONS, HIGH_PRECISION

__all__ = ["GatherPlan", "UnshardSetup", "make_plan", "every_plan", "setup_of", "unshard_setup"]


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    send: tuple[str, ...]  # directions quantized on each rank and all-gathered
    materialize: tuple[str, ...]  # directions filled into the unsharded weight
    derive: bool  # columnwise computed from the gathered rowwise after the gather
    deferred: tuple[str, ...]  # directions a later (backward) unshard will fill
    local: tuple[str, ...] = ()  # quantized on every rank from the gathered high-precision weight (not sent)


def _order(dirs) -> tuple[str, ...]:
    return tuple(d for d in DIRECTIONS if d in dirs)


def make_plan(*, phase: Phase | str, reshard_after_forward: bool | None, backward_override: str | None,
              derivable: bool, known: bool, backward_extra=()) -> GatherPlan:
    """phase: forward or backward. reshard_after_forward None = unknown (conservative). derivable: the
    columnwise form is an exact transform of the rowwise one. known=False: FSDP2 internals were not found, so
    the payload must not change between unshards (every unshard sends the same directions). backward_extra:
    directions an earlier backward had to gather lazily (activation recompute reads the rowwise form).

    backward_override="high_precision": backward reads the weight in the gather dtype (FSDP's param_dtype), so the
    HIGH_PRECISION "direction" (the shard itself) is what backward gathers. When it is gathered, any quantized
    direction of the same unshard is quantized from it on every rank (bitwise the one-device quantization of
    the full weight) instead of being sent too: reshard_after_forward=False then sends param_dtype bytes only."""
    return _make_plan(Phase.parse(phase, "phase"), reshard_after_forward, backward_override, derivable, known,
                      frozenset(backward_extra))


@functools.lru_cache(maxsize=256)  # (a handful of distinct arguments; asked for on every all-gather)
def _make_plan(phase: Phase, reshard_after_forward: bool | None, backward_override: str | None, derivable: bool,
               known: bool, backward_extra: frozenset) -> GatherPlan:
    bwd = {COLUMNWISE} if backward_override is None else (
        {ROWWISE} if backward_override == BackwardOverride.DEQUANTIZED else {HIGH_PRECISION})
    deferred: set[str] = set()
    if phase == Phase.BACKWARD:
        mat = set(bwd) | set(backward_extra)
    else:
        mat = {ROWWISE}
        if reshard_after_forward:
            deferred = bwd - mat  # backward re-gathers them
        else:
            mat |= bwd  # no backward unshard: everything backward reads comes now

    def sends(dirs):
        if HIGH_PRECISION in dirs:
            return {HIGH_PRECISION}
        return {ROWWISE if (d == COLUMNWISE and derivable) else d for d in dirs}

    send = sends(mat) or {ROWWISE}
    if not known:
        send = sends({ROWWISE} | bwd)
    local = (mat - {HIGH_PRECISION}) if HIGH_PRECISION in send else set()
    derive = COLUMNWISE in mat and COLUMNWISE not in send and not local
    return GatherPlan(_order(send), _order(mat), derive, _order(deferred), _order(local))


def every_plan(backward_override: str | None, derivable: bool) -> tuple[GatherPlan, ...]:
    """Every plan an unshard of a weight with this override can follow: forward and backward, any
    reshard_after_forward, FSDP2 internals found or not, with or without the rowwise form in backward
    (activation recompute, reshard_after_backward=False)."""
    extras = ((), (ROWWISE,))
    plans = {_make_plan(phase, ra, backward_override, derivable, known, frozenset(extra))
             for phase in Phase for ra in (True, False, None) for known in (True, False)
             for extra in extras}
    return tuple(sorted(plans, key=repr))


@dataclasses.dataclass(frozen=True)
class UnshardSetup:
    """What an unshard running now follows, from FSDP2's settings and the weight's format (`unshard_setup`)."""

    phase: Phase
    reshard_after_forward: bool | None
    backward_extra: frozenset
    plan: GatherPlan
    keeps: bool  # a forward unshard whose payload the backward unshard re-sends: it is kept for that one


# (phase, reshard_after_forward, reshard_after_backward, override, derivable, known, backward_extra) -> UnshardSetup:
# a handful of keys per process, asked at every all-gather of every weight (one dict lookup instead of the plan's
# argument parsing and a second plan for the kept payload)
_SETUPS: dict = {}
_NO_EXTRA: frozenset = frozenset()


def unshard_setup(link: FSDPLink | None, backward_extra: frozenset, backward_override: str | None,
                  derivable: bool) -> UnshardSetup:
    """The plan of the unshard running now, from FSDP2's state (link None: FSDP2 internals not found; the plan then
    keeps the payload constant), with whether its payload is kept for the backward unshard (a forward unshard whose
    directions backward re-gathers unchanged: per-tensor FP8 rowwise, columnwise derived)."""
    phase, ra, rab = link.unshard_state() if link is not None else (phase_of(None), None, True)
    return setup_of(phase, ra, rab, backward_override, derivable, link is not None, backward_extra)


def setup_of(phase: Phase, reshard_after_forward: bool | None, reshard_after_backward: bool,
             backward_override: str | None, derivable: bool, known: bool, backward_extra: frozenset) -> UnshardSetup:
    """The `UnshardSetup` of these settings (`make_plan`'s arguments; reshard_after_backward=False gathers the rowwise
    form in backward too), remembered per settings."""
    key = (phase, reshard_after_forward, reshard_after_backward, backward_override, derivable, known, backward_extra)
    hit = _SETUPS.get(key)
    if hit is None:
        ra = reshard_after_forward
        extra = frozenset(backward_extra) | (_NO_EXTRA if reshard_after_backward else frozenset((ROWWISE,)))
        plan = make_plan(phase=phase, reshard_after_forward=ra, backward_override=backward_override,
                         derivable=derivable, known=known, backward_extra=extra)
        keeps = bool(phase == Phase.FORWARD and plan.deferred and make_plan(
            phase=Phase.BACKWARD, reshard_after_forward=ra, backward_override=backward_override, derivable=derivable,
            known=True, backward_extra=extra).send == plan.send)
        if len(_SETUPS) >= 256:
            _SETUPS.clear()
        hit = _SETUPS[key] = UnshardSetup(phase, ra, extra, plan, keeps)
    return hit
