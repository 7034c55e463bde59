"""Recipes: presets by name, the role-based factory and the backward override."""

import pytest
import torch

import hybridq as hq
from hybridq.recipe import BACKWARD_OVERRIDE_ENV, Role

PRESETS = hq.preset_names()
REQUIRED = ["fp8_tensorwise", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
            "fp8_block_fwd_mxfp8_bwd", "fp8_fwd_high_precision_bwd"]


def q_for(recipe, tensor_type, name="layer"):
    return recipe.quantizer(Role("linear", tensor_type, name))


@pytest.mark.parametrize("name", REQUIRED)
def test_required_preset_is_selectable_by_name(name):
    r = hq.recipe(name)
    assert r.name == name
    for t in ("input", "weight", "grad_output"):
        assert isinstance(q_for(r, t), hq.Quantizer), f"{name}: no quantizer for {t}"


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown recipe 'fp9'.*fp8_tensorwise"):
        hq.recipe("fp9")


def test_fp8_tensorwise_uses_e4m3_forward_and_e5m2_gradients():
    r = hq.recipe("fp8_tensorwise")
    assert q_for(r, "input").dtype == torch.float8_e4m3fn
    assert q_for(r, "weight").dtype == torch.float8_e4m3fn
    assert q_for(r, "grad_output").dtype == torch.float8_e5m2
    assert q_for(r, "input").scaling == "current"


def test_fp8_delayed_is_stateful():
    assert all(q_for(hq.recipe("fp8_delayed"), t).is_stateful for t in ("input", "weight", "grad_output"))


def test_fp8_block_uses_1x128_activations_and_128x128_weights():
    r = hq.recipe("fp8_block")
    assert q_for(r, "input").block_dim == 1 and q_for(r, "grad_output").block_dim == 1
    assert q_for(r, "weight").block_dim == 2


def test_nvfp4_preset_weights_2d_inputs_rht_grads_rht_and_sr():
    r = hq.recipe("nvfp4")
    w, x, g = q_for(r, "weight"), q_for(r, "input"), q_for(r, "grad_output")
    assert (w.block_2d, w.rht, w.stochastic_rounding) == (True, False, False)
    assert (x.block_2d, x.rht, x.stochastic_rounding) == (False, True, False)
    assert (g.block_2d, g.rht, g.stochastic_rounding) == (False, True, True)


@pytest.mark.parametrize("name, row, col", [
    ("mxfp8_fwd_nvfp4_bwd", hq.MXFP8Quantizer, hq.NVFP4Quantizer),
    ("fp8_block_fwd_mxfp8_bwd", hq.Float8BlockQuantizer, hq.MXFP8Quantizer),
    ("fp8_fwd_high_precision_bwd", hq.Float8Quantizer, hq.IdentityQuantizer),
])
def test_hybrid_presets_pair_forward_and_backward_formats(name, row, col):
    for t in ("input", "weight"):
        q = q_for(hq.recipe(name), t)
        assert isinstance(q, hq.HybridQuantizer), f"{name} {t}: {q!r}"
        assert isinstance(q.rowwise, row) and isinstance(q.columnwise, col), f"{name} {t}: {q!r}"


def test_custom_recipe_factory_sees_the_role():
    seen = []

    def factory(role):
        seen.append(role)
        return hq.MXFP8Quantizer() if role.name == "fc1" else None

    r = hq.CustomRecipe(factory)
    assert isinstance(q_for(r, "weight", "fc1"), hq.MXFP8Quantizer)
    assert isinstance(q_for(r, "weight", "fc2"), hq.IdentityQuantizer), "None must keep high precision"
    assert seen[0] == Role("linear", "weight", "fc1")


def test_custom_recipe_factory_must_return_a_quantizer():
    with pytest.raises(TypeError, match="not a hybridq Quantizer"):
        q_for(hq.CustomRecipe(lambda role: "mxfp8"), "input")


def test_role_rejects_unknown_tensor_type():
    with pytest.raises(ValueError, match="tensor_type must be one of"):
        Role("linear", "activation")


@pytest.mark.parametrize("value", [None, "high_precision", "dequantized"])
def test_backward_override_on_recipe(value, monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    assert hq.recipe("mxfp8", backward_override=value).backward_override == value


def test_backward_override_unknown_value_is_an_error():
    with pytest.raises(ValueError, match="backward_override must be one of"):
        hq.recipe("mxfp8", backward_override="fp32")


@pytest.mark.parametrize("value", ["high_precision", "dequantized"])
def test_backward_override_from_environment(value, monkeypatch):
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, value)
    assert hq.recipe("mxfp8").backward_override == value


def test_backward_override_recipe_value_wins_over_environment(monkeypatch):
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "high_precision")
    assert hq.recipe("mxfp8", backward_override="dequantized").backward_override == "dequantized"


def test_backward_override_unknown_environment_value_is_an_error(monkeypatch):
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "bogus")
    with pytest.raises(ValueError, match=f"environment {BACKWARD_OVERRIDE_ENV}.*'bogus'"):
        hq.recipe("mxfp8").backward_override


@pytest.mark.parametrize("spelling", ["default", "DEFAULT", "Default"])
def test_default_names_the_default_override_on_a_recipe(spelling, monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)
    assert hq.recipe("mxfp8", backward_override=spelling).backward_override is None


@pytest.mark.parametrize("spelling", ["default", "DEFAULT", "Default"])
def test_default_names_the_default_override_in_the_environment(spelling, monkeypatch):
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, spelling)
    assert hq.recipe("mxfp8").backward_override is None


def test_unknown_override_is_a_recipe_error(monkeypatch):
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "bogus")
    with pytest.raises(hq.RecipeError):
        hq.recipe("mxfp8").backward_override


def test_factory_exception_is_a_recipe_error_naming_recipe_and_role():
    def factory(role):
        return hq.Float8Quantizer(scaling="sometimes")

    with pytest.raises(hq.RecipeError, match=r"recipe 'mine': qfactory raised ValueError for Role\(.*'weight'.*"
                                             r"scaling must be one of \[.current., .delayed.\]"):
        q_for(hq.CustomRecipe(factory, name="mine"), "weight")


def test_recipes_with_the_same_factory_name_and_override_are_equal():
    assert hq.recipe("mxfp8") == hq.recipe("mxfp8")
    assert hq.recipe("mxfp8") != hq.recipe("nvfp4")
    assert hq.recipe("mxfp8") != hq.recipe("mxfp8", backward_override="dequantized")
