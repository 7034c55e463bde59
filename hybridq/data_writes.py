"""Writes through `.data`: the check that keeps hybridq from reusing data derived from a weight's old values.

hybridq reuses what it derives from a weight (the is_first_microbatch quantized weight, the reduced statistics, a
prepared or kept all-gather payload) under keys of version counters. A write through `.data` (`p.data.mul_(2)`,
`p.data.copy_(x)`, the local shard's `.data`) moves none of them: `.data` is a tensor with a version counter of its
own over the same storage. So each reused entry also carries the fingerprint of the values it was derived from, and
the reuse compares it with the values' fingerprint now (see [Note: data-write check]).

Switch: `HYBRIDQ_CHECK_DATA_WRITES=0` starts a process with the check off (no fingerprint is taken or compared);
`set_check_data_writes(on)` turns it on or off.
"""

from __future__ import annotations

import logging
import weakref

import torch

from .errors import StaleWeightError
from .switches import Switch

__all__ = ["CHECK", "LEDGER", "bits_sum", "check_data_writes_enabled", "fingerprint", "set_check_data_writes"]

log = logging.getLogger("hybridq")

# [Note: data-write check]
# The fingerprint is the sum of a tensor's bit patterns as int64 (integers, wrapping: exact, order-free, NaN-proof):
# one read, one launch (`bits_sum`). Any change of one element changes it; only changes that compensate each other exactly
# escape. It is taken where data is derived from the values (the entry keeps it) and again where that data is reused
# under its version key; what happens on a difference depends on who may decide:
# - a decision of this rank alone (one rank, no tensor parallelism: no collective depends on it), values on the CPU:
#   compared at once; changed -> the data is derived anew from the current values (bitwise a fresh run), with a
#   warning (the is_first_microbatch cache's precedent);
# - the same on CUDA: reading the comparison would be a host sync per reuse, so each check is compared on the device
#   into a flag of the weight's queue (`QueuedChecks`: a buffer of flags, one launch per check), and every `_FLUSH`
#   checks (or when a weight's buffer is full) the queues are read in one batch (one stack + any + copy to pinned
#   memory, an event), read once the event has completed (polled at later checks without waiting; waited for at the
#   next `precompute_scales`) -> StaleWeightError (the unshards since then sent the old data: that cannot be undone);
# - a decision that involves other ranks (world > 1: the reduced statistics, and payloads made with them): a rank
#   that re-derived alone would leave the others waiting in a collective or mismatch theirs. The check is compared
#   into the weight's own queue (its state's `data_checks`: the same weights queue checks on every rank, since the
#   reuse decisions read version counters only) and the next `precompute_scales` sends one flag per weight with
#   queued checks with its fused MAX all-reduce of the weight's process group (appended values: no collective of its
#   own, except for a group with checks and no statistics to reduce); every rank then raises StaleWeightError naming
#   the same weights: on the CPU in that call, on CUDA at the call after it (the reduced flags reach pinned memory
#   asynchronously; the next call waits for them, on every rank alike). Without a precompute_scales nothing reads
#   them: past `_UNREPORTED` waiting checks a weight queues none (and takes no fingerprint for one) until the next
#   precompute_scales reports them. A tensor-parallel piece's checks are not queued (its statistics span the TP
#   group too, which that all-reduce does not reach).
# Memory: a queued check holds no tensor (its flag is a byte of the weight's buffer of `_UNREPORTED` flags, made at its
# first check), so device memory is the same after every step, however many checks wait for a report.
# A precomputed payload that the backward unshard will re-send (kept from forward) is not checked at the forward when
# the check would only be queued (CUDA, world > 1): the backward's kept-payload check compares with the fingerprint
# it was prepared from, which sees a write in either window (`unit_cast.unit_payload`'s `defer_check`): one read of
# the weight per step, not two.
# Cost per reuse: one read of the weight's shard (one launch, `bits_sum`) and one compare (queued: into its flag; on
# the CPU at one rank read at once); per derivation one read; per precompute_scales four launches per process group
# for the queued checks (stack, any, fp32 copy, one multi-tensor zero).

CHECK = Switch("HYBRIDQ_CHECK_DATA_WRITES")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLUSH = 256  # queued local CUDA checks compared in one batch (bounds the queue without a precompute_scales)
_UNREPORTED = 64  # a weight's flag buffer: world > 1 checks made before a precompute_scales reports them (then none)


def set_check_data_writes(on: bool) -> bool:
    """Turn the data-write check on or off (`HYBRIDQ_CHECK_DATA_WRITES=0` starts a process with it off); returns
    the previous setting."""
    return CHECK.set(on)


