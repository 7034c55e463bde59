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
    per_process = re.findall(r"^\[\S+\] 3 steps in a fresh process .*per step: process CPU \d+\.\d ms, "
                             r"\d+\.\d involuntary switches", p.stdout, re.M)
    assert len(per_process) == 2, f"each process's line must say what its host did per step:\n{p.stdout}"
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


def _profile_step():
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "launch")]
    try:
        import profile_step
    finally:
        del sys.path[:2]
    return profile_step


def test_process_summary_is_per_step_and_takes_the_stolen_share_of_the_machine_ticks():
    ps = _profile_step()
    host = {"before": {"cpu_s": 1.0, "involuntary_switches": 10, "minor_faults": 100, "ticks": 1000, "steal_ticks": 50},
            "after": {"cpu_s": 3.0, "involuntary_switches": 30, "minor_faults": 600, "ticks": 3000, "steal_ticks": 250}}
    alloc = {"before": {"num_device_alloc": 5, "num_device_free": 1, "num_alloc_retries": 0},
             "after": {"num_device_alloc": 9, "num_device_free": 4, "num_alloc_retries": 2}}
    got = ps.process_summary(host, alloc, steps=10, wall_s=2.5)
    want = {"process_cpu_ms": 200.0, "involuntary_switches": 2.0, "minor_faults": 50.0, "wall_s": 2.5, "steal_pct": 10.0,
            "cuda_mallocs": 4, "cuda_frees": 3, "alloc_retries": 2}
    assert got == pytest.approx(want), f"process summary {got}, expected {want}"
    text = ps.process_text(got)
    assert ("process CPU 200.0 ms" in text and "50 minor page faults" in text and "stolen 10.0%" in text
            and "cudaFree 3" in text), text


def test_process_summary_leaves_out_what_the_machine_does_not_report():
    ps = _profile_step()
    host = {"before": {"cpu_s": 0.0, "involuntary_switches": 0}, "after": {"cpu_s": 0.5, "involuntary_switches": 5}}
    got = ps.process_summary(host, {"before": {}, "after": {}}, steps=5, wall_s=1.0)
    assert set(got) == {"process_cpu_ms", "involuntary_switches", "wall_s"}, f"keys {sorted(got)}"
    assert "stolen" not in ps.process_text(got) and "cudaMalloc" not in ps.process_text(got)
