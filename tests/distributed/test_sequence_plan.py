"""What the sequence-parallel all-gathers send in forward and in backward (`hybridq.distributed.sequence.gather_plan`,
[Note: sequence phases] in sequence.py), in spawned gloo groups of 2 and 4 ranks (one job each,
_sequence_plan_jobs.job_all).

Oracles:
- whatever is sent (per phase: each rank's quantized rows in forward and its own columnwise form -- or rowwise form,
  when the columnwise one is its transform -- in backward; forward only: the quantized directions, or the rows in
  the input's dtype when that is fewer bytes), every rank ends with the single device's quantization of the whole
  input, both directions, bit for bit: every preset, bf16 and fp32 inputs, [B, S, H] (runs of rows) and [S, B, H]
  (rank boundaries inside blocks);
- the bytes each phase's gather hands to the collective, and what wgrad keeps, are the table's
  (`sequence_gather_bytes`), in the dtype the plan says;
- column-parallel layers sharing one bf16 input: the fprop and wgrad input operands, the outputs and the weight
  gradients bitwise the single device's; outputs, input and weight gradients bitwise the forward-only gathers'
  (the results before per-phase gathers), also with activation recompute and CPU offload; one gather per phase for
  both layers; the activation bytes kept for wgrad fewer than the forward-only gathers' and bf16 SP's;
- no preset sends more than bf16 sequence parallelism per step (`sequence_bytes_table`).
"""

from __future__ import annotations

import functools

import pytest
import torch

import hybridq
from hybridq import Role
from hybridq.distributed import sequence_bytes_table, sequence_gather_bytes

from _harness import spawn
import _sequence_plan_jobs as jobs

pytestmark = pytest.mark.distributed

WORLDS = [2, 4]
# forward only, the rows in the input's dtype (fewer bytes than the quantized payload, and per phase would send more
# than them: bf16 inputs of the 8-bit block formats, whose two directions are 33/32 of the bf16 bytes each; an
# identity columnwise form)
HIGH_PRECISION = {"bfloat16": {"fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd", "fp8_fwd_high_precision_bwd",
                                "fp8_rowwise"},
                  "float32": {"fp8_fwd_high_precision_bwd"}}
# per phase: the rowwise form in forward, each rank's own form in backward (the rest of each dtype's presets)
PER_PHASE_BF16 = {"fp8_tensorwise", "nvfp4", "mxfp8_fwd_nvfp4_bwd"}


@functools.lru_cache(maxsize=None)
def _run(world_size: int) -> tuple:
    return tuple(spawn(jobs.job_all, world_size, "gloo"))


@pytest.mark.parametrize("world_size", WORLDS)
def test_gathered_quantization_is_the_single_devices_bitwise(world_size):
    for rank, r in enumerate(_run(world_size)):
        bad = [d for case in r["gather"].values() for d in case["diffs"]]
        assert not bad, f"rank {rank}:\n" + "\n".join(bad[:20])
        assert len(r["gather"]) == len(jobs.PRESETS) * 2 * 2


@pytest.mark.parametrize("world_size", WORLDS)
def test_bytes_sent_in_each_phase_are_the_tables(world_size):
    for rank, r in enumerate(_run(world_size)):
        for key, case in r["gather"].items():
            preset, dtype = key.split("/")[:2]
            t = case["table"]
            high = preset in HIGH_PRECISION[dtype]
            assert (t["forward_sends"] == "high_precision") == high, (key, t)
            want_dtype = f"torch.{dtype}" if high else "torch.uint8"
            assert case["forward"] == [[want_dtype, t["forward"]]], f"rank {rank} {key}: forward sent " \
                f"{case['forward']}, table {t}"
            if high:
                assert t["forward"] < t["quantized_payload"] and not case["backward"], (key, t, case["backward"])
                continue
            # per phase: the rowwise form forward, this rank's own form backward
            assert t["forward_sends"] == "rowwise" and t["backward_sends"] in ("rowwise", "columnwise"), (key, t)
            assert case["backward"] == [["torch.uint8", t["backward"]]], f"rank {rank} {key}: backward sent " \
                f"{case['backward']}, table {t}"
            # (a rank whose rows cut blocks may keep a few scales more: the table gives the most any rank keeps)
            kept = [other["gather"][key]["kept"] for other in _run(world_size)]
            assert case["kept"] <= t["kept"] == max(kept), f"{key}: ranks kept {kept} bytes for wgrad, table {t}"


