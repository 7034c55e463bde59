"""Tensor / sequence parallelism refuses what it cannot compute, on every rank and before any collective can
abort or hang, and a hybridq TP / SP step emits no deprecation warning and no warning of hybridq's own (issues 29,
31). Jobs in _tp_hygiene_jobs.py (2 gloo ranks, one spawn)."""

from __future__ import annotations

import pytest

import _tp_hygiene_jobs as jobs
from _harness import spawn

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def report() -> list[dict]:
    return spawn(jobs.job_all, 2, "gloo")


def _raised(report, key: str) -> list[dict]:
    return [rep["refusals"][key] for rep in report]


@pytest.mark.parametrize("key", ["uneven_linear_5_3", "uneven_linear_3_5", "uneven_block_5_3"])
def test_uneven_sequence_shards_raise_on_every_rank(report, key):
    """5 tokens on one rank and 3 on the other aborted inside gloo ("Received data size doesn't match"): now a
    ValueError on every rank naming the input, the rule and the token counts."""
    for rank, err in enumerate(_raised(report, key)):
        assert err["type"] == "ValueError", f"rank {rank}: {err}"
        for words in ("input of", "same share of the sequence", "between 3 and 5 tokens",
                      "multiple of 2"):
            assert words in err["message"], f"rank {rank}: {words!r} not in {err['message']!r}"


def test_even_sequence_shards_run(report):
    for rank, err in enumerate(_raised(report, "even_block_4_4")):
        assert err["type"] is None, f"rank {rank}: {err}"


def test_column_parallel_weight_split_inside_a_block_is_refused_at_parallelize_time(report):
    """A column-parallel piece is a GEMM operand of its own: a TP boundary inside a block (MXFP8's 32-row
    columnwise blocks, 160 rows over 2 ranks) is refused naming the weight, the format and the rule; the module is
    left as it was."""
    for rank, err in enumerate(_raised(report, "weight_rows_cut")):
        assert err["type"] == "FormatShapeError", f"rank {rank}: {err}"
        for words in ("weight of 0", "along M", "M=160 splits at 80", "multiple of 64"):
            assert words in err["message"], f"rank {rank}: {words!r} not in {err['message']!r}"
        assert err["unchanged"], f"rank {rank}: the module changed before the error"


@pytest.mark.parametrize("case", [f"{b}/{p}/{o}" for b, p, o in jobs.WARNING_CASES])
def test_tensor_parallel_step_emits_no_deprecation_or_hybridq_warning(report, case):
    """torch 2.13 deprecates reduce_scatter_tensor / all_gather_into_tensor (a FutureWarning per call, 40 per
    main-job run): hybridq calls the names neither torch version deprecates."""
    for rank, rep in enumerate(report):
        assert rep["warnings"][case] == [], f"rank {rank}:\n" + "\n".join(rep["warnings"][case])
