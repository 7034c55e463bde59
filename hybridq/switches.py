"""Process-wide on/off switches of hybridq's alternative paths: each new path that replaces an older one keeps the
older one behind a switch, for A/B measurements and for tests that compare the two bitwise.

A `Switch` is read once from its environment variable when its module is imported: on by default ("0" starts the
process with it off), or, for an opt-in path (`default=False`), off unless the variable is "1". Code reads it as
`switch.on` ([Note: switch reads]); `set` changes it from then on and returns the previous setting; `turned` does the
same and, used as a `with` block, restores the previous setting at the block's end; tests patch it with
`monkeypatch.setattr(switch, "on", ...)`. `switches()` lists every switch by its environment variable (each one is
named in docs/: tests/test_switches.py).
"""

from __future__ import annotations

import os

__all__ = ["Switch", "Turned", "switches"]

_ALL: dict[str, "Switch"] = {}

# [Note: switch reads] Hot paths read a switch on every call (a Linear's eager fast path, a grouped GEMM's dispatch),
# so its setting is a plain instance attribute: `switch.on` costs ~5 ns on CPython 3.11, against ~11 ns for
# `d["on"]` of a plain dict and ~21 ns for a dict subclass's (the form of 5504206: CPython specialises subscripts of
# exact dicts only). The mapping form of 5504206 (`switch["on"]`, `monkeypatch.setitem(switch, "on", v)`) still
# reads and writes the same attribute, through a Python call, for code written against it; new code reads `.on`.


class Switch:
    """The switch of the environment variable `env`: on unless it is "0" at import (`default=False`: off unless it
    is "1"; any other value leaves the default)."""

    def __init__(self, env: str, default: bool = True):
        value = os.environ.get(env)
        self.env = env
        self.default = default
        self.on: bool = default if value is None else (value != "0" if default else value == "1")
        _ALL[env] = self

    def set(self, on: bool) -> bool:
        """Turn it on or off from now on; the previous setting."""
        was = self.on
        self.on = bool(on)
        return was

    def turned(self, on: bool) -> "Turned":
        """Turn it on or off from now on, like `set`; as a `with` block, only inside it (the setting before is
        restored at the block's end, whatever the block set)."""
        return Turned(self, on)

    def _check_key(self, key: str) -> None:
        if key != "on":
            raise KeyError(f"{self!r} has one setting, 'on', not {key!r}")

    def __getitem__(self, key: str) -> bool:  # (the mapping form: [Note: switch reads])
        self._check_key(key)
        return self.on

    def __setitem__(self, key: str, on: bool) -> None:
        self._check_key(key)
        self.on = on

    def get(self, key: str, default=None):
        return self.on if key == "on" else default

    def __bool__(self) -> bool:  # (`if switch:` would always hold: a switch's setting is `.on`)
        raise TypeError(f"{self!r} has no truth value: read its setting, `.on`")

    def __repr__(self) -> str:
        return f"Switch({self.env}: {'on' if self.on else 'off'})"


class Turned:
    """A switch turned on or off by `Switch.turned`: from then on, or, used as a `with` block, until its end."""

    __slots__ = ("switch", "previous")

    def __init__(self, switch: Switch, on: bool):
        self.switch = switch
        self.previous = switch.set(on)

    def __enter__(self) -> "Turned":
        return self

    def __exit__(self, *exc) -> None:
        self.switch.on = self.previous


def switches() -> dict[str, Switch]:
    """Every switch created so far (those of the modules imported), by environment variable."""
    return dict(_ALL)
