"""GroupedLinear: each expert's GEMMs are bitwise those of a hybridq Linear on its token slice (zero-padded to
the token count the formats' shape rules take), for every preset, backward override, save_original_input and
dtype; zero-token experts; is_first_microbatch caching; no-grad forward; m_splits errors; the expert protocol."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq

from _compare import assert_bitwise
from hybridq.gemm import native_row_multiple
from hybridq.nn.grouped_packed import padded_tokens
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

E, IN, OUT = 3, 64, 32
SPLITS = [17, 0, 40]  # a zero-token expert and counts that are not multiples of 16 / 32
OVERRIDES = [None, "high_precision", "dequantized"]
PRESETS = hq.preset_names()


def _stateful(preset):
    return any(hq.recipe(preset).quantizer(hq.Role("linear", t)).is_stateful
               for t in ("input", "weight", "grad_output"))


CASES = [(p, o) for p in PRESETS for o in OVERRIDES if not (o is not None and _stateful(p))]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def _grouped(preset, override=None, dtype=torch.float32, bias=True, save_original_input=False):
    torch.manual_seed(0)
    return hq.GroupedLinear(E, IN, OUT, bias=bias, dtype=dtype, name="moe",
                            recipe=hq.recipe(preset, backward_override=override),
                            save_original_input=save_original_input)


def _experts_as_linears(g):
    """One hybridq Linear per expert, with a copy of that expert's weight and bias and the same recipe."""
    out = []
    for e in range(E):
        lin = nn.Linear(IN, OUT, bias=g.bias is not None, dtype=g.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(g.weight[e])
            if g.bias is not None:
                lin.bias.copy_(g.bias[e])
        out.append(hq.Linear.from_linear(lin, g.recipe, name=f"moe.experts.{e}",
                                         save_original_input=g.save_original_input))
    return out


def _data(splits, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    t = sum(splits)
    return torch.randn(t, IN, generator=gen).to(dtype), torch.randn(t, OUT, generator=gen).to(dtype)


def _reference(linears, qs, x, gy, splits, grad=True, **kw):
    """Each expert as its own Linear on its slice, zero-padded to the token count its casts take; the experts'
    outputs concatenated, one backward (the same graph order as GroupedLinear's, so stochastic rounding draws
    the same numbers). Returns (y, dx, [dW_e], [db_e])."""
    x = x.detach().clone().requires_grad_(grad)
    outs = []
    quantized_bwd = grad and linears[0].recipe.backward_override is None
    for lin, q, xe, m in zip(linears, qs, x.split(splits), splits):
        if m == 0:
            continue
        n = padded_tokens(m, IN, OUT, q, quantized_bwd, quantized_bwd, native_row_multiple(xe.device))
        ye = lin(F.pad(xe, (0, 0, 0, n - m)), **kw)
        outs.append(ye[:m])
    y = torch.cat(outs)
    if grad:
        y.backward(gy)
        return (y.detach(), x.grad, [l.weight.grad for l in linears],
                [None if l.bias is None else l.bias.grad for l in linears])
    return y, None, None, None


def _run(g, x, gy, splits, grad=True, **kw):
    x = x.detach().clone().requires_grad_(grad)
    y = g(x, splits, **kw)
    if grad:
        y.backward(gy)
        return y.detach(), x.grad, g.weight.grad, g.bias.grad if g.bias is not None else None
    return y, None, None, None


_assert_equal = assert_bitwise  # bit for bit (a -0.0 differs from a 0.0)


def _assert_matches_linears(g, linears, x, gy, splits, grad=True, **kw):
    torch.manual_seed(4)  # stochastic rounding draws from torch's default generator
    ref = _reference(linears, g.expert_quantizers, x, gy, splits, grad, **kw)
    torch.manual_seed(4)
    got = _run(g, x, gy, splits, grad, **kw)
    _assert_equal(got[0], ref[0], "output")
    if not grad:
        return
    _assert_equal(got[1], ref[1], "grad_input")
    for e, m in enumerate(splits):
        if m == 0:
            assert not got[2][e].any(), f"expert {e} has no tokens but a nonzero weight gradient"
            assert got[3] is None or not got[3][e].any(), f"expert {e} has no tokens but a nonzero bias gradient"
            continue
        _assert_equal(got[2][e], ref[2][e], f"grad_weight of expert {e}")
        if got[3] is not None:
            _assert_equal(got[3][e], ref[3][e], f"grad_bias of expert {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("save_original_input", [False, True], ids=["saveq", "saveorig"])
@pytest.mark.parametrize("preset,override", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_bitwise_equal_to_per_expert_linear(preset, override, save_original_input, dtype):
    g = _grouped(preset, override, dtype, save_original_input=save_original_input)
    x, gy = _data(SPLITS, dtype)
    _assert_matches_linears(g, _experts_as_linears(g), x, gy, SPLITS)


@pytest.mark.parametrize("splits", [[0, 0, 57], [1, 2, 3], [16, 32, 48], [17, 31, 33], [0, 64, 0], [5, 0, 0]],
                         ids=str)
@pytest.mark.parametrize("preset", ["mxfp8", "fp8_block", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
def test_m_splits_grid(preset, splits):
    g = _grouped(preset, dtype=torch.bfloat16)
    x, gy = _data(splits, torch.bfloat16)
    _assert_matches_linears(g, _experts_as_linears(g), x, gy, splits)


def test_m_splits_as_tensor_gives_the_list_result():
    g = _grouped("mxfp8")
    x, _ = _data(SPLITS, torch.float32)
    with torch.no_grad():
        assert torch.equal(g(x, torch.tensor(SPLITS)), g(x, SPLITS)), "tensor m_splits gave another result"


@pytest.mark.parametrize("preset,tokens,padded", [("mxfp8", 17, 32), ("mxfp8", 32, 32), ("mxfp8", 1, 32),
                                                  ("fp8_tensorwise", 17, 17)])
def test_padding_only_to_what_the_columnwise_rule_needs(preset, tokens, padded):
    g = _grouped(preset)
    assert padded_tokens(tokens, IN, OUT, g.expert_quantizers[0], True, True) == padded, (
        f"{preset}: {tokens} tokens should be padded to {padded} for the columnwise casts")
    assert padded_tokens(tokens, IN, OUT, g.expert_quantizers[0], False, False) == tokens, (
        f"{preset}: a rowwise-only call should not pad {tokens} tokens")


@pytest.mark.parametrize("preset,tokens,padded", [("fp8_tensorwise", 17, 32), ("fp8_tensorwise", 3, 16),
                                                  ("mxfp8", 17, 32), ("mxfp8", 33, 64), ("fp8_block", 17, 128),
                                                  ("fp8_block", 129, 256), ("nvfp4", 17, 32)])
def test_on_a_gpu_token_counts_are_padded_to_what_the_hardware_gemms_take(preset, tokens, padded):
    """The tensor-core GEMMs need M, N, K % 16 == 0 (wgrad contracts over the tokens), and the block-scaled GEMMs
    whole scaling blocks along it (FP8 1x128: 128 tokens): on CUDA an expert's slice is padded to those multiples
    as well, in every call (forward-only: to 16), instead of running the fp32 emulated GEMM."""
    q = _grouped(preset).expert_quantizers[0]
    multiple = native_row_multiple(torch.device("cuda"))
    assert multiple == 16 and native_row_multiple(torch.device("cpu")) == 1
    assert padded_tokens(tokens, IN, OUT, q, True, True, multiple) == padded, (preset, tokens)
    assert padded_tokens(tokens, IN, OUT, q, False, False, multiple) == -(-tokens // 16) * 16, (preset, tokens)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_without_grad_tiny_counts(preset, mode):
    """Rowwise forms only: tiny per-expert counts need no padding, and the result is the per-expert Linear's."""
    g = _grouped(preset, dtype=torch.bfloat16)
    splits = [1, 0, 3]
    x, gy = _data(splits, torch.bfloat16)
    linears = _experts_as_linears(g)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        torch.manual_seed(4)
        ref = torch.cat([lin(xe) for lin, xe in zip(linears, x.split(splits)) if xe.shape[0]])
        torch.manual_seed(4)
        got = g(x, splits)
    _assert_equal(got, ref, f"{mode} output")


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8", "nvfp4"])
def test_is_first_microbatch_cache_keeps_columnwise_after_eval(preset):
    """eval (no_grad, first micro-batch) then two training micro-batches: the cached weights gain the columnwise
    form, and every step equals the per-expert Linears run with the same is_first_microbatch sequence."""
    g = _grouped(preset)
    linears = _experts_as_linears(g)
    x, gy = _data(SPLITS, torch.float32)
    with torch.no_grad():
        _assert_equal(g(x, SPLITS, is_first_microbatch=True),
                      _reference(linears, g.expert_quantizers, x, gy, SPLITS, False, is_first_microbatch=True)[0],
                      "eval output")
    assert not any(c is not None and c[1].has("columnwise") for c in g._weight_caches), "eval cached columnwise"
    for first in (True, False):
        _assert_matches_linears(g, linears, x, gy, SPLITS, is_first_microbatch=first)
    for e, m in enumerate(SPLITS):
        if m:
            assert g._weight_caches[e][1].has("columnwise"), f"expert {e}: training did not cache columnwise"


def test_roles_carry_the_expert_index():
    """A custom recipe can give expert 1 another format: here high precision (identity) for expert 1 only."""
    mx = hq.recipe("mxfp8")

    def factory(role):
        return None if role.name == "moe.experts.1" else mx.quantizer(role)

    g = hq.GroupedLinear(E, IN, OUT, recipe=hq.CustomRecipe(factory, name="expert1_hp"), name="moe")
    assert [r["weight"] is not None for r in g.expert_quantizers] == [True] * E
    assert type(g.expert_quantizers[1]["weight"]).__name__ == "IdentityQuantizer", "expert 1 not high precision"
    assert type(g.expert_quantizers[0]["weight"]).__name__ == "MXFP8Quantizer", "expert 0 lost its recipe format"
    x, _ = _data([8, 8, 8], torch.float32)
    with torch.no_grad():
        y = g(x, [8, 8, 8])
    assert torch.equal(y[8:16], F.linear(x[8:16], g.weight[1])), "expert 1 was quantized"


@pytest.mark.parametrize("splits,x_shape,match", [
    ([10, 10, 10], (31, IN), "sum to 30 but the input has 31 tokens"),
    ([-1, 16, 16], (31, IN), "must be >= 0"),
    ([10, 10], (20, IN), r"one count per expert \(3\), got 2"),
    ([10, 10, 10], (30, IN + 1), r"\[tokens, 64\]"),
    ([10, 10, 10], (3, 10, IN), r"\[tokens, 64\]"),
])
def test_bad_m_splits_or_input_raise_before_any_state_change(splits, x_shape, match):
    g = _grouped("fp8_delayed")  # stateful: a cast before the check would change the amax history
    before = [q["input"].state_dict() if hasattr(q["input"], "state_dict") else None for q in g.expert_quantizers]
    with pytest.raises(ValueError, match=match) as err:
        g(torch.randn(*x_shape), splits, is_first_microbatch=True)
    assert "moe" in str(err.value), f"the error does not name the layer: {err.value}"
    assert g._weight_caches == [None] * E, "a weight was cached before the error"
    after = [q["input"].state_dict() if hasattr(q["input"], "state_dict") else None for q in g.expert_quantizers]
    assert repr(before) == repr(after), "a quantizer's state changed before the error"


def test_bad_recipe_leaves_the_layer_unchanged():
    g = _grouped("mxfp8")
    with pytest.raises(hq.RecipeError):
        g.recipe = hq.recipe("fp8_delayed", backward_override="dequantized")
    assert g.recipe.name == "mxfp8" and type(g.expert_quantizers[0]["weight"]).__name__ == "MXFP8Quantizer"


# ---- expert protocol ---------------------------------------------------------------------------------------

class SwiGLUExperts(nn.Module):
    """A user's MoE expert module: `[E, out, in]` parameters, grouped products through hybridq.nn.grouped_mm."""

    hybridq_grouped_weights = ("w1", "w2", "w3")

    def __init__(self, e, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, hidden, dim) / dim ** 0.5)
        self.w3 = nn.Parameter(torch.randn(e, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e, dim, hidden) / hidden ** 0.5)

    def forward(self, x, m_splits):
        h = F.silu(hq.grouped_mm(self, "w1", x, m_splits)) * hq.grouped_mm(self, "w3", x, m_splits)
        return hq.grouped_mm(self, "w2", h, m_splits)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = SwiGLUExperts(E, IN, OUT)


def test_expert_protocol_before_conversion_is_high_precision():
    torch.manual_seed(0)
    m = SwiGLUExperts(E, IN, OUT)
    x, _ = _data(SPLITS, torch.float32)
    ref = []
    for e, xe in enumerate(x.split(SPLITS)):
        ref.append(F.linear(F.silu(F.linear(xe, m.w1[e])) * F.linear(xe, m.w3[e]), m.w2[e]))
    assert torch.equal(m(x, SPLITS), torch.cat(ref)), "unconverted grouped_mm is not the high-precision product"


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4"])
def test_convert_experts_uses_grouped_linear_and_keeps_the_model(preset):
    torch.manual_seed(0)
    model = Block()
    keys = list(model.state_dict())
    params = list(model.parameters())
    report = hq.convert_experts(model, hq.recipe(preset))
    assert sorted(report) == ["experts.w1", "experts.w2", "experts.w3"], f"report: {report}"
    assert list(model.state_dict()) == keys, "conversion changed the state_dict keys"
    assert list(model.parameters()) == params, "conversion changed the parameters"
    ex = model.experts
    direct = {n: hq.GroupedLinear.from_parameters(getattr(ex, n), recipe=hq.recipe(preset), name=f"experts.{n}")
              for n in ("w1", "w2", "w3")}
    x, _ = _data(SPLITS, torch.float32)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))  # the experts map dim -> dim
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(4)
    y = ex(xa, SPLITS)
    y.backward(gy)
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    torch.manual_seed(4)
    h = F.silu(direct["w1"](xb, SPLITS)) * direct["w3"](xb, SPLITS)
    y_ref = direct["w2"](h, SPLITS)
    y_ref.backward(gy)
    _assert_equal(y.detach(), y_ref.detach(), "converted expert output")
    _assert_equal(xa.grad, xb.grad, "converted expert grad_input")
    for p, gr in zip(params, grads):
        _assert_equal(gr, p.grad, "converted expert weight grad")


def test_convert_experts_rejects_a_listed_name_that_is_not_a_parameter():
    class Bad(nn.Module):
        hybridq_grouped_weights = ("w1", "w9")

        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(E, OUT, IN))

    m = nn.Sequential(Bad())
    with pytest.raises(ValueError, match=r"0\.w9 is listed in hybridq_grouped_weights but is not a parameter"):
        hq.convert_experts(m, hq.recipe("mxfp8"))
    assert "_hybridq_grouped" not in m[0].__dict__, "a module was converted before the error"


@pytest.mark.parametrize("preset", [p for p in PRESETS if not _stateful(p)])
def test_high_precision_override_grads_are_those_of_an_unquantized_grouped_gemm(preset):
    g = _grouped(preset, "high_precision", torch.bfloat16)
    x, gy = _data(SPLITS, torch.bfloat16)
    _, dx, dw, db = _run(g, x, gy, SPLITS)
    w = g.weight.detach().clone().requires_grad_()
    b = g.bias.detach().clone().requires_grad_()
    xr = x.clone().requires_grad_()
    y = torch.cat([F.linear(xe, w[e], b[e]) for e, xe in enumerate(xr.split(SPLITS))])
    y.backward(gy)
    _assert_equal(dx, xr.grad, "high_precision grad_input")
    _assert_equal(dw, w.grad, "high_precision grad_weight")
    _assert_equal(db, b.grad, "high_precision grad_bias")


@pytest.mark.parametrize("preset", ["mxfp8", "fp8_tensorwise"])
def test_no_tokens_at_all_gives_zero_gradients(preset):
    g = _grouped(preset)
    x = torch.zeros(0, IN, requires_grad=True)
    y = g(x, [0, 0, 0])
    assert y.shape == (0, OUT) and y.requires_grad, f"empty call gave {tuple(y.shape)}, requires_grad={y.requires_grad}"
    y.sum().backward()
    assert g.weight.grad is not None and not g.weight.grad.any(), "weight gradient of an empty call is not zero"
    assert not g.bias.grad.any(), "bias gradient of an empty call is not zero"


def test_the_path_choice_compares_the_experts_quantizers_once_per_recipe(monkeypatch):
    """Which path runs (packed / jagged / per expert) depends on the experts' quantizers only: they are compared
    (E x 3 quantizer comparisons) once per recipe, not at every call; a new recipe is looked at again."""
    import hybridq.nn.grouped as grouped_mod
    real, calls = grouped_mod.packed_quantizers, []
    monkeypatch.setattr(grouped_mod, "packed_quantizers", lambda qs: calls.append(1) or real(qs))
    g = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe("fp8_tensorwise"), name="moe")
    x, _ = _data(SPLITS, torch.float32)
    for _ in range(3):
        g(x, SPLITS).sum().backward()
    assert len(calls) == 1, f"the experts' quantizers were compared {len(calls)} times in 3 calls"
    g.recipe = hq.recipe("mxfp8")
    g(x, SPLITS)
    assert len(calls) == 2, "a new recipe reused the old path choice"
