"""launch/e2e_report.py on CPU: the log parser and budget rows in-process, the torchao_float8 error path of
launch/train.py, and one tiny end-to-end report (2 gloo processes, bf16 + fp8_tensorwise launched; fp8_delayed
skipped as apply_hybrid_fsdp rejects it; torchao_float8 a "not installed" row where torchao does not import)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import e2e_report  # noqa: E402
import train  # noqa: E402


def _torchao_missing() -> bool:
    return e2e_report.torchao_status() is not None


def test_parse_log_reads_train_step_lines():
    text = ("noise\n"
            "[nvfp4] step  1/30 | loss 5.5312 | lr 2.00e-04 |    12,345 tok/s | step  2654.0 ms | peak GPU mem 40.12 GiB\n"
            "[bf16] step  1/30 | loss 9.0 | lr 2.00e-04 |    1 tok/s | step  1.0 ms | peak GPU mem 1.00 GiB\n"
            "[nvfp4] step  2/30 | loss 5.0000 | lr 4.00e-04 |    30,000 tok/s | step  1092.3 ms | peak GPU mem 41.50 GiB\n"
            "[nvfp4] step 3/30 | loss 4.5000 | lr 6.00e-04 | 31,000 tok/s | step 1057.0 ms | peak RSS 432 MiB\n")
    steps = e2e_report.parse_log(text, "nvfp4")
    assert [s["n"] for s in steps] == [1, 2, 3]
    assert [s["loss"] for s in steps] == [5.5312, 5.0, 4.5]
    assert steps[1]["tps"] == 30000 and steps[1]["mem_bytes"] == 41.5 * 2**30
    assert steps[2]["mem_kind"] == "peak RSS" and steps[2]["mem_bytes"] == 432 * 2**20


def test_gap_is_taken_over_the_steps_both_runs_did():
    ref = {"recipe": "bf16", "losses": [5.0] * 20 + [3.0] * 10, "tokens_per_s": 100.0, "status": "ok"}
    cut = {"recipe": "nvfp4", "losses": [5.5] * 20, "tokens_per_s": 40.0, "status": "time limit"}
    rows = {r["recipe"]: r for r in e2e_report.rows_for([ref, cut, {"recipe": "fp8_delayed", "skip": "why"}])}
    assert rows["nvfp4"]["gap_at"] == 20 and rows["nvfp4"]["gap"] == pytest.approx(0.5)
    assert rows["nvfp4"]["speed_vs_bf16"] == pytest.approx(0.4)
    assert rows["bf16"]["loss"] == pytest.approx(3.0) and "gap" not in rows["bf16"]


def test_plan_skips_fp8_delayed_and_puts_bf16_first():
    a = e2e_report.parse_args(["--tiny", "--recipes", "fp8_delayed,fp8_tensorwise,torchao_float8"])
    todo = {t["recipe"]: t["skip"] for t in e2e_report.plan(a)}
    assert list(todo)[0] == "bf16"
    assert "apply_hybrid_fsdp" in todo["fp8_delayed"] and "delayed scaling" in todo["fp8_delayed"]
    assert todo["fp8_tensorwise"] is None
    assert (todo["torchao_float8"] is not None) == _torchao_missing()
    with pytest.raises(SystemExit, match="unknown recipe"):
        e2e_report.plan(e2e_report.parse_args(["--recipes", "nope"]))


@pytest.mark.skipif(not _torchao_missing(), reason="torchao is installed: the error path does not apply")
def test_train_torchao_recipe_without_torchao_is_a_clear_error():
    args = train.parse_args(["--recipe", "torchao_float8", "--device", "cpu"])
    with pytest.raises(SystemExit, match="needs torchao"):
        train.check_args(args, world=2)


@pytest.mark.distributed
def test_tiny_report_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "launch" / "e2e_report.py"), "--device", "cpu", "--tiny", "--nproc", "2",
           "--recipes", "bf16,fp8_tensorwise,fp8_delayed,torchao_float8", "--out-dir", str(tmp_path)]
    if not _torchao_missing():  # torchao float8 needs a GPU: keep the CPU test to the two hybridq runs
        cmd[cmd.index("bf16,fp8_tensorwise,fp8_delayed,torchao_float8")] = "bf16,fp8_tensorwise,fp8_delayed"
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "report.md").read_text()
    rows = {r["recipe"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    for name in ("bf16", "fp8_tensorwise"):
        r = rows[name]
        assert r["status"] == "ok" and r["steps_done"] == 4 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert f"train.py --recipe {name} " in r["command"] and f"| {name} | ok | 4 |" in md
        assert (tmp_path / f"{name}.json").exists()
    assert abs(rows["fp8_tensorwise"]["gap"]) < 0.2 and rows["fp8_tensorwise"]["gap_at"] == 4
    assert rows["fp8_delayed"]["skip"] and "| fp8_delayed | skipped: rejected by hybridq.apply_hybrid_fsdp" in md
    if _torchao_missing():
        assert "| torchao_float8 | skipped: torchao not installed" in md
