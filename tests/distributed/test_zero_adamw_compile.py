"""A compiled model with quantized parameters trained by ZeroAdamW (one gloo rank): every step's loss and weights
bitwise those of the same model trained eagerly, so each compiled step reads the weights the last optimizer step
wrote (checks in _qparam_compile_jobs.py, one spawn)."""

from __future__ import annotations

import pytest

import _qparam_compile_jobs
from _harness import spawn

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return spawn(_qparam_compile_jobs.job_checks, 1, "gloo")


@pytest.mark.parametrize("preset", _qparam_compile_jobs.PRESETS)
def test_compiled_training_with_zero_adamw_is_bitwise_eager(results, preset):
    fails = [f"rank {r}: {m}" for r, out in enumerate(results) for m in out[preset][:8]]
    assert not fails, "\n".join(fails)