def check_data_writes_enabled() -> bool:
    return CHECK.on


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The int64 sum (wrapping) of `t`'s bit patterns (a 0-d tensor on its device): one read, one launch. Read as
    int64 words where its rows hold whole words (a 32- or 16-bit view summed `dtype=torch.int64` is first converted
    to an int64 copy of the whole tensor, then reduced: two launches, 2-4x the bytes); else as its own width. Either
    way a change of any one element changes the sum (only changes that compensate each other exactly escape), and
    the two fingerprints compared always come from one tensor's shape, so they are read alike."""
    if t.requires_grad:  # (a dtype view of a tensor that requires grad is refused; a shard's master never does)
        t = t.detach()
    size = t.element_size()
    if size < 8 and t.dim() > 0 and t.stride(-1) == 1 and (t.shape[-1] * size) % 8 == 0 \
            and (t.storage_offset() * size) % 8 == 0 and all((s * size) % 8 == 0 for s in t.stride()[:-1]):
        return t.view(torch.int64).sum()
    return t.view(_BITS[size]).sum(dtype=torch.int64)


def fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """`bits_sum(t)` where the check is on, else None (an entry without a fingerprint is never checked)."""
    return bits_sum(t) if CHECK.on else None


def _message(names, what: str) -> str:
    return (f"{', '.join(sorted(set(names)))}: changed without a version counter changing (a write through `.data`, "
            f"e.g. `p.data.mul_(2)` or into the local shard's `.data`) after hybridq derived {what} from its values, "
            f"and an unshard since then used that data (the gathered weight came from the old values or their "
            f"scale). Change weights through the parameter itself under torch.no_grad() (`p.mul_(...)`, "
            f"`p.copy_(...)`), with load_state_dict or DCP (their version counters show the change), or call "
            f"precompute_scales again after such a write. (HYBRIDQ_CHECK_DATA_WRITES=0 turns this check off.)")


class QueuedChecks:
    """A weight's data-write checks queued since they were last reported ([Note: data-write check]): one flag per
    check on the device (`seen[i]`: the i-th check's fingerprints differ), written into a buffer of `_UNREPORTED`
    flags made at the weight's first check, so a queued check holds no tensor of its own and memory does not grow
    from step to step; `count` of them are queued."""

    __slots__ = ("name", "seen", "count", "what", "__weakref__")

    def __init__(self, name: str):
        self.name, self.seen, self.count, self.what = name, None, 0, ""

    def __bool__(self) -> bool:
        return self.count > 0

    def will_report(self, local: bool) -> bool:
        """Whether a check of a reuse decided by this rank alone (`local`: at once, or by the ledger) or by all ranks
        is made: all ranks' until `_UNREPORTED` wait unreported (a run without precompute_scales: nothing would read
        more; the next precompute_scales reports them and they are made again)."""
        return local or self.count < _UNREPORTED

    def add(self, ref: torch.Tensor, now: torch.Tensor, what: str) -> bool:
        """Queue one check: the fingerprint `ref` the reused data was derived at against `now`. One launch (the
        compare, written into its flag). Returns whether the queue is full (to be reported before the next)."""
        if self.seen is None or self.seen.device != now.device:
            with torch.inference_mode(False):  # (written in place later, also outside inference mode)
                self.seen = torch.zeros(_UNREPORTED, dtype=torch.bool, device=now.device)
        torch.ne(ref if ref.device == now.device else ref.to(now.device), now, out=self.seen[self.count])
        self.count += 1
        self.what = what
        return self.count >= _UNREPORTED


def flags(checks: list[QueuedChecks]) -> torch.Tensor:
    """fp32 flags, one per weight of `checks` with a queued check (in that order): 1 where one of its checks saw a
    change. Reported: their queues are emptied (the flags cleared in place). Four launches (stack, any, the fp32
    copy, one multi-tensor zero)."""
    seen = [c.seen for c in checks]
    out = torch.stack(seen).any(dim=1).to(torch.float32)
    torch._foreach_zero_(seen)
    for c in checks:
        c.count = 0
    return out


class _Report:
    """Flags on their way to pinned host memory: `names[i]` is stale where `host[i]` is set once `event` completed."""

    __slots__ = ("names", "host", "event", "what")

    def __init__(self, names: list[str], flags: torch.Tensor, what: str):
        self.names, self.what = names, what
        if flags.is_cuda:
            with torch.inference_mode(False):
                self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(flags.device))
        else:
            self.host, self.event = flags, None

    def ready(self, wait: bool) -> bool:
        if self.event is None:
            return True
        if wait:
            self.event.synchronize()
            return True
        return self.event.query()

    def stale(self) -> list[str]:
        return [n for n, f in zip(self.names, self.host.tolist()) if f]


