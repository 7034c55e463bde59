"""benchmarks/multi_gpu_runs.sh (issue 18's runs, for machines lent only at times) checked on the CPU, so that device
time is not spent on a typo: stage names, the refusal without GPUs, and the flags of every e2e_report.py /
profile_step.py command it runs (parsed by the scripts' own parsers, e2e_report's train.py commands by train.py's)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "multi_gpu_runs.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_report  # noqa: E402
import profile_step  # noqa: E402


def _commands(prefix: str) -> list[list[str]]:
    """The script's commands that start with `prefix` (a shell variable), continuation lines joined, $N = 8."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#") or prefix not in line:
            continue
        cmd = line.split(prefix, 1)[1].split(">", 1)[0].replace('"$N"', "8").replace('"$d"', "out")
        cmd = re.sub(r"\$\{?\w+\}?", "x", cmd)
        out.append(shlex.split(cmd))
    return out


def _run(*stages: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=os.devnull)
    return subprocess.run(["bash", str(SCRIPT), *stages], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_unknown_stage_is_refused_naming_the_stages():
    p = _run("nccl", "nope")
    assert p.returncode == 2 and "unknown stage 'nope'" in p.stderr and "scaling" in p.stderr, p.stderr


def test_without_two_gpus_it_stops_before_running_anything():
    p = _run("scaling")
    assert p.returncode == 2 and "needs >= 2 CUDA devices" in p.stderr, p.stdout + p.stderr


def test_every_e2e_report_command_parses_and_plans_train_commands_that_parse(tmp_path):
    cmds = _commands("$E2E")
    assert len(cmds) == 4, cmds  # e2e, compiled, scaling, 7b
    for args in cmds:
        a = e2e_report.parse_args(args)
        rows = e2e_report.schedule(a, nproc=8, gpus=8)
        assert rows and not any(r["skip"] and "GPUs" in r["skip"] for r in rows), (args, rows)
        for r in rows:
            if r["skip"] is None:
                e2e_report.parse_args_for_train(e2e_report.command(a, r["recipe"], r["nproc"], tmp_path, r["compiled"]))


def test_every_profile_step_command_parses():
    cmds = [c[c.index("benchmarks/profile_step.py") + 1:] for c in _commands("$TORCHRUN") if "benchmarks/profile_step.py" in c]
    assert len(cmds) == 1, cmds
    for args in cmds:
        a = profile_step.parse_args(args)
        assert a.recipe_list == ["bf16", "fp8_tensorwise"], a.recipe_list
