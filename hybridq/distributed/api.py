"""`apply_hybrid_fsdp` (before `fully_shard`): check the recipe against every weight, convert the layers, and wrap
each weight FSDP2 will shard in the type whose all-gather hooks gather it quantized: a Linear's `HybridWeight`, a
GroupedLinear's or expert module's `GroupedHybridWeight` (`weights.py`). `precompute_scales` is in `scales.py`."""

from __future__ import annotations

import collections
import logging
from typing import Callable

import torch
import torch.nn as nn

from ..enums import OnIncompatible
from ..errors import FormatShapeError
from ..formats.base import Quantizer
from ..formats.shardable import check_shardable
from ..nn.convert import ConversionReport, LayerReport, convert_linears
from ..nn.grouped import GroupedLinear, converted_experts, expert_name, expert_weight_names, install_expert_module, \
    plan_expert_module
from ..nn.linear import Linear
from ..nn.quantized_params import quantized_param_info
from ..recipe import CustomRecipe, Role, resolve_recipe
from ..torch_private import local_tensor
from .grad_reduce import arm_grad_reduce, check_rearm, parse_grad_reduce
from .state import GroupedWeightState, WeightState
from .weights import GroupedHybridWeight, HybridWeight

__all__ = ["apply_hybrid_fsdp"]

log = logging.getLogger("hybridq")


def _refuse_delayed(q: Quantizer, whose: str) -> None:
    if q.is_stateful:
        raise ValueError(
            f"apply_hybrid_fsdp: the weight of {whose} uses delayed scaling ({q.describe()}); under FSDP2 every rank "
            f"quantizes its shard and backward re-gathers the weight, so a scale that changes between casts cannot "
            f"give the single-device result. Use current scaling (e.g. the 'fp8_tensorwise' preset: its global amax "
            f"costs one fused all-reduce per step).")


def _unwrap_state_dict(module, state_dict, prefix, local_metadata) -> None:
    from torch.distributed.tensor import DTensor

    for key, v in list(state_dict.items()):
        if isinstance(v, DTensor) and isinstance(local_tensor(v), HybridWeight):
            state_dict[key] = DTensor.from_local(local_tensor(v)._data, v.device_mesh, v.placements,
                                                 run_check=False, shape=v.shape, stride=v.stride())
        elif isinstance(v, HybridWeight):
            state_dict[key] = v._data


# [Note: load_state_dict(assign=True) of a weight gathered quantized]
# state_dict gives each HybridWeight as the plain (DTensor of a plain) tensor it wraps (`_unwrap_state_dict`), so a
# load with assign=True -- a user's, or DCP's set_model_state_dict from a full / rank-0 state dict onto a meta-device
# model -- put that plain tensor in the weight's place: FSDP2 then held a parameter without the all-gather hooks, and
# the next unshard failed deep in hybridq ("no rowwise form") or gathered it wrong, the layer still reporting it
# converted. So the owner module's load pre-hook wraps the loaded value as the weight it replaces is wrapped: a
# HybridWeight (GroupedHybridWeight) over the loaded tensor with the replaced weight's state, inside a DTensor of the
# loaded one's mesh and placements; FSDP2's own post-load hook then re-pads it (`new_zeros`, which keeps the type).
# The state's caches are keyed by the parameter's and the shard's identities and versions and the shard's data
# pointer (transport.stats_key), all new here, so nothing prepared from the replaced values is reused.

