"""An eager per-tensor FP8 Linear with delayed scaling (fp8_delayed) runs as nn/delayed_linear.py's few calls instead of
the general path of linear_function.py (issue 33's eager host cost): over several steps its outputs, gradients and
every quantizer's delayed-scaling state (amax history, scale, pending update) are bitwise the general path's --
with and without gradients, with activation recompute (replayed casts), a layer called twice per step, batched
updates between steps -- and every call the general path must run declines to it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hybridq as hq
from hybridq.formats import Float8Quantizer
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _compare import assert_bitwise
from _linear_paths import RESULTS, node_name

IN, OUT, TOKENS = 256, 128, (2, 64)
STEPS = 4
FAST, GENERAL = "_DelayedLinearBackward", "_LinearFunctionBackward"
ONE_OP = "torch::autograd::CppNode<hybridq::ops::Fp8Linear>"  # CUDA: hybridq::fp8_linear_delayed
STATE = ("amax_history", "scale", "update_pending")

# delayed-scaling recipes: the preset (E4M3 forward, E5M2 gradients, history 1024, max) and per-tensor options that
# change the update (a short history, a margin, the most recent amax)
CASES = {
    "fp8_delayed": lambda: hq.recipe("fp8_delayed"),
    "e4m3_history4": lambda: hq.CustomRecipe(lambda role: Float8Quantizer(scaling="delayed", amax_history_len=4),
                                             name="e4m3-history4"),
    "margin1_most_recent": lambda: hq.CustomRecipe(
        lambda role: Float8Quantizer("e5m2" if role.tensor_type.startswith("grad") else "e4m3", scaling="delayed",
                                     amax_history_len=3, margin=1, amax_compute_algo="most_recent"),
        name="margin1-most-recent"),
}


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.kernels import _ext
    return _ext.available_for(torch.device("cuda")) and torch.cuda.get_device_capability() >= (8, 9)


CUDA = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores and the extension")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    with shared_input_quantization(False), eager_fast_path(True):
        yield


def _layer(case: str, device="cpu", dtype=torch.float32, bias=True, **kw) -> hq.Linear:
    torch.manual_seed(0)
    return hq.Linear(IN, OUT, bias=bias, recipe=CASES[case](), name="fc", device=device, dtype=dtype, **kw)


def _inputs(step: int, device="cpu", dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    # (each step another range, so the histories and scales move)
    g = torch.Generator().manual_seed(step)
    scale = 2.0 ** (step - 1)
    return ((torch.randn(*TOKENS, IN, generator=g) * scale).to(device, dtype),
            (torch.randn(*TOKENS, OUT, generator=g) / scale).to(device, dtype))


def _state(layer) -> dict:
    return {f"{role}.{f}": getattr(q, f) for role, q in layer.quantizers().items() for f in STATE}


def _step(layer, x, gy, x_grad=True, twice=False, recompute=False) -> tuple[list, str | None]:
    """(results, node) of one training step: forward (twice on one input, summed: a layer called twice per step;
    recompute: under non-reentrant activation checkpointing) and backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x_grad)
    call = (lambda t: checkpoint(layer, t, use_reentrant=False)) if recompute else layer
    y = call(x)
    node = node_name(y)
    if twice:
        y = y + call(x * 0.5)
    if y.requires_grad:
        y.backward(gy)
    return [y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad], node


def _assert_steps_match(case: str, what: str, make=None, device="cpu", dtype=torch.float32, between=None,
                        node=lambda step: FAST, **step_kw) -> None:
    """STEPS steps of a layer on the fast path, then of an identical one on the general path (one after the other:
    no backward of one run counts a step of the other's quantizers): the fast one takes the fast path and every
    step's results and state are bitwise the general path's (`node(step)`: the fast path's node at that step)."""
    make = make or (lambda: _layer(case, device=device, dtype=dtype))
    runs = []
    for fast_path in (True, False):
        layer, steps = make(), []
        with eager_fast_path(fast_path):
            for s in range(STEPS):
                x, gy = _inputs(s, device, dtype)
                results, taken = _step(layer, x, gy, **step_kw)
                steps.append((results, taken, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in _state(layer).items()}))
                if between is not None:
                    between(layer)
        runs.append(steps)
    for s, ((got, got_node, got_state), (want, want_node, want_state)) in enumerate(zip(*runs)):
        where = f"{case}/{what}, step {s}"
        assert (got_node, want_node) == (node(s), GENERAL), f"{where}: paths taken {got_node}, {want_node}"
        for n, a, b in zip(RESULTS, got, want):
            assert (a is None) == (b is None), f"{where}: {n} is {'missing' if a is None else 'there'} on the fast path"
            if a is not None:
                assert_bitwise(a, b, f"{where}: {n}")
        for k, b in want_state.items():
            a = got_state[k]
            if isinstance(b, torch.Tensor):
                assert_bitwise(a, b, f"{where}: {k}")
            else:
                assert a == b, f"{where}: {k} {a} on the fast path, {b} on the general path"


