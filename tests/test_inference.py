"""Forward without gradients (torch.no_grad, torch.inference_mode, nothing requiring grad): only the rowwise forms
fprop reads are quantized, only the rowwise shape rules apply, and the numbers are those of the training forward.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.gemm import gemm
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

PRESETS = hq.preset_names()
IN, HIDDEN, OUT = 96, 64, 32
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
# presets whose forward formats scale every row of the input on its own (blocks along K, no per-tensor statistic):
# a token's output does not depend on the other tokens of the batch
ROW_LOCAL = ["fp8_block", "mxfp8", "mxfp8_fwd_nvfp4_bwd", "fp8_block_fwd_mxfp8_bwd"]
GENERATION_LENGTHS = range(1, 18)


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def _model(preset):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))
    hq.convert_linears(m, hq.recipe(preset), on_incompatible="error")
    return m


def _tokens(n, seed=1):
    return torch.randn(1, n, IN, generator=torch.Generator().manual_seed(seed))


def _training_forward(model, x):
    """The forward of a training step (input requiring grad, grad mode on) on a copy of the model."""
    return copy.deepcopy(model)(x.clone().requires_grad_()).detach()


def _inference_forward(model, x, mode="inference_mode"):
    with MODES[mode]():
        return copy.deepcopy(model)(x).clone()


def _fprop_oracle(model, x):
    """y = x W^T + b layer by layer on the rowwise-only quantizations of input and weight (what fprop reads)."""
    model = copy.deepcopy(model)  # delayed scaling: the same quantizer state as the copy under test
    h = x.reshape(-1, IN)
    with torch.no_grad():
        for layer in model:
            if not isinstance(layer, hq.Linear):
                h = layer(h)
                continue
            xq = layer.input_quantizer.quantize(h, rowwise=True, columnwise=False)
            wq = layer.weight_quantizer.quantize(layer.weight, rowwise=True, columnwise=False)
            h = gemm(xq.part("rowwise"), wq.part("rowwise"), h.dtype) + layer.bias
    return h.reshape(*x.shape[:-1], -1)


def _training_takes(model, m):
    """Whether a training step's shape rules (columnwise forms included) take M = m tokens."""
    try:
        for layer in model:
            if isinstance(layer, hq.Linear):
                layer.input_quantizer.validate((m, layer.in_features), rowwise=True, columnwise=True)
                layer.grad_output_quantizer.validate((m, layer.out_features), rowwise=True, columnwise=True)
    except hq.FormatShapeError:
        return False
    return True


def _assert_equal(got, want, what):
    diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
    assert got.shape == want.shape and torch.equal(got, want), f"{what}: differs (max abs diff {diff})"


class _DirectionSpy:
    """Records (name, rowwise, columnwise) of every quantize call of a quantizer."""

    def __init__(self, quantizer, calls):
        orig = quantizer.quantize

        def spy(x, *, rowwise=None, columnwise=None, name="tensor"):
            calls.append((name, rowwise, columnwise))
            return orig(x, rowwise=rowwise, columnwise=columnwise, name=name)

        quantizer.quantize = spy


# -- what is quantized -----------------------------------------------------------------------------------