@pytest.mark.parametrize("world_size", WORLDS)
def test_column_parallel_layers_match_the_single_device_and_the_forward_only_gathers(world_size):
    for rank, r in enumerate(_run(world_size)):
        for preset, case in r["layers"].items():
            assert not case["diffs"], f"rank {rank}:\n" + "\n".join(case["diffs"])


@pytest.mark.parametrize("world_size", WORLDS)
def test_layers_sharing_an_input_gather_it_once_per_phase(world_size):
    for rank, r in enumerate(_run(world_size)):
        for preset, case in r["layers"].items():
            t = case["table"]
            per_phase = preset in PER_PHASE_BF16
            assert (t["backward"] > 0) == per_phase, (preset, t)
            assert [n for _, n in case["forward"]] == [t["forward"]], f"rank {rank} {preset}: forward {case}"
            assert [n for _, n in case["backward"]] == ([t["backward"]] if per_phase else []), \
                f"rank {rank} {preset}: backward gathers {case['backward']}, table {t}"
            if not per_phase:
                continue
            fwd, bwd = case["recompute"]  # the forward gather again in the recomputed forward
            assert fwd == case["forward"] and bwd == case["forward"] + case["backward"], (preset, case["recompute"])
            fwd, bwd = case["forward_only"]
            assert [n for _, n in fwd] == [t["quantized_payload"]] and not bwd, (preset, case["forward_only"])


@pytest.mark.parametrize("world_size", WORLDS)
def test_layers_keep_the_tables_activation_bytes_per_phase_fewer_than_forward_only(world_size):
    for rank, r in enumerate(_run(world_size)):
        for preset, case in r["layers"].items():
            t = case["table"]
            assert case["kept"] == t["kept"], f"rank {rank} {preset}: kept {case['kept']} bytes, table {t}"
            if preset in PER_PHASE_BF16:
                assert case["kept"] < case["kept_forward_only"], (preset, case)
                assert case["kept"] < t["bf16_kept"] // world_size, (preset, case)


def test_no_preset_sends_more_than_bf16_sequence_parallelism():
    shape = (1, 4096, 4096)
    for preset in hybridq.preset_names():
        rec = hybridq.recipe(preset)
        q = rec.quantizer(Role("linear", "input"))
        if q.is_stateful:
            continue
        r = sequence_gather_bytes(q, shape, 1, 2, backward_override=rec.backward_override)
        assert r.total <= r.bf16, (preset, r)
        assert (r.forward_sends == "high_precision") == (preset in HIGH_PRECISION["bfloat16"]), (preset, r)
        assert (r.backward > 0) == (preset in PER_PHASE_BF16), (preset, r)
        assert r.kept < r.bf16_kept or preset == "fp8_fwd_high_precision_bwd", (preset, r)
    table = sequence_bytes_table(shape)
    head = table.splitlines()[0]
    assert all(c in head for c in ("forward bytes", "sends in backward", "backward bytes", "kept for wgrad",
                                   "activation bytes saved")), head
    ratios = [float(row.split("|")[7]) for row in table.splitlines()[2:] if "rejected" not in row]
    assert ratios and max(ratios) <= 1.0, table


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8", "nvfp4"])
def test_bytes_of_the_backward_overrides(preset):
    """backward_override="dequantized": wgrad reads the forward's whole rowwise form, kept from forward, nothing
    gathered in backward; "high_precision" and save_original_input: each rank keeps its rows and gathers them again
    in backward."""
    shape = (1, 256, 512)
    q = hybridq.recipe(preset).quantizer(Role("linear", "input"))
    whole_rowwise = q.quantize_parts(torch.empty(256, 512, dtype=torch.bfloat16, device="meta"), True, False)[0]
    r = sequence_gather_bytes(q, shape, 1, 2, backward_override="dequantized")
    assert (r.backward, r.backward_sends, r.kept) == (0, "", whole_rowwise.nbytes()), (preset, r)
    rows = 128 * 512 * 2
    for r in (sequence_gather_bytes(q, shape, 1, 2, backward_override="high_precision"),
              sequence_gather_bytes(q, shape, 1, 2, save_original_input=True)):
        assert (r.backward, r.backward_sends, r.kept) == (rows, "high_precision", rows), (preset, r)


def test_an_unknown_backward_override_is_refused_by_name():
    q = hybridq.recipe("mxfp8").quantizer(Role("linear", "input"))
    with pytest.raises(ValueError, match=r"backward_override must be one of \['high_precision', 'dequantized'\], "
                                         r"got 'dequantised'"):
        sequence_gather_bytes(q, (1, 256, 512), backward_override="dequantised")
