"""Recipes: which quantizer each tensor of each module gets, named presets, and the backward override."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import torch

from .enums import BackwardOverride, TensorType
from .errors import RecipeError
from .formats import (Float8BlockQuantizer, Float8Quantizer, HybridQuantizer, IdentityQuantizer, MXFP8Quantizer,
                      NVFP4Quantizer, Quantizer)
from .formats._presets import declared_presets

TENSOR_TYPES = tuple(TensorType)
BACKWARD_OVERRIDES = (None, *BackwardOverride)
BACKWARD_OVERRIDE_ENV = "HYBRIDQ_BACKWARD_OVERRIDE"

# [Note: the override's environment under torch.compile] A Linear reads its backward override at each forward, also
# while dynamo traces it, and the graph keeps what it read. Dynamo guards no read of `os.environ` (a value set after a
# layer was traced went unseen by its graph: the gradients of the old mode), but it guards each key read from a plain
# dict: so the variable is read from os.environ's own dict (CPython's `os.environ._data`, which every write through
# os.environ updates), and a graph recompiles when this variable changes (and, since dynamo guards the dict's size
# too, once when any variable is added to or removed from the environment; a new value of another does not).
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(BACKWARD_OVERRIDE_ENV) if _ENVIRON is not None else None


def _environment_value() -> str | None:
    """HYBRIDQ_BACKWARD_OVERRIDE as os.environ holds it now (traced: guarded, [Note: the override's environment
    under torch.compile])."""
    if _ENVIRON is None:
        return os.environ.get(BACKWARD_OVERRIDE_ENV)
    raw = _ENVIRON.get(_ENV_KEY)
    return None if raw is None else os.environ.decodevalue(raw)


@dataclasses.dataclass(frozen=True)
class Role:
    """What a quantizer is for: module type ("linear"), tensor type (a `TensorType` or its string) and module
    name."""

    module_type: str
    tensor_type: TensorType
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "tensor_type", TensorType.parse(self.tensor_type, "Role tensor_type"))


DEFAULT_OVERRIDE_NAME = "default"  # accepted (any case) as the name of the default mode, None


def _check_override(value, source: str) -> BackwardOverride | None:
    if value is None or value == "" or (isinstance(value, str) and value.lower() == DEFAULT_OVERRIDE_NAME):
        return None
    try:
        return BackwardOverride.parse(value, "backward_override")
    except ValueError:
        raise RecipeError(_bad_override_message(source, value)) from None


def _bad_override_message(source: str, value) -> str:
    return (f"{source}: backward_override must be one of {[None] + [o.value for o in BackwardOverride]} (or "
            f"{DEFAULT_OVERRIDE_NAME!r} for None), got {value!r}")


# the environment's accepted values (lower case) -> the override, for `_parse_traced`
_ENV_VALUES = {"": None, DEFAULT_OVERRIDE_NAME: None, **{o.value: o for o in BackwardOverride}}


def _parse_traced(value: str) -> BackwardOverride | None:
    """The environment's value as dynamo traces it: a lookup it follows (the enum's own parse and `_env_override`'s
    cache it does not: an internal error for a bad value, a warning on every compiled run); a bad value raises the
    RecipeError eager code raises."""
    parsed = _ENV_VALUES.get(value.lower(), _ENV_VALUES)
    if parsed is _ENV_VALUES:
        raise RecipeError(_bad_override_message(f"environment {BACKWARD_OVERRIDE_ENV}", value))
    return parsed


@functools.lru_cache(maxsize=16)
def _env_override(value: str | None) -> BackwardOverride | None:
    # the environment is read on every call (it may change between calls); its parse is cached per value (asked
    # per layer call: host time). A bad value is not cached: it raises every time
    return _check_override(value, f"environment {BACKWARD_OVERRIDE_ENV}")


def check_override_compatible(override: str | None, quantizers: dict[str, Quantizer], layer: str) -> None:
    """Raise RecipeError if a backward override is combined with delayed scaling in any of a layer's roles
    (the override skips the backward casts that delayed scaling's amax history expects)."""
    if override is None:
        return
    stateful = [t for t, q in quantizers.items() if q.is_stateful]
    if stateful:
        raise RecipeError(
            f"{layer}: backward_override={override!r} cannot be combined with delayed scaling "
            f"({', '.join(stateful)} quantizer); use current scaling (e.g. 'fp8_tensorwise')")


class CustomRecipe:
    """A recipe built from `qfactory(role) -> Quantizer | None` (None keeps that tensor in high precision).

    backward_override: None | "high_precision" | "dequantized" ("default", any case, names None). When None
    here, the environment variable HYBRIDQ_BACKWARD_OVERRIDE (read at use, same values) may set it; a bad value
    raises RecipeError.
    """

    def __init__(self, qfactory: Callable[[Role], Quantizer | None], *, backward_override: str | None = None,
                 name: str = "custom"):
        self.qfactory = qfactory
        self._backward_override = _check_override(backward_override, f"recipe {name!r}")
        self.name = name

    @property
    def backward_override(self) -> str | None:
        if self._backward_override is not None:
            return self._backward_override
        value = _environment_value()
        if value is None:  # (the usual case)
            return None
        if torch.compiler.is_compiling():
            return _parse_traced(value)
        return _env_override(value)

    def quantizer(self, role: Role) -> Quantizer:
        """A fresh quantizer for `role`; IdentityQuantizer where the factory keeps high precision. An exception
        raised by the factory is re-raised as RecipeError naming the recipe and the role."""
        try:
            q = self.qfactory(role)
        except Exception as e:
            raise RecipeError(f"recipe {self.name!r}: qfactory raised {type(e).__name__} for {role}: {e}") from e
        if q is None:
            return IdentityQuantizer()
        if not isinstance(q, Quantizer):
            raise TypeError(f"recipe {self.name!r}: qfactory returned {q!r} for {role}, not a hybridq Quantizer")
        return q

    def __eq__(self, other) -> bool:
        """Same factory, same name and same backward override set on the recipe (two `hybridq.recipe("mxfp8")`
        calls are equal)."""
        if not isinstance(other, CustomRecipe):
            return NotImplemented
        return (self.qfactory is other.qfactory and self.name == other.name
                and self._backward_override == other._backward_override)

    def __hash__(self) -> int:
        return hash((id(self.qfactory), self.name, self._backward_override))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backward_override={self._backward_override!r})"


