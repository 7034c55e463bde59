"""`convert_linears`: swap nn.Linear modules for hybridq Linear in place, with a per-layer report."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch.nn as nn

from ..recipe import CustomRecipe
from .linear import Linear

log = logging.getLogger("hybridq")


@dataclasses.dataclass
class LayerReport:
    name: str
    converted: bool
    formats: dict[str, str] = dataclasses.field(default_factory=dict)  # tensor type -> format description
    reason: str = ""


@dataclasses.dataclass
class ConversionReport:
    layers: list[LayerReport]

    @property
    def converted(self) -> list[str]:
        return [l.name for l in self.layers if l.converted]

    @property
    def skipped(self) -> dict[str, str]:
        return {l.name: l.reason for l in self.layers if not l.converted}

    def table(self) -> str:
        rows = [("layer", "status", "input", "weight", "grad_output")]
        for l in self.layers:
            if l.converted:
                rows.append((l.name, "converted", l.formats["input"], l.formats["weight"], l.formats["grad_output"]))
            else:
                rows.append((l.name, "skipped", l.reason, "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def convert_linears(model: nn.Module, recipe: CustomRecipe,
                    module_filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
                    on_incompatible: str = "skip") -> ConversionReport:
    """Replace every nn.Linear of `model` (for which `module_filter_fn(module, fqn)` is true) by a hybridq
    Linear sharing its parameters. A layer whose shapes the recipe's formats cannot take is skipped with a
    logged reason (on_incompatible="skip") or raises ValueError before anything is replaced ("error")."""
    if on_incompatible not in ("skip", "error"):
        raise ValueError(f"on_incompatible must be 'skip' or 'error', got {on_incompatible!r}")
    plan: list[tuple[nn.Module, str, str, Linear]] = []
    layers: list[LayerReport] = []
    for fqn, mod in model.named_modules():
        for child_name, child in mod.named_children():
            full = f"{fqn}.{child_name}" if fqn else child_name
            if not isinstance(child, nn.Linear) or isinstance(child, Linear):
                continue
            if module_filter_fn is not None and not module_filter_fn(child, full):
                continue
            try:
                new = Linear.from_linear(child, recipe, name=full)
            except ValueError as e:
                if on_incompatible == "error":
                    raise
                log.warning("hybridq: keeping %s in high precision: %s", full, e)
                layers.append(LayerReport(full, False, reason=str(e)))
                continue
            plan.append((mod, child_name, full, new))
            layers.append(LayerReport(full, True, formats=new.describe_formats()))
    for parent, child_name, _, new in plan:
        setattr(parent, child_name, new)
    return ConversionReport(layers)
