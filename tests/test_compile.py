"""torch.compile of a model with hybridq layers (torchtitan's per-block compile). A Linear with a plain weight
compiles into the graph as hybridq's custom ops (nn/compiled_linear.py; per-tensor FP8 layers as their traced ops,
nn/float8_graph.py, see test_float8_graph.py) and computes bitwise what eager computes; so does a Linear whose
weight FSDP2 all-gathers quantized (its handle in the graph: tests/distributed/test_fsdp_compile.py) and a quantized
parameter (test_quantized_params_compile.py).
What those ops do not take (a GroupedLinear with list counts or a recipe other than per-tensor FP8 -- FP8 experts
with tensor counts compile into the graph: test_grouped_compile.py --, delayed scaling, the is_first_microbatch
cache, tensor-parallel DTensor weights) runs eagerly between compiled regions (a graph break
each) and computes what eager computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq

from _compare import assert_bitwise

SPLITS = [40, 0, 24]


class Block(nn.Module):
    def __init__(self, preset: str):
        super().__init__()
        self.norm = nn.RMSNorm(128)
        self.fc1 = hq.Linear(128, 256, bias=False, recipe=hq.recipe(preset), name="fc1")
        self.experts = hq.GroupedLinear(3, 256, 128, recipe=hq.recipe(preset), name="experts")

    def forward(self, x):
        return x + self.experts(F.silu(self.fc1(self.norm(x))), SPLITS)


def _run(block, x, call=None):
    """Output, input gradient and parameter gradients of `call` (default: the block itself)."""
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    y = (call if call is not None else block)(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8"])
def test_compiled_block_computes_what_eager_computes(preset):
    torch.manual_seed(0)
    block = Block(preset)
    x = torch.randn(sum(SPLITS), 128)
    want = _run(block, x)
    torch._dynamo.reset()
    got = _run(block, x, torch.compile(block))
    # the quantized layers run the same eager code; the compiled RMSNorm / SiLU may round their fp32 math
    # differently from eager, which moves a few quantized codes by one step
    assert_bitwise(got[0], want[0], f"{preset}: compiled forward output")
    for what, g, w in [("grad input", got[1], want[1])] + [(f"grad {n}", got[2][n], want[2][n]) for n in want[2]]:
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 2e-2, f"{preset}: compiled {what} differs from eager by {rel:.2e} (relative norm)"


def test_grouped_linear_is_a_graph_break_and_linear_is_not():
    block = Block("fp8_tensorwise")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(torch.randn(sum(SPLITS), 128))
    assert explained.graph_break_count == 1, f"expected one break, at the GroupedLinear only: {explained}"
    assert _ops_in_graphs(explained) == 1, f"the Linear is not in the graph: {explained}"


# ---- the Linear inside the graph ------------------------------------------------------------------------------

IN_GRAPH_PRESETS = [p for p in hq.preset_names() if not hq.recipe(p).quantizer(
    hq.Role("linear", "input", "x")).is_stateful]


class MLP(nn.Module):
    def __init__(self, recipe, save_original_input=False, bias=True, act=F.silu):
        super().__init__()
        self.act = act
        self.fc1 = hq.Linear(64, 128, bias=bias, recipe=recipe, name="fc1", save_original_input=save_original_input)
        self.fc2 = hq.Linear(128, 64, bias=False, recipe=recipe, name="fc2")

    def forward(self, x, **kw):
        return self.fc2(self.act(self.fc1(x, **kw)), **kw)


def _ops_in_graphs(explained) -> int:
    """How many hybridq Linear calls the compiled graphs hold: the custom ops (compiled_linear) or, for per-tensor
    FP8, the traced autograd function (float8_graph)."""
    op = torch.ops.hybridq.linear_forward
    traced = torch.ops.higher_order.autograd_function_apply
    return sum(n.target in (op, op.default, traced) for g in explained.graphs for n in g.graph.nodes)


def _grads(model, x, call, seed=5, **kw):
    """Output, input gradient and parameter gradients of `call(x)`; the RNG seeded first (stochastic rounding)."""
    x = x.clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    y = call(x, **kw)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_same(got, want, what, reordered_bias_sums: bool = False):
    """Output and gradients bitwise eager's. `reordered_bias_sums`: a bias gradient is a plain sum over the rows
    whose order Inductor may choose differently (as for any compiled nn.Linear): compared to a sum's rounding."""
    assert_bitwise(got[0], want[0], f"{what}: output")
    if want[1] is not None:
        assert_bitwise(got[1], want[1], f"{what}: grad input")
    assert got[2].keys() == want[2].keys(), f"{what}: gradients of {sorted(got[2])} vs eager {sorted(want[2])}"
    for n in want[2]:
        if reordered_bias_sums and n.endswith(".bias"):
            torch.testing.assert_close(got[2][n], want[2][n], msg=lambda m: f"{what}: grad {n}: {m}")
        else:
            assert_bitwise(got[2][n], want[2][n], f"{what}: grad {n}")


