"""benchmarks/step_time.py: every recipe timed in a process of its own (no profiler, nothing else run before it), and
the table of wall / host medians with the ratio to bf16."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_each_recipe_runs_in_a_fresh_process_and_is_tabled_against_bf16():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    cmd = [sys.executable, "benchmarks/step_time.py", "--smoke", "--device", "cpu", "--recipes", "bf16,fp8_tensorwise"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    pids = re.findall(r"^\[(\S+)\] 3 steps in a fresh process \(pid (\d+)\)", p.stdout, re.M)
    assert [r for r, _ in pids] == ["bf16", "fp8_tensorwise"], f"recipes timed: {pids}\n{p.stdout}"
    assert len({pid for _, pid in pids}) == 2, f"each recipe must run in a process of its own: pids {pids}"
    rows = {l.split("|")[1].strip(): l for l in p.stdout.splitlines() if l.startswith("| ") and "recipe" not in l}
    assert set(rows) == {"bf16", "fp8_tensorwise"}, p.stdout
    assert rows["bf16"].rstrip().endswith("| 1.00x |"), rows["bf16"]
    assert re.search(r"\| \d+\.\d\dx \|$", rows["fp8_tensorwise"].rstrip()), rows["fp8_tensorwise"]


def test_a_failing_recipe_fails_the_run_with_its_output():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "benchmarks/step_time.py", "--smoke", "--device", "cpu", "--recipes", "bf16",
           "--train-args=--no-such-flag"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "bf16 failed" in p.stderr and "no-such-flag" in p.stderr, p.stdout + p.stderr


def _step_time():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_time
    finally:
        sys.path.pop(0)
    return step_time


def test_rounds_rotate_the_order_so_no_recipe_always_runs_first():
    st = _step_time()
    orders = [st.round_order(["bf16", "a", "b"], r) for r in range(3)]
    assert [o[0] for o in orders] == ["bf16", "a", "b"], f"first recipe per round: {orders}"
    assert all(sorted(o) == ["a", "b", "bf16"] for o in orders), orders


def test_rounds_table_takes_each_ratio_within_its_round():
    st = _step_time()
    res = lambda name, wall, host: {"recipe": name, "median_ms": wall, "host_median_ms": host}
    rounds = [[res("bf16", 100.0, 50.0), res("fp8_tensorwise", 80.0, 40.0)],     # 1.25x
              [res("bf16", 120.0, 60.0), res("fp8_tensorwise", 80.0, 70.0)],     # 1.50x
              [res("bf16", 90.0, 55.0), res("fp8_tensorwise", 100.0, 45.0)]]     # 0.90x
    rows = {l.split("|")[1].strip(): l for l in st.rounds_table(rounds).splitlines()[2:]}
    assert "| 80.0 / 80.0 / 100.0 | 80.0 | 45.0 | 1.25x (0.90-1.50) |" in rows["fp8_tensorwise"], rows
    assert "| 100.0 / 120.0 / 90.0 | 100.0 | 55.0 | 1.00x (1.00-1.00) |" in rows["bf16"], rows


def test_rounds_must_be_positive():
    st = _step_time()
    assert st._pop_rounds(["--rounds", "3", "--smoke"]) == (3, ["--smoke"])
    assert st._pop_rounds(["--rounds=2"]) == (2, [])
    with pytest.raises(SystemExit, match="--rounds must be >= 1, got 0"):
        st._pop_rounds(["--rounds", "0"])
