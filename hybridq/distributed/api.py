"""Public entry points: `apply_hybrid_fsdp` (before `fully_shard`) and `precompute_scales` (after each
optimizer step)."""

from __future__ import annotations

import collections
import logging
from typing import Callable

import torch
import torch.nn as nn

from ..formats._sharding import dim0_chunks
from ..formats._reduce import amax_all_reduce_
from ..formats.shardable import check_shardable
from ..nn.convert import ConversionReport, convert_linears
from ..nn.linear import Linear
from ..nn.quantized_params import quantized_param_info
from ..recipe import CustomRecipe, Role, resolve_recipe
from .grad_reduce import arm_grad_reduce, check_rearm, parse_grad_reduce
from .grouped import apply_grouped, check_grouped_recipe, grouped_stats_items, plan_grouped
from .state import WeightState
from .transport import stats_key
from .weights import HybridWeight

__all__ = ["apply_hybrid_fsdp", "precompute_scales"]

log = logging.getLogger("hybridq")


def _unwrap_state_dict(module, state_dict, prefix, local_metadata) -> None:
    from torch.distributed.tensor import DTensor

    for key, v in list(state_dict.items()):
        if isinstance(v, DTensor) and isinstance(v._local_tensor, HybridWeight):
            state_dict[key] = DTensor.from_local(v._local_tensor._data, v.device_mesh, v.placements,
                                                 run_check=False, shape=v.shape, stride=v.stride())
        elif isinstance(v, HybridWeight):
            state_dict[key] = v._data


def apply_hybrid_fsdp(model: nn.Module, recipe: CustomRecipe | str,
                      module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                      on_incompatible: str = "skip", reuse_forward_payload: bool = True,
                      norms: bool = True, grad_reduce: str = "fp32") -> ConversionReport:
    """Prepare `model` for FSDP2 with quantized all-gathers; call it before `fully_shard`.

    Converts the eligible nn.Linear layers (`convert_linears`, same filter and `on_incompatible` semantics) and
    wraps the weight of every hybridq Linear in a `HybridWeight`; likewise applies the recipe to every
    `GroupedLinear` and converts every expert module (`hybridq_grouped_weights`, as `convert_experts`) and wraps
    their `[E, out, in]` weights in a `GroupedHybridWeight` (each expert gathered quantized, for FSDP2's Shard(0)
    and Shard(1) placements; see `distributed/grouped.py`), so that FSDP2 all-gathers the weight in the
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
    shard from forward to backward (1 byte per local FP8 element) instead of casting and quantizing it again.

    norms: swap the model's RMSNorm modules for hybridq.nn.RMSNorm (as `convert_linears(..., norms=True)`).
    `recipe`: a recipe or a preset name (TypeError for anything else).

    grad_reduce: the wire format of FSDP2's gradient reduce-scatter: "fp32" (FSDP2's own, in `reduce_dtype`;
    nothing installed), "bf16" or "mxfp8" (each rank sends every other rank its chunk quantized, the receiver
    sums in fp32 in rank order; 0.5x / ~0.26x of fp32's bytes; error bound and non-finite rules in
    `hybridq/distributed/grad_reduce.py`). Installed on every FSDP module under `model` at the first forward
    after `fully_shard`; `hybridq.distributed.grad_reduce_bytes(model)` counts the bytes sent.
    """
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
            q = recipe.quantizer(Role("linear", "weight", full))  # what convert_linears gives it, converted or not
            check_shardable(q, child.weight.shape, child.weight.dtype, f"the weight of {full}", "apply_hybrid_fsdp")
            if q.is_stateful:
                raise ValueError(
                    f"apply_hybrid_fsdp: the weight of {full} uses delayed scaling ({q.describe()}); under FSDP2 "
                    f"every rank quantizes its shard and backward re-gathers the weight, so a scale that changes "
                    f"between casts cannot give the single-device result. Use current scaling (e.g. the "
                    f"'fp8_tensorwise' preset: its global amax costs one fused all-reduce per step).")
    # grouped (mixture-of-experts) weights: GroupedLinear and expert modules (hybridq_grouped_weights)
    check_grouped_recipe(model, recipe, module_filter_fn)
    grouped_todo, grouped_skipped = plan_grouped(model, recipe, module_filter_fn, on_incompatible)
    report = convert_linears(model, recipe, module_filter_fn, on_incompatible=on_incompatible, norms=norms)
    counts = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    report.layers += apply_grouped(model, recipe, grouped_todo, counts) + grouped_skipped
    for fqn, mod in model.named_modules():
        if not isinstance(mod, Linear) or isinstance(mod.weight, HybridWeight):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        w = mod.weight
        if counts[id(w)] > 1:
            log.warning("hybridq: %s.weight is shared with another module; FSDP2 gathers it in high precision", fqn)
            continue
        state = WeightState(model, f"{fqn}.weight" if fqn else "weight")
        state.reuse_payload = reuse_forward_payload
        mod.weight = nn.Parameter(HybridWeight(w.data, state), requires_grad=w.requires_grad)
        mod.mark_weight_quantized_elsewhere()
    if not getattr(model, "_hybridq_state_dict_hook", False):
        if hasattr(model, "register_state_dict_post_hook"):
            model.register_state_dict_post_hook(_unwrap_state_dict)
        else:  # pragma: no cover - older torch
            model._register_state_dict_hook(lambda m, sd, p, lm: _unwrap_state_dict(m, sd, p, lm))
        model._hybridq_state_dict_hook = True
    arm_grad_reduce(model, wire)
    return report


