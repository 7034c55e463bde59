"""Delayed-scaling state (amax history, scale, pending update) in a layer's `state_dict`, as plain tensors.

A layer whose recipe uses delayed scaling gets, per delayed-scaling quantizer, the keys

    {prefix}delayed_scaling.{tensor type}[.{i}].amax_history   fp32 [history length]
    {prefix}delayed_scaling.{tensor type}[.{i}].scale          fp32 [1]
    {prefix}delayed_scaling.{tensor type}[.{i}].update_pending bool [] (an amax recorded, the update not yet run)

(`.{i}` numbers the parts of a hybrid quantizer that use delayed scaling). A `GroupedLinear`'s tensor type is per
expert: `experts.{e}.{tensor type}`. An expert module converted by `convert_experts` holds its GroupedLinears
outside its submodules (its state_dict keys stay the model's), so the module itself carries their state:
`{prefix}delayed_scaling.{weight name}.experts.{e}.{tensor type}[.{i}].{field}`. Loading them restores the state bit for
bit, so a resumed run casts exactly as the uninterrupted one; `torch.load(weights_only=True)` reads them (plain
tensors), and `torch.distributed.checkpoint` saves them like any other tensor. A layer without delayed scaling has
no such keys (its state_dict is nn.Linear's). A state_dict with none of a layer's keys (nn.Linear's, weights only)
loads and leaves the layer's delayed-scaling state as it is; one with only some of them reports the others missing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..formats import Float8Quantizer
from .expert_layers import converted_experts

PREFIX = "delayed_scaling."
FIELDS = ("amax_history", "scale", "update_pending")


def _roles(module: nn.Module) -> dict:
    """{key stem of a tensor type: quantizer} of a hybridq Linear, a GroupedLinear or a converted expert module."""
    if hasattr(module, "expert_quantizers"):  # GroupedLinear: one set per expert
        return {f"experts.{e}.{t}": q for e, qs in enumerate(module.expert_quantizers) for t, q in qs.items()}
    if hasattr(module, "quantizers"):  # Linear
        return module.quantizers()
    # an expert module: the GroupedLinear of each converted weight, under that weight's name
    return {f"{name}.{stem}": q for name, layer in converted_experts(module).items()
            for stem, q in _roles(layer).items()}


def delayed_quantizers(module: nn.Module) -> dict[str, Float8Quantizer]:
    """{key stem: quantizer} of the module's delayed-scaling quantizers (hybrids contribute their parts)."""
    out: dict[str, Float8Quantizer] = {}
    roles = _roles(module)
    for role, q in roles.items():
        parts = [p for p in q.quantizers() if isinstance(p, Float8Quantizer) and p.is_stateful]
        for i, p in enumerate(parts):
            out[role if len(q.quantizers()) == 1 else f"{role}.{i}"] = p
    return out


def _state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for stem, q in delayed_quantizers(module).items():
        key = f"{prefix}{PREFIX}{stem}."
        state_dict[key + "amax_history"] = q.amax_history.detach().clone()
        state_dict[key + "scale"] = q.scale.detach().clone()
        state_dict[key + "update_pending"] = torch.tensor(q.update_pending)


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    quantizers = delayed_quantizers(module)
    ours = f"{prefix}{PREFIX}"
    found = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(ours)]}
    expected = {f"{ours}{stem}.{f}": (q, f) for stem, q in quantizers.items() for f in FIELDS}
    unexpected_keys.extend(k for k in found if k not in expected)
    if not found:  # a state_dict without the state (nn.Linear's, weights only): the layer keeps its own
        return
    missing = [k for k in expected if k not in found]
    if missing:  # part of it: strict loading reports the rest, a non-strict load keeps the current state
        missing_keys.extend(missing)
        return
    # check everything before changing anything
    errors = []
    for k, (q, f) in expected.items():
        v = found[k]
        want = (q.amax_history.shape if f == "amax_history" else q.scale.shape if f == "scale" else torch.Size([]))
        if not isinstance(v, torch.Tensor) or v.shape != want:
            errors.append(f"{k}: expected a tensor of shape {tuple(want)} for {q.describe()} "
                          f"(amax_history_len={q.amax_history_len}), got "
                          f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        elif f == "amax_history":
            # a history holds amaxes; the cast kernels max-combine into it by bit pattern (docs/numerics.md)
            negative = (torch.signbit(v) & ~torch.isnan(v)).nonzero()
            if negative.numel():
                i = int(negative[0, 0])
                errors.append(f"{k}: an amax history holds amaxes (sign bit clear: the cast kernels max-combine by "
                              f"bit pattern) for {q.describe()}, got {v[i].item()!r} at index {i}")
    if errors:
        error_msgs.extend(errors)
        return
    for stem, q in quantizers.items():
        k = f"{ours}{stem}."
        dev = q.scale.device
        q.amax_history = found[k + "amax_history"].detach().to(dev, torch.float32).clone()
        q.scale = found[k + "scale"].detach().to(dev, torch.float32).clone()
        q._forward_scale = q.scale
        q._update_pending = bool(found[k + "update_pending"])


def install(module: nn.Module) -> None:
    """Put `module`'s delayed-scaling state into its state_dict (and load it back); once per module."""
    if getattr(module, "_hybridq_delayed_state_hooks", False):
        return
    module.register_state_dict_post_hook(_state_dict_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)
    module._hybridq_delayed_state_hooks = True
