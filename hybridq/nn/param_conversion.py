"""`quantize_parameters(model)`: turn the weights of an existing model's hybridq Linear layers into quantized
parameters (what `quantized_model_init` does at construction; see quantized_params.py)."""

from __future__ import annotations

import torch.nn as nn

from .grouped import GroupedLinear
from .linear import Linear
from .quantized_params import _install, check_layer, quantized_param_info, refuse_grouped

__all__ = ["quantize_parameters"]


def _layers(model: nn.Module):
    for name, mod in model.named_modules():
        if isinstance(mod, GroupedLinear):
            refuse_grouped(name or mod.name)
        if isinstance(mod, Linear):
            yield name, mod


def quantize_parameters(model: nn.Module, *, preserve_high_precision_init_val: bool = False) -> list[str]:
    """Make the weight of every hybridq `Linear` in `model` (itself included) a quantized parameter, like
    `quantized_model_init` does at construction; returns the names of the layers converted. Every layer is
    checked first (shape rules of the directions the recipe needs, delayed scaling, FSDP2 / DTensor weights,
    GroupedLinear): an error names the layer, the format and the rule, with no layer changed. Already quantized
    weights are left as they are. Call it after `convert_linears` and after moving the model to its device and
    dtype."""
    layers = [(n, m) for n, m in _layers(model) if quantized_param_info(m.weight) is None]
    plans = [(m, check_layer(m)) for _, m in layers]
    for m, plan in plans:
        _install(m, plan, preserve_high_precision_init_val)
    return [m.name for m, _ in plans]
