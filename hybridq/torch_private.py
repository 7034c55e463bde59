"""The one place outside `distributed/fsdp_adapter.py` that reads torch's private attributes (a leaf module: the
layers import it without importing the distributed code).

DTensor's local tensor: `DTensor.to_local()` is the public way, but it returns a new view (through autograd and
the tensor subclass's dispatch), while hybridq needs the very object FSDP2 holds: its identity says whether two
parameters wrap the same shard, its version counter sees in-place updates, and its type says whether FSDP2
all-gathers it quantized. So the private attribute is read here, and only here.

The autograd graph task running on this thread: whether a backward pass is running (and which one); torch has no
public query for it.

A storage's use count: whether a fresh allocation is referenced by one tensor only (then the unsharded weight may
adopt it instead of copying it); torch has no public query for it. A storage's identity (its implementation's
address): what stays the same when FSDP2 frees and re-allocates an all-gather output's bytes.

The aliasing check of a custom op's outputs: torch runs it inside `torch.library.custom_op` only.

The current CUDA stream as its raw handle, a C call: `torch.cuda.current_stream` builds a Stream object through
several Python calls (~20 us of host time each on the H200 machine's host), and the gather hooks and grouped layers
ask for it at every call.
"""

from __future__ import annotations

import torch
from torch._library.utils import _c_check_aliasing_constraint

__all__ = ["check_output_aliasing", "current_raw_stream", "current_stream", "graph_task_id", "in_backward",
           "local_tensor", "storage_id", "storage_use_count"]


def local_tensor(x) -> torch.Tensor | None:
    """The local tensor a DTensor wraps (the object itself, not a view); None for anything else (a plain tensor, a
    parameter not sharded yet, None)."""
    return getattr(x, "_local_tensor", None)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references the storage's implementation has (a tensor and its views each hold one)."""
    return torch._C._storage_Use_Count(storage._cdata)


def storage_id(t: torch.Tensor) -> int:
    """An id of the storage implementation `t` views: the same for every view of it while any tensor holds it, and
    across a resize of its bytes (which changes the data pointer; FSDP2 frees and re-allocates its all-gather outputs
    that way at every unshard)."""
    return t.untyped_storage()._cdata


def check_output_aliasing(qualname: str, args: tuple, kwargs: dict, result) -> None:
    """Raise if an op's outputs alias its inputs or one another: the check `torch.library.custom_op` runs after
    each call (its C++ part; nn/plain_ops.py registers ops without custom_op's layers)."""
    _c_check_aliasing_constraint(qualname, args, kwargs, result)


# `torch.set_grad_enabled(enabled)` as a statement: the C call alone (the public one builds a context-manager object
# through Python calls; the gather hooks switch the mode twice per unshard on FSDP2's one-rank path)
set_grad_mode = torch._C._set_grad_enabled


def graph_task_id() -> int:
    """The id of the autograd graph task (backward pass) running on this thread, -1 outside one."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread."""
    return graph_task_id() != -1


def current_raw_stream(device: torch.device) -> int:
    """The raw handle of the current CUDA stream of `device` (what `torch.cuda.current_stream(device).cuda_stream`
    gives)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else
                                              torch.cuda.current_device())


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device)`, its Stream object made once per raw handle."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, torch._C._cuda_getCurrentRawStream(idx))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 256:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(idx)
    return stream