@pytest.mark.parametrize("save_original_input", [False, True])
@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
@pytest.mark.parametrize("preset", IN_GRAPH_PRESETS)
def test_linear_in_graph_is_bitwise_eager(preset, override, save_original_input):
    """fullgraph=True: no graph break at a Linear; forward and every gradient bit for bit the eager layer's."""
    torch.manual_seed(0)
    model = MLP(hq.recipe(preset, backward_override=override), save_original_input)
    x = torch.randn(2, 32, 64)
    torch._dynamo.reset()
    got = _grads(model, x, torch.compile(model, fullgraph=True, backend="aot_eager"))
    want = _grads(model, x, model)
    _assert_same(got, want, f"{preset}, backward_override={override}, save_original_input={save_original_input}")


def test_linear_in_graph_with_inductor():
    """The default backend (Inductor) around the ops. Inductor may round the element-wise math between them
    differently from eager (SiLU's backward), so here the Linears follow each other directly."""
    torch.manual_seed(0)
    model = MLP(hq.recipe("mxfp8_fwd_nvfp4_bwd"), act=lambda t: t)
    x = torch.randn(2, 32, 64)
    torch._dynamo.reset()
    _assert_same(_grads(model, x, torch.compile(model, fullgraph=True)), _grads(model, x, model), "inductor")


@pytest.mark.parametrize("preset", ["mxfp8", "fp8_tensorwise", "fp8_block"])  # custom ops; traced (float8_graph)
@pytest.mark.parametrize("case", ["no_grad", "input_only", "weights_frozen", "bias_only"])
def test_linear_in_graph_computes_only_the_gradients_asked_for(case, preset):
    torch.manual_seed(0)
    model = MLP(hq.recipe(preset))
    x = torch.randn(2, 32, 64, requires_grad=case in ("input_only", "weights_frozen"))
    if case in ("input_only", "weights_frozen", "bias_only"):
        model.fc1.weight.requires_grad_(False)
        model.fc2.weight.requires_grad_(False)
    if case == "input_only":
        model.fc1.bias.requires_grad_(False)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    if case == "no_grad":
        with torch.no_grad():
            assert_bitwise(compiled(x), model(x), "no_grad output")
        return
    _assert_same(_grads(model, x, compiled), _grads(model, x, model), case)


def _swap_recipes(model, monkeypatch):
    model.fc1.recipe = model.fc2.recipe = hq.recipe("mxfp8")


# what changes after the first compiled step, in order: each must reach the graph (a recompile where it must)
CHANGES_AFTER_COMPILE = {
    "recipe swapped to mxfp8": [_swap_recipes],
    # ([Note: the override's environment under torch.compile]: the graph kept the mode it was traced with before)
    "HYBRIDQ_BACKWARD_OVERRIDE set, then unset": [
        lambda model, mp: mp.setenv("HYBRIDQ_BACKWARD_OVERRIDE", "high_precision"),
        lambda model, mp: mp.delenv("HYBRIDQ_BACKWARD_OVERRIDE")],
}


