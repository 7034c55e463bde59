"""Gathered parts must be indistinguishable from a one-device quantization to anything reading raw memory (the CUDA
kernels, torch._scaled_mm / F.scaled_mm): same shape, stride, dtype and contiguity for every tensor of every part,
and 16-byte aligned data pointers, in forward and backward gathers, first and later (in place) iterations."""

from __future__ import annotations

import pytest

from _harness import backends, spawn
import _jobs

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("backend", backends())
def test_gathered_parts_match_unsharded_metadata(backend):
    out = spawn(_jobs.job_metadata, 2, backend)
    for r in out:
        assert not r["diffs"], "\n".join(r["diffs"][:40])
        assert r["checked"] > 0
