"""benchmarks/bench_host.py runs on the CPU (its smoke test; the numbers that matter come from a GPU machine): the table a
user reads has its header and one row per call of the CPU ladder, in order, and the JSON holds the same rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEADER = ["call", "host us per call (median round)", "min-max over rounds"]
CPU_ROWS = [  # every row a CPU run prints (the CUDA rows come after them on a GPU)
    "torch.empty_like (allocator)",
    "x.abs() (one torch kernel)",
    "nn.Linear forward (bf16 mm)",
    "nn.Linear fwd+bwd",
    "hybridq Linear fwd+bwd (fp8_tensorwise)",
    "hybridq Linear fwd+bwd (fp8_tensorwise, general path)",
    "hybridq Linear fwd+bwd (fp8_tensorwise, fast-path checks uncached)",
    "hybridq Linear fwd+bwd (fp8_tensorwise, sharing on, fresh input)",
    "hybridq Linear fwd+bwd (fp8_tensorwise, sharing on, fresh input, QuantizedTensor shared)",
    "hybridq Linear fwd+bwd (fp8_delayed)",
    "hybridq Linear fwd+bwd (fp8_delayed, general path)",
    "hybridq Linear fwd+bwd (fp8_block)",
    "hybridq Linear fwd+bwd (fp8_block, general path)",
    "hybridq Linear forward only (grad on)",
    "hybridq Linear fwd+bwd, weight cached (is_first_microbatch=False)",
    "hybridq Linear fwd+bwd, weight cached (is_first_microbatch=False, general path)",
    "FSDP2 nn.Linear fwd+bwd (bf16)",
    "FSDP2 hybridq Linear fwd+bwd (fp8_tensorwise, gathered weight)",
    "FSDP2 hybridq Linear fwd+bwd (fp8_tensorwise, gathered weight, general path)",
    "FSDP2 hybridq Linear fwd+bwd (fp8_block, gathered weight)",
    "compiled gathered op forward (fp8_tensorwise, x parts handed)",
    "compiled gathered op forward (fp8_tensorwise, x parts handed, every call decided anew)",
    "compiled gathered op backward (fp8_tensorwise)",
    "compiled gathered op backward (fp8_tensorwise, every call decided anew)",
    "compiled gathered op forward (fp8_block, x quantized inside)",
    "compiled gathered op forward (fp8_block, x quantized inside, every call decided anew)",
    "compiled gathered op backward (fp8_block)",
    "compiled gathered op backward (fp8_block, every call decided anew)",
    "Float8Quantizer.quantize_parts (rowwise+columnwise)",
    "Function(empty) fwd+bwd",
    "Function(Float8Quantizer.quantize in forward)",
    "Function(Float8Quantizer.quantize in backward)",
]


def test_bench_host_prints_the_table_of_every_call_on_cpu(tmp_path):
    out = tmp_path / "host.json"
    prof = tmp_path / "prof.txt"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--device", "cpu", "--dim", "32",
                        "--n", "3", "--rounds", "2", "--json", str(out), "--profile", str(prof), "--profile-steps", "5"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_host failed:\n{r.stdout}\n{r.stderr}"
    table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in r.stdout.splitlines()
             if line.startswith("|")]
    assert table[0] == HEADER, f"table header {table[0]}, expected {HEADER}"
    body = table[2:]
    assert [row[0] for row in body] == CPU_ROWS, f"rows {[row[0] for row in body]}"
    for call, median, span in body:
        lo, hi = map(float, span.split("-"))
        assert 0 < lo <= float(median) <= hi, f"{call}: median {median} outside its rounds' range {span}"
    rows = json.loads(out.read_text())["rows"]
    assert [(x["call"], f"{x['us']:.1f}", len(x["rounds_us"])) for x in rows] == \
        [(call, median, 2) for call, median, _ in body], "the JSON rows are the printed rows, 2 rounds each"
    text = prof.read_text()
    assert "_Float8GraphLinear" in text, "the profile does not show the Linear's autograd nodes (its eager fast path)"
    assert all(f"==== hybridq Linear fwd+bwd ({r}): cProfile" in text for r in ("fp8_tensorwise", "fp8_block")), \
        "the profile lacks the fp8_tensorwise or the fp8_block step"
