"""Bytes that autograd saves for backward, measured per layer with `torch.autograd.graph.saved_tensors_hooks`.

What a layer's forward saves stays in memory until its backward: this is the activation memory that offload and
recompute trade for transfers or compute. The hooks see every saved tensor; hybridq layers save a QuantizedTensor
as the plain tensors of its parts (hybridq.tensor.save_quantized), and a QuantizedTensor saved by other code is
counted part by part (data, scales, amaxes of every direction it holds), as hybridq.CPUOffload walks it.

A storage is counted once (the first layer that saves it), at its full size (a saved view keeps its whole
storage alive); parameters and buffers (and views of them) are not activations and are not counted.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from hybridq.tensor import QuantizedTensor


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    if isinstance(t, QuantizedTensor):
        return [x for p in (t._rowwise, t._columnwise) if p is not None
                for x in p.tensors().values() if x is not None]
    return [t]


class SavedBytes:
    """Counts, per `layer()` block, the bytes of the distinct storages saved for backward (parameters and buffers
    of `model` excluded). The hooks hand every tensor back unchanged: nothing is copied or moved.

    ```python
    counter = SavedBytes(model)
    for block in model.layers:
        with counter.layer():
            h = block(h)
    counter.per_layer  # [bytes of block 0, bytes of block 1, ...]
    ```

    The innermost `saved_tensors_hooks` wins: code inside the block that installs its own hooks (hybridq.CPUOffload,
    non-reentrant checkpoint's recompute) hides what it saves from the counter; for torch.utils.checkpoint the
    counter sees what the checkpoint keeps (the block's inputs), which is what stays in memory.
    """

    def __init__(self, model: nn.Module):
        self._skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._seen: set[int] = set()
        self.per_layer: list[int] = []

    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        self.per_layer.append(0)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for x in _plain_tensors(t):
            storage = x.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._skip or ptr in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(ptr)
            self.per_layer[-1] += storage.nbytes()
        return t