@pytest.mark.parametrize("input_requires_grad", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_without_gradients_quantizes_only_the_rowwise_forms(preset, mode, input_requires_grad):
    model = _model(preset)
    calls = []
    for layer in (model[0], model[2]):
        for q in layer.quantizers().values():
            _DirectionSpy(q, calls)
    x = _tokens(32).requires_grad_(input_requires_grad)
    with MODES[mode]():
        model(x)
    assert calls, "nothing was quantized"
    extra = [c for c in calls if c[2] or not c[1]]
    assert not extra, f"{preset} under {mode}: quantized more than fprop reads: {extra}"


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4", "fp8_tensorwise"])
def test_forward_with_nothing_requiring_grad_quantizes_only_the_rowwise_forms(preset):
    model = _model(preset).requires_grad_(False)
    calls = []
    for q in model[0].quantizers().values():
        _DirectionSpy(q, calls)
    model(_tokens(32))
    assert calls and all(c[1] and not c[2] for c in calls), f"{preset}: {calls}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("preset", PRESETS)
def test_one_token_forward_without_gradients_takes_only_the_rowwise_shape_rules(preset, mode):
    model = _model(preset)
    x = _tokens(1).requires_grad_(mode == "no_grad")  # (an inference tensor cannot require grad)
    y = _inference_forward(model, x, mode)
    assert y.shape == (1, 1, OUT)
    _assert_equal(y, _fprop_oracle(model, x.detach()), f"{preset} under {mode}, one token")


# -- is_first_microbatch without gradients ----------------------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "fp8_delayed"])
def test_cached_weight_from_a_forward_without_gradients_serves_the_next_training_step(preset, mode):
    """eval with is_first_microbatch=True (an input that requires grad under no_grad), then a training step
    reusing the cache: outputs and gradients equal those of a layer that never cached."""
    torch.manual_seed(0)
    layer = hq.Linear(IN, HIDDEN, recipe=hq.recipe(preset), name="fc")
    fresh = copy.deepcopy(layer)
    x, gy = _tokens(32)[0], torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(2))
    with MODES[mode]():
        y_eval = layer(x.clone().requires_grad_(mode == "no_grad"), is_first_microbatch=True)
    _assert_equal(y_eval, _fprop_oracle(nn.Sequential(layer), x), f"{preset}: eval output")
    runs = []
    for mod, first in ((layer, False), (fresh, None)):
        xr = x.clone().requires_grad_()
        torch.manual_seed(5)
        y = mod(xr, is_first_microbatch=first)
        y.backward(gy)
        runs.append((y.detach(), xr.grad, mod.weight.grad, mod.bias.grad))
    for name, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), *runs):
        _assert_equal(a, b, f"{preset}: training step after a cached {mode} step, {name}")


# -- generation-style use ----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_generation_of_1_to_17_tokens_under_inference_mode_equals_the_rowwise_fprop(preset):
    model = _model(preset)
    for n in GENERATION_LENGTHS:
        x = _tokens(n, seed=n)
        _assert_equal(_inference_forward(model, x), _fprop_oracle(model, x), f"{preset}, batch 1, {n} tokens")


SAME_TOKENS = [p for p in PRESETS if any(_training_takes(_model(p), n) for n in GENERATION_LENGTHS)]


def test_every_preset_has_a_training_forward_to_compare_with():
    missing = sorted(set(PRESETS) - set(SAME_TOKENS) - set(ROW_LOCAL))
    assert not missing, f"no training-mode comparison for {missing}"


@pytest.mark.parametrize("preset", SAME_TOKENS)
def test_generation_equals_the_training_forward_of_the_same_tokens(preset):
    """Every length 1..17 whose token count the training step's shape rules take (all for per-tensor FP8 and
    FP8 blocks; 16 where a columnwise form needs M % 16)."""
    model = _model(preset)
    lengths = [n for n in GENERATION_LENGTHS if _training_takes(model, n)]
    for n in lengths:
        x = _tokens(n, seed=n)
        _assert_equal(_inference_forward(model, x), _training_forward(model, x), f"{preset}, {n} tokens")


@pytest.mark.parametrize("preset", ROW_LOCAL)
def test_generation_equals_the_training_forward_of_a_full_batch_row_by_row(preset):
    """For row-local forward formats the training forward of a 32-token batch (what the columnwise rules take)
    gives each token the output the generation step gives it."""
    model = _model(preset)
    full = _tokens(32)
    want = _training_forward(model, full)
    for n in GENERATION_LENGTHS:
        _assert_equal(_inference_forward(model, full[:, :n]), want[:, :n], f"{preset}, first {n} of 32 tokens")