@pytest.mark.parametrize("change", list(CHANGES_AFTER_COMPILE))
def test_a_change_after_compile_takes_effect(change, monkeypatch):
    monkeypatch.delenv("HYBRIDQ_BACKWARD_OVERRIDE", raising=False)
    torch.manual_seed(0)
    model = MLP(hq.recipe("fp8_tensorwise"))
    x = torch.randn(2, 32, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    _grads(model, x, compiled)
    for i, step in enumerate(CHANGES_AFTER_COMPILE[change]):
        step(model, monkeypatch)
        _assert_same(_grads(model, x, compiled), _grads(model, x, model), f"{change}, after change {i + 1}")


def test_what_the_ops_do_not_take_stays_eager_and_correct():
    """Delayed scaling (its state changes per call) and the is_first_microbatch cache: a graph break each, the
    same results as an identical eager model."""
    torch.manual_seed(0)
    model, twin = MLP(hq.recipe("fp8_delayed")), MLP(hq.recipe("fp8_delayed"))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 32, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    explained = torch._dynamo.explain(MLP(hq.recipe("fp8_delayed")))(x)
    assert explained.break_reasons and _ops_in_graphs(explained) == 0, f"delayed scaling in the graph: {explained}"
    for step in range(2):
        _assert_same(_grads(model, x, compiled), _grads(twin, x, twin), f"fp8_delayed, step {step}")
    cached = MLP(hq.recipe("fp8_tensorwise"))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(cached)(x, is_first_microbatch=True)
    assert explained.break_reasons and _ops_in_graphs(explained) == 0, f"weight cache in the graph: {explained}"
    compiled = torch.compile(cached, backend="aot_eager")
    for first in (True, False):
        _assert_same(_grads(cached, x, compiled, is_first_microbatch=first),
                     _grads(cached, x, cached, is_first_microbatch=first), f"is_first_microbatch={first}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", IN_GRAPH_PRESETS)
def test_linear_in_graph_on_cuda_is_bitwise_eager(preset):
    """On the GPU: the CUDA kernels' fake implementations trace, Inductor compiles around the ops, and the
    results are bit for bit the eager layer's (bf16 activations, as in training)."""
    torch.manual_seed(0)
    model = MLP(hq.recipe(preset), act=lambda t: t).cuda().to(torch.bfloat16)
    x = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    got = _grads(model, x, torch.compile(model, fullgraph=True))
    _assert_same(got, _grads(model, x, model), f"{preset} on CUDA")


def test_a_copied_layer_compiles_with_its_own_configuration():
    import copy

    torch.manual_seed(0)
    model = MLP(hq.recipe("fp8_tensorwise"))
    twin = copy.deepcopy(model)
    twin.fc1.recipe = twin.fc2.recipe = hq.recipe("nvfp4")
    x = torch.randn(2, 32, 64)
    torch._dynamo.reset()
    for m, what in ((model, "original"), (twin, "copy")):
        _assert_same(_grads(m, x, torch.compile(m, backend="aot_eager")), _grads(m, x, m), what)


@pytest.mark.parametrize("preset", ["mxfp8", "fp8_tensorwise"])  # custom ops; traced (float8_graph)
def test_blocks_that_differ_in_layer_names_share_one_compiled_graph(preset):
    """torchtitan compiles each block (same code, other layers): layers with equal configurations must not make
    dynamo trace every block again (after 8 it would give up and run the rest eagerly)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    x = torch.randn(2, 32, 64)
    for i in range(12):
        block = MLP(hq.recipe(preset))
        block.fc1.name, block.fc2.name = f"layers.{i}.fc1", f"layers.{i}.fc2"
        block.forward = torch.compile(block.forward, backend=counter)
        block(x).sum().backward()
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled for 12 blocks of one configuration"


_OTHER_PROCESS = """
import sys, torch
sys.path.insert(0, {tests!r})
import hybridq as hq
from test_compile import MLP, _grads, _assert_same
torch.manual_seed(0)
model = MLP(hq.recipe(sys.argv[1]), bias=False, act=lambda t: t)  # (no bias: Inductor may reorder its gradient's sum)
x = torch.randn(2, 32, 64)
_assert_same(_grads(model, x, torch.compile(model, fullgraph=True)), _grads(model, x, model), sys.argv[1])
print("same as eager")
"""


def test_another_process_with_another_recipe_does_not_reuse_a_cached_graph(tmp_path):
    """Inductor and AOTAutograd cache compiled graphs on disk, keyed by their ops and constants. Two processes
    compiling the same model with different recipes (same shapes) each compute their own recipe: the ops name a
    layer's configuration by a key unique to the process (an int key once served the first run's graph -- the
    first recipe's numbers -- to the second)."""
    import os
    import pathlib
    import subprocess
    import sys

    tests = str(pathlib.Path(__file__).resolve().parent)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", PYTHONPATH=str(pathlib.Path(tests).parent), OMP_NUM_THREADS="1")
    for preset in ("mxfp8", "fp8_block_fwd_mxfp8_bwd"):  # (two configurations that run as the custom ops)
        p = subprocess.run([sys.executable, "-c", _OTHER_PROCESS.format(tests=tests), preset], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "same as eager" in p.stdout, f"{preset}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def test_tracing_never_runs_or_turns_off_a_native_gemm(monkeypatch):
    """Under fake tensors (what compile traces with) `gemm` gives an empty result of the right shape and dtype
    without looking for a native kernel: a native kernel probed on fake tensors can fail (torch 2.11's meta
    function of the FP8 block GEMM does) and a failure turns that kernel off for the real calls too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hybridq import gemm as gemm_module

    def refuse(*_):
        raise AssertionError("a native GEMM was looked up on fake tensors")

    monkeypatch.setattr(gemm_module, "find_native_gemm", refuse)
    q = hq.recipe("fp8_block").quantizer(hq.Role("linear", "input", "x"))
    with FakeTensorMode():
        a = q.quantize(torch.randn(64, 128), rowwise=True, columnwise=False, name="a").part("rowwise")
        b = q.quantize(torch.randn(32, 128), rowwise=True, columnwise=False, name="b").part("rowwise")
        y = gemm_module.gemm(a, b, torch.bfloat16, "test")
    assert (tuple(y.shape), y.dtype) == ((64, 32), torch.bfloat16), f"fake result {tuple(y.shape)} {y.dtype}"


def test_a_handle_whose_weight_is_gone_is_a_clear_error():
    """A compiled graph reads a gathered weight through a handle (nn/compiled_linear.py): once the weight's owner
    is gone, running the op says so instead of reading freed or foreign memory."""
    import gc

    from hybridq.nn import compiled_linear

    class Owner:
        weight = None

    layer = hq.Linear(64, 32, bias=False, recipe=hq.recipe("mxfp8"), name="fc")
    owner = Owner()
    handle = compiled_linear.weight_handle(owner, lambda o: o.weight)
    del owner
    gc.collect()
    with pytest.raises(RuntimeError, match="is gone"):
        torch.ops.hybridq.gathered_linear_forward(torch.randn(4, 64), handle, None, layer._configuration_key, None,
                                                  False, False, [32, 64], torch.float32)


def test_compiling_a_converted_model_warns_nothing_about_the_override_environment(monkeypatch):
    """The backward override's environment variable is read at each use; unset, compile's trace never reaches its
    cached parse (dynamo warned about tracing through the cache on every compiled run)."""
    import warnings
    monkeypatch.delenv("HYBRIDQ_BACKWARD_OVERRIDE", raising=False)
    torch.manual_seed(0)
    model = MLP(hq.recipe("fp8_tensorwise"))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _grads(model, torch.randn(2, 32, 64), torch.compile(model, backend="aot_eager"))
    cache_warnings = [str(w.message)[:120] for w in caught if "lru_cache" in str(w.message)]
    assert not cache_warnings, f"compile warned about a cached function: {cache_warnings}"


def test_another_environment_variables_value_changing_does_not_recompile(monkeypatch):
    """Dynamo guards os.environ's dict by its size and the override's key ([Note: the override's environment under
    torch.compile]): a new value of another variable leaves the graph as it is; the override's changes recompile."""
    monkeypatch.delenv("HYBRIDQ_BACKWARD_OVERRIDE", raising=False)
    monkeypatch.setenv("HYBRIDQ_SOME_OTHER_VARIABLE", "0")
    torch.manual_seed(0)
    model = MLP(hq.recipe("fp8_tensorwise"))
    x = torch.randn(2, 32, 64)
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    _grads(model, x, compiled)
    first = len(compiles)
    monkeypatch.setenv("HYBRIDQ_SOME_OTHER_VARIABLE", "1")
    _grads(model, x, compiled)
    assert len(compiles) == first, f"{len(compiles) - first} recompile(s) after another variable's value changed"
    monkeypatch.setenv("HYBRIDQ_BACKWARD_OVERRIDE", "dequantized")
    _grads(model, x, compiled)
    assert len(compiles) > first, "no recompile after HYBRIDQ_BACKWARD_OVERRIDE changed"


def test_a_bad_override_environment_raises_the_recipe_error_under_compile(monkeypatch):
    """As eager code does (it was dynamo's internal error around the enum's ValueError)."""
    monkeypatch.delenv("HYBRIDQ_BACKWARD_OVERRIDE", raising=False)
    model = MLP(hq.recipe("fp8_tensorwise"))
    monkeypatch.setenv("HYBRIDQ_BACKWARD_OVERRIDE", "bogus")
    torch._dynamo.reset()
    with pytest.raises(hq.RecipeError, match="environment HYBRIDQ_BACKWARD_OVERRIDE: backward_override must be one "
                                             "of .* got 'bogus'"):
        torch.compile(model, backend="aot_eager")(torch.randn(2, 32, 64))
