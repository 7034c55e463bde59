"""How many CUDA streams a grouped op issues its per-expert cuBLAS GEMMs on (csrc/expert_streams.h, [Note:
per-expert GEMMs on two streams]): two where the average expert's GEMM is short -- a GEMM of 1-2 waves of output
tiles leaves SMs idle in its last wave, which the next expert's GEMM on the other stream fills -- else one (long
GEMMs measured 4-8% slower on two: they only contend)."""

from __future__ import annotations

# The average expert GEMM's estimated time (`gemm_us`) below which two streams are used. Measured on one H200
# (2026-11-29, the per-expert GEMMs of bench_grouped's configs): ~22 us (64 experts, d 2048, h 3072) 9-27% faster per
# phase on two streams, ~85 us (16 experts, d 2048, h 5632) 8-12% faster, ~440 us (8 experts, d 4096, h 14336) 4-8%
# slower (fprop, dgrad) or even (wgrad). Set it to 0 for one stream always.
TWO_STREAMS_MAX_US = 200.0


def gemm_us(sizes: list[int], k: int, n: int) -> float:
    """The average expert's GEMM time estimated at 1.1 PFLOP/s (the FP8 GEMMs measured on an H200), in us."""
    return 2.0 * (sum(sizes) / len(sizes)) * k * n / 1.1e15 * 1e6


def streams_for(sizes: list[int], k: int, n: int) -> int:
    """The streams for GEMMs of `sizes[g]` rows (or contracted tokens) each, contracting `k`, `n` wide."""
    busy = [s for s in sizes if s]
    return 2 if len(busy) > 1 and gemm_us(busy, k, n) < TWO_STREAMS_MAX_US else 1
