"""torch.distributed.checkpoint from a plain user script on a hybridq model under FSDP2 + tensor parallelism
(hybridq's TP styles over "tp" of a 2-D mesh, fully_shard over "dp"), with its AdamW optimizer and torch's
standard helpers (get_state_dict / set_state_dict + dcp.save / dcp.load), on gloo (see _dcp_tp_jobs.py).

Saved at dp2 x tp2; loaded at the same layout (fresh model: state, forward and the next steps' losses bitwise),
at dp1 x tp2 and dp2 x tp1 (state bitwise; forward bitwise at the same tp, else within FORWARD_RTOL; losses
within LOSS_RTOL: only the summation order of row-parallel partial products and of gradient reductions
changes), and into a plain
single-process PyTorch model (weights bitwise; converted with the same recipe it trains on within the same
tolerances).
"""

from __future__ import annotations

import pytest

from _harness import spawn
import _dcp_tp_jobs

pytestmark = pytest.mark.distributed

SAVED = (2, 2)
FORWARD_RTOL = 1e-5  # of the largest output magnitude
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp_tp"))


@pytest.fixture(scope="module")
def same_layout(folder):
    dp, tp = SAVED
    return spawn(_dcp_tp_jobs.job_save, dp * tp, "gloo", folder=folder, dp=dp, tp=tp)


def _check_resumed(out: list[dict], where: str, *, forward_bitwise: bool, losses_bitwise: bool) -> None:
    for rank, r in enumerate(out):
        assert not r["diffs"], f"{where}, rank {rank}:\n" + "\n".join(r["diffs"])
        if forward_bitwise:
            assert r["forward_err"] == 0.0, f"{where}: forward differs from the saved model's ({r['forward_err']:.2e})"
        else:
            assert r["forward_err"] <= FORWARD_RTOL, f"{where}: forward rel. diff {r['forward_err']:.2e}"
        if losses_bitwise:
            assert r["losses"] == r["saved_losses"], f"{where}: losses {r['losses']} != saved run's {r['saved_losses']}"
        for got, want in zip(r["losses"], r["saved_losses"]):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"{where}: losses {r['losses']} vs {r['saved_losses']}"


def test_loaded_at_the_same_layout_continues_bit_for_bit(same_layout):
    _check_resumed(same_layout, f"saved and loaded at dp{SAVED[0]} x tp{SAVED[1]}", forward_bitwise=True,
                   losses_bitwise=True)


@pytest.mark.parametrize("layout", [(1, 2), (2, 1)], ids=lambda l: f"dp{l[0]}xtp{l[1]}")
def test_loaded_at_another_layout_has_the_saved_state_and_trains_on(same_layout, folder, layout):
    """The same tp: the forward is computed exactly as the saved model's (bitwise); another tp sums the
    row-parallel products in another order. The losses after a step sum gradients in another order."""
    out = spawn(_dcp_tp_jobs.job_load, layout[0] * layout[1], "gloo", folder=folder, dp=layout[0], tp=layout[1])
    _check_resumed(out, f"saved at dp{SAVED[0]} x tp{SAVED[1]}, loaded at dp{layout[0]} x tp{layout[1]}",
                   forward_bitwise=layout[1] == SAVED[1], losses_bitwise=False)


def test_loaded_into_a_plain_single_process_model(same_layout, folder):
    out = _dcp_tp_jobs.plain_resume(folder)
    _check_resumed([out], f"saved at dp{SAVED[0]} x tp{SAVED[1]}, loaded into a plain model",
                   forward_bitwise=False, losses_bitwise=False)
