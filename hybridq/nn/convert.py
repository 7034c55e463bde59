"""`convert_linears`: swap nn.Linear modules for hybridq Linear in place (or re-apply a recipe to layers
already converted), with a per-layer report. A module the swap would lose behaviour of is kept, with the reason
(hybridq.nn.replaceable)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch.nn as nn

from ..enums import OnIncompatible
from ..errors import FormatShapeError
from ..recipe import CustomRecipe, resolve_recipe
from .linear import Linear
from .layer_norm import LayerNorm, is_layer_norm_candidate
from .norm import RMSNorm, is_rms_norm_candidate
from .replaceable import carry_over, direct_readers, replacement_blocker
from .swiglu import SwiGLU, is_swiglu_candidate

log = logging.getLogger("hybridq")

_LINEAR = "hybridq.nn.Linear"
_LINEAR_ATTRS = frozenset(vars(nn.Linear(1, 1, device="meta")))  # what Linear.from_linear sets up itself
# the norms swapped: (is a candidate, torch's class, hybridq's class, its name, the attributes hybridq's sets up)
_SWIGLU = "hybridq.nn.SwiGLU"
_MODULE_STD = frozenset(vars(nn.Module()))
_NORMS = tuple((candidate, torch_type, new_type, f"hybridq.nn.{new_type.__name__}", params,
                frozenset(vars(torch_type(1, device="meta"))))
               for candidate, torch_type, new_type, params in (
                   (is_rms_norm_candidate, nn.RMSNorm, RMSNorm, ("weight",)),
                   (is_layer_norm_candidate, nn.LayerNorm, LayerNorm, ("weight", "bias"))))


def _norm_blocker(torch_type: type, params: tuple[str, ...], new_name: str) -> Callable[[nn.Module], str | None]:
    def blocker(child: nn.Module) -> str | None:
        base = torch_type if isinstance(child, torch_type) else nn.Module
        # (the weight always; a protocol norm may have no bias at all)
        takes = params[:1] + tuple(n for n in params[1:] if n in child._parameters)
        return replacement_blocker(child, base, takes, new_name, frozenset({"forward"}))
    return blocker


def _swaps() -> list[tuple]:
    """(is a candidate, make the replacement, why a candidate cannot be swapped (its own checks aside), the
    attributes the replacement sets up, its name) of each module kind convert_norms swaps."""
    out = [(candidate, new_type.from_module, _norm_blocker(torch_type, params, new_name), attrs, new_name)
           for candidate, torch_type, new_type, new_name, params, attrs in _NORMS]
    # (SwiGLU.from_module checks the rest: children, parameters, hooks, methods, the probe)
    out.append((is_swiglu_candidate, SwiGLU.from_module, lambda child: None, _MODULE_STD, _SWIGLU))
    return out


@dataclasses.dataclass
class LayerReport:
    """What conversion did to one layer. `previous_recipe`: the name of the recipe a layer that was already a
    hybridq Linear had before (None for a layer converted from nn.Linear). `reason`: why a skipped layer kept
    its previous precision."""

    name: str
    converted: bool
    formats: dict[str, str] = dataclasses.field(default_factory=dict)  # tensor type -> format description
    reason: str = ""
    previous_recipe: str | None = None
    unchanged: bool = False  # already converted with this recipe: nothing was done
    replacement: str = ""  # a norm swapped in: its class (hybridq.nn.RMSNorm / LayerNorm)

    @property
    def status(self) -> str:
        if not self.converted:
            return "skipped" if self.previous_recipe is None else f"skipped (keeps {self.previous_recipe})"
        if self.unchanged:
            return "already converted"
        return "converted" if self.previous_recipe is None else f"re-converted (was {self.previous_recipe})"


@dataclasses.dataclass
class ConversionReport:
    layers: list[LayerReport]
    # RMSNorm / LayerNorm / SwiGLU feed-forward modules swapped for hybridq.nn.RMSNorm / LayerNorm / SwiGLU
    # (converted) or left as they are (with the reason)
    norms: list[LayerReport] = dataclasses.field(default_factory=list)

    @property
    def converted(self) -> list[str]:
        """Layers that use the recipe now (newly converted, re-converted or already converted with it)."""
        return [l.name for l in self.layers if l.converted]

    @property
    def skipped(self) -> dict[str, str]:
        return {l.name: l.reason for l in self.layers if not l.converted}

    def table(self) -> str:
        cols = ("layer", "status", "input", "weight", "grad_output", "reason")
        rows = [cols]
        for l in self.layers:
            f = l.formats if l.converted else {}
            rows.append((l.name, l.status, f.get("input", ""), f.get("weight", ""), f.get("grad_output", ""),
                         l.reason))
        for l in self.norms:
            rows.append((l.name, l.replacement if l.converted else "norm kept", "", "", "", l.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _children(model: nn.Module, module_filter_fn,
              kind: Callable[[nn.Module], bool] = lambda m: isinstance(m, nn.Linear)
              ) -> list[tuple[nn.Module, str, str, nn.Module]]:
    """(parent, attribute, qualified name, module) of every module of `kind` (default: nn.Linear, hybridq ones
    included) the filter accepts."""
    out = []
    for fqn, mod in model.named_modules():
        for child_name, child in mod.named_children():
            full = f"{fqn}.{child_name}" if fqn else child_name
            if not kind(child):
                continue
            if module_filter_fn is not None and not module_filter_fn(child, full):
                continue
            out.append((mod, child_name, full, child))
    return out


def convert_linears(model: nn.Module, recipe: CustomRecipe | str,
                    module_filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
                    on_incompatible: OnIncompatible | str = "skip", norms: bool = True) -> ConversionReport:
    """Replace every nn.Linear of `model` (for which `module_filter_fn(module, fqn)` is true) by a hybridq
    Linear sharing its parameters; a layer that is already a hybridq Linear with another recipe gets `recipe`
    (its report row says which recipe it had), one with an equal recipe is left as it is ("already converted").
    `recipe`: a recipe or a preset name.

    Everything is checked before the first layer changes. A recipe that is wrong in itself (unknown backward
    override, also from HYBRIDQ_BACKWARD_OVERRIDE; an override with delayed scaling; a factory that fails)
    always raises. A layer whose shapes the recipe's formats cannot take (FormatShapeError), or that the swap
    would lose behaviour of, keeps its previous precision with a logged reason (on_incompatible="skip") or
    raises ("error"; ValueError naming the layer and the rule for the latter). The swap keeps the parameters (the
    same objects), the training flag and plain instance attributes; it is refused for a subclass overriding
    nn.Linear's methods (e.g. a LoRA-style forward), extra parameters / buffers / submodules, a parametrized
    weight, module hooks and Module.compile(), and for a layer whose parameters an ancestor's forward reads itself
    (nn.MultiheadAttention's out_proj, nn.TransformerEncoderLayer's inference fast path): its forward would not run.

    norms: also swap every RMSNorm / LayerNorm the filter accepts (torch.nn.RMSNorm / LayerNorm, or a module
    following the RMSNorm / LayerNorm protocol, see hybridq.nn.norm / layer_norm) for hybridq.nn.RMSNorm /
    LayerNorm sharing its parameters: one kernel per pass on CUDA, max|y| computed in passing for the per-tensor
    casts of the Linear layers that read y, and their rowwise block-format input written by the norm
    (hybridq.nn.fused_input); and every SwiGLU feed-forward (modules with children w1, w2, w3 computing
    w2(silu(w1 x) * w3 x)) for hybridq.nn.SwiGLU, whose silu * mul kernel does the same for w2's input. A candidate whose math
    does not match on a probe input, or that the swap would lose behaviour of, is kept (the report says why)."""
    on_incompatible = OnIncompatible.parse(on_incompatible, "on_incompatible")
    recipe = resolve_recipe(recipe, "convert_linears")
    recipe.backward_override  # an invalid override raises even on a model without Linear layers
    readers = direct_readers(model)
    replace: list[tuple[nn.Module, str, Linear]] = []
    reapply: list[tuple[Linear, dict, LayerReport]] = []
    layers: list[LayerReport] = []
    for parent, child_name, full, child in _children(model, module_filter_fn):
        previous = child.recipe.name if isinstance(child, Linear) else None
        why = readers.get(full)
        if why is None and not isinstance(child, Linear):
            why = replacement_blocker(child, nn.Linear, ("weight", "bias"), _LINEAR)
        if why is not None:
            _keep(layers, full, child, previous, why, on_incompatible)
            continue
        if isinstance(child, Linear) and child.recipe == recipe:
            child.check_override()  # (the override may come from the environment, changed since)
            layers.append(LayerReport(full, True, formats=child.describe_formats(), previous_recipe=previous,
                                      unchanged=True))
            continue
        try:
            if isinstance(child, Linear):
                quantizers = child.quantizers_for(recipe)  # installed once every layer has passed
            else:
                new = Linear.from_linear(child, recipe, name=full)
        except FormatShapeError as e:
            if on_incompatible == OnIncompatible.ERROR:
                raise
            if previous is None:
                log.warning("hybridq: keeping layer '%s' in high precision: %s", full, e)
            else:
                log.warning("hybridq: keeping layer '%s' with its recipe '%s': %s", full, previous, e)
            layers.append(LayerReport(full, False, reason=str(e), previous_recipe=previous))
            continue
        if not isinstance(child, Linear):
            why = carry_over(child, new, _LINEAR_ATTRS, _LINEAR)
            if why is not None:
                _keep(layers, full, child, previous, why, on_incompatible)
                continue
        report = LayerReport(full, True, previous_recipe=previous)
        layers.append(report)
        if isinstance(child, Linear):
            reapply.append((child, quantizers, report))
        else:
            report.formats = new.describe_formats()
            replace.append((parent, child_name, new))
    for parent, child_name, new in replace:
        setattr(parent, child_name, new)
    for layer, quantizers, report in reapply:
        layer.install_recipe(recipe, quantizers)
        report.formats = layer.describe_formats()
        log.info("hybridq: layer '%s' re-converted from recipe '%s' to '%s'", report.name, report.previous_recipe,
                 recipe.name)
    return ConversionReport(layers, convert_norms(model, module_filter_fn) if norms else [])


def _keep(layers: list[LayerReport], full: str, child: nn.Module, previous: str | None, why: str,
          on_incompatible: OnIncompatible) -> None:
    """A layer conversion would lose behaviour of: raise ("error") or keep it as it is, with the reason."""
    if on_incompatible == OnIncompatible.ERROR:
        raise ValueError(f"cannot convert layer '{full}' ({type(child).__name__}) to {_LINEAR} without losing "
                         f"behaviour: {why}. Conversion keeps what a module does and owns or leaves the module as it "
                         f"is: exclude it with module_filter_fn, or pass on_incompatible='skip' to keep it")
    what = "in high precision" if previous is None else f"with its recipe '{previous}'"
    log.warning("hybridq: keeping layer '%s' %s: %s", full, what, why)
    layers.append(LayerReport(full, False, reason=why, previous_recipe=previous))


def convert_norms(model: nn.Module, module_filter_fn: Callable[[nn.Module, str], bool] | None = None
                  ) -> list[LayerReport]:
    """Swap every RMSNorm and LayerNorm of `model` the filter accepts -- torch.nn.RMSNorm / LayerNorm, or a module
    following the RMSNorm / LayerNorm protocol (hybridq.nn.norm, hybridq.nn.layer_norm) -- for hybridq.nn.RMSNorm /
    LayerNorm sharing its parameters, and every SwiGLU feed-forward (the protocol of hybridq.nn.swiglu: children
    w1, w2, w3, forward w2(silu(w1 x) * w3 x)) for hybridq.nn.SwiGLU holding the same Linears; a candidate that
    fails the protocol's checks, or that the swap would lose behaviour of (as in `convert_linears`; its forward is
    checked on a probe input instead), is kept, with the reason in its report row (never raises: nothing is changed
    for it)."""
    readers = direct_readers(model)
    reports = []
    for candidate, make, blocker, attrs, new_name in _swaps():
        for parent, child_name, full, child in _children(model, module_filter_fn, candidate):
            why = readers.get(full) or blocker(child)
            if why is None:
                try:
                    new = make(child, name=full)
                except ValueError as e:
                    why = str(e)
                else:
                    why = carry_over(child, new, attrs, new_name)
            if why is not None:
                log.warning("hybridq: keeping '%s': %s", full, why)
                reports.append(LayerReport(full, False, reason=why))
                continue
            setattr(parent, child_name, new)
            reports.append(LayerReport(full, True, replacement=new_name))
    return reports
