"""Values attached to live tensors by identity (a quantization of a Linear's input shared by the layers that read
it, the max|y| a producing kernel computed in passing), without holding the tensors."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


class TensorSideTable:
    """The newest `slots` (tensor, key) -> value entries. An entry serves only the same tensor object at the same
    version (an in-place change invalidates it) and is dropped as soon as that tensor dies, so a value never
    outlives its tensor and never keeps it alive. Inference tensors (no version counter) get no entries."""

    def __init__(self, slots: int):
        self.slots = slots
        self.entries: tuple = ()  # (weakref to x, x._version, key, value), newest last

    def find(self, x: torch.Tensor, accept: Callable[[Any, Any], bool] = lambda key, value: True) -> Any:
        if x.is_inference():  # (never stored: see put)
            return None
        for ref, version, key, value in self.entries:
            if ref() is x and version == x._version and accept(key, value):
                return value
        return None

    def put(self, x: torch.Tensor, key: Any, value: Any, same_key: Callable[[Any], bool] = lambda key: True) -> None:
        if x.is_inference():  # no version counter, so an in-place change could not invalidate the entry: none
            return
        keep = tuple(e for e in self.entries  # drop dead entries and the one this supersedes
                     if e[0]() is not None and not (e[0]() is x and same_key(e[2])))
        self.entries = (keep + ((weakref.ref(x, self._drop), x._version, key, value),))[-self.slots:]

    def clear(self) -> None:
        self.entries = ()

    def _drop(self, ref: weakref.ref) -> None:  # x died
        self.entries = tuple(e for e in self.entries if e[0] is not ref)
