"""hybridq.RMSNorm / LayerNorm / SwiGLU under torch.compile: their kernels run as custom ops with fakes
(hybridq/nn/compiled_norms.py), one node each in the graph, no graph break. On the CPU the ops run the reference
(forward and its vjp): compiled with "aot_eager", fullgraph, bitwise the eager module. On CUDA, with Inductor,
bitwise the eager kernels (the same kernels with the same arguments)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.nn.swiglu import swiglu

from _compare import assert_bitwise
from _conversion_models import SwiGLU as FeedForward
from _gpu import gpu

DTYPES = [torch.float32, torch.bfloat16]
NORMS = {"RMSNorm": lambda: hq.nn.RMSNorm(64), "LayerNorm": lambda: hq.nn.LayerNorm(64),
         "RMSNorm without weight": lambda: hq.nn.RMSNorm(64, elementwise_affine=False),
         "LayerNorm without bias": lambda: hq.nn.LayerNorm(64, bias=False)}
OPS = {"RMSNorm": torch.ops.hybridq.compiled_norm_forward, "LayerNorm": torch.ops.hybridq.compiled_norm_forward,
       "SwiGLU": torch.ops.hybridq.compiled_swiglu_forward}


def _norm(kind: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = NORMS[kind]().to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand_like(p) + 0.5)
    return m


def _results(fn, inputs: list[torch.Tensor], params: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    """[y, gradients of the inputs, gradients of the parameters] of `fn(*inputs)` for the output gradient dy."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*inputs)
    return [y.detach(), *torch.autograd.grad(y, [*inputs, *params], dy)]


def _assert_all_bitwise(got, want, names, what):
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert_bitwise(g, w, f"{what}: compiled {name}")


