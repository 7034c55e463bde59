"""The choice of streams for the per-expert cuBLAS GEMMs (hybridq/kernels/expert_streams.py; csrc/expert_streams.h):
two where the average expert's GEMM is short, one where it is long or only one expert has tokens. The GEMMs' results
on two streams are checked bitwise in test_cublaslt_fp8.py (GPU)."""

from __future__ import annotations

import pytest

from hybridq.kernels import expert_streams

# (tokens per expert, K, N, streams): bench_grouped's configs (64 / 16 / 8 experts), one busy expert, none
CASES = [
    ([2048] * 64, 2048, 3072, 2),
    ([4096] * 16, 2048, 5632, 2),
    ([4096] * 8, 4096, 14336, 1),
    ([0, 0, 2048, 0], 2048, 3072, 1),
    ([0, 0], 2048, 3072, 1),
]


@pytest.mark.parametrize("sizes,k,n,want", CASES, ids=lambda v: str(v)[:24])
def test_streams_follow_the_average_expert_gemm_time(sizes, k, n, want):
    got = expert_streams.streams_for(sizes, k, n)
    assert got == want, f"{len(sizes)} experts of ~{max(sizes)} tokens, K {k}, N {n}: {got} streams, want {want}"


def test_empty_experts_do_not_shorten_the_average(monkeypatch):
    """The average is over the experts with tokens: many empty experts do not make one long GEMM look short."""
    monkeypatch.setattr(expert_streams, "TWO_STREAMS_MAX_US", 200.0)
    assert expert_streams.streams_for([4096, 4096] + [0] * 62, 4096, 14336) == 1


def test_a_zero_threshold_keeps_one_stream(monkeypatch):
    monkeypatch.setattr(expert_streams, "TWO_STREAMS_MAX_US", 0.0)
    assert expert_streams.streams_for([2048] * 64, 2048, 3072) == 1
