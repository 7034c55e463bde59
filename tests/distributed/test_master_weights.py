"""quantize_master_weights and ZeroAdamW on 2 gloo ranks (jobs in _master_jobs.py)."""

from __future__ import annotations

import pytest

import _master_jobs
from _harness import backends, spawn

pytestmark = pytest.mark.distributed


def _report(out) -> str:
    return "\n".join(f"rank {r}: {m}" for r, fails in enumerate(out) for m in fails[:8])


@pytest.mark.parametrize("backend", backends())
def test_fragments_give_the_whole_weights_quantization(backend):
    """Every plain weight format and every preset's weight quantizer (both stored directions of the hybrids):
    2 ranks own flat fragments cut mid-row, mid-block, mid-tile, row-aligned, a few elements long, empty, and in
    either rank order; the refreshed quantized weight equals quantizing the whole bf16 master, bitwise."""
    out = spawn(_master_jobs.job_fragments, 2, backend)
    assert out == [[], []], _report(out)


def test_errors_name_the_weight_and_change_nothing():
    """Fragments that leave a gap or overrun the weight, stochastic rounding, and fully_shard on quantized
    parameters raise with a message naming the weight; the parameter keeps its bytes."""
    out = spawn(_master_jobs.job_errors, 2, "gloo")
    assert out == [[], []], _report(out)


def test_zero_adamw_reproduces_fsdp2():
    """TinyLM with quantized parameters under ZeroAdamW (flat fragments cutting parameters anywhere) gives the
    losses and fp32 masters of the FSDP2 run of the same recipe with torch AdamW, bitwise, for 3 steps."""
    out = spawn(_master_jobs.job_zero_training, 2, "gloo",
                presets=["mxfp8_fwd_nvfp4_bwd", "fp8_block", "nvfp4"])
    assert out == [[], []], _report(out)


def test_grouped_fragments_give_each_experts_quantization():
    """A GroupedLinear's quantized experts from fragments of the flat `[E, out, in]` master cut inside experts, at
    and across expert boundaries: each expert is its own master slice's quantization (own amax), bitwise."""
    out = spawn(_master_jobs.job_grouped_fragments, 2, "gloo")
    assert out == [[], []], _report(out)


def test_zero_adamw_reproduces_fsdp2_for_experts():
    """TinyMoE with every weight quantized (GroupedLinear, expert module, dense layers) under ZeroAdamW: the losses
    and fp32 masters of the FSDP2 run of the same recipe, bitwise."""
    out = spawn(_master_jobs.job_zero_moe_training, 2, "gloo", presets=["fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd"])
    assert out == [[], []], _report(out)


def test_zero_adamw_resumes_at_another_world_size(tmp_path):
    """consolidated_state_dict() saved at 2 ranks loads at 1 (masters and AdamW moments by name): the next step on
    a batch both runs share gives the same loss and masters, bitwise; per-rank state_dict() refuses the change."""
    out = spawn(_master_jobs.job_zero_resume, 2, "gloo", folder=str(tmp_path))
    assert out == [[], []], _report(out)
    (one,) = spawn(_master_jobs.job_zero_resume, 1, "gloo", folder=str(tmp_path))
    assert one == [], "\n".join(one)
