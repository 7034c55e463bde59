"""benchmarks/fsdp_unshard_cost.py: its timers keep each call's own time apart from the timed calls inside it and leave
every patched attribute as it was; the CPU smoke run (gloo, world 1) counts one pre- and one post-all-gather hook call
per hybridq weight per unshard and none for bf16 (times are never compared to a bound)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fsdp_unshard_cost as fuc  # noqa: E402


def test_a_timed_call_inside_another_is_not_counted_twice():
    t = fuc.Timers()
    inner = t.wrap("inner", lambda: time.sleep(0.02))
    outer = t.wrap("outer", lambda: inner())
    outer()
    assert t.calls == {"inner": 1, "outer": 1}
    assert t.own["inner"] >= 0.02, f"inner's own time {t.own['inner']:.4f}s is less than its sleep"
    assert t.own["outer"] < t.own["inner"], (f"outer's own time {t.own['outer']:.4f}s holds inner's "
                                             f"{t.own['inner']:.4f}s")


def test_patching_restores_every_attribute():
    before = [(owner, attr, vars(owner)[attr]) for _, owner, attr, _ in fuc._rows()]
    with fuc.patched(fuc.Timers()):
        unpatched = [attr for owner, attr, orig in before if vars(owner)[attr] is orig]
        assert not unpatched, f"not patched: {unpatched}"
    left = [attr for owner, attr, orig in before if vars(owner)[attr] is not orig]
    assert not left, f"not restored: {left}"


def test_cpu_smoke_counts_the_hooks_per_weight_and_unshard():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_unshard_cost.py"), "--device", "cpu",
                        "--recipes", "bf16,fp8_tensorwise", "--d-model", "64", "--hidden", "128", "--n-layers", "1",
                        "--seq", "32", "--batch", "1", "--warmup", "1", "--steps", "1"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    head = next(line for line in r.stdout.splitlines() if line.startswith("fsdp_unshard_cost.py:"))
    weights = int(head.split("fp8_tensorwise: ")[1].split(" hybridq weights")[0])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in r.stdout.splitlines()
            if line.startswith("| hybridq")}
    for label in ("hybridq pre-all-gather hook", "hybridq post-all-gather hook"):
        bf16, fp8 = rows[label][0], rows[label][1]
        assert "(0)" in bf16, f"{label}: bf16 calls its hooks: {bf16}"
        # one unshard in forward, one in backward (resharded after forward)
        assert f"({2 * weights})" in fp8, f"{label}: expected {2 * weights} calls per step, got {fp8}"
