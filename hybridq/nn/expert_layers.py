"""Names of experts, and where a converted expert module keeps its GroupedLinears: a plain dict in the module's `__dict__` (not
submodules, so the model's parameters and state_dict keys stay as they were). A leaf of `hybridq.nn`: both the
conversion (grouped.py) and the delayed-scaling state (delayed_state.py) read it."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

CONVERTED_ATTR = "_hybridq_grouped"


def expert_name(name: str, expert: int) -> str:
    """The module name an expert's roles carry: `Role("grouped_linear", tensor_type, f"{name}.experts.{e}")`."""
    return f"{name}.experts.{expert}"


def converted_experts(module: nn.Module) -> dict[str, Any]:
    """weight name -> GroupedLinear of an expert module converted by convert_experts (empty if not converted)."""
    return dict(module.__dict__.get(CONVERTED_ATTR, {}))


def converted_layer(module: nn.Module, weight_name: str) -> Any | None:
    """The GroupedLinear computing `weight_name` of a converted expert module, or None."""
    return module.__dict__.get(CONVERTED_ATTR, {}).get(weight_name)


def set_converted(module: nn.Module, layers: dict[str, Any]) -> None:
    module.__dict__[CONVERTED_ATTR] = layers
