"""apply_hybrid_fsdp + fully_shard on torch's attention modules (2 gloo ranks): nn.MultiheadAttention's out_proj and
nn.TransformerEncoderLayer's Linears, whose weights their owners read themselves, stay plain parameters (the report
says why) and the model trains like the same conversion on one process; the recipe is given by preset name."""

from __future__ import annotations

import pytest

from _harness import spawn
import _convert_jobs

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def transformer_run():
    return spawn(_convert_jobs.job_transformer_fsdp, 2, "gloo", preset="mxfp8")


def test_layers_read_by_their_owner_are_reported_skipped_and_the_others_converted(transformer_run):
    out = transformer_run[0]
    assert sorted(out["converted"]) == ["1.ff", "2"], out
    for name, reader in [("0.self_attn.out_proj", "MultiheadAttention"), ("0.linear1", "TransformerEncoderLayer"),
                         ("0.linear2", "TransformerEncoderLayer"), ("1.attn.out_proj", "MultiheadAttention")]:
        assert f"{reader}.forward reads self." in out["skipped"].get(name, ""), (name, out["skipped"])


def test_training_and_inference_forward_match_the_single_process_conversion(transformer_run):
    for rank, out in enumerate(transformer_run):
        assert out["output_diff"] == 0, f"rank {rank}: output differs by {out['output_diff']:g}"
        bad = {n: d for n, d in out["grad_diffs"].items() if d != 0}
        assert not bad, f"rank {rank}: gradients differ from the single-process model's: {bad}"
        assert out["inference_diff"] == 0, f"rank {rank}: inference output differs by {out['inference_diff']:g}"


def test_a_bare_layers_weight_is_named_after_the_layer():
    """apply_hybrid_fsdp on a Linear itself (no parent module path): the weight's errors name the layer, not just
    "weight"."""
    import hybridq
    from hybridq.distributed import apply_hybrid_fsdp
    lin = hybridq.Linear(32, 32, bias=False, name="proj", recipe="fp8_tensorwise")
    apply_hybrid_fsdp(lin, hybridq.recipe("fp8_tensorwise"))
    assert lin.weight._hq.name == "proj.weight", f"the bare layer's weight is named {lin.weight._hq.name!r}"
