"""benchmarks/bench_post_hook.py runs on the CPU (its smoke test; timings are reported, never asserted): it times
both modes' forward and backward post-all-gather hooks, and its counters show what each mode ran -- the backward
unshards of the in-place mode derived in place, the other mode's never."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_post_hook_times_both_modes(tmp_path):
    out = tmp_path / "hook.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_post_hook.py"), "--dim", "32", "--layers", "2",
                        "--warmup", "1", "--steps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_post_hook.py failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    got = json.loads(out.read_text())
    calls = {k: v["calls"] for k, v in got["us_per_call"].items()}
    assert calls == {f"{p} {m}": 4 for p in ("forward", "backward") for m in ("in_place", "before")}, \
        f"calls timed per (phase, mode): {calls}, not 2 weights x 2 steps each"
    # 3 steps (1 warm-up) x 2 weights: the first backward unshard of each weight fills as usual, the next two replay
    assert got["counters"]["in_place"]["derived_in_place"] == 4, got["counters"]
    assert got["counters"]["before"]["derived_in_place"] == 0, got["counters"]
    for line in ("backward in_place", "backward before"):
        assert line in r.stdout, f"no {line!r} row printed:\n{r.stdout}"
