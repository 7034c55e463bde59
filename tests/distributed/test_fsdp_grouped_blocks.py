"""A GroupedLinear whose `[E, out, in]` weight FSDP2 gathers quantized in a block format (FP8 1x128 / 128x128,
MXFP8, their hybrid) takes the packed block path (host counts) or the device-count path, reading the gathered experts'
parts (rowwise in forward, columnwise in backward) instead of running one GEMM per expert (issue 30: the MoE job's
fp8_block step was host-bound on ~590 expert GEMM calls).

Oracle (bitwise): the per-expert path (`packed_path = False`) on the same gathered weight -- output, input gradient and
this rank's shard of the weight gradient -- on one and two ranks (gloo, CPU), uneven routing with an expert without
tokens on every rank, and a NaN weight and an inf input propagating as they do there."""

from __future__ import annotations

import pytest

from _harness import nccl_devices, spawn
import _gathered_block_jobs as jobs

pytestmark = pytest.mark.distributed

PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]
COUNTS = ["host", "device"]
CASES = [dict(preset=p, counts=c) for p in PRESETS for c in COUNTS] + [
    dict(preset=p, counts="host", nonfinite=True) for p in PRESETS] + [
    dict(preset=p, counts=c, out=96) for p in PRESETS for c in COUNTS]  # (weight tiles that would span experts)
# the packed run's autograd node: the path it took (the per-expert path's output is a cat of the experts' outputs)
NODES = {"host": "PackedBlockExpertsBackward", "device": "DeviceBlockExpertsBackward"}
IDS = [f"{c['preset']}-{c['counts']}{'-nonfinite' if c.get('nonfinite') else ''}-out{c.get('out', jobs.OUT)}"
       for c in CASES]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request):  # (one spawn per world size for every case: process start-up dominates on the CPU)
    return request.param, spawn(jobs.job_gathered_blocks, request.param, "gloo", cases=CASES)


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_gathered_block_experts_take_the_packed_path(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        got = res[i]["node"]
        want = NODES[CASES[i]["counts"]]
        assert got == want, f"world {ws} rank {rank} {IDS[i]}: the gathered weight ran {got}, expected {want}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_gathered_block_experts_are_bitwise_the_per_expert_path(runs, i):
    ws, results = runs
    for rank, res in enumerate(results):
        assert not res[i]["diffs"], f"world {ws} rank {rank}:\n" + "\n".join(res[i]["diffs"])


# (the cases whose weight outsizes every activation form: an FP8 tensor of its size saved is a copy of it)
BIG_WEIGHT = [i for i, c in enumerate(CASES) if "out" not in c]


@pytest.mark.parametrize("i", BIG_WEIGHT, ids=[IDS[i] for i in BIG_WEIGHT])
def test_gathered_block_experts_are_not_copied_for_backward(runs, i):
    """Forward reads the gathered rowwise parts and saves no weight-sized FP8 copy: dgrad reads the columnwise parts
    the backward unshard fills."""
    ws, results = runs
    for rank, res in enumerate(results):
        assert not res[i]["saved_fp8"], f"world {ws} rank {rank} {IDS[i]}: saved for backward {res[i]['saved_fp8']}"


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c.get("nonfinite")],
                         ids=[IDS[i] for i, c in enumerate(CASES) if c.get("nonfinite")])
def test_nonfinite_values_reach_output_and_gradients(runs, i):
    """A NaN weight element and an inf input element: the output and input gradient hold non-finite values on every
    rank, the weight gradient on the rank whose shard holds the expert of the inf token (and, by the bitwise test,
    exactly where the per-expert path puts them)."""
    ws, results = runs
    for rank, res in enumerate(results):
        got = res[i]["nonfinite"]
        assert got["y"] and got["dx"], f"world {ws} rank {rank} {IDS[i]}: non-finite (y, dx): {got}"
    assert any(res[i]["nonfinite"]["dw"] for res in results), f"world {ws} {IDS[i]}: every weight gradient finite"



# ---- compiled: the gathered block experts inside the graph --------------------------------------------------------

# grouped products per block of _grouped_compile_jobs' model: the experts' w1, w3, w2 and the GroupedLinear proj
PRODUCTS = 4


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def compiled_runs(request):
    import _grouped_compile_jobs as compile_jobs
    from _harness import job_several

    return request.param, spawn(job_several, request.param, "gloo", jobs={
        "routed": (compile_jobs.compiled_experts_match_eager, {"cases": PRESETS})})


@pytest.mark.parametrize("preset", PRESETS)
def test_compiled_gathered_block_experts_are_in_the_graph(compiled_runs, preset):
    """Routed top-2 MoE blocks compiled with fullgraph=True (a graph break fails the job) under FSDP2: every grouped
    product runs as the gathered ops, which read the weight through its handle (no gathered bytes in the graphs)."""
    ws, results = compiled_runs
    for rank, res in enumerate(results):
        r, at = res["routed"][preset], f"world {ws} rank {rank} {preset}"
        assert r["ops"].get("gathered_grouped_blocks_forward", 0) >= PRODUCTS, f"{at}: {r['ops']}"
        assert r["ops"].get("gathered_grouped_blocks_backward", 0) >= PRODUCTS, f"{at}: {r['ops']}"
        assert "grouped_blocks_forward" not in r["ops"], f"{at}: an op took the gathered weight itself: {r['ops']}"
        assert not r["weight_tensors"], f"{at}: gathered weight bytes in the graphs: {r['weight_tensors']}"


@pytest.mark.parametrize("preset", PRESETS)
def test_compiled_gathered_block_experts_are_bitwise_eager(compiled_runs, preset):
    """aot_eager: each of 2 AdamW steps' output, input gradient and every parameter gradient, and the parameters
    after, bit for bit the eager model's (whose experts take the packed path on the gathered weight)."""
    ws, results = compiled_runs
    for rank, res in enumerate(results):
        diffs = res["routed"][preset]["diffs"]
        assert not diffs, f"world {ws} rank {rank} {preset}: compiled differs from eager:\n" + "\n".join(diffs[:20])


# ---- on a GPU: the CUDA grouped GEMMs ----------------------------------------------------------------------------

GPU_CASES = [dict(preset=p, counts=c) for p in PRESETS for c in COUNTS] + [
    dict(preset="fp8_block", counts="host", out=96)]
GPU_IDS = [f"{c['preset']}-{c['counts']}-out{c.get('out', jobs.OUT)}" for c in GPU_CASES]


@pytest.fixture(scope="module")
def gpu_runs():
    return spawn(jobs.job_gathered_vs_plain, 1, "nccl", cases=GPU_CASES)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device and NCCL")
@pytest.mark.parametrize("i", range(len(GPU_CASES)), ids=GPU_IDS)
def test_gpu_gathered_block_experts_are_bitwise_the_packed_path_on_a_plain_weight(gpu_runs, i):
    """CUDA, world 1: the gathered weight takes the path a plain weight takes (host counts: the packed path, the
    cuBLAS loop or the Triton kernels; device counts: the device-count path where its grouped GEMMs run), bitwise
    it: output, input gradient, weight gradient."""
    r = gpu_runs[i]
    assert r["node"] == r["plain_node"] and r["node"] != "CatBackward0", (
        f"{GPU_IDS[i]}: the gathered weight ran {r['node']}, a plain weight {r['plain_node']}")
    assert not r["diffs"], f"{GPU_IDS[i]}:\n" + "\n".join(r["diffs"])