def _graph_ops(fn, *args) -> list:
    """The call targets of the graphs dynamo makes of `fn(*args)`, asserting there is no graph break."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, f"graph breaks: {explained.break_reasons}"
    return [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]


# ---- the CPU: the reference inside the ops -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(NORMS))
def test_compiled_norm_is_bitwise_eager(kind, dtype):
    m = _norm(kind, dtype=dtype)
    x = (torch.randn(3, 8, 64) * 3).to(dtype)
    dy = torch.randn(3, 8, 64).to(dtype)
    params = list(m.parameters())
    want = _results(m, [x], params, dy)
    torch._dynamo.reset()
    got = _results(torch.compile(m, backend="aot_eager", fullgraph=True), [x], params, dy)
    _assert_all_bitwise(got, want, ["y", "dx"] + [f"d{n}" for n, _ in m.named_parameters()], f"{kind} {dtype}")


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_compiled_norm_is_one_custom_op_in_the_graph(kind):
    targets = _graph_ops(_norm(kind), torch.randn(4, 64))
    assert targets.count(OPS[kind]) == 1, f"{kind}: the graph does not hold one compiled_norm_forward: {targets}"
    assert len(targets) == 2, f"{kind}: the graph holds more than the op and its output's getitem: {targets}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_swiglu_is_bitwise_eager(dtype):
    torch.manual_seed(0)
    a, b, dy = (torch.randn(2, 8, 96).to(dtype) for _ in range(3))
    want = _results(swiglu, [a, b], [], dy)
    torch._dynamo.reset()
    got = _results(torch.compile(swiglu, backend="aot_eager", fullgraph=True), [a, b], [], dy)
    _assert_all_bitwise(got, want, ["y", "da", "db"], f"SwiGLU {dtype}")


def test_compiled_swiglu_is_one_custom_op_in_the_graph():
    targets = _graph_ops(swiglu, torch.randn(4, 32), torch.randn(4, 32))
    assert targets.count(OPS["SwiGLU"]) == 1, f"the graph does not hold one compiled_swiglu_forward: {targets}"
    assert len(targets) == 2, f"the graph holds more than the op and its output's getitem: {targets}"


class Block(nn.Module):
    """A pre-norm transformer feed-forward block: `x + ffn(norm(x))`, the feed-forward a SwiGLU."""

    def __init__(self, norm=nn.RMSNorm):
        super().__init__()
        self.norm = norm(64)
        self.ffn = FeedForward(64, 128)

    def forward(self, x):
        return x + self.ffn(self.norm(x))


@pytest.mark.parametrize("norm", [nn.RMSNorm, nn.LayerNorm], ids=lambda n: n.__name__)
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "mxfp8"])
def test_compiled_block_with_swapped_norm_and_swiglu_is_bitwise_eager(preset, norm):
    """convert_linears swaps the norm and the feed-forward; compiled (fullgraph: the norm, the SwiGLU and the
    Linears in one graph), output and every gradient are bitwise the eager block's. (bf16, as training runs: in
    fp32 eager autograd adds the residual's gradient of x between the two gradients the RMSNorm reference's ops
    give x, the op after their sum, which may differ in the last bit.)"""
    torch.manual_seed(0)
    model = Block(norm).to(torch.bfloat16)
    hq.convert_linears(model, preset)
    assert isinstance(model.ffn, hq.nn.SwiGLU) and type(model.norm).__module__.startswith("hybridq"), model
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    dy = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    params = list(model.parameters())
    want = _results(model, [x], params, dy)
    torch._dynamo.reset()
    got = _results(torch.compile(model, backend="aot_eager", fullgraph=True), [x], params, dy)
    _assert_all_bitwise(got, want, ["y", "dx"] + [f"d{n}" for n, _ in model.named_parameters()], preset)
    targets = _graph_ops(model, x)
    for op in (OPS["RMSNorm"], OPS["SwiGLU"]):
        assert op in targets, f"{preset}: {op} is not in the compiled block's graph"


# ---- CUDA: the kernels, compiled by Inductor ------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("kind", list(NORMS))
def test_compiled_norm_on_cuda_is_bitwise_the_eager_kernel(kind):
    torch.manual_seed(3)
    m = _norm(kind, "cuda", torch.bfloat16)
    x = torch.randn(8, 16, 64, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn_like(x)
    params = list(m.parameters())
    want = _results(m, [x], params, dy)
    torch._dynamo.reset()
    got = _results(torch.compile(m, fullgraph=True), [x], params, dy)
    _assert_all_bitwise(got, want, ["y", "dx"] + [f"d{n}" for n, _ in m.named_parameters()], kind)


@gpu
def test_compiled_swiglu_on_cuda_is_bitwise_the_eager_kernel():
    torch.manual_seed(3)
    a, b, dy = (torch.randn(16, 32, 352, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3))
    want = _results(swiglu, [a, b], [], dy)
    torch._dynamo.reset()
    got = _results(torch.compile(swiglu, fullgraph=True), [a, b], [], dy)
    _assert_all_bitwise(got, want, ["y", "da", "db"], "SwiGLU")


@gpu
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_block", "mxfp8"])
def test_compiled_block_on_cuda_is_bitwise_eager(preset):
    torch.manual_seed(0)
    model = Block().cuda().to(torch.bfloat16)
    hq.convert_linears(model, preset)
    x = torch.randn(8, 128, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    params = list(model.parameters())
    want = _results(model, [x], params, dy)
    torch._dynamo.reset()
    got = _results(torch.compile(model, fullgraph=True), [x], params, dy)
    _assert_all_bitwise(got, want, ["y", "dx"] + [f"d{n}" for n, _ in model.named_parameters()], preset)


@pytest.mark.parametrize("norm", [nn.RMSNorm, nn.LayerNorm], ids=lambda n: n.__name__)
@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8"])
def test_blocks_with_swapped_norms_and_swiglu_compile_once(preset, norm):
    """The blocks of a model (per-block compile, as torchtitan and train.py do) share one compiled graph: nothing a
    hybridq norm or SwiGLU reads under compile differs between blocks (a guard on a block's name would compile each
    block anew, up to dynamo's recompile limit, and run the rest eagerly)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(norm) for _ in range(3)]).to(torch.bfloat16)
    hq.convert_linears(model, preset)
    assert len({m.name for m in model.modules() if isinstance(m, hq.nn.SwiGLU)}) == 3, "the blocks' names differ"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for block in model:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    model(torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True))  # (every block: an input with grad)
    assert len(graphs) == 1, f"the 3 blocks compiled {len(graphs)} graphs (one expected: a guard differs per block)"
