"""benchmarks/bench_memory.py and its saved-bytes counter (benchmarks/saved_bytes.py).

The counter: a block's saved bytes are those of the distinct storages autograd keeps for its backward,
parameters excluded, a quantized tensor counted part by part. The benchmark runs on the CPU with --smoke (its
numbers come from a GPU machine): one row per preset and mode, bf16 first, ratios to bf16 plain; recompute keeps
only each block's input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hybridq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from saved_bytes import SavedBytes  # noqa: E402

T, K, N = 64, 64, 32  # tokens, in, out


def _count(model: nn.Module, x: torch.Tensor) -> int:
    counter = SavedBytes(model)
    with counter.layer():
        y = model(x)
    y.sum().backward()
    return counter.per_layer[0]


def test_a_plain_linear_saves_its_input_and_its_weight_is_not_counted():
    layer = nn.Linear(K, N, bias=False)
    x = torch.randn(T, K, requires_grad=True)
    assert _count(layer, x) == T * K * 4, "fp32 input [64, 64]; the weight is a parameter"


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8", "nvfp4"])
def test_a_hybridq_linear_counts_the_columnwise_parts_of_its_input_and_weight(preset):
    """What backward reads: the input's columnwise part (wgrad) and the weight's columnwise part (dgrad)."""
    layer = hybridq.Linear(K, N, bias=False, recipe=hybridq.recipe(preset))
    x = torch.randn(T, K, requires_grad=True)
    want = (layer.input_quantizer.quantize(x.detach(), rowwise=False, columnwise=True).part("columnwise").nbytes()
            + layer.weight_quantizer.quantize(layer.weight.detach(), rowwise=False, columnwise=True)
            .part("columnwise").nbytes())
    assert _count(layer, x) == want, f"{preset}: counted bytes != input + weight columnwise parts ({want})"


class _SaveQuantized(torch.autograd.Function):
    """Code outside hybridq that saves a QuantizedTensor object itself (not its parts)."""

    @staticmethod
    def forward(ctx, x, q):
        ctx.save_for_backward(q)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.saved_tensors
        return dy, None


def test_a_quantized_tensor_saved_as_one_object_is_counted_part_by_part():
    q = hybridq.recipe("mxfp8").quantizer(hybridq.Role("linear", "input")).quantize(
        torch.randn(T, K), rowwise=True, columnwise=True)
    counter = SavedBytes(nn.Module())
    x = torch.randn(4, requires_grad=True)
    with counter.layer():
        y = _SaveQuantized.apply(x, q)
    y.sum().backward()
    want = q.part("rowwise").nbytes() + q.part("columnwise").nbytes()
    assert counter.per_layer == [want], f"counted {counter.per_layer}, the two parts hold {want} bytes"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_memory") / "memory.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--smoke", "--device", "cpu",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_memory failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in r.stdout.splitlines()
             if line.startswith("|")]
    return table, json.loads(out.read_text())["rows"]


def test_bench_memory_smoke_prints_every_preset_in_every_mode_bf16_first(smoke):
    table, rows = smoke
    assert table[0][:3] == ["preset", "mode", "saved bytes/layer"] and table[0][-1] == "step ms", table[0]
    want = [(p, m) for p in ["bf16", *hybridq.preset_names()] for m in ("plain", "offload", "recompute")]
    assert [(r[0], r[1]) for r in table[2:]] == want, table
    assert table[2][3] == "1.000", f"bf16 plain is the reference: {table[2]}"
    assert [(r["preset"], r["mode"]) for r in rows] == want, "the JSON rows follow the table"
    assert all(r["ms"] > 0 for r in rows), rows


def test_recompute_keeps_only_each_blocks_input(smoke):
    _, rows = smoke
    block_input = 2 * 64 * 64 * 2  # batch x seq x d_model, bf16
    for r in rows:
        if r["mode"] == "recompute":
            assert r["saved_bytes_per_layer"] == block_input, r


def test_on_the_cpu_offload_moves_nothing(smoke):
    """hybridq.CPUOffload keeps tensors that are already in CPU memory (docs/offload-recompute-checkpoints.md: a
    no-op move on the CPU)."""
    _, rows = smoke
    assert all(r["offloaded_bytes_per_layer"] == 0 for r in rows if r["mode"] == "offload"), rows


def test_nvfp4_saves_less_than_bf16(smoke):
    """4-bit columnwise inputs where bf16 keeps 16-bit ones: less even at smoke sizes, weight copies included."""
    _, rows = smoke
    by = {(r["preset"], r["mode"]): r["saved_bytes_per_layer"] for r in rows}
    assert by[("nvfp4", "plain")] < by[("bf16", "plain")], by
