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
# - the same on CUDA: reading the comparison would be a host sync per reuse, so the fingerprints are queued and
#   compared in batches (`_flush`: one stack + compare + copy to pinned memory, an event), read once the event has
#   completed (polled at later checks without waiting; waited for at the next `precompute_scales`) ->
#   StaleWeightError (the unshards since then sent the old data: that cannot be undone);
# - a decision that involves other ranks (world > 1: the reduced statistics, and payloads made with them): a rank
#   that re-derived alone would leave the others waiting in a collective or mismatch theirs. The check is queued on
#   the weight (its state's `data_checks`: the same checks in the same order on every rank, since the reuse decisions
#   read version counters only) and the next `precompute_scales` sends one flag per queued check with its fused MAX
#   all-reduce of the weight's process group (appended values: no collective of its own, except for a group with
#   checks and no statistics to reduce); every rank then raises StaleWeightError naming the same weights: on the CPU
#   in that call, on CUDA at the call after it (the reduced flags reach pinned memory asynchronously; the next call
#   waits for them, on every rank alike). Without a precompute_scales nothing reports them (a weight's queue is
#   folded into one check past `_FOLD`, so it stays bounded). A tensor-parallel piece's checks are not queued (its
#   statistics span the TP group too, which that all-reduce does not reach).
# A precomputed payload that the backward unshard will re-send (kept from forward) is not checked at the forward when
# the check would only be queued (CUDA, world > 1): the backward's kept-payload check compares with the fingerprint
# it was prepared from, which sees a write in either window (`unit_cast.unit_payload`'s `defer_check`): one read of
# the weight per step, not two.
# Cost per reuse: one read of the weight's shard (one launch, `bits_sum`) and a list append (on the CPU, one rank: and
# a compare); per derivation one read; per precompute_scales one stack and one compare per process group for the
# queued checks.

CHECK = Switch("HYBRIDQ_CHECK_DATA_WRITES")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLUSH = 256  # queued local CUDA checks compared in one batch (bounds the queue without a precompute_scales)
_FOLD = 64  # a weight's queued world > 1 checks folded into one (bounds it likewise)


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
    """The process's queued checks of decisions of one rank on CUDA (`local`: compared in batches into `reports`,
    polled) and the reduced flags of a precompute_scales on CUDA (`due`: read at the next one). The checks of world > 1
    decisions are queued on each weight's state (its `data_checks` list), where precompute_scales finds them."""

    def __init__(self):
        self.local: list = []  # (name, fingerprint then, fingerprint now, what)
        self.reports: list[_Report] = []  # local batches in flight: raised by a later check or precompute_scales
        self.due: list[_Report] = []  # reduced flags of a precompute_scales on CUDA: waited for at the next one

    def reused(self, name: str, values: torch.Tensor, ref: torch.Tensor | None, pending: list | None, local: bool,
               what: str) -> tuple[bool, torch.Tensor | None]:
        """Data derived from `values` when their fingerprint was `ref` is about to be reused: (derive it anew now,
        the fingerprint of the values now). Anew: a decision of this rank alone (`local`), on the CPU, and the values
        changed. Else the check is queued ([Note: data-write check]): `local` in this ledger, else on `pending`, the
        weight's queue that precompute_scales reports. (False, None) where `ref` is None (taken with the check off),
        the check is off, or a decision of several ranks has no queue."""
        if ref is None or not CHECK.on or (pending is None and not local):
            # (a tensor-parallel piece: its decisions span two groups; docs/known-limits.md)
            return False, None
        if self.reports:
            self.poll(wait=False)
        now = bits_sum(values)
        if local:
            if not now.is_cuda:
                if not torch.equal(now, ref):  # (one op, read at once: no device to wait for)
                    log.warning("%s: changed through `.data` since hybridq derived %s from it; deriving it again "
                                "from the current values", name, what)
                    return True, now
                return False, now
            self.local.append((name, ref, now, what))
            if len(self.local) >= _FLUSH:
                self._flush()
            return False, now
        pending.append((ref, now))
        if len(pending) >= _FOLD:
            pending[:] = [_folded(pending)]
        return False, now

    def _flush(self) -> None:
        if not self.local:
            return
        entries, self.local = self.local, []
        device, k = entries[0][2].device, len(entries)
        both = torch.stack([r.to(device) for _, r, _, _ in entries] + [n for _, _, n, _ in entries])
        self.reports.append(_Report([e[0] for e in entries], both[:k] != both[k:], entries[0][3]))

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


def _folded(pending: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One (then, now) pair that differs where any of `pending`'s pairs does (bounds a weight's queue where no
    precompute_scales comes to take it)."""
    with torch.inference_mode(False), torch.no_grad():
        refs, nows = zip(*pending)
        device = nows[0].device
        both = torch.stack([r.to(device) for r in refs] + list(nows))
        changed = (both[:len(nows)] != both[len(nows):]).any().to(torch.int64)
        return torch.zeros_like(changed), changed


def flags(pending: list) -> torch.Tensor:
    """fp32 flags, one per queued (then, now) pair of the weights' queues `pending` (concatenated): 1 where the pair
    differs. Two launches (one stack, one compare into fp32)."""
    refs = [r for r, _ in pending]
    nows = [n for _, n in pending]
    device, k = nows[0].device, len(nows)
    both = torch.stack([r.to(device) for r in refs] + nows)
    return torch.ne(both[:k], both[k:], out=torch.empty(k, device=device))


def raise_stale(names, what: str = "data") -> None:
    if names:
        raise StaleWeightError(_message(names, what))
