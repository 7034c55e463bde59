"""Eager FP8 Linears whose weights FSDP2 all-gathers quantized (apply_hybrid_fsdp) run as nn/float8_graph.py's few
ops reading the gathered weight's parts (the host cost of a Linear step, issue 33), and train bit for bit as on the
general path: losses and every gradient of 2 AdamW steps and the parameters after them, 2 ranks (CPU gloo)."""

from __future__ import annotations

import pytest

from _harness import backends, spawn
import _fast_path_jobs

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("backend", backends(needs_extension=True))  # (asserts the extension's fast path ran)
def test_fast_path_with_gathered_weights_trains_as_the_general_path(backend):
    out = spawn(_fast_path_jobs.fast_path_matches_general_path, 2, backend, presets=["fp8_tensorwise", "fp8_block"])
    for rank, o in enumerate(out):
        for preset, r in o.items():
            where = f"{preset}, rank {rank}"
            # 2 steps x 2 blocks x 2 Linears, every forward on the fast path
            assert r["fast_calls"] == 8, f"{where}: {r['fast_calls']} Linear calls on the fast path, expected 8"
            assert not r["diffs"], f"{where}: fast path differs from the general path:\n" + "\n".join(r["diffs"][:20])
