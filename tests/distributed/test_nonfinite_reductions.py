"""A NaN or an inf in a piece held by a rank other than 0 gives the single-device result, non-finite included, at
every distributed statistic reduction (issue 29): FSDP2 gathers and precompute_scales, tensor-parallel weight and
input pieces, the sequence-parallel input all-gather, master-weight fragments and ZeroAdamW, grouped experts,
delayed-scaling amax histories, and FSDP2 x TP (dp2 x tp2). A plain MAX all-reduce may drop a NaN from another
rank (gloo does), after which NVFP4, which carries a NaN only in its global amax, came out all finite.

Oracles: the quantized parts bitwise equal to quantizing the whole tensor on one device (NaN positions equal, NaN
payloads free), or the GEMM operands bitwise equal to their piece of the single-device model's; outputs and
input gradients non-finite exactly where one device has them. Jobs in _nonfinite_jobs.py (gloo, 2 and 4 ranks).
"""

from __future__ import annotations

import pytest

import _nonfinite_jobs as jobs
from _harness import nccl_devices, spawn

pytestmark = pytest.mark.distributed

FORMATS = jobs.stat_formats()  # every format whose sharded quantization reduces statistics
TENSOR_WIDE = jobs.tensor_wide_formats()  # those with a per-tensor / global amax
VALUES = list(jobs.VALUES)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(jobs.job_all, 2, "gloo", formats=FORMATS, tensor_wide=TENSOR_WIDE)


@pytest.fixture(scope="module")
def dp2_tp2() -> list[dict]:
    return spawn(jobs.job_fsdp_tp, 4, "gloo", formats=TENSOR_WIDE)


def _check(report: list[dict], key: str) -> None:
    missing = [r for r, rep in enumerate(report) if key not in rep]
    assert not missing, f"{key}: not run on ranks {missing}"
    bad = [f"rank {r}: {d}" for r, rep in enumerate(report) for d in rep[key][:4]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("what", [f"float/torch.{d}/{l}" for d in ("float32", "float64", "bfloat16", "float16")
                                  for l in ("contiguous", "strided")] + ["view/payload", "int64"])
def test_amax_all_reduce_is_the_one_device_amax_and_keeps_nan(two_ranks, what):
    """amax_all_reduce_ (hybridq/formats/_reduce.py), the one reduction of statistics: torch.amax of the ranks'
    magnitudes on one device, so NaN (either sign, payload kept) on any rank gives NaN, +-inf gives +inf, -0.0 is
    0; in place on a view and a strided tensor, dtype kept; integers refused."""
    _check(two_ranks, f"helper/{what}")


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("site", ["gather", "precompute", "forward"])
def test_fsdp2_keeps_non_finite(two_ranks, site, fmt, value):
    """The gathered weight (statistics reduced at the gather; "precompute": by precompute_scales' fused reduction)
    bitwise the one-device quantization; "forward": outputs and input gradients non-finite where one device's are
    (the issue's repro: NVFP4 with a NaN in rank 1's weight shard gave 0 non-finite outputs, one device all)."""
    _check(two_ranks, f"{site}/{fmt}/{value}")


@pytest.mark.parametrize("value", list(jobs.TP_VALUES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("site", jobs.TP_SITES)
def test_tensor_and_sequence_parallel_operands_keep_non_finite(two_ranks, site, fmt, value):
    """Column-parallel weight rows, row-parallel weight and input columns, the sequence-parallel input: every GEMM
    operand bitwise its piece of the single-device one (also with finite values: the pieces of a column-parallel
    weight cut at the format's row granularity are exact for 128x128 tiles of different magnitudes)."""
    _check(two_ranks, f"{site}/{fmt}/{value}")


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("fmt", TENSOR_WIDE)
@pytest.mark.parametrize("site", ["master", "zero"])
def test_master_weights_keep_non_finite(two_ranks, site, fmt, value):
    """quantize_master_weights from fragments cut mid-block ("master"), and a ZeroAdamW refresh ("zero"; the
    issue's repro: a master fragment holding a NaN on rank 1 gave a weight without one): the quantized weight
    bitwise the one-device quantization of the whole master."""
    _check(two_ranks, f"{site}/{fmt}/{value}")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("how", ["gather", "precompute"])
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("fmt", TENSOR_WIDE)
def test_grouped_experts_keep_non_finite(two_ranks, fmt, value, how, dim):
    _check(two_ranks, f"grouped_{how}/{fmt}/{value}/Shard({dim})")


@pytest.mark.parametrize("how", ["update", "update_delayed_scaling"])
@pytest.mark.parametrize("value", VALUES)
def test_delayed_scaling_history_keeps_non_finite(two_ranks, value, how):
    _check(two_ranks, f"delayed_{how}/{value}")


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(2), reason="needs 2 CUDA devices + NCCL")
def test_delayed_scaling_history_keeps_non_finite_in_the_batched_device_update():
    """On CUDA with the extension, update_delayed_scaling reduces the histories in its batched path."""
    report = spawn(jobs.job_delayed, 2, "nccl")
    for key in report[0]:
        _check(report, key)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("fmt", TENSOR_WIDE)
def test_fsdp2_x_tensor_parallel_keeps_non_finite(dp2_tp2, fmt, value):
    _check(dp2_tp2, f"fsdp_tp/{fmt}/{value}")


def test_the_training_jobs_loss_read_keeps_a_non_finite_loss_of_another_rank():
    """train.py reads the window's losses in one SUM all-reduce: a NaN or inf held by the last rank only is what every
    rank reads (so every rank stops the job naming that step); +inf on one rank and -inf on another is NaN."""
    for world in (2, 4):
        report = spawn(jobs.job_loss_window, world, "gloo")
        mean = repr(sum(range(world)) / world)
        want = {"1": mean, "2": "nan", "3": "inf", "4": "nan"}
        for r, rep in enumerate(report):
            assert rep["read"] == want, f"world {world}, rank {r} read {rep['read']}, expected {want}"