def _shard_info(p):
    """(mesh, shard mesh dim, world size, rank) of a DTensor parameter sharded on dim 0, else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 0]
    if len(dims) != 1:
        return None
    mesh, i = p.device_mesh, dims[0]
    return mesh, i, mesh.size(i), mesh.get_local_rank(i)


@torch.no_grad()
def precompute_scales(model: nn.Module) -> dict:
    """Reduce the cross-shard statistics of every converted FSDP2-sharded weight of `model` in one fused
    all-reduce per process group; call it after `optimizer.step()` on every rank (it is a collective). The
    next all-gathers use them instead of one all-reduce per weight. A harmless no-op on a model that is not
    sharded. Returns {"weights": n, "values": reduced fp32 values, "all_reduces": collectives issued}."""
    per_group: dict = {}
    for mod in model.modules():
        if not isinstance(mod, Linear):
            continue
        p = mod._parameters.get("weight")
        info = _shard_info(p)
        if info is None or not isinstance(p._local_tensor, HybridWeight):
            continue
        mesh, i, ws, rank = info
        local = p._local_tensor
        st = local._hq
        if ws == 1 or st.tp_group is not None:  # (a TP piece's per-tensor statistics are reduced at its gather)
            continue
        dtype = st.param_dtype or local.dtype
        shape = tuple(p.shape)
        shard = dim0_chunks(shape, ws)[rank]
        data = local._data
        x2d = data.to(dtype).reshape(shard.length, shape[-1])
        s = mod.weight_quantizer.shard_stats(x2d, shard)
        if s is None:
            continue
        key = stats_key(p, dtype, shard)
        group = mesh.get_group(i)
        device = (torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda"
                  else torch.device(mesh.device_type))
        per_group.setdefault(id(group), (group, [], device))[1].append((st, key, s.reshape(-1).float()))
    for group, device, st, key, s in grouped_stats_items(model):  # all experts of a grouped weight: one entry
        per_group.setdefault(id(group), (group, [], device))[1].append((st, key, s))
    values = 0
    for group, items, device in per_group.values():
        flat = torch.cat([s for _, _, s in items]).to(device)  # CPU-offloaded shards: reduce on the PG's device
        amax_all_reduce_(flat, group)
        i = 0
        for st, key, s in items:
            st.stats_key, st.stats = key, flat[i:i + s.numel()]  # views of one fresh vector: no copy per weight
            i += s.numel()
        values += flat.numel()
    return {"weights": sum(len(v[1]) for v in per_group.values()), "values": values,
            "all_reduces": len(per_group)}
