"""Process-wide on/off switches of hybridq's alternative paths: each new path that replaces an older one keeps the
older one behind a switch, for A/B measurements and for tests that compare the two bitwise.

A `Switch` is read once from its environment variable when its module is imported (default on: "0" starts the
process with it off) and is a one-entry dict, `{"on": bool}`, which the code reads as `switch["on"]` (one dict
lookup on hot paths) and tests set with `monkeypatch.setitem(switch, "on", ...)`; `set` changes it from then on.
`switches()` lists every switch by its environment variable (docs/gpu-build.md names them).
"""

from __future__ import annotations

import os

__all__ = ["Switch", "switches"]

_ALL: dict[str, "Switch"] = {}


class Switch(dict):
    """The switch of `env` (on unless the variable is "0" at import)."""

    def __init__(self, env: str):
        super().__init__(on=os.environ.get(env, "1") != "0")
        self.env = env
        _ALL[env] = self

    @property
    def on(self) -> bool:
        return self["on"]

    def set(self, on: bool) -> bool:
        """Turn it on or off from now on; the previous setting."""
        was = self["on"]
        self["on"] = bool(on)
        return was

    def __repr__(self) -> str:
        return f"Switch({self.env}: {'on' if self['on'] else 'off'})"


def switches() -> dict[str, Switch]:
    """Every switch created so far (those of the modules imported), by environment variable."""
    return dict(_ALL)
