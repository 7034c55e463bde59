"""The aten ops code issues, seen through a TorchDispatchMode: host-cost tests count what a call dispatches."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """Every aten op called inside it: `ops` their names in order (e.g. "aten._assert_async.msg"), `counts` per
    overload packet name (e.g. "_grouped_mm")."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
