"""torch.compile of mixture-of-experts blocks whose grouped weights FSDP2 all-gathers quantized (apply_hybrid_fsdp):
per-tensor FP8 experts with current scaling and tensor counts compile into the block's graph (fullgraph=True: a graph
break fails the job), the gathered weight entering the graph as its handle (nn/compiled_grouped.py,
nn/weight_handle.py): the grouped ops read the gathered stacked buffers when they run, and no graph input or saved
tensor has a grouped weight's shape. Training computes bit for bit what the same model computes eagerly: each step's
output, input gradient and every gradient of 2 AdamW steps, and the parameters after them; world sizes 1 and 2
(CPU gloo)."""

from __future__ import annotations

import functools

import pytest
import torch

import hybridq as hq
from hybridq.nn.compiled_grouped import experts_in_graph

from _harness import backends, job_several, nccl_devices, spawn
import _grouped_compile_jobs as jobs

pytestmark = pytest.mark.distributed

# the per-tensor FP8 formats with current scaling of the case list (every tensor of every expert), and the preset
FP8_CASES = ["fp8_tensorwise", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_pow2"]
# grouped products per block: the experts' w1, w3, w2 and the GroupedLinear proj
PRODUCTS = 4


def _check(out: dict, where: str, products: int = PRODUCTS) -> None:
    for case, r in out.items():
        at = f"{case}, {where}"
        assert r["ops"].get("gathered_grouped_linear_forward", 0) >= products, \
            f"{at}: the gathered experts' forward op is not in the graphs: {r['ops']}"
        assert r["ops"].get("gathered_grouped_linear_backward", 0) >= products, \
            f"{at}: the gathered experts' backward op is not in the graphs: {r['ops']}"
        assert "grouped_linear_forward" not in r["ops"], f"{at}: a grouped op took the gathered weight itself: {r['ops']}"
        assert not r["weight_tensors"], f"{at}: gathered weight bytes in the graphs: {r['weight_tensors']}"
        assert not r["diffs"], f"{at}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])


@functools.lru_cache(maxsize=None)
def _two_ranks(backend: str) -> tuple:
    return tuple(spawn(job_several, 2, backend, jobs={
        "routed": (jobs.compiled_experts_match_eager, {"cases": FP8_CASES[:1]})}))


@pytest.mark.parametrize("backend", backends())
def test_compiled_moe_blocks_with_gathered_fp8_experts_two_ranks(backend):
    """Routed top-2 blocks (router, experts, a GroupedLinear): no graph break, the gathered ops in the graphs, bitwise
    eager on both ranks."""
    for rank, o in enumerate(_two_ranks(backend)):
        _check(o["routed"], f"rank {rank} of 2")


def _cuda_jagged() -> bool:
    from hybridq.gemm import jagged_fp8_kernels
    q = hq.GroupedLinear(1, 64, 64, recipe="fp8_tensorwise").expert_quantizers[0]
    return nccl_devices(1) and jagged_fp8_kernels(torch.device("cuda"), 64, 96, q) is not None


# gloo on the CPU; one CUDA device through NCCL where the jagged kernels run (the GPU machine)
GLOO_AND_ONE_GPU = ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _cuda_jagged(), reason="needs a CUDA device with the jagged kernels (sm_90, Triton, the built extension) "
                               "and NCCL")])]


@functools.lru_cache(maxsize=None)
def _one_rank() -> dict:
    return spawn(job_several, 1, "gloo", jobs={
        "formats": (jobs.compiled_experts_match_eager, {"cases": FP8_CASES[1:], "routed": False}),
        "kept_gathered": (jobs.compiled_experts_match_eager, {"cases": FP8_CASES[:1], "reshard": False}),
        "launch_model": (jobs.launch_moe_model_compiles, {})})[0]


@pytest.mark.parametrize("job", ["formats", "kept_gathered"])
def test_compiled_moe_blocks_with_gathered_fp8_experts_one_rank(job):
    """World size 1 (FSDP2's no-collective path): the other per-tensor FP8 formats with given counts (an expert
    without tokens), and the weights kept gathered from forward to backward (reshard_after_forward=False)."""
    _check(_one_rank()[job], f"world 1, {job}")


@pytest.mark.parametrize("backend", GLOO_AND_ONE_GPU)
def test_the_training_jobs_moe_blocks_compile_whole_with_fp8_experts(backend):
    """launch/model.py's blocks (attention, router, top-2 experts) with fp8_tensorwise under FSDP2 compile with
    fullgraph=True -- the experts' forward is no longer run under torch.compiler.disable there -- and train as
    eagerly: the first output bit for bit, the rest within 1e-3 (the attention and norm gradients' last bits differ
    under AOTAutograd). On the GPU machine too: its torch (2.11) traces other Python than CI's (2.13): `bool(dict)`
    in experts_in_graph was a graph break there, and the job's experts ran eagerly under --compile."""
    out = _one_rank() if backend == "gloo" else spawn(job_several, 1, backend, jobs={
        "launch_model": (jobs.launch_moe_model_compiles, {})})[0]
    _check(out["launch_model"], f"launch/model.py, world 1, {backend}", products=3)


@pytest.mark.parametrize("preset, compiles", [("fp8_tensorwise", True), ("mxfp8", True), ("fp8_block", True),
                                             ("nvfp4", False)])
def test_experts_in_graph_says_which_configurations_compile(preset, compiles):
    """What the training job asks before it lets an expert module's forward into the graph (launch/model.py)."""
    experts = jobs.Experts(torch.nn.functional.silu)
    assert not experts_in_graph(experts), "an expert module that was not converted runs high precision eagerly"
    hq.convert_experts(experts, preset)
    assert experts_in_graph(experts) is compiles, f"{preset}: experts_in_graph should be {compiles}"


def test_experts_in_graph_is_false_with_an_option_the_ops_do_not_take():
    layer = hq.GroupedLinear(4, 64, 64, recipe="fp8_tensorwise", name="g")
    assert experts_in_graph(layer)
    layer.save_original_input = True
    assert not experts_in_graph(layer), "save_original_input runs eagerly: the module is not all in the graph"


@pytest.mark.parametrize("backend", GLOO_AND_ONE_GPU)
def test_compiled_experts_with_gathered_fp8_under_inductor(backend):
    """Inductor around the ops, bf16 weights gathered as FP8, world 1: on the CPU (the reference kernels) and on an
    H100/H200 (NCCL; the CUDA jagged kernels, Triton grouped GEMMs, counts on the device): bitwise eager. (A block
    without residual: Inductor sums three bf16 gradient terms with one rounding, eager with two.)"""
    out = spawn(job_several, 1, backend, jobs={"inductor": (jobs.compiled_experts_match_eager, {
        "cases": ["fp8_tensorwise"], "compiler": "inductor", "routed": False, "dtype": "bfloat16"})})
    for r in out[0]["inductor"].values():  # (Inductor's input is dynamo's graph: the layer's op on the weight)
        assert r["ops"].get("grouped_linear_forward", 0) >= PRODUCTS, f"the grouped ops not in the graph: {r['ops']}"
        assert not r["diffs"], f"{backend}, inductor: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])
