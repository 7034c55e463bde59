"""A checksum of a weight's bits, so that the `is_first_microbatch` cache notices writes its key cannot see.

The fingerprint and the switch that turns it off (`HYBRIDQ_CHECK_DATA_WRITES=0`) are hybridq/data_writes.py's, which
the FSDP2 caches use too ([Note: data-write check]).

The cache key (data_ptr, `_version`) catches every in-place op on the parameter and every replaced tensor, but
not a write through `weight.data` (`layer.weight.data.mul_(2)`, `p.data.copy_(...)`): `.data` is a new tensor with
a version counter of its own over the same storage. The fingerprint is the sum of the weight's bit patterns
(integers: exact, order-free, NaN-proof), one read of the weight on its device. Any change of one element changes
it; only changes that compensate each other exactly escape.

On the CPU a later call compares it at once. On a CUDA device reading the comparison would be a host sync per
call, so its result goes to pinned host memory asynchronously (accumulated on the device) and is read once the
copy's event has completed: polled without waiting at every later call of the weight, waited for when the cache
is refreshed or dropped. A change seen there raises `StaleWeightError`: calls already ran on the old quantized
weight, which cannot be undone.
"""

from __future__ import annotations

import torch

from ..data_writes import CHECK, bits_sum as _bits_sum
from ..errors import StaleWeightError

__all__ = ["StaleWeightError", "WeightFingerprint"]


class WeightFingerprint:
    """The fingerprint of a weight when it was quantized into the cache, and the pending checks of later calls."""

    __slots__ = ("value", "lazy", "stale", "host", "event")

    def __init__(self, w: torch.Tensor):
        self.value = _bits_sum(w) if CHECK.on else None  # (None: taken with the check off, never compared)
        self.lazy = w.device.type == "cuda"
        self.stale = self.host = self.event = None

    def changed(self, w: torch.Tensor) -> bool:
        """Whether `w` differs from the fingerprinted weight, where that costs no host sync (the CPU, devices
        other than CUDA); on CUDA queue the comparison and return False (`check` reports it later)."""
        if self.value is None or not CHECK.on:
            return False
        now = _bits_sum(w)
        if not self.lazy:
            return bool(now != self.value)
        # (not in place: a tensor made under inference_mode may not be updated outside it)
        self.stale = now != self.value if self.stale is None else self.stale | (now != self.value)
        if self.host is None:
            # (a normal tensor even when the first check runs under inference_mode: an inference tensor could not
            # be written by the checks of later calls outside it)
            with torch.inference_mode(False):
                self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.host.copy_(self.stale, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(w.device))  # (the stream the copy was queued on)
        return False

    def check(self, name: str, wait: bool) -> None:
        """Raise StaleWeightError if a queued comparison found a change (`wait`: wait for the last one)."""
        if self.event is None:
            return
        if wait:
            self.event.synchronize()
        elif not self.event.query():
            return
        self.event = None
        if bool(self.host):
            self.stale = None  # reported once
            raise StaleWeightError(
                f"{name}: the weight changed without its version counter changing (a write through `.data`, e.g. "
                f"`weight.data.mul_(2)`) after is_first_microbatch quantized it, and the is_first_microbatch=False "
                f"calls since then used the old quantized weight (on a GPU this check runs asynchronously, to spare "
                f"a host sync per call, so it is reported now). Change weights through the parameter itself under "
                f"torch.no_grad() (its version then shows the change and the next call quantizes it again), or pass "
                f"is_first_microbatch=True after changing it")