# ---- presets -------------------------------------------------------------------------------------

def _fp8_tensorwise(role: Role) -> Quantizer:
    return Float8Quantizer("e5m2" if role.tensor_type.startswith("grad") else "e4m3")


def _fp8_delayed(role: Role) -> Quantizer:
    return Float8Quantizer("e5m2" if role.tensor_type.startswith("grad") else "e4m3", scaling="delayed")


def _fp8_block(role: Role) -> Quantizer:
    return Float8BlockQuantizer(block_dim=2 if role.tensor_type == TensorType.WEIGHT else 1)


def _mxfp8(role: Role) -> Quantizer:
    return MXFP8Quantizer()


def _nvfp4(role: Role) -> Quantizer:
    if role.tensor_type == TensorType.WEIGHT:
        return NVFP4Quantizer(block_2d=True)
    grad = role.tensor_type.startswith("grad")
    return NVFP4Quantizer(rht=True, stochastic_rounding=grad)


def _mxfp8_fwd_nvfp4_bwd(role: Role) -> Quantizer:
    if role.tensor_type in (TensorType.GRAD_OUTPUT, TensorType.GRAD_INPUT):
        return NVFP4Quantizer(rht=True, stochastic_rounding=True)
    # the columnwise form only feeds backward GEMMs, so it takes the backward format
    col = NVFP4Quantizer(rht=role.tensor_type != TensorType.WEIGHT)
    return HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=col)


def _fp8_block_fwd_mxfp8_bwd(role: Role) -> Quantizer:
    if role.tensor_type.startswith("grad"):
        return MXFP8Quantizer()
    row = Float8BlockQuantizer(block_dim=2 if role.tensor_type == TensorType.WEIGHT else 1)
    return HybridQuantizer(rowwise=row, columnwise=MXFP8Quantizer())


def _fp8_fwd_high_precision_bwd(role: Role) -> Quantizer | None:
    if role.tensor_type.startswith("grad"):
        return None
    return HybridQuantizer(rowwise=Float8Quantizer(), columnwise=IdentityQuantizer())


PRESETS: dict[str, tuple[Callable[[Role], Quantizer | None], str]] = {
    "fp8_tensorwise": (_fp8_tensorwise, "per-tensor FP8, current scaling: E4M3 forward, E5M2 gradients"),
    "fp8_delayed": (_fp8_delayed, "per-tensor FP8, delayed scaling (amax history 1024, max): E4M3 / E5M2"),
    "fp8_block": (_fp8_block, "FP8 E4M3 blocks: 1x128 activations and gradients, 128x128 weights"),
    "mxfp8": (_mxfp8, "MXFP8 E4M3, 1x32 / 32x1 blocks, E8M0 scales"),
    "nvfp4": (_nvfp4, "NVFP4: 16x16 weight tiles; RHT on the columnwise form; stochastic rounding on grads"),
    "mxfp8_fwd_nvfp4_bwd": (_mxfp8_fwd_nvfp4_bwd, "MXFP8 rowwise (fprop), NVFP4 columnwise and gradients"),
    "fp8_block_fwd_mxfp8_bwd": (_fp8_block_fwd_mxfp8_bwd, "FP8 blocks rowwise (fprop), MXFP8 for backward"),
    "fp8_fwd_high_precision_bwd": (_fp8_fwd_high_precision_bwd,
                                   "per-tensor FP8 E4M3 forward, backward GEMMs in high precision"),
}
# then the presets a format module declares beside its format (`formats._presets.declare_preset`): a format and its
# named recipe are added in that one module (docs/architecture.md "Extension points")
_clash = PRESETS.keys() & declared_presets().keys()
if _clash:
    raise ValueError(f"presets {sorted(_clash)} are declared by a format module and in recipe.PRESETS")
PRESETS.update(declared_presets())


def recipe(name: str, *, backward_override: str | None = None) -> CustomRecipe:
    """A preset by name, e.g. `hybridq.recipe("mxfp8_fwd_nvfp4_bwd")`."""
    try:
        factory, _ = PRESETS[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; presets: {', '.join(PRESETS)}") from None
    return CustomRecipe(factory, backward_override=backward_override, name=name)


def preset_names() -> list[str]:
    return list(PRESETS)


def resolve_recipe(value: CustomRecipe | str, caller: str, argument: str = "recipe") -> CustomRecipe:
    """The recipe an entry point was given: a CustomRecipe as it is, a preset name as `recipe(name)` (an unknown name
    raises RecipeError listing the presets); anything else raises TypeError naming `caller`'s `argument`."""
    if isinstance(value, CustomRecipe):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise RecipeError(f"{caller}: {argument}={value!r} is not a preset; presets: {', '.join(PRESETS)}")
        return recipe(value)
    raise TypeError(f"{caller}: {argument} must be a hybridq recipe (hybridq.recipe(name), hybridq.CustomRecipe) or "
                    f"a preset name ({', '.join(PRESETS)}), got {type(value).__name__}")