@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "frozen_weight", "input_no_grad",
                                     "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_steps_are_bitwise_the_general_path(case, variant):
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32

    def make():
        layer = _layer(case, dtype=dtype, bias=variant != "no_bias",
                       save_original_input=variant == "save_original_input")
        layer.weight.requires_grad_(variant != "frozen_weight")
        return layer

    _assert_steps_match(case, variant, make, dtype=dtype, x_grad=variant != "input_no_grad")


@pytest.mark.parametrize("case", CASES)
def test_recomputed_forward_replays_the_casts_as_on_the_general_path(case):
    """Activation checkpointing: backward recomputes the forward, whose casts replay the forward's scales and record
    nothing (Float8Quantizer.replaying): the same outputs, gradients and histories as the general path's."""
    _assert_steps_match(case, "recompute", recompute=True)


@pytest.mark.parametrize("case", CASES)
def test_a_layer_called_twice_per_step_is_bitwise_the_general_path(case):
    """Two forward casts per quantizer per step (and two dy casts in backward): each applies the pending update
    first, as on the general path."""
    _assert_steps_match(case, "called twice", twice=True)


@pytest.mark.parametrize("case", CASES)
def test_batched_updates_between_steps_are_bitwise_the_general_path(case):
    """hybridq.update_delayed_scaling after every step (the batched update: no pending update at the next cast)."""
    _assert_steps_match(case, "batched updates",
                        between=lambda layer: hq.update_delayed_scaling(layer.quantizers().values()))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", CASES)
def test_forward_without_gradients_is_bitwise_the_general_path(case, mode):
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    fast, general = _layer(case), _layer(case)
    for s in range(STEPS):
        x, _ = _inputs(s)
        with context():
            got = fast(x)
            with eager_fast_path(False):
                want = general(x)
        assert_bitwise(got, want, f"{case} under {mode}, step {s}: output")
        for k, b in _state(general).items():
            a = _state(fast)[k]
            assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), f"{case} {mode} step {s}: {k}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_state_loaded_between_forward_and_backward_is_what_the_gradient_cast_uses(device):
    """A state_dict loaded after a forward (new state tensors) and before its backward: dy's cast uses the loaded
    state, as on the general path (the one op holds dy's state tensors: the pre-hook copies the loaded values into
    them)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    runs = []
    for fast_path in (True, False):
        layer = _layer("fp8_delayed", device=device, dtype=dtype)
        with eager_fast_path(fast_path):
            for s in range(2):
                _step(layer, *_inputs(s, device, dtype))
            saved = {k: v.clone() for k, v in layer.state_dict().items()}
            _step(layer, *_inputs(2, device, dtype))
            x, gy = _inputs(3, device, dtype)
            x = x.requires_grad_()
            y = layer(x)
            layer.load_state_dict(saved)
            y.backward(gy)
            runs.append([y.detach(), x.grad, layer.weight.grad] + [t.clone() for t in _state(layer).values()
                                                                   if isinstance(t, torch.Tensor)])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise(a, b, f"{device}: result {i} with a state loaded between forward and backward")


def _node(layer, x, **kw) -> str | None:
    return node_name(layer(x.clone().requires_grad_(), **kw))


def test_calls_the_general_path_must_run_decline():
    layer = _layer("fp8_delayed")
    x, _ = _inputs(0)
    assert _node(layer, x) == FAST
    assert _node(layer, x, is_first_microbatch=True) == GENERAL, "the is_first_microbatch cache runs the general path"
    with eager_fast_path(False):
        assert _node(layer, x) == GENERAL, "the fast path switched off must run the general path"
    layer.input_quantizer.quantize = layer.input_quantizer.quantize  # (an instance attribute: a wrapper)
    assert _node(layer, x) == GENERAL, "a quantizer with a replaced quantize must run the general path"


def test_an_input_without_rows_runs_the_general_path():
    layer = _layer("fp8_delayed")
    y = layer(torch.randn(0, IN, requires_grad=True))
    assert node_name(y) == GENERAL and y.shape == (0, OUT), (node_name(y), y.shape)


def test_only_delayed_scaling_in_every_role_takes_this_path():
    """A recipe mixing delayed and current scaling, or current scaling throughout, is not this path's."""
    mixed = hq.CustomRecipe(lambda role: Float8Quantizer(
        scaling="current" if role.tensor_type == "weight" else "delayed"), name="mixed")
    x, _ = _inputs(0)
    for recipe in (mixed, hq.recipe("fp8_tensorwise")):
        layer = hq.Linear(IN, OUT, recipe=recipe, name="fc")
        assert layer._delayed_spec is None and _node(layer, x) != FAST, f"{recipe.name} took the delayed fast path"


