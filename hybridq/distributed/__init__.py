"""Distributed training: FSDP2 with quantized all-gathers (`apply_hybrid_fsdp`, `precompute_scales`).

Modules, one job each, for Linear weights and grouped `[E, out, in]` expert weights alike (each expert gathered
quantized on its own): `plan` (what an unshard gathers), `fsdp_adapter` (the only reader of FSDP2's private
state), `layout` (where a weight's rows live on the ranks, the all-gather input FSDP2 accepts), `payload` (packing
a quantized shard into bytes and back), `transport` (building and gathering payloads), `checks` (sharding rules
checked when the layout is known), `state` (per-weight state), `stats` (its reduced statistics), `buffers` (the
unsharded weight's own buffers), `gathered` / `weights` (the unsharded and sharded weight types), `api`
(`apply_hybrid_fsdp`), `scales` (`precompute_scales`), `accounting` (bytes on the wire) and `grad_reduce` (the
low-precision gradient reduce-scatter). Tensor parallelism: `tensor_parallel` (hybridq's
ColwiseParallel / RowwiseParallel / PrepareModuleInput), `sequence` (the quantized sequence-parallel all-gather)
and `pieces` (a rank's piece of a tensor quantized with the whole tensor's statistics). ZeRO optimizers:
`fragments` (flat fragments of a weight), `master_weights` (quantize_master_weights; each direction's task in
`master_tasks`) and `zero` (ZeroAdamW; its state dicts in `zero_state`). DTensor's private state is read through
`hybridq.torch_private` only.
"""

from .accounting import (GatherBytes, SequenceBytes, bytes_table, gather_bytes_per_step, sequence_bytes_table,
                         sequence_gather_bytes)
from .api import apply_hybrid_fsdp
from .grad_reduce import grad_reduce_bytes
from .gathered import GatheredWeight, GroupedGatheredWeight
from .scales import PrecomputedScales, precompute_scales
from .tensor_parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from .weights import GroupedHybridWeight, HybridWeight
from .fragments import FragmentLayout
from .master_weights import quantize_master_weights
from .zero import ZeroAdamW

__all__ = ["apply_hybrid_fsdp", "precompute_scales", "PrecomputedScales", "GatherBytes", "SequenceBytes",
           "HybridWeight",
           "GatheredWeight", "GroupedHybridWeight", "GroupedGatheredWeight", "gather_bytes_per_step", "bytes_table",
           "sequence_gather_bytes", "sequence_bytes_table", "grad_reduce_bytes", "ColwiseParallel", "RowwiseParallel",
           "PrepareModuleInput", "quantize_master_weights", "ZeroAdamW", "FragmentLayout"]
