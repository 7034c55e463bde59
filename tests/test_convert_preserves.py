"""Conversion keeps everything a module does and owns, or leaves the module as it is with the reason in the report
(and raises with on_incompatible="error" before anything changes); a layer is reported converted only if its
forward runs; the entry points take a preset name as the recipe."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

import hybridq as hq
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

from _conversion_models import D, AttentionBlock  # (inputs have 32 tokens: every preset's row rules)
RECIPE = hq.recipe("fp8_tensorwise")  # (the recipe argument's own tests pass names)


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def _apply_hybrid_fsdp(model, recipe, **kw):
    return hq.apply_hybrid_fsdp(model, recipe, **kw)


CONVERTERS = {"convert_linears": hq.convert_linears, "apply_hybrid_fsdp": _apply_hybrid_fsdp}


def _x(*lead):
    return torch.randn(*(lead or (32,)), D, generator=torch.Generator().manual_seed(1))


# -- modules the swap would lose behaviour of -------------------------------------------------------------------------

class LoRALinear(nn.Linear):
    """LoRA-style: the subclass's forward adds B(A(x)) through parameters of its own."""

    def __init__(self, i, o, r=4):
        super().__init__(i, o)
        self.lora_a = nn.Parameter(torch.randn(r, i) / i)
        self.lora_b = nn.Parameter(torch.randn(o, r))

    def forward(self, x):
        return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class ScaledLinear(nn.Linear):
    """No forward of its own, but a buffer (e.g. a mask or a scale another module reads)."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.register_buffer("scale", torch.full((o,), 2.0))


class AdapterLinear(nn.Linear):
    """No forward of its own, but a submodule another module calls."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.adapter = nn.LayerNorm(o)


