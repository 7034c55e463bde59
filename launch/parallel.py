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


def top_plan() -> dict:
    """The modules outside the blocks: embedding row-parallel into sequence shards, final norm sequence-parallel,
    output head column-parallel reading the sequence-sharded input, with a replicated (whole) logits output."""
    return {
        "tok_embeddings": TorchRowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def apply_tensor_parallel(model: Transformer, tp_mesh) -> None:
    """torchtitan's plan: `top_plan` on the model, `block_plan` on every block."""
    parallelize_module(model, tp_mesh, top_plan())
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan())


class _GroupOfSize:
    """What the set-up checks of hybridq's styles read from the tensor-parallel mesh: its size. The pre-flight
    runs them before any process group exists, on a converted meta-device model."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


# the flag that sets each projection's size, for saying what to change when it does not split
_SIZE_FLAG = {"wq": "--d-model", "wk": "--d-model", "wv": "--d-model", "wo": "--d-model", "w1": "--hidden",
              "w3": "--hidden", "w2": "--hidden", "output": "the byte vocabulary: drop --quantize-head"}


def layout_problems(model: Transformer, recipe: str, args) -> list[str]:
    """Every layout rule `apply_tensor_parallel` and the first forward will check, on `model` converted for
    `recipe` (a meta-device model will do): hybridq's tensor-parallel set-up checks of each converted Linear (its
    K or N split keeps every block whole, no delayed scaling), the FSDP2 x TP row cut of a weight FSDP2 gathers
    quantized, and the sequence-parallel rules of each column-parallel layer's input (every one of them reads a
    sequence-sharded input in this plan). One line per flag (and size) to change, naming the first layer that breaks
    it."""
    from hybridq.distributed import HybridWeight
    from hybridq.distributed.pieces import check_column_cuts
    from hybridq.distributed.sequence import SequenceGather
    from hybridq.distributed.tensor_parallel import TensorParallelLinear

    tp = args.tp
    if tp == 1:
        return []
    modules = dict(model.named_modules())
    found: dict[str, str] = {}

    def run(what: str, check) -> None:
        try:
            check()
        except hybridq.RecipeError as e:  # the recipe itself (delayed scaling): no size would help
            found.setdefault("recipe", f"--tp {tp}, recipe {recipe}: choose another recipe: {e}")
        except ValueError as e:  # FormatShapeError: a size to change
            found.setdefault(what, f"--tp {tp}, recipe {recipe}: change {what}: {e}")

    plans = [("", top_plan())] + [(f"layers.{i}.", block_plan()) for i in range(len(model.layers))]
    for prefix, plan in plans:
        for sub, style in plan.items():
            mod = modules.get(prefix + sub)
            if not isinstance(mod, hybridq.Linear) or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue  # (torch's own styles: no format rule)
            colwise = isinstance(style, ColwiseParallel)
            leaf = sub.rsplit(".", 1)[-1]
            flag = ("--n-kv-heads or --d-model" if leaf in ("wk", "wv") and model.cfg.n_kv_heads != model.cfg.n_heads
                    else _SIZE_FLAG[leaf])
            what = f"{flag} ({mod.out_features if colwise else mod.in_features})"
            tpl = TensorParallelLinear("colwise" if colwise else "rowwise", _GroupOfSize(tp), mod.in_features,
                                       mod.out_features)
            run(what, lambda: tpl.check(mod))
            if not colwise:
                continue
            override = mod.recipe.backward_override
            if isinstance(mod.weight, HybridWeight):  # FSDP2 cuts this rank's rows again (_distribute_weight)
                run(what, lambda: check_column_cuts(mod.weight_quantizer, mod.out_features, tp, True,
                                                    override is None, f"weight of {mod.name} (FSDP2 x TP)",
                                                    axis="M"))
            gather = SequenceGather(None, (args.batch, args.seq, mod.in_features), 1, None, tp, 0)
            x_col = override is None and not mod.save_original_input
            run(f"--seq ({args.seq})", lambda: gather.check(mod.input_quantizer, x_col, f"input of {mod.name}"))
    return list(found.values())


def sequence_bytes_line(model: nn.Module, args) -> str | None:
    """Per step and rank: bytes the sequence-parallel all-gathers send (forward and backward, one each per input
    shared by q/k/v or w1/w3, and the head's), against bf16 sequence parallelism."""
    if args.tp == 1:
        return None
    shape = (args.batch, args.seq, model.cfg.d_model)
    quantized = bf16 = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, hybridq.Linear) or not name.endswith(("wq", "w1", "output")):
            continue  # (wk / wv and w3 read the input wq / w1 gathered)
        r = sequence_gather_bytes(mod.input_quantizer, shape, 1, args.tp, dtype=torch.bfloat16,
                                  backward_override=mod.recipe.backward_override,
                                  save_original_input=mod.save_original_input)
        quantized, bf16 = quantized + r.total, bf16 + r.bf16
    if not bf16:
        return None
    return (f"sequence-parallel all-gathers per step and rank (forward + backward): {quantized / 2**20:.2f} MiB "
            f"quantized vs {bf16 / 2**20:.2f} MiB in bf16 ({quantized / bf16:.3f}x)")
