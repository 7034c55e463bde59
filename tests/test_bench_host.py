"""launch/bench_host.py runs on the CPU (its smoke test; the numbers that matter come from a GPU machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_host_reports_every_call_on_cpu(tmp_path):
    out = tmp_path / "host.json"
    prof = tmp_path / "prof.txt"
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "bench_host.py"), "--device", "cpu", "--dim", "32",
                        "--n", "3", "--rounds", "2", "--json", str(out), "--profile", str(prof)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_host failed:\n{r.stdout}\n{r.stderr}"
    rows = {row["call"]: row["us"] for row in json.loads(out.read_text())["rows"]}
    for call in ("nn.Linear fwd+bwd", "hybridq Linear fwd+bwd (fp8_tensorwise)"):
        assert rows.get(call, 0) > 0, f"no positive time for {call!r}: {rows}"
    assert "_LinearFunction" in prof.read_text(), "the profile does not show the Linear's autograd nodes"
