"""The one place outside `distributed/fsdp_adapter.py` that reads torch's private attributes (a leaf module: the
layers import it without importing the distributed code).

DTensor's local tensor: `DTensor.to_local()` is the public way, but it returns a new view (through autograd and
the tensor subclass's dispatch), while hybridq needs the very object FSDP2 holds: its identity says whether two
parameters wrap the same shard, its version counter sees in-place updates, and its type says whether FSDP2
all-gathers it quantized. So the private attribute is read here, and only here.

The autograd graph task running on this thread: whether a backward pass is running (and which one); torch has no
public query for it.

A storage's use count: whether a fresh allocation is referenced by one tensor only (then the unsharded weight may
adopt it instead of copying it); torch has no public query for it.
"""

from __future__ import annotations

import torch

__all__ = ["graph_task_id", "in_backward", "local_tensor", "storage_use_count"]


def local_tensor(x) -> torch.Tensor | None:
    """The local tensor a DTensor wraps (the object itself, not a view); None for anything else (a plain tensor, a
    parameter not sharded yet, None)."""
    return getattr(x, "_local_tensor", None)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references the storage's implementation has (a tensor and its views each hold one)."""
    return torch._C._storage_Use_Count(storage._cdata)


def graph_task_id() -> int:
    """The id of the autograd graph task (backward pass) running on this thread, -1 outside one."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread."""
    return graph_task_id() != -1
