"""Exception types that callers tell apart.

A shape a format cannot take (`FormatShapeError`) is a property of one tensor: `convert_linears(...,
on_incompatible="skip")` keeps that layer in high precision. A recipe that is wrong in itself
(`RecipeError`: an unknown backward override, an override combined with delayed scaling, a factory that
fails or returns something else than a quantizer) is never skipped: it raises before any module changes.
Both are ValueErrors.
"""

from __future__ import annotations


class FormatShapeError(ValueError):
    """A tensor's shape breaks a format's shape rule (e.g. MXFP8 needs K % 32 == 0)."""


class RecipeError(ValueError):
    """A recipe or quantizer configuration that cannot be used (independent of any tensor's shape)."""


class StaleWeightError(RuntimeError):
    """A cached quantized weight was used after its high-precision weight changed where the cache key cannot see
    it (a write through `.data`)."""