class ExtraStateLinear(nn.Linear):
    """Overrides what state_dict writes."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "note"] = torch.tensor(1.0)


def _hooked(register):
    def make():
        lin = nn.Linear(D, D)
        register(lin)
        return lin
    return make


def _compiled():
    lin = nn.Linear(D, D)
    lin.compile(backend="eager")  # (lazy: compiles at the first call)
    return lin


def _attribute_clash():
    lin = nn.Linear(D, D)
    lin.name = "my projection"  # hybridq.nn.Linear has a `name` of its own
    return lin


# id -> (module factory, what the reason must say)
KEPT = {
    "own_forward_and_parameters": (lambda: LoRALinear(D, D), r"class LoRALinear overrides Linear\.forward"),
    "buffer": (lambda: ScaledLinear(D, D), r"owns buffer 'scale'"),
    "submodule": (lambda: AdapterLinear(D, D), r"owns submodule 'adapter'"),
    "state_dict_override": (lambda: ExtraStateLinear(D, D), r"overrides Linear\._save_to_state_dict"),
    "forward_hook": (_hooked(lambda m: m.register_forward_hook(lambda mod, i, o: o * 2)), r"forward hooks"),
    "forward_pre_hook": (_hooked(lambda m: m.register_forward_pre_hook(lambda mod, i: (i[0] * 2,))),
                         r"forward pre-hooks"),
    "backward_hook": (_hooked(lambda m: m.register_full_backward_hook(lambda mod, gi, go: None)), r"backward hooks"),
    "state_dict_hook": (_hooked(lambda m: m.register_state_dict_post_hook(
        lambda mod, sd, prefix, lm: sd.__setitem__(prefix + "tag", torch.tensor(3.0)))), r"state_dict hooks"),
    "load_state_dict_hook": (_hooked(lambda m: m.register_load_state_dict_pre_hook(lambda *a: None)),
                             r"load_state_dict pre-hooks"),
    "module_compile": (_compiled, r"compiled with Module\.compile\(\)"),
    "attribute_clash": (_attribute_clash, r"attribute\(s\) name would be replaced"),
}


def _cls(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("convert", list(CONVERTERS))
@pytest.mark.parametrize("case", list(KEPT))
def test_a_module_the_swap_would_lose_behaviour_of_is_kept_with_the_reason(case, convert):
    """The module stays (the same object, same output, same state_dict), the report says why, the plain Linear beside
    it is still converted."""
    factory, reason = KEPT[case]
    torch.manual_seed(0)
    model = nn.Sequential(factory(), nn.Linear(D, D))
    kept = model[0]
    x = _x()
    y0 = kept(x).detach()
    sd0 = _state(model)
    report = CONVERTERS[convert](model, RECIPE)
    assert model[0] is kept, f"{_cls(kept)} was replaced by {_cls(model[0])}"
    assert isinstance(model[1], hq.Linear), "the plain Linear beside it was not converted"
    assert report.converted == ["1"], report.table()
    assert "0" in report.skipped, report.table()
    assert re.search(reason, report.skipped["0"]), report.skipped["0"]
    assert torch.equal(kept(x), y0), "the kept module's output changed"
    sd = model.state_dict()
    assert sd.keys() == sd0.keys(), f"state_dict keys changed: {sorted(set(sd) ^ set(sd0))}"
    for k, v in sd0.items():
        assert torch.equal(torch.as_tensor(sd[k]), v), f"state_dict[{k!r}] changed"


@pytest.mark.parametrize("case", list(KEPT))
def test_error_mode_names_the_module_and_the_rule_before_anything_changes(case):
    factory, reason = KEPT[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), factory(), nn.RMSNorm(D))
    with pytest.raises(ValueError, match=r"cannot convert layer '1' \(\w+\) to hybridq\.nn\.Linear without losing "
                                         r"behaviour: .*" + reason):
        hq.convert_linears(model, RECIPE, on_incompatible="error")
    assert [type(m) for m in model] == [nn.Linear, type(model[1]), nn.RMSNorm], "a module was replaced before the error"


def _symmetric_linear():
    class Symmetric(nn.Module):
        def forward(self, w):
            return (w + w.T) / 2

    lin = nn.Linear(D, D)
    parametrize.register_parametrization(lin, "weight", Symmetric())
    return lin


@pytest.mark.parametrize("convert", list(CONVERTERS))
def test_a_parametrized_weight_is_kept_and_still_trains(convert):
    torch.manual_seed(0)
    model = nn.Sequential(_symmetric_linear(), nn.Linear(D, D))
    report = CONVERTERS[convert](model, RECIPE)
    assert "parametrized (torch.nn.utils.parametrize)" in report.skipped.get("0", ""), report.table()
    names = dict(model.named_parameters())
    assert "0.parametrizations.weight.original" in names, f"the parametrization's parameter is gone: {sorted(names)}"
    model(_x()).sum().backward()
    assert names["0.parametrizations.weight.original"].grad is not None, "the parametrized weight no longer trains"


def test_the_swap_keeps_the_training_flag_and_plain_attributes():
    lin = nn.Linear(D, D)
    lin.is_residual_projection = True  # a tag an init function or a parallel plan reads
    lin.eval()
    model = nn.Sequential(lin)
    hq.convert_linears(model, RECIPE)
    assert isinstance(model[0], hq.Linear)
    assert getattr(model[0], "is_residual_projection", None) is True, "the instance attribute was lost"
    assert model[0].training is False, "an eval-mode layer came back in training mode"


def test_a_linear_subclass_without_behaviour_of_its_own_is_converted():
    class Tagged(nn.Linear):
        def __init__(self, i, o):
            super().__init__(i, o)

        def extra_repr(self):
            return "tagged " + super().extra_repr()

    model = nn.Sequential(Tagged(D, D))
    report = hq.convert_linears(model, RECIPE)
    assert report.converted == ["0"] and isinstance(model[0], hq.Linear), report.table()


# -- norms: the same check ---------------------------------------------------------------------------------------------

def _parametrized_norm():
    norm = nn.RMSNorm(D)
    parametrize.register_parametrization(norm, "weight", nn.Softplus())
    return norm


def _norm_with_state_dict_hook():
    norm = nn.RMSNorm(D)
    norm.register_state_dict_post_hook(lambda mod, sd, prefix, lm: sd.__setitem__(prefix + "tag", torch.tensor(1.0)))
    return norm


class BufferedRMSNorm(nn.RMSNorm):
    def __init__(self, d):
        super().__init__(d)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))


NORMS_KEPT = {
    "parametrized_weight": (_parametrized_norm, "parametrized (torch.nn.utils.parametrize)"),
    "state_dict_hook": (_norm_with_state_dict_hook, "state_dict hooks"),
    "buffer": (lambda: BufferedRMSNorm(D), "owns buffer 'steps'"),
}


@pytest.mark.parametrize("case", list(NORMS_KEPT))
def test_a_norm_the_swap_would_lose_behaviour_of_is_kept_with_the_reason(case):
    factory, reason = NORMS_KEPT[case]
    torch.manual_seed(0)
    model = nn.Sequential(factory(), nn.RMSNorm(D))
    kept = model[0]
    sd0 = _state(model)
    reports = {r.name: r for r in hq.convert_norms(model)}
    assert model[0] is kept and isinstance(model[1], hq.RMSNorm), [type(m).__name__ for m in model]
    assert not reports["0"].converted and reason in reports["0"].reason, reports["0"]
    assert model.state_dict().keys() == sd0.keys()


# -- a layer is reported converted only if its forward runs ------------------------------------------------------------

class TiedHead(nn.Module):
    """Reads proj's weight itself (F.linear) although proj is a Linear child."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(F.linear(x, self.proj.weight, self.proj.bias))