class Ledger:
    """The process's queued checks of decisions of one rank on CUDA (`local`: one `QueuedChecks` per weight's queue,
    compared in a batch every `_FLUSH` checks into `reports`, polled) and the reduced flags of a precompute_scales on
    CUDA (`due`: read at the next one). The checks of world > 1 decisions are queued on each weight's state (its
    `data_checks`), where precompute_scales finds them."""

    def __init__(self):
        # a weight's queue -> its local checks (weak: a model's weights leave with it)
        self.local: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.queued = 0  # local checks queued since the last batch
        self.reports: list[_Report] = []  # local batches in flight: raised by a later check or precompute_scales
        self.due: list[_Report] = []  # reduced flags of a precompute_scales on CUDA: waited for at the next one

    def reused(self, name: str, values: torch.Tensor, ref: torch.Tensor | None, pending: QueuedChecks | None,
               local: bool, what: str) -> tuple[bool, torch.Tensor | None]:
        """Data derived from `values` when their fingerprint was `ref` is about to be reused: (derive it anew now,
        the fingerprint of the values now). Anew: a decision of this rank alone (`local`), on the CPU, and the values
        changed. Else the check is queued ([Note: data-write check]): `local` in this ledger (under `pending`, the
        weight's queue), else on `pending`, which precompute_scales reports. (False, None) where `ref` is None (taken
        with the check off), the check is off, or the weight has no queue and the check would be queued."""
        if ref is None or not CHECK.on:
            return False, None
        if not (pending.will_report(local) if pending is not None else local and not values.is_cuda):
            # (no queue: a tensor-parallel piece, its decisions span two groups, docs/known-limits.md; a queue of all
            # ranks' checks that no precompute_scales reports)
            return False, None
        now = bits_sum(values)
        if self.reports:
            self.poll(wait=False)
        if local:
            if not now.is_cuda:
                if not torch.equal(now, ref):  # (one op, read at once: no device to wait for)
                    log.warning("%s: changed through `.data` since hybridq derived %s from it; deriving it again "
                                "from the current values", name, what)
                    return True, now
                return False, now
            self.queue_local(name, pending, ref, now, what)
            return False, now
        pending.add(ref, now, what)
        return False, now

    def queue_local(self, name: str, pending: QueuedChecks, ref: torch.Tensor, now: torch.Tensor, what: str) -> None:
        """Queue a check of one rank's decision on CUDA under the weight's queue `pending` (compared with the others
        every `_FLUSH` checks)."""
        mine = self.local.get(pending)
        if mine is None:
            mine = self.local[pending] = QueuedChecks(name)
        full = mine.add(ref, now, what)
        self.queued += 1
        if full or self.queued >= _FLUSH:
            self._flush()

    def _flush(self) -> None:
        checks = [c for c in self.local.values() if c]
        self.queued = 0
        if checks:
            names, what = [c.name for c in checks], checks[0].what
            self.reports.append(_Report(names, flags(checks), what))

    def poll(self, wait: bool) -> None:
        """Raise StaleWeightError for the local batches whose flags reached the host (`wait`: every one)."""
        stale, what, keep = [], None, []
        for r in self.reports:
            if r.ready(wait):
                names = r.stale()
                if names:
                    stale += names
                    what = r.what
            else:
                keep.append(r)
        self.reports = keep
        if stale:
            raise StaleWeightError(_message(stale, what))

    def begin_report(self) -> list[_Report]:
        """At a precompute_scales call: the reports in flight before it (waited for by `end_report`); the local
        checks queued since are compared in a batch now (read at a later check or the next call)."""
        due, self.reports, self.due = self.reports + self.due, [], []
        self._flush()
        return due

    def reduced_flags(self, names: list[str], flags: torch.Tensor) -> list[str]:
        """The weights whose data-write flags, MAX-reduced over a process group, are set: read now on the CPU; on
        CUDA copied to pinned memory and read by the next precompute_scales ([] now)."""
        if flags.is_cuda:
            self.due.append(_Report(names, flags, "data"))
            return []
        return [n for n, f in zip(names, flags.tolist()) if f]

    def end_report(self, due: list[_Report]) -> list[str]:
        """The stale weights of the reports `begin_report` returned (waiting for their copies: events recorded at
        least one step ago)."""
        out = []
        for r in due:
            r.ready(wait=True)
            out += r.stale()
        return out


LEDGER = Ledger()


def raise_stale(names, what: str = "data") -> None:
    if names:
        raise StaleWeightError(_message(names, what))
