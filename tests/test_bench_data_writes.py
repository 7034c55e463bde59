"""benchmarks/bench_data_writes.py runs on the CPU (its smoke test; timings are reported, never asserted): it times the
data-write check's parts on a weight shard and, per preset, an activation's fingerprint beside its input
quantization ([Note: data-write check], hybridq/data_writes.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_data_writes_times_every_part_of_the_check(tmp_path):
    out = tmp_path / "data_writes.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_data_writes.py"), "--calls", "5", "--rounds",
                        "1", "--tokens", "32", "--dim", "64", "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_data_writes.py failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    got = json.loads(out.read_text())
    host = got["host_us_per_call"]
    assert {"bits_sum", "check, world > 1 (queued)"} <= set(host) and any(k.startswith("check, one rank") for k in host), \
        f"host rows timed: {sorted(host)}"
    device = got["device_us_per_call"]
    assert "fingerprint of x" in device and any("fp8_tensorwise" in k for k in device) and \
        any("mxfp8" in k for k in device), f"device rows timed: {sorted(device)}"
    assert all(v > 0 for v in (*host.values(), *device.values())), f"a row timed nothing: {got}"
