"""Sharding-dependent rules of a weight's formats are checked when FSDP2's shard layout is first known (the first
unshard, in forward), for every direction any unshard will gather -- not at the first backward that gathers the
offending direction. Only directions that are actually gathered are checked."""

from __future__ import annotations

import pytest

from _harness import spawn
import _jobs

pytestmark = pytest.mark.distributed

CASES = [(fmt, None) for fmt in _jobs.LAYOUT_FORMATS] + [("nvfp4_rht", "dequantized")]


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return spawn(_jobs.job_layout_errors, 2, "gloo", cases=CASES)


@pytest.mark.parametrize("fmt", list(_jobs.LAYOUT_FORMATS))
def test_unaligned_hadamard_shard_rejected_at_first_unshard(outcomes, fmt):
    for rank, out in enumerate(outcomes):
        r = out[f"{fmt}/None"]
        assert r["raised_in"] == "forward", (
            f"rank {rank}, {fmt}: a shard boundary at row 24 breaks the Hadamard transform's 16-row rule of the "
            f"columnwise form backward gathers; expected the error at the forward's first unshard, got "
            f"{r['raised_in']!r} ({r['message'] or 'no error'})")
        assert r["params_unchanged"], f"rank {rank}, {fmt}: parameters changed before the error"


@pytest.mark.parametrize("fmt", list(_jobs.LAYOUT_FORMATS))
def test_layout_error_names_weight_format_rule_and_boundary(outcomes, fmt):
    msg = outcomes[0][f"{fmt}/None"]["message"]
    for needed in ("0.weight", "RHT", "columnwise", "multiple of 16", "boundaries at rows 24"):
        assert needed in msg, f"{fmt}: {needed!r} missing from the error: {msg}"
    assert outcomes[1][f"{fmt}/None"]["message"] == msg, "every rank must raise the same error"


def test_direction_never_gathered_is_not_checked(outcomes):
    """backward_override='dequantized': backward reads the rowwise form, so the columnwise rule does not apply."""
    for rank, out in enumerate(outcomes):
        r = out["nvfp4_rht/dequantized"]
        assert r["raised_in"] == "none", f"rank {rank}: unexpected error: {r['message']}"
        assert not r["params_unchanged"], f"rank {rank}: the optimizer step did not run"


@pytest.mark.parametrize("override, columnwise_gathered", [(None, True), ("dequantized", False),
                                                           ("high_precision", False)])
def test_checked_directions_follow_the_plans(override, columnwise_gathered):
    """The directions checked are those some plan sends: the columnwise form only when backward reads it."""
    from hybridq import NVFP4Quantizer
    from hybridq.distributed.checks import gathered_directions

    dirs = gathered_directions(NVFP4Quantizer(rht=True), _jobs.LAYOUT_SHAPE, override, derivable=False)
    assert ("columnwise" in dirs) == columnwise_gathered, (override, dirs)
    assert "rowwise" in dirs, (override, dirs)


@pytest.mark.parametrize("rows, world_size, boundaries", [(64, 2, None), (64, 3, "22, 44"), (48, 2, "24"),
                                                         (48, 1, None)])
def test_layout_check_on_every_rank_shard(rows, world_size, boundaries):
    """check_shard_layout needs no data and no collective (every rank's shard is quantized on the meta device):
    NVFP4 RHT accepts shard boundaries on multiples of 16 rows and rejects any other, naming them."""
    import torch

    from hybridq import NVFP4Quantizer
    from hybridq.distributed.checks import check_shard_layout

    args = (NVFP4Quantizer(rht=True), "layer.weight", (rows, 64), world_size, torch.bfloat16, None, False)
    if boundaries is None:
        check_shard_layout(*args)
    else:
        with pytest.raises(ValueError, match=rf"layer\.weight .*boundaries at rows {boundaries}\)"):
            check_shard_layout(*args)


def test_a_layout_that_passed_is_not_quantized_again_and_a_failing_one_always_raises(monkeypatch):
    """check_shard_layout remembers layouts hybridq's quantizers passed (their repr is their whole configuration):
    a second weight of that layout quantizes nothing; a rejected layout raises every time; a quantizer of another
    class (a user's subclass) is checked every time."""
    import torch

    import hybridq.distributed.checks as checks
    from hybridq import NVFP4Quantizer

    calls = []
    real = checks.quantize_shard
    monkeypatch.setattr(checks, "quantize_shard", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(checks, "_PASSED", set())
    args = ("layer.weight", (64, 64), 2, torch.bfloat16, None, False)
    checks.check_shard_layout(NVFP4Quantizer(rht=True), *args)
    first = len(calls)
    checks.check_shard_layout(NVFP4Quantizer(rht=True), *args)
    assert first > 0 and len(calls) == first, f"the passed layout was quantized again ({first} then {len(calls)})"
    for _ in range(2):
        with pytest.raises(ValueError, match=r"boundaries at rows 22, 44"):
            checks.check_shard_layout(NVFP4Quantizer(rht=True), "layer.weight", (64, 64), 3, torch.bfloat16, None,
                                      False)

    class UserQuantizer(NVFP4Quantizer):  # (not hybridq's: its state may not show in the repr)
        pass

    before = len(calls)
    checks.check_shard_layout(UserQuantizer(rht=True), *args)
    checks.check_shard_layout(UserQuantizer(rht=True), *args)
    assert len(calls) == before + 2 * first, "a user's quantizer was not checked every time"
