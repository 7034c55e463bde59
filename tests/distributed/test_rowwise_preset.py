"""The fp8_rowwise preset (hybridq/formats/float8_rowwise.py) under FSDP2 and tensor parallelism, with the oracles of
test_fsdp.py and test_tensor_parallel.py (2 gloo ranks): training under FSDP2 bitwise the single-process replay (the
gathered weight is the whole weight's quantization: per-row scales from the shard's rows, per-column scales from the
MAX-reduced column amaxes); a tensor-parallel MLP block (column- and row-parallel weights, sequence-parallel input)
equal to the single-process model within test_tensor_parallel's tolerance, its row and column pieces quantized with
the amaxes of their cut axis (`piece_stats`)."""

from __future__ import annotations

import pytest

from _harness import spawn
import _jobs
import _tp_jobs
from test_fsdp import check_training

pytestmark = pytest.mark.distributed

PRESET = "fp8_rowwise"
TP_CASES = [("mlp", PRESET, None, False, (2, 256, 128), 1), ("mlp", PRESET, None, False, (96, 1, 128), 0)]


def test_fsdp2_training_matches_single_process():
    out = spawn(_jobs.job_training, 2, "gloo", configs=[{"preset": PRESET}])
    for rank, rep in enumerate(out):
        check_training(rep["runs"][0], rank)


def test_tensor_parallel_block_matches_the_single_process_model():
    out = spawn(_tp_jobs.tp_block_job, 2, "gloo", cases=TP_CASES)
    for block, p, o, soi, shape, sd in TP_CASES:
        key = f"{block}/{p}/{o}/soi={soi}/{tuple(shape)}/seq{sd}"
        for rank, rep in enumerate(out):
            assert not rep[key]["diffs"], f"{key}, rank {rank}:\n" + "\n".join(rep[key]["diffs"])
