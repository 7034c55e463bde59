"""An FSDP2 unit whose output is a hybridq Linear's output on a [batch, seq, features] input returns a tensor
FSDP2 can hook like the plain model's (not a view: FSDP2 warns that an in-place op on a view drops its
pre-backward hook). The model is that of docs/fsdp2.md's example."""

from __future__ import annotations

import pytest

from _harness import spawn
import _jobs

pytestmark = pytest.mark.distributed


def test_plain_model_returns_no_view():
    out = spawn(_jobs.job_view_warnings, 2, "gloo", converted=False)
    assert not out[0]["view_warnings"], "the reference (unconverted) model already warns: " + out[0]["view_warnings"][0]


def test_converted_model_returns_no_view():
    out = spawn(_jobs.job_view_warnings, 2, "gloo", converted=True)
    warned = out[0]["view_warnings"]
    assert not warned, f"{len(warned)} FSDP2 view warnings with apply_hybrid_fsdp, none without: {warned[0]}"