class DtypeReader(nn.Module):
    """Reads only proj's weight's dtype (not its value) and calls proj."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        if self.proj.weight is not None and x.dtype != self.proj.weight.dtype:
            x = x.to(self.proj.weight.dtype)
        return self.proj(x)


# id -> (model factory, {layer kept: the reader named in its reason}, layers converted)
READ_DIRECTLY = {
    "multihead_attention": (AttentionBlock, {"attn.out_proj": "MultiheadAttention.forward"}, ["ff"]),
    "transformer_encoder_layer": (
        lambda: nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True),
        {"self_attn.out_proj": "MultiheadAttention.forward", "linear1": "TransformerEncoderLayer.forward",
         "linear2": "TransformerEncoderLayer.forward"}, []),
    "transformer_decoder_layer": (
        lambda: nn.TransformerDecoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True),
        {"self_attn.out_proj": "MultiheadAttention.forward", "multihead_attn.out_proj": "MultiheadAttention.forward"},
        ["linear1", "linear2"]),
    "user_module_reading_a_weight": (TiedHead, {"proj": "TiedHead.forward"}, ["out"]),
    "user_module_reading_a_dtype": (DtypeReader, {}, ["proj"]),
}


@pytest.mark.parametrize("convert", list(CONVERTERS))
@pytest.mark.parametrize("case", list(READ_DIRECTLY))
def test_a_layer_whose_weight_its_owner_reads_itself_is_kept_with_the_reason(case, convert):
    factory, kept, converted = READ_DIRECTLY[case]
    torch.manual_seed(0)
    report = CONVERTERS[convert](factory(), RECIPE)
    assert sorted(report.converted) == sorted(converted), report.table()
    for name, reader in kept.items():
        assert f"{reader} reads self." in report.skipped.get(name, ""), f"{name}:\n{report.table()}"


def _call(model, x):
    return model(x, x) if isinstance(model, nn.TransformerDecoderLayer) else model(x)


@pytest.mark.parametrize("case", list(READ_DIRECTLY))
def test_every_layer_reported_converted_runs_its_forward(case, monkeypatch):
    """In training and in inference (eval + no_grad: nn.TransformerEncoderLayer's fused fast path)."""
    factory, _, _ = READ_DIRECTLY[case]
    torch.manual_seed(0)
    model = factory()
    report = hq.convert_linears(model, RECIPE)
    calls = {}
    forward = hq.Linear.forward

    def counting(self, *a, **kw):  # (patched on the class: a module hook would itself turn fast paths off)
        calls[self] = calls.get(self, 0) + 1
        return forward(self, *a, **kw)

    monkeypatch.setattr(hq.Linear, "forward", counting)
    x = _x(2, 16)
    silent = {}
    for mode in ("train", "inference"):
        calls.clear()
        model.train(mode == "train")
        with torch.set_grad_enabled(mode == "train"):
            _call(model, x)
        silent[mode] = [n for n in report.converted if calls.get(model.get_submodule(n), 0) == 0]
    assert not any(silent.values()), f"reported converted, forward not run: {silent}\n{report.table()}"


# -- the recipe argument -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("convert", list(CONVERTERS))
def test_a_preset_name_is_taken_as_that_preset(convert):
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(D, D)), nn.Sequential(nn.Linear(D, D))
    by_name = CONVERTERS[convert](a, "mxfp8")
    by_recipe = CONVERTERS[convert](b, hq.recipe("mxfp8"))
    assert a[0].recipe == hq.recipe("mxfp8")
    assert by_name.layers == by_recipe.layers


@pytest.mark.parametrize("convert", list(CONVERTERS))
@pytest.mark.parametrize("bad", [None, 3, hq.MXFP8Quantizer(), hq.recipe], ids=["None", "int", "quantizer", "function"])
def test_a_recipe_argument_of_another_type_is_a_type_error_naming_it(convert, bad):
    model = nn.Sequential(nn.Linear(D, D))
    with pytest.raises(TypeError, match=rf"{convert}: recipe must be a hybridq recipe .* or a preset name "
                                        rf"\(fp8_tensorwise, .*\), got {type(bad).__name__}"):
        CONVERTERS[convert](model, bad)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("convert", list(CONVERTERS))
def test_an_unknown_preset_name_is_a_recipe_error_listing_the_presets(convert):
    model = nn.Sequential(nn.Linear(D, D))
    with pytest.raises(hq.RecipeError, match=rf"{convert}: recipe='mxfp9' is not a preset; presets: fp8_tensorwise"):
        CONVERTERS[convert](model, "mxfp9")
    assert type(model[0]) is nn.Linear


def test_linear_takes_a_preset_name_as_its_recipe_and_refuses_other_types():
    layer = hq.Linear(D, D, recipe="mxfp8")
    assert layer.recipe == hq.recipe("mxfp8")
    layer.recipe = "fp8_block"
    assert layer.recipe == hq.recipe("fp8_block")
    with pytest.raises(TypeError, match=r"recipe must be a hybridq recipe .* got int"):
        layer.recipe = 3
    assert layer.recipe == hq.recipe("fp8_block"), "a refused recipe changed the layer"


def test_grouped_linear_and_convert_experts_take_a_preset_name():
    layer = hq.GroupedLinear(2, D, D, recipe="mxfp8")
    assert layer.recipe == hq.recipe("mxfp8")
    layer.recipe = "fp8_block"
    assert layer.recipe == hq.recipe("fp8_block")
    with pytest.raises(TypeError, match=r"convert_experts: recipe must be a hybridq recipe .* got int"):
        hq.convert_experts(nn.Sequential(), 3)
    with pytest.raises(hq.RecipeError, match=r"convert_experts: recipe='mxfp9' is not a preset"):
        hq.convert_experts(nn.Sequential(), "mxfp9")
