"""A mixture-of-experts block with per-tensor FP8 GroupedLinears is capturable in a CUDA graph (issue 30): the job's MoE
(launch/model.py: router, top-k dispatch with the counts kept on the device, SwiGLU experts converted to fp8_tensorwise
on the jagged path, combine) captures its forward and backward without a host sync (a sync inside a capture is an
error), and a replay computes bitwise what eager computes on the same inputs."""

import pathlib
import sys

import pytest
import torch

import hybridq as hq
from _compare import assert_bitwise

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "launch"))
import model as job_model  # noqa: E402


def _jagged_kernels_run_here() -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.formats import Float8Quantizer
    from hybridq.gemm import jagged_fp8_kernels
    q = Float8Quantizer()
    k = jagged_fp8_kernels(torch.device("cuda"), 64, 64, {"input": q, "weight": q, "grad_output": q})
    return k is not None and k.name != "reference"


needs_jagged_gpu = pytest.mark.skipif(not _jagged_kernels_run_here(),
                                      reason="needs the CUDA jagged kernels (sm_90, Triton, the built extension)")


def _moe_block() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = job_model.ModelConfig(d_model=256, n_heads=2, hidden=128, moe_experts=8, moe_top_k=2)
    moe = job_model.MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    moe = moe.cuda().to(torch.bfloat16)
    hq.convert_experts(moe, "fp8_tensorwise")
    return moe


def _step(moe, x, dy) -> torch.Tensor:
    out = moe(x)
    out.backward(dy)
    return out


def _clear_grads(moe, x) -> None:
    x.grad = None
    for p in moe.parameters():
        p.grad = None


@pytest.mark.gpu
@needs_jagged_gpu
def test_gpu_moe_block_forward_backward_replays_bitwise_from_a_cuda_graph():
    moe = _moe_block()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, the extension loads
        for _ in range(2):
            _clear_grads(moe, x)
            _step(moe, x, dy)
    torch.cuda.current_stream().wait_stream(side)
    _clear_grads(moe, x)
    want_out = _step(moe, x, dy).detach().clone()
    want = {"dx": x.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    _clear_grads(moe, x)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # (a host sync in here raises: capture forbids it)
        out = _step(moe, x, dy)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, want_out, "MoE output replayed from the CUDA graph vs eager")
    got = {"dx": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        assert_bitwise(got[name], want[name], f"gradient {name} replayed from the CUDA graph vs eager")
