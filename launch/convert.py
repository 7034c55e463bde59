"""Conversion of the model's Linear layers for a recipe (before fully_shard) and the per-layer report.

A quantized recipe that converts no layer is refused: a run labelled with a low-precision recipe that
trains in high precision would be the worst outcome a benchmark can have.
"""

from __future__ import annotations

from collections import Counter

import torch.nn as nn

import hybridq
from config import GRAD_WIRES, TORCHAO, ConfigError


def head_filter(args):
    """module_filter_fn: every Linear but the output head unless --quantize-head, and never an MoE router (its
    logits pick the experts: kept in high precision, as torchtitan keeps it)."""
    if args.quantize_head:
        return lambda module, fqn: not fqn.endswith("router")
    return lambda module, fqn: fqn != "output" and not fqn.endswith("router")


def convert(model: nn.Module, recipe_name: str, args) -> tuple[list[list[str]], str]:
    """Convert the model's Linears for `recipe_name` (before fully_shard); return the report rows and a
    one-line summary."""
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    filt = head_filter(args)
    gather_quantized = args.weight_gather == "quantized"  # (--moe: quantized only, see config.check_args)
    if gather_quantized:  # (--grad-reduce: the gradient wire, installed at the first forward after fully_shard)
        report = hybridq.apply_hybrid_fsdp(model, hybridq.recipe(recipe_name), module_filter_fn=filt,
                                           on_incompatible="skip", norms=args.norms != "model",
                                           grad_reduce=args.grad_reduce)
    else:
        report = hybridq.convert_linears(model, hybridq.recipe(recipe_name), module_filter_fn=filt,
                                         on_incompatible="skip", norms=args.norms != "model")
    by_name = {l.name: l for l in report.layers}
    rows = [["layer", "status", "input (row / col)", "weight (row / col)", "grad_output (row / col)", "why"]]
    n_conv = 0
    for name in linear_names:
        l = by_name.get(name)
        if l is None:
            why = ("output head kept in high precision (--quantize-head converts it)" if name == "output"
                   else "MoE router kept in high precision (routing)" if name.endswith("router")
                   else "excluded by module_filter_fn")
            rows.append([name, "skipped", "-", "-", "-", why])
        elif l.converted:
            n_conv += 1
            f = l.formats
            rows.append([name, "converted", f.get("input", "?"), f.get("weight", "?"), f.get("grad_output", "?"),
                         ""])
        else:
            rows.append([name, "skipped", "-", "-", "-", l.reason])
    grouped = [l for l in report.layers if l.name not in set(linear_names)]  # MoE expert weights [E, out, in]
    for l in grouped:
        f = l.formats
        rows.append([f"{l.name} [E={args.moe}]", "converted" if l.converted else "skipped",
                     f.get("input", "-"), f.get("weight", "-"), f.get("grad_output", "-"), l.reason])
    n_grouped = sum(l.converted for l in grouped)
    if args.tie_embeddings:
        rows.append(["output (tied)", "skipped", "-", "-", "-",
                     "tied to tok_embeddings (F.linear, not a Linear module)"])
    if n_conv == 0:
        raise ConfigError(no_layer_converted(recipe_name, [(r[0], r[5]) for r in rows[1:]]))
    for l in report.norms:
        rows.append([l.name, l.replacement if l.converted else "module kept", "-", "-", "-", l.reason])
    summary = (f"{n_conv} of {len(linear_names)} Linear layers"
               + (f" and {n_grouped} of {len(grouped)} grouped expert weights" if grouped else "")
               + (" converted by hybridq.apply_hybrid_fsdp (FSDP2 all-gathers their weights quantized; gradients "
                  f"reduce-scattered {GRAD_WIRES[args.grad_reduce]}). "
                  if gather_quantized else " converted by hybridq.convert_linears (FSDP2 all-gathers their weights "
                  "in param_dtype; each Linear quantizes its weight itself). ")
               + "".join(f"{n} modules run as {kind}. " for kind, n in sorted(Counter(
                   l.replacement for l in report.norms if l.converted).items()))
               + "Directions: forward y = x.row @ W.row; dgrad = dy.row @ W.col; wgrad = dy.col @ x.col "
               "(hybrid[row / col] names both; a plain format serves both).")
    return rows, summary


def convert_torchao(model: nn.Module, args, out) -> None:
    """The torchao float8 baseline (before fully_shard): torchao.float8.convert_to_float8_training, tensorwise
    dynamic scaling, enable_fsdp_float8_all_gather=True, same head filter as the hybridq recipes; build()
    adds precompute_float8_dynamic_scale_for_fsdp after each optimizer step (as benchmarks/bench_fsdp.py does)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=head_filter(args))
    n_conv = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if n_conv == 0:
        raise ConfigError(no_layer_converted(TORCHAO, [(n, "not converted by torchao") for n, m in
                                                       model.named_modules() if isinstance(m, nn.Linear)]))
    out(f"\n{TORCHAO}: {n_conv} of {n_linear} Linear layers converted by torchao.float8.convert_to_float8_training "
        "(tensorwise, float8 all-gather, scales precomputed after each optimizer step)"
        + ("" if args.quantize_head else "; output head kept in high precision"))


def no_layer_converted(recipe_name: str, why: list[tuple[str, str]]) -> str:
    reasons = "; ".join(f"{n}: {r}" for n, r in why[:8]) or "the model has no Linear layer"
    return (f"recipe {recipe_name}: no Linear layer was converted ({reasons}), so this run would train in high "
            "precision under a quantized recipe's name; refusing to run it (pick a recipe whose block sizes "
            "divide the layer shapes, or --recipe bf16 for the unquantized baseline)")