def _rewrap_assigned(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    from torch.distributed.tensor import DTensor

    for name, p in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        shard = local_tensor(p) if isinstance(p, DTensor) else p
        if not isinstance(shard, HybridWeight) or not isinstance(value, torch.Tensor):
            continue
        loaded = local_tensor(value) if isinstance(value, DTensor) else value
        if isinstance(loaded, HybridWeight) or (isinstance(p, DTensor) != isinstance(value, DTensor)):
            continue  # (already wrapped; a plain value for a DTensor parameter is torch's / FSDP2's error)
        wrapped = type(shard)(loaded.detach(), shard._hq)
        if isinstance(value, DTensor):
            wrapped = DTensor.from_local(wrapped, value.device_mesh, value.placements, run_check=False,
                                         shape=value.shape, stride=value.stride())
        state_dict[key] = nn.Parameter(wrapped, requires_grad=p.requires_grad)


def _keep_wrapped_on_assign(module: nn.Module) -> None:
    """Install `_rewrap_assigned` on a module owning a weight gathered quantized (once)."""
    if not getattr(module, "_hybridq_assign_hook", False):
        module._register_load_state_dict_pre_hook(_rewrap_assigned, with_module=True)
        module._hybridq_assign_hook = True


def apply_hybrid_fsdp(model: nn.Module, recipe: CustomRecipe | str,
                      module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                      on_incompatible: OnIncompatible | str = "skip", reuse_forward_payload: bool = True,
                      norms: bool = True, grad_reduce: str = "fp32") -> ConversionReport:
    """Prepare `model` for FSDP2 with quantized all-gathers; call it before `fully_shard`.

    Converts the eligible nn.Linear layers (`convert_linears`, same filter and `on_incompatible` semantics) and
    wraps the weight of every hybridq Linear in a `HybridWeight`; likewise applies the recipe to every
    `GroupedLinear` and converts every expert module (`hybridq_grouped_weights`, as `convert_experts`) and wraps
    their `[E, out, in]` weights in a `GroupedHybridWeight` (each expert gathered quantized, for FSDP2's Shard(0)
    and Shard(1) placements; see `distributed/layout.py`), so that FSDP2 all-gathers the weight in the
    recipe's weight format: rowwise in forward, only what dgrad reads in backward, a direction that is an exact
    transform of the other derived after the gather. The gathered weight is bitwise the quantization of the
    full weight (global amaxes and split blocks are reduced across shards; see docs/fsdp2.md). Call
    `hybridq.precompute_scales(model)` after each `optimizer.step()` to fuse those reductions into one
    all-reduce (optional). Delayed-scaling weight quantizers are rejected (use current scaling). A weight shared
    with another module (tied embeddings) stays a plain parameter (gathered in high precision).

    The shard layout is known from the first unshard on: its all-gather first checks every rank's shard against
    the formats' sharding rules in every direction any unshard will gather (ValueError naming the weight, the
    format, the rule and the shard boundary), before anything is quantized or sent.

    reuse_forward_payload: when the backward unshard gathers the same directions as the forward one (per-tensor
    FP8 and 128x128 blocks: rowwise, the columnwise form derived after the gather), each rank keeps its quantized
    shard of a Linear or grouped weight from forward to backward (1 byte per local FP8 element) instead of casting
    and quantizing it again (not if the weight changed in between).

    norms: swap the model's RMSNorm / LayerNorm modules and SwiGLU feed-forwards for hybridq.nn.RMSNorm / LayerNorm /
    SwiGLU (as `convert_linears(..., norms=True)`).
    `recipe`: a recipe or a preset name (TypeError for anything else).

    grad_reduce: the wire format of FSDP2's gradient reduce-scatter: "fp32" (FSDP2's own, in `reduce_dtype`;
    nothing installed), "bf16" or "mxfp8" (each rank sends every other rank its chunk quantized, the receiver
    sums in fp32 in rank order; 0.5x / ~0.26x of fp32's bytes; error bound and non-finite rules in
    `hybridq/distributed/grad_reduce.py`). Installed on every FSDP module under `model` at the first forward
    after `fully_shard`; `hybridq.distributed.grad_reduce_bytes(model)` counts the bytes sent.
    """
    on_incompatible = OnIncompatible.parse(on_incompatible, "on_incompatible")
    wire = parse_grad_reduce(grad_reduce)
    check_rearm(model, wire)
    recipe = resolve_recipe(recipe, "apply_hybrid_fsdp")
    for name, p in model.named_parameters():
        info = quantized_param_info(p)
        if info is not None:
            raise NotImplementedError(
                f"apply_hybrid_fsdp: {name} is the quantized weight of {info.layer} ({info.describe()}), held only "
                f"quantized (quantized_model_init / quantize_parameters); FSDP2 shards high-precision parameters and "
                f"all-gathers them quantized itself. Apply it to the model without quantized parameters, or train the "
                f"quantized-parameter model with hybridq.distributed.ZeroAdamW")
    for fqn, mod in model.named_modules():
        candidates = [(f"{fqn}.{n}" if fqn else n, c) for n, c in mod.named_children() if isinstance(c, nn.Linear)]
        for full, child in candidates:
            if module_filter_fn is not None and not module_filter_fn(child, full):
                continue
            if hasattr(child.weight, "device_mesh"):
                raise ValueError(f"apply_hybrid_fsdp: {full}.weight is already a DTensor; call apply_hybrid_fsdp "
                                 f"before parallelize_module and fully_shard (torchtitan's order: convert, tensor-parallelize with "
                                 f"hybridq.distributed's styles, then fully_shard over the dp mesh dimension)")
            # (what convert_linears gives it, converted or not)
            q = recipe.quantizer(Role("linear", "weight", full))
            check_shardable(q, child.weight.shape, child.weight.dtype, f"the weight of {full}", "apply_hybrid_fsdp")
            _refuse_delayed(q, full)
    # grouped (mixture-of-experts) weights: GroupedLinear and expert modules (hybridq_grouped_weights)
    _check_grouped_recipe(model, recipe, module_filter_fn)
    grouped_todo, grouped_skipped = _plan_grouped(model, recipe, module_filter_fn, on_incompatible)
    report = convert_linears(model, recipe, module_filter_fn, on_incompatible=on_incompatible, norms=norms)
    counts = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    report.layers += _apply_grouped(model, recipe, grouped_todo, counts, reuse_forward_payload) + grouped_skipped
    for fqn, mod in model.named_modules():
        if not isinstance(mod, Linear) or isinstance(mod.weight, HybridWeight):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        w = mod.weight
        if counts[id(w)] > 1:
            log.warning("hybridq: %s.weight is shared with another module; FSDP2 gathers it in high precision", fqn)
            continue
        state = WeightState(model, f"{fqn or mod.name}.weight")  # (a bare layer: its own name)
        state.reuse_payload = reuse_forward_payload
        mod.weight = nn.Parameter(HybridWeight(w.data, state), requires_grad=w.requires_grad)
        mod.mark_weight_quantized_elsewhere()
        _keep_wrapped_on_assign(mod)  # ([Note: load_state_dict(assign=True) of a weight gathered quantized])
    if not getattr(model, "_hybridq_state_dict_hook", False):
        if hasattr(model, "register_state_dict_post_hook"):
            model.register_state_dict_post_hook(_unwrap_state_dict)
        else:  # pragma: no cover - older torch
            model._register_state_dict_hook(lambda m, sd, p, lm: _unwrap_state_dict(m, sd, p, lm))
        model._hybridq_state_dict_hook = True
    arm_grad_reduce(model, wire)
    return report


# ---- the grouped weights: GroupedLinear and expert modules -------------------------------------------------------

def _grouped_weight_modules(model: nn.Module, module_filter_fn=None) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every GroupedLinear and expert module (`hybridq_grouped_weights`) the filter accepts."""
    out = []
    for fqn, mod in model.named_modules():
        if not (isinstance(mod, GroupedLinear) or expert_weight_names(mod) is not None):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        out.append((fqn, mod))
    return out


def _check_grouped_recipe(model: nn.Module, recipe: CustomRecipe, module_filter_fn=None) -> None:
    """Reject delayed scaling on any expert weight (as apply_hybrid_fsdp does for Linear weights)."""
    for fqn, mod in _grouped_weight_modules(model, module_filter_fn):
        if isinstance(mod, GroupedLinear):
            names, weights = [mod._role_name or fqn], [mod.weight]
        else:
            names = [f"{fqn}.{n}" if fqn else n for n in expert_weight_names(mod)]
            weights = [getattr(mod, n, None) for n in expert_weight_names(mod)]
        for name, w in zip(names, weights):
            if hasattr(w, "device_mesh"):
                raise ValueError(f"apply_hybrid_fsdp: {name} is already a DTensor; call apply_hybrid_fsdp before "
                                 f"fully_shard")
            for e in range(w.shape[0] if w is not None and w.dim() == 3 else 0):
                _refuse_delayed(recipe.quantizer(Role("grouped_linear", "weight", expert_name(name, e))),
                                f"expert {e} of {name}")


def _plan_grouped(model: nn.Module, recipe: CustomRecipe, module_filter_fn, on_incompatible: OnIncompatible):
    """Check every grouped weight against `recipe` before anything changes. Returns the work `_apply_grouped`
    does and the report rows of the layers kept in their precision."""
    todo, skipped = [], []
    for fqn, mod in _grouped_weight_modules(model, module_filter_fn):
        try:
            if isinstance(mod, GroupedLinear):
                quantizers = None if mod.recipe == recipe else mod.quantizers_for(recipe)
                todo.append((fqn, mod, quantizers))
            else:
                todo.append((fqn, mod, plan_expert_module(fqn, mod, recipe)))
        except FormatShapeError as e:
            if on_incompatible != OnIncompatible.SKIP:
                raise
            log.warning("hybridq: keeping grouped layer %r in its precision: %s", fqn, e)
            prev = mod.recipe.name if isinstance(mod, GroupedLinear) else None
            skipped.append(LayerReport(fqn, False, reason=str(e), previous_recipe=prev))
    return todo, skipped


def _apply_grouped(model: nn.Module, recipe: CustomRecipe, todo, counts, reuse_payload: bool = True) -> list:
    """Install the planned recipes and wrap each grouped weight in a GroupedHybridWeight. Returns report rows."""
    rows = []
    for fqn, mod, plan in todo:
        if isinstance(mod, GroupedLinear):
            prev = mod.recipe.name
            if plan is not None:
                mod.install_recipe(recipe, plan)
            rows.append(LayerReport(fqn, True, mod.describe_formats(), previous_recipe=prev, unchanged=plan is None))
            targets = [("weight", f"{fqn or mod.name}.weight", mod)]
        else:
            install_expert_module(mod, plan)
            layers = converted_experts(mod)
            rows += [LayerReport(g.name, True, g.describe_formats()) for g in layers.values()]
            targets = [(n, g.name, g) for n, g in layers.items()]
        for attr, name, layer in targets:
            w = getattr(mod, attr)
            if isinstance(w, GroupedHybridWeight):
                continue
            if counts[id(w)] > 1:
                log.warning("hybridq: %s is shared with another module; FSDP2 gathers it in high precision", name)
                continue
            state = GroupedWeightState(model, name, attr)
            state.reuse_payload = reuse_payload
            new = nn.Parameter(GroupedHybridWeight(w.data, state), requires_grad=w.requires_grad)
            setattr(mod, attr, new)
            layer._parameters["weight"] = new
            _keep_wrapped_on_assign(mod)
            _keep_wrapped_on_assign(layer)
    return rows
