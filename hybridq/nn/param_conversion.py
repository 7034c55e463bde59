"""`quantize_parameters(model)`: turn the weights of an existing model's hybridq Linear and GroupedLinear layers (and
converted expert modules) into quantized parameters, what `quantized_model_init` does at construction (see
quantized_params.py and quantized_experts.py)."""

from __future__ import annotations

import torch.nn as nn

from .expert_layers import converted_experts
from .grouped import GroupedLinear, install_expert_module
from .linear import Linear
from .quantized_experts import check_grouped_layer, install_grouped
from .quantized_params import _install, check_layer, quantized_param_info

__all__ = ["quantize_parameters"]


def _layers(model: nn.Module):
    """(layer, owning expert module or None) of every hybridq layer whose weight is not held quantized yet."""
    for mod in model.modules():
        if isinstance(mod, (Linear, GroupedLinear)):
            yield mod, None
        for layer in converted_experts(mod).values():  # convert_experts: GroupedLinears that are not submodules
            yield layer, mod


def quantize_parameters(model: nn.Module, *, preserve_high_precision_init_val: bool = False) -> list[str]:
    """Make the weight of every hybridq `Linear` and `GroupedLinear` in `model` (itself included; expert modules
    converted by `convert_experts` too) a quantized parameter, like `quantized_model_init` does at construction;
    returns the names of the layers converted. Every layer is checked first (shape rules of the directions the
    recipe needs, delayed scaling, FSDP2 / DTensor weights): an error names the layer, the format and the rule,
    with no layer changed. Already quantized weights are left as they are. Call it after `convert_linears` /
    `convert_experts` and after moving the model to its device and dtype."""
    todo = [(m, owner) for m, owner in _layers(model) if quantized_param_info(m.weight) is None]
    plans = [(m, owner, check_grouped_layer(m) if isinstance(m, GroupedLinear) else check_layer(m))
             for m, owner in todo]
    for m, owner, plan in plans:
        if isinstance(m, GroupedLinear):
            install_grouped(m, plan, preserve_high_precision_init_val)
        else:
            _install(m, plan, preserve_high_precision_init_val)
        if owner is not None:  # the expert module's parameter is the layer's weight
            install_expert_module(owner, converted_experts(owner))
    return [m.name for m, _, _ in plans]
