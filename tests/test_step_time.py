"""benchmarks/step_time.py: every recipe timed in a process of its own (no profiler, nothing else run before it), and
the table of wall / host medians with the ratio to bf16."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

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
