"""Distributed training: FSDP2 with quantized all-gathers (`apply_hybrid_fsdp`, `precompute_scales`)."""

from .fsdp import (GatheredWeight, HybridWeight, apply_hybrid_fsdp, bytes_table, gather_bytes_per_step,
                   precompute_scales)

__all__ = ["apply_hybrid_fsdp", "precompute_scales", "HybridWeight", "GatheredWeight", "gather_bytes_per_step",
           "bytes_table"]
