"""Delayed-scaling state update of many per-tensor FP8 quantizers at once (docs/numerics.md "Per-tensor FP8
(current, delayed)"): `update_delayed_scaling(quantizers)` does what calling `Float8Quantizer.update()` on
each would do, bit for bit, with one CUDA launch per device for every quantizer whose state lives on a CUDA device (the
`torch.ops.hybridq.fp8_delayed_update` op) instead of about ten small torch ops per quantizer.

Differences from the per-quantizer Python update, all of them about bookkeeping, none about values:
- the CUDA op updates `amax_history` and `scale` in place (the Python update rebinds new tensors);
- the optional MAX all-reduce of `amax_history[:1]` over `amax_reduction_group` runs as one all-reduce per
  group for all its quantizers (elementwise MAX: the same values as one all-reduce per quantizer).

Everything else runs the Python `update()`: quantizers on the CPU, without the extension, with a history longer
than the kernel takes (4096), subclasses that override `update()` or add options, and batches in which two
quantizers share a state tensor. Quantizers without delayed scaling are skipped (their `update()` does nothing);
hybrid quantizers contribute their parts.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.distributed as dist

from .. import dispatch
from ..enums import AmaxComputeAlgo, Scaling
from ..formats import Float8Quantizer
from ..formats._numerics import FP8_MAX
from ..formats._reduce import amax_all_reduce_
from ..formats.base import option_names
from . import _ext

MAX_HISTORY = 4096  # csrc/hybridq.h kDelayedMaxLen


def _flatten(quantizers: Iterable) -> list:
    out, seen = [], set()
    for q in quantizers:
        parts = q.quantizers() if hasattr(q, "quantizers") else (q,)
        for p in parts:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _type_ok(cls: type, options: frozenset | None) -> bool:
    # the reference update and options the quantize kernel takes (a class property: cached per class)
    return (cls.update is Float8Quantizer.update and options is not None
            and option_names(cls) <= options)


def _state_ok(q: Float8Quantizer) -> bool:
    # the state the update kernel takes
    h, s = q.amax_history, q.scale
    return (q.amax_compute_algo in (AmaxComputeAlgo.MAX, AmaxComputeAlgo.MOST_RECENT)
            and isinstance(h, torch.Tensor) and isinstance(s, torch.Tensor)
            and h.is_cuda and s.device == h.device and h.dtype == torch.float32 and s.dtype == torch.float32
            and h.dim() == 1 and 1 <= h.numel() <= MAX_HISTORY and h.is_contiguous()
            and s.numel() == 1 and s.is_contiguous()
            and _ext.available_for(h.device))


def _kernel_ok(q: Float8Quantizer) -> bool:
    return _type_ok(type(q), dispatch.quantize_options(Float8Quantizer)) and _state_ok(q)


def _launch(qs: list) -> None:
    # (the op sets its device from the tensors')
    torch.ops.hybridq.fp8_delayed_update([q.amax_history for q in qs], [q.scale for q in qs],
                                         [FP8_MAX[q.dtype] for q in qs], [_divisor(q.margin) for q in qs],
                                         [int(q.amax_compute_algo == AmaxComputeAlgo.MOST_RECENT) for q in qs])
    for q in qs:
        q.mark_updated()


@functools.lru_cache(maxsize=None)
def _divisor(margin: int) -> float:
    # the reference divides the fp32 scale by the Python float 2.0 ** margin, which torch rounds to fp32
    return float(torch.tensor(2.0 ** margin, dtype=torch.float64).float().item())


def update_delayed_scaling(quantizers: Iterable) -> None:
    """`q.update()` for every delayed-scaling quantizer in `quantizers` (and in the hybrids among them): one CUDA
    launch per device for the CUDA-resident states, the Python update for the rest. See the module docstring."""
    delayed = [q for q in _flatten(quantizers) if isinstance(q, Float8Quantizer) and q.scaling == Scaling.DELAYED]
    batch = [q for q in delayed if _kernel_ok(q)]
    ptrs = [t.data_ptr() for q in batch for t in (q.amax_history, q.scale)]
    if len(set(ptrs)) != len(ptrs):  # shared state: the sequential Python semantics
        batch = []
    rest = [q for q in delayed if not any(q is b for b in batch)]

    # the MAX all-reduce of the recorded amax, one collective per group
    groups: dict = {}
    for q in batch:
        if q.amax_reduction_group is not None and dist.is_initialized():
            groups.setdefault(id(q.amax_reduction_group), (q.amax_reduction_group, []))[1].append(q)
    for group, qs in groups.values():
        buf = torch.cat([q.amax_history[:1] for q in qs])
        amax_all_reduce_(buf, group)
        for i, q in enumerate(qs):
            q.amax_history[:1].copy_(buf[i:i + 1])

    by_device: dict = {}
    for q in batch:
        by_device.setdefault(q.amax_history.device, []).append(q)
        q.detach_forward_scale()  # (the update is in place; a replay still to come needs the scale cast with)
    for qs in by_device.values():
        _launch(qs)
    for q in rest:
        q.update()


def _direct(q: Float8Quantizer) -> bool:
    # update_before_cast's launch of the update kernel alone (no all-reduce first)
    return (q.amax_reduction_group is None or not dist.is_initialized()) and _kernel_ok(q)


def update_before_casts(qs: list, device: torch.device) -> None:
    """The pending updates of distinct quantizers (sharing no state tensor) whose next casts are about to run on
    `device`, in one launch where the kernel takes them all as `update_before_cast` would (state on `device`), else
    nothing here: each cast's `begin_delayed_cast` then updates its own. The kernel updates each entry on its own, so
    one launch for several is bitwise one each (nn/delayed_linear.py: x's and the weight's in one)."""
    pending = [q for q in qs if q.update_pending]
    if len(pending) > 1 and all(q.amax_history.device == device and _direct(q) for q in pending):
        _launch(pending)


def update_before_cast(q: Float8Quantizer) -> None:
    """The pending update of one quantizer at the start of its next cast on the extension (`begin_delayed_cast`'s
    `run_update`): the update kernel directly when it takes the quantizer, `update_delayed_scaling([q])` otherwise.
    This is the per-cast path, so it skips what the batched one needs for many quantizers (about 30 us of host time
    per cast). No replay can follow an update made here: a forward cast replaces the scale a replay uses, and a
    quantizer that casts only in backward is never replayed, so the scale is updated in place without a copy."""
    if _direct(q):
        _launch([q])
    else:
        update_delayed_scaling([q])
