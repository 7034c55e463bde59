"""benchmarks/bench_tp.py runs on the CPU with --smoke under torchrun (2 and 4 gloo processes; its numbers come from GPU
machines): one row per mode (bf16 first, then every preset but delayed scaling), ratios to bf16, and each row's
sequence-parallel gather bytes equal the accounting function's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hybridq

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_bench_tp_smoke_prints_every_mode_with_its_gather_bytes(tmp_path, tp):
    """At TP=4 too: the smoke sizes grow with the world so that every preset's blocks split (1x128 FP8 blocks at
    TP=4 failed at the fixed 2-rank sizes)."""
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
                        str(ROOT / "benchmarks" / "bench_tp.py"), "--smoke", "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_tp failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in r.stdout.splitlines()
             if line.startswith("|")]
    modes = ["bf16", *(n for n in hybridq.preset_names() if n != "fp8_delayed")]
    assert [row[0] for row in table[2:]] == modes, table
    assert table[2][2] == "1.00x" and table[2][4] == "1.000", table[2]
    rows = {x["mode"]: x for x in json.loads(out.read_text())["rows"]}
    from hybridq import Role
    from hybridq.distributed import sequence_gather_bytes

    for mode in modes[1:]:
        q = hybridq.recipe(mode).quantizer(Role("linear", "input"))
        want = 2 * sequence_gather_bytes(q, (1, 32 * tp, 128 * tp), 1, tp).total  # attention and MLP inputs
        assert rows[mode]["gather_bytes"] == want, (mode, rows[mode], want)
