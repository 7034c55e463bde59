"""Tensor parallelism for the launch model: the plan (torchtitan's, with hybridq's styles for hybridq layers) and
the sequence-parallel bytes it all-gathers."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise, SequenceParallel, parallelize_module

import hybridq
from hybridq.distributed import ColwiseParallel, PrepareModuleInput, RowwiseParallel, sequence_gather_bytes

from model import Transformer


def block_plan() -> dict:
    """One transformer block: norms sequence-parallel; q/k/v and w1/w3 column-parallel reading one sequence-sharded
    input each (hybridq all-gathers it quantized, once); wo and w2 row-parallel back to sequence shards."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: Transformer, tp_mesh) -> None:
    """torchtitan's plan: embedding row-parallel into sequence shards, blocks as `block_plan`, final norm
    sequence-parallel, output head column-parallel with a replicated (whole) logits output."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": TorchRowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan())


def tp_problems(args, cfg) -> list[str]:
    """What the model and flags must satisfy for --tp (checked before any collective)."""
    tp, out = args.tp, []
    if tp == 1:
        return out
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("--seq", args.seq)):
        if n % tp:
            out.append(f"--tp {tp}: {what}={n} must be a multiple of the tensor-parallel size")
    if cfg.tie_embeddings:
        out.append(f"--tp {tp}: tied embeddings are not tensor-parallelized here; drop --tie-embeddings")
    if "torchao_float8" in (args.recipe, args.compare):
        out.append(f"--tp {tp}: the torchao float8 baseline is not tensor-parallelized here")
    if args.moe:
        out.append(f"--tp {tp}: MoE layers are not tensor-parallelized yet; use --tp 1 with --moe")
    return out


def sequence_bytes_line(model: nn.Module, args) -> str | None:
    """Per step and rank: bytes the sequence-parallel all-gathers send (forward, one per input shared by q/k/v or
    w1/w3, and the head's), against bf16 sequence parallelism."""
    if args.tp == 1:
        return None
    shape = (args.batch, args.seq, model.cfg.d_model)
    quantized = bf16 = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, hybridq.Linear) or not name.endswith(("wq", "w1", "output")):
            continue  # (wk / wv and w3 read the input wq / w1 gathered)
        columnwise = mod.recipe.backward_override is None and not mod.save_original_input
        r = sequence_gather_bytes(mod.input_quantizer, shape, 1, args.tp, columnwise=columnwise,
                                  dtype=torch.bfloat16)
        quantized, bf16 = quantized + r["quantized"], bf16 + r["bf16"]
    if not bf16:
        return None
    return (f"sequence-parallel all-gathers per step and rank (forward): {quantized / 2**20:.2f} MiB quantized vs "
            f"{bf16 / 2**20:.2f} MiB in bf16 ({quantized / bf16:.3f}x)")