# ---- CUDA ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("variant", ["plain", "save_original_input", "frozen_weight", "input_no_grad", "recompute",
                                     "twice", "batched"])
@pytest.mark.parametrize("case", CASES)
def test_steps_on_cuda_are_bitwise_the_general_path(case, variant):
    def make():
        layer = _layer(case, device="cuda", dtype=torch.bfloat16,
                       save_original_input=variant == "save_original_input")
        layer.weight.requires_grad_(variant != "frozen_weight")
        return layer

    batched = lambda layer: hq.update_delayed_scaling(layer.quantizers().values())  # noqa: E731
    # one op from the second step (the gradient quantizer's state reaches the device at its first cast); the
    # Python node with save_original_input
    op_from = STEPS if variant == "save_original_input" else 1
    _assert_steps_match(case, f"{variant} on CUDA", make, device="cuda", dtype=torch.bfloat16,
                        between=batched if variant == "batched" else None, recompute=variant == "recompute",
                        twice=variant == "twice", x_grad=variant != "input_no_grad",
                        node=lambda s: ONE_OP if s >= op_from else FAST)


@pytest.mark.gpu
@CUDA
def test_the_op_switched_off_runs_the_python_node_bitwise():
    from hybridq.nn.delayed_linear import _DELAYED_OP
    with _DELAYED_OP.turned(False):
        _assert_steps_match("fp8_delayed", "op off", lambda: _layer("fp8_delayed", device="cuda",
                                                                     dtype=torch.bfloat16),
                            device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@CUDA
def test_rows_the_fp8_gemm_cannot_take_decline_on_cuda():
    """M = 2 x 36 (not a multiple of 16): the general path emulates that GEMM (and warns); the fast path declines."""
    layer = _layer("fp8_delayed", device="cuda", dtype=torch.bfloat16)
    assert _node(layer, torch.randn(2, 36, IN, device="cuda", dtype=torch.bfloat16)) == GENERAL


@pytest.mark.gpu
@CUDA
def test_pending_updates_in_one_launch_are_bitwise_one_launch_each():
    """kernels.delayed.update_before_casts (x's and the weight's pending updates in one launch) against
    update_before_cast on each: the same histories and scales."""
    from hybridq.kernels.delayed import update_before_cast, update_before_casts

    def pending_pair():
        qs = [Float8Quantizer(fp8, scaling="delayed", amax_history_len=n) for fp8, n in (("e4m3", 5), ("e5m2", 3))]
        for i, q in enumerate(qs):
            q.amax_history = torch.arange(1.0, q.amax_history_len + 1, device="cuda") * (i + 2)
            q.scale = torch.full((1,), 0.5, device="cuda")
            q.mark_amax_recorded()
        return qs

    one, each = pending_pair(), pending_pair()
    update_before_casts(one, one[0].amax_history.device)
    for q in each:
        update_before_cast(q)
    for i, (a, b) in enumerate(zip(one, each)):
        assert not a.update_pending, f"quantizer {i}: still pending after update_before_casts"
        assert_bitwise(a.amax_history, b.amax_history, f"quantizer {i}: amax_history")
        assert_bitwise(a.scale, b.scale, f"quantizer {i}: scale")
