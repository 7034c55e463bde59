"""What the sequence-parallel all-gather sends (`hybridq.distributed.sequence.gather_plan`), in spawned gloo
groups of 2 and 4 ranks (one job each, _sequence_plan_jobs.job_all).

Oracles:
- whatever is sent (each rank's quantized rows, or its rows in the input's dtype when that is fewer bytes), every
  rank ends with the single device's quantization of the whole input, both directions, bit for bit: every preset,
  bf16 and fp32 inputs, [B, S, H] (runs of rows) and [S, B, H] (rank boundaries inside blocks);
- the bytes each gather sends are the table's (`sequence_gather_bytes`), in the dtype the plan says;
- column-parallel layers sharing one bf16 input: the fprop and wgrad input operands bitwise the single device's,
  one all-gather per step, none in backward;
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
# the rows in the input's dtype are fewer bytes than the quantized payload of these presets' inputs (bf16: both
# directions in 8 bits, or an identity columnwise form; fp32: the identity columnwise form alone is the fp32 rows)
HIGH_PRECISION = {"bfloat16": {"fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd", "fp8_fwd_high_precision_bwd",
                                "fp8_rowwise"},
                  "float32": {"fp8_fwd_high_precision_bwd"}}
HIGH_PRECISION_BF16 = HIGH_PRECISION["bfloat16"]


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
def test_bytes_sent_are_the_tables(world_size):
    for rank, r in enumerate(_run(world_size)):
        for key, case in r["gather"].items():
            preset, dtype = key.split("/")[:2]
            t = case["table"]
            high = preset in HIGH_PRECISION[dtype]
            assert (t["sends"] == "high_precision") == high, (key, t)
            want_dtype = f"torch.{dtype}" if high else "torch.uint8"
            assert case["sent"] == [[want_dtype, t["forward"]]], f"rank {rank} {key}: sent {case['sent']}, table {t}"
            if high:
                assert t["forward"] < t["quantized_payload"], (key, t)


@pytest.mark.parametrize("world_size", WORLDS)
def test_column_parallel_layers_read_the_single_devices_operands(world_size):
    for rank, r in enumerate(_run(world_size)):
        for preset, case in r["layers"].items():
            assert not case["diffs"], f"rank {rank}:\n" + "\n".join(case["diffs"])
            assert len(case["sent"]) == 1, f"rank {rank} {preset}: one gather for both layers, got {case['sent']}"


def test_no_preset_sends_more_than_bf16_sequence_parallelism():
    shape = (1, 4096, 4096)
    for preset in hybridq.preset_names():
        rec = hybridq.recipe(preset)
        q = rec.quantizer(Role("linear", "input"))
        if q.is_stateful:
            continue
        r = sequence_gather_bytes(q, shape, 1, 2, columnwise=rec.backward_override is None)
        assert r["total"] <= r["bf16"], (preset, r)
        assert (r["sends"] == "high_precision") == (preset in HIGH_PRECISION_BF16), (preset, r)
    table = sequence_bytes_table(shape)
    head = table.splitlines()[0]
    assert "forward bytes" in head and "backward bytes" in head and "activation bytes saved" in head, head
    ratios = [float(row.split("|")[6]) for row in table.splitlines()[2:] if "rejected" not in row]
    assert ratios and max(ratios) <= 1.0, table
