"""Ops per converted weight per training step in the FSDP2 weight path (each a kernel launch on a GPU), per
preset, printed for the record (no assertion on the counts beyond sanity). GPU-equivalent counting: a quantization
the CUDA kernels take counts as one op. See tests/distributed/_opcount.py."""

from __future__ import annotations

import pytest

from _harness import spawn
import _jobs

pytestmark = pytest.mark.distributed

PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block_fwd_mxfp8_bwd",
           "fp8_fwd_high_precision_bwd"]


def _cell(d, phase, kind="launches"):
    return d.get(phase, {}).get(kind, 0.0)


def format_table(out) -> str:
    rows = ["| preset | pre_all_gather (stats / quantize / pack) | post_all_gather (unpack) | precompute_scales | "
            "total launches | KiB written | host constants | plain Linear weight quantize |",
            "|---|---|---|---|---|---|---|---|"]
    for preset, r in out.items():
        f, p = r["fsdp"], r["plain"]
        total = _cell(f, "pre_all_gather") + _cell(f, "post_all_gather") + _cell(f, "precompute_scales")
        kib = sum(_cell(f, ph, "bytes") for ph in ("pre_all_gather", "post_all_gather", "precompute_scales")) / 1024
        const = sum(_cell(f, ph, "constants") for ph in ("pre_all_gather", "post_all_gather", "precompute_scales"))
        rows.append(
            f"| {preset} | {_cell(f, 'pre_all_gather'):.1f} ({_cell(f, 'pre_all_gather/stats'):.1f} / "
            f"{_cell(f, 'pre_all_gather/quantize'):.1f} / {_cell(f, 'pre_all_gather/pack'):.1f}) | "
            f"{_cell(f, 'post_all_gather'):.1f} ({_cell(f, 'post_all_gather/unpack'):.1f}) | "
            f"{_cell(f, 'precompute_scales'):.1f} | {total:.1f} | {kib:.0f} | {const:.1f} | "
            f"{_cell(p, 'plain_weight'):.1f} |")
    return "\n".join(rows)


def test_opcount_table(capsys):
    out = spawn(_jobs.job_opcount, 2, "gloo", presets=PRESETS)[0]
    table = format_table(out)
    with capsys.disabled():
        print("\nFSDP2 weight path: ops (kernel launches, GPU-equivalent) per converted weight per step, 2 ranks, "
              f"weights {list(_jobs.OPCOUNT_SHAPES)}, reshard_after_forward=True, precompute_scales:\n" + table)
    for preset, r in out.items():
        assert r["fsdp"]["pre_all_gather"]["launches"] > 0, preset
