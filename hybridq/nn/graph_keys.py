"""Configurations by content: the plain string keys by which the compiled graph's custom ops name a layer's
configuration (compiled_linear.py, compiled_grouped.py, compiled_grouped_blocks.py, distributed/compiled_tp.py).

[Note: configuration keys]
The custom ops take plain values only, so a layer's configuration (its quantizers, save_original_input, its
tensor-parallel group...) travels as a string, and every string in a graph is a constant the graph is compiled for.
The key is the configuration's content, so that the blocks of a model, whose layers differ in name only, share one
compiled graph (a key per layer would make dynamo compile each block anew, up to its recompile limit, and run the
rest eagerly). It also names this process: Inductor's and AOTAutograd's caches on disk key a compiled graph by its
ops and constants, so another process's graph must never name this process's configurations. A key, once given,
names one value for the life of the process: content whose value must be replaced (a process group of the same name
made anew) gets a new key, never a reused one.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["PROCESS", "ConfigurationKeys"]

PROCESS = uuid.uuid4().hex[:12]

V = TypeVar("V")


class ConfigurationKeys(Generic[V]):
    """content -> key, and key -> the value registered with it (what the ops read back; made from the first layer
    of that content, so messages name that layer)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._by_content: dict[Hashable, str] = {}
        self._values: dict[str, V] = {}
        self._numbers = itertools.count()

    def key(self, content: Hashable, value: Callable[[], V], keep: Callable[[V], bool] | None = None) -> str:
        """The key of `content`: the one given before while `keep(its value)` holds (always, without `keep`), else
        a new key registered with `value()`. Called eagerly, never while compile traces."""
        key = self._by_content.get(content)
        if key is None or (keep is not None and not keep(self._values[key])):
            key = self._by_content[content] = f"{self.prefix}{next(self._numbers)}@{PROCESS}"
            self._values[key] = value()
        return key

    def owns(self, key: str | None) -> bool:
        """Whether `key` is one of these keys (by its prefix: the registries' prefixes are distinct)."""
        return key is not None and key.startswith(self.prefix)

    def __getitem__(self, key: str) -> V:
        return self._values[key]
