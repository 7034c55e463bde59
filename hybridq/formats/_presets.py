"""Named recipes that format modules declare next to their format (`hybridq.recipe(name)` lists them after the
presets of `recipe.py`), so that adding a format with its preset touches the format's module and its export line
only (docs/architecture.md "Extension points").

A leaf of the formats package: it imports nothing from hybridq, so a format module can declare a preset without
importing `recipe.py` (which imports the formats). A preset's factory takes a `hybridq.Role` and returns a
quantizer, or None to keep that tensor in high precision, exactly as a `CustomRecipe` factory does.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["declare_preset", "declared_presets"]

_DECLARED: dict[str, tuple[Callable, str]] = {}


def declare_preset(name: str, description: str) -> Callable[[Callable], Callable]:
    """Decorator: register `fn(role) -> Quantizer | None` as the named recipe `name` (one line of `description`
    for `hybridq.preset_names()` listings). A name declared twice raises ValueError (two formats claiming one
    recipe name would make `hybridq.recipe(name)` depend on import order)."""
    def register(fn: Callable) -> Callable:
        if name in _DECLARED and _DECLARED[name][0] is not fn:
            raise ValueError(f"preset {name!r} is declared twice ({_DECLARED[name][0].__module__} and "
                             f"{fn.__module__})")
        _DECLARED[name] = (fn, description)
        return fn
    return register


def declared_presets() -> dict[str, tuple[Callable, str]]:
    """The presets the format modules declared, in declaration (import) order."""
    return dict(_DECLARED)
