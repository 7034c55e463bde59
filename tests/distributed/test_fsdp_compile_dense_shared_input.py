"""Compiled blocks whose per-tensor FP8 Linears FSDP2 all-gathers quantized quantize each tensor the Linears read once
per step: q/k/v's input once, w1/w3's once ([Note: one dense input quantization in the graph],
hybridq/nn/float8_graph.py: `hybridq::linear_input_quantize`, merged by AOTAutograd's CSE), bit for bit the eager
model (losses, gradients, parameters after 2 AdamW steps). Calls that differ -- a frozen weight (no columnwise form
for wgrad) -- and graphs without backward quantize per Linear, bitwise too. (Before the input's quantization was an
op of its own each gathered forward quantized x inside: 7 casts per block where 4 tensors are read.)"""

from __future__ import annotations

import pytest

from _harness import job_several, nccl_devices, spawn
import _dense_shared_input_jobs as jobs
from _dense_shared_input_jobs import LAYERS, LINEARS, READ_TENSORS

pytestmark = pytest.mark.distributed

_JOB = jobs.shared_input_step
# name: (job kwargs, input casts per compiled step)
CASES = {
    "aot_eager": ({}, READ_TENSORS * LAYERS),
    "aot_eager, save_original_input": ({"save_original_input": True}, READ_TENSORS * LAYERS),
    "inductor": ({"compiler": "inductor", "act": "identity"}, READ_TENSORS * LAYERS),
    # wk takes no weight gradient: its input cast has no columnwise form, unlike wq's and wv's
    "aot_eager, frozen wk": ({"frozen": ("wk",)}, (READ_TENSORS + 1) * LAYERS),
    # no backward: the graph is not partitioned, each Linear quantizes its input in its forward op
    "aot_eager, no_grad": ({"no_grad": True}, LINEARS * LAYERS),
}


@pytest.fixture(scope="module")
def results() -> dict:
    return spawn(job_several, 1, "gloo", jobs={name: (_JOB, kw) for name, (kw, _) in CASES.items()})[0]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_quantizes_each_read_tensor_once_cpu(results, case):
    r, want = results[case], CASES[case][1]
    assert r["graph_breaks"] == 0, f"{case}: graph breaks {r['graph_breaks']}"
    assert r["casts"] and all(c == want for c in r["casts"]), \
        f"{case}: input casts per compiled step {r['casts']}, want {want} ({LAYERS} blocks)"


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_with_shared_input_casts_is_bitwise_eager_cpu(results, case):
    r = results[case]
    assert not r["diffs"], f"{case}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])


@pytest.mark.parametrize("case, want", [("aot_eager", READ_TENSORS), ("aot_eager, frozen wk", READ_TENSORS + 1),
                                        ("aot_eager, no_grad", 0)])
def test_forward_graph_holds_one_input_quantize_per_read_tensor_cpu(results, case, want):
    """Each block's forward graph (AOTAutograd's min-cut partitioner, its CSE run) holds the merged quantize ops."""
    nodes = results[case]["quantize_nodes"]
    assert nodes and all(n == want for n in nodes), \
        f"{case}: linear_input_quantize nodes per forward graph {nodes}, want {want}"


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device + NCCL")
def test_compiled_step_quantizes_each_read_tensor_once_gpu():
    """nccl, world size 1, Inductor: the extension's casts (`linear_input_quantize` on `hybridq::fp8_tensor_quantize`),
    `hybridq::fp8_linear_fprop` on the handed x parts, bitwise the eager model."""
    out = spawn(job_several, 1, "nccl", jobs={
        "inductor": (_JOB, {"compiler": "inductor", "act": "identity"}),
        "inductor, frozen wk": (_JOB, {"compiler": "inductor", "act": "identity", "frozen": ("wk",)})})[0]
    for name, want in (("inductor", READ_TENSORS * LAYERS), ("inductor, frozen wk", (READ_TENSORS + 1) * LAYERS)):
        r = out[name]
        assert not r["diffs"], f"{name}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])
        assert r["casts"] and all(c == want for c in r["casts"]), f"{name}: input casts {r['casts']}, want {want}"
