"""convert_linears / apply_hybrid_fsdp: what gets converted, what is skipped (shape rules only), what raises
before anything changes (recipe errors), re-conversion of converted layers, and the report."""

import logging

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

IN = 96


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def _assert_same_run(a, b) -> None:
    """Two (output, parameter gradients) results are bitwise equal."""
    (y1, g1), (y2, g2) = a, b
    assert torch.equal(y1, y2), f"output differs (max abs diff {(y1 - y2).abs().max().item():g})"
    for i, (u, v) in enumerate(zip(g1, g2)):
        assert torch.equal(u, v), f"gradient of parameter {i} differs"


def _model(k=IN):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, 64), nn.ReLU(), nn.Linear(64, 32))


def _types(model):
    return [type(m).__name__ for m in model if not isinstance(m, nn.ReLU)]


def _apply_hybrid_fsdp(model, recipe, **kw):
    return hq.apply_hybrid_fsdp(model, recipe, **kw)


CONVERTERS = {"convert_linears": hq.convert_linears, "apply_hybrid_fsdp": _apply_hybrid_fsdp}


# -- conversion and skips ------------------------------------------------------------------------------

def test_convert_linears_swaps_in_place_and_shares_parameters():
    m = _model()
    w0 = m[0].weight
    report = hq.convert_linears(m, hq.recipe("mxfp8"))
    assert isinstance(m[0], hq.Linear) and isinstance(m[2], hq.Linear)
    assert m[0].weight is w0, "parameters must be shared, not copied"
    assert report.converted == ["0", "2"]
    assert report.layers[0].formats["weight"] == "MXFP8 E4M3"


def test_convert_linears_filter():
    m = _model()
    report = hq.convert_linears(m, hq.recipe("mxfp8"), module_filter_fn=lambda mod, fqn: fqn != "2")
    assert isinstance(m[0], hq.Linear) and type(m[2]) is nn.Linear
    assert report.converted == ["0"]


def test_convert_linears_skips_incompatible_layers_with_a_logged_reason(caplog):
    m = _model(k=100)  # K=100 is not a multiple of 32
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        report = hq.convert_linears(m, hq.recipe("mxfp8"))
    assert type(m[0]) is nn.Linear and isinstance(m[2], hq.Linear)
    assert "K % 32 == 0, got K=100 for weight of 0" in report.skipped["0"]
    assert "keeping layer '0' in high precision: MXFP8" in caplog.text, caplog.text


def test_convert_linears_error_mode_raises_before_changing_anything():
    m = _model(k=100)
    with pytest.raises(hq.FormatShapeError, match=r"MXFP8 E4M3 needs K % 32 == 0, got K=100 for weight of 0"):
        hq.convert_linears(m, hq.recipe("mxfp8"), on_incompatible="error")
    assert type(m[0]) is nn.Linear and type(m[2]) is nn.Linear, "a layer was replaced before the error"


def test_shape_rule_violations_are_format_shape_errors_and_value_errors():
    with pytest.raises(hq.FormatShapeError) as e:
        hq.MXFP8Quantizer().validate((64, 100), "weight of fc")
    assert isinstance(e.value, ValueError)


def test_convert_linears_report_table_lists_formats():
    m = _model()
    table = hq.convert_linears(m, hq.recipe("mxfp8_fwd_nvfp4_bwd")).table()
    assert "hybrid[MXFP8 E4M3 / NVFP4 (RHT)]" in table and "NVFP4 (RHT, SR)" in table


def _table_cells(table: str) -> list[dict[str, str]]:
    """The table's rows as {column: cell}, cut at the header's column starts."""
    header, *rows = table.splitlines()
    names = header.split()
    starts = [header.index(n) for n in names] + [None]
    return [{n: r[a:b].strip() for n, a, b in zip(names, starts, starts[1:])} for r in rows]


def test_report_table_puts_a_skip_reason_in_its_own_column():
    m = _model(k=100)
    cells = _table_cells(hq.convert_linears(m, hq.recipe("mxfp8")).table())
    skipped = next(c for c in cells if c["layer"] == "0")
    assert skipped["status"] == "skipped", skipped
    assert skipped.get("input") == "" and "K % 32 == 0" in skipped.get("reason", ""), \
        f"the skip reason should be in a 'reason' column, not under input: {skipped}"
    converted = next(c for c in cells if c["layer"] == "2")
    assert converted["input"] == "MXFP8 E4M3" and converted["reason"] == "", converted


# -- recipe errors raise before anything is replaced -----------------------------------------------------

@pytest.mark.parametrize("convert", list(CONVERTERS))
def test_unknown_environment_override_raises_before_any_layer_is_replaced(convert, monkeypatch):
    m = _model()
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "bogus")
    with pytest.raises(ValueError, match=f"{BACKWARD_OVERRIDE_ENV}.*'bogus'"):
        CONVERTERS[convert](m, hq.recipe("mxfp8"))
    assert _types(m) == ["Linear", "Linear"] and all(type(l) is nn.Linear for l in (m[0], m[2])), \
        f"{convert}: layers were replaced although the override is invalid: {_types(m)}"


@pytest.mark.parametrize("on_incompatible", ["skip", "error"])
@pytest.mark.parametrize("source", ["recipe", "environment"])
def test_override_with_delayed_scaling_raises_before_any_layer_is_replaced(source, on_incompatible, monkeypatch):
    m = _model()
    if source == "environment":
        monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "dequantized")
        r = hq.recipe("fp8_delayed")
    else:
        r = hq.recipe("fp8_delayed", backward_override="dequantized")
    with pytest.raises(ValueError, match="backward_override='dequantized' cannot be combined with delayed scaling"):
        hq.convert_linears(m, r, on_incompatible=on_incompatible)
    assert all(type(l) is nn.Linear for l in (m[0], m[2])), f"a layer was replaced ({source}, {on_incompatible})"


def test_override_with_delayed_scaling_raises_from_apply_hybrid_fsdp(monkeypatch):
    m = _model()
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "high_precision")
    with pytest.raises(ValueError, match="delayed scaling"):
        hq.apply_hybrid_fsdp(m, hq.recipe("fp8_delayed"))
    assert all(type(l) is nn.Linear for l in (m[0], m[2])), "a layer was replaced"


def _bad_format_config(role):
    return hq.NVFP4Quantizer(block_2d=True, rht=True)  # the quantizer refuses this combination


def _failing_factory(role):
    raise KeyError(f"no quantizer configured for {role.name}")


@pytest.mark.parametrize("factory", [_bad_format_config, _failing_factory], ids=["invalid_quantizer", "raising"])
def test_a_failing_recipe_factory_raises_in_skip_mode_and_replaces_nothing(factory):
    m = _model()
    with pytest.raises(hq.RecipeError, match=r"recipe 'custom': qfactory raised .* for Role\(module_type='linear'"):
        hq.convert_linears(m, hq.CustomRecipe(factory), on_incompatible="skip")
    assert all(type(l) is nn.Linear for l in (m[0], m[2])), "a layer was replaced"


def test_a_factory_returning_no_quantizer_raises_in_skip_mode():
    m = _model()
    with pytest.raises(TypeError, match="not a hybridq Quantizer"):
        hq.convert_linears(m, hq.CustomRecipe(lambda role: "mxfp8"), on_incompatible="skip")
    assert all(type(l) is nn.Linear for l in (m[0], m[2])), "a layer was replaced"


def test_a_recipe_error_after_a_compatible_layer_replaces_nothing():
    """The second layer's role makes the factory fail: the first layer, which was fine, stays unconverted."""
    m = _model()

    def factory(role):
        if role.name == "2":
            raise ValueError("layer 2 has no format")
        return hq.MXFP8Quantizer()

    with pytest.raises(hq.RecipeError, match="layer 2 has no format"):
        hq.convert_linears(m, hq.CustomRecipe(factory))
    assert type(m[0]) is nn.Linear, "the first layer was replaced before the second one's recipe error"


def test_default_override_names_the_default_mode_in_convert(monkeypatch):
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "DEFAULT")
    m = _model()
    report = hq.convert_linears(m, hq.recipe("mxfp8"), on_incompatible="error")
    assert report.converted == ["0", "2"] and m[0].recipe.backward_override is None


# -- converting a converted model ----------------------------------------------------------------------

def _outputs(model, x):
    torch.manual_seed(3)
    return model(x)


@pytest.mark.parametrize("convert", list(CONVERTERS))
def test_converting_again_with_another_recipe_applies_it(convert):
    m = _model()
    hq.convert_linears(m, hq.recipe("mxfp8"))
    layers = [m[0], m[2]]
    report = CONVERTERS[convert](m, hq.recipe("fp8_block"))
    assert [m[0], m[2]] == layers, "re-conversion should keep the modules (and their parameters)"
    for name, layer in (("0", m[0]), ("2", m[2])):
        assert layer.recipe.name == "fp8_block", f"{convert}: layer {name} kept recipe {layer.recipe.name!r}"
        assert layer.describe_formats()["weight"] == "FP8-block E4M3 128x128", f"{convert}: {layer.describe_formats()}"
    assert report.converted == ["0", "2"]
    assert [l.status for l in report.layers] == ["re-converted (was mxfp8)"] * 2, report.table()


def test_re_converted_model_computes_what_a_fresh_conversion_computes():
    m, fresh = _model(), _model()
    x = torch.randn(2, 32, IN)
    hq.convert_linears(m, hq.recipe("nvfp4"))
    with torch.no_grad():
        m[0](x, is_first_microbatch=True)  # a cached quantized weight of the old recipe
    hq.convert_linears(m, hq.recipe("fp8_block"))
    hq.convert_linears(fresh, hq.recipe("fp8_block"))
    got = m[0](x, is_first_microbatch=False)
    want = fresh[0](x)
    assert torch.equal(got, want), f"max abs diff {(got - want).abs().max().item():g}"


def test_converting_again_with_an_equal_recipe_changes_nothing():
    m = _model()
    hq.convert_linears(m, hq.recipe("mxfp8"))
    quantizers = m[0].quantizers()
    report = hq.convert_linears(m, hq.recipe("mxfp8"))
    assert m[0].quantizers() == quantizers and all(a is b for a, b in zip(m[0].quantizers().values(),
                                                                            quantizers.values()))
    assert [l.status for l in report.layers] == ["already converted"] * 2, report.table()
    assert report.converted == ["0", "2"]


def test_re_conversion_a_layer_cannot_take_keeps_its_recipe_and_says_so(caplog):
    m = nn.Sequential(nn.Linear(48, 64))  # K=48: FP8 blocks take it, MXFP8 (K % 32) does not
    hq.convert_linears(m, hq.recipe("fp8_block"))
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        report = hq.convert_linears(m, hq.recipe("mxfp8"))
    assert m[0].recipe.name == "fp8_block"
    assert report.layers[0].status == "skipped (keeps fp8_block)" and "K % 32" in report.skipped["0"]
    assert "keeping layer '0' with its recipe 'fp8_block'" in caplog.text, caplog.text


def test_re_conversion_with_a_recipe_error_changes_no_layer():
    m = _model()
    hq.convert_linears(m, hq.recipe("fp8_tensorwise"))
    with pytest.raises(ValueError, match="cannot be combined with delayed scaling"):
        hq.convert_linears(m, hq.recipe("fp8_delayed", backward_override="high_precision"))
    assert [m[0].recipe.name, m[2].recipe.name] == ["fp8_tensorwise"] * 2


def test_apply_hybrid_fsdp_rejects_delayed_scaling_for_already_converted_layers():
    m = _model()
    hq.convert_linears(m, hq.recipe("fp8_tensorwise"))
    with pytest.raises(ValueError, match="delayed scaling"):
        hq.apply_hybrid_fsdp(m, hq.recipe("fp8_delayed"))
    assert [m[0].recipe.name, m[2].recipe.name] == ["fp8_tensorwise"] * 2


@pytest.mark.distributed
def test_apply_hybrid_fsdp_re_conversion_trains_like_a_fresh_fsdp_conversion(tmp_path):
    """A model converted with nvfp4, then apply_hybrid_fsdp(model, fp8_block) + fully_shard (1 process): the
    forward and the gradients are those of a fresh apply_hybrid_fsdp(fp8_block) model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = torch.randn(2, 32, IN)
        results = []
        for first in ("nvfp4", None):
            m = _model()
            if first is not None:
                hq.convert_linears(m, hq.recipe(first))
            hq.apply_hybrid_fsdp(m, hq.recipe("fp8_block"))
            fully_shard(m, mesh=mesh)
            y = m(x)
            y.sum().backward()
            results.append((y.detach(), [p.grad.full_tensor() for p in m.parameters()]))
        _assert_same_run(*results)
    finally:
        dist.destroy_process_group()


def test_training_job_conversion_refuses_an_unknown_environment_override(monkeypatch):
    """launch/train.py converts through apply_hybrid_fsdp; its build() turns the ValueError into a clean exit."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "launch"))
    import convert as job_convert
    import model as job_model
    import train

    args = train.parse_args(["--d-model", "64", "--n-layers", "1", "--n-heads", "2", "--device", "cpu"])
    m = job_model.Transformer(train.model_config(args))
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "bogus")
    with pytest.raises(ValueError, match=f"{BACKWARD_OVERRIDE_ENV}.*'bogus'"):
        job_convert.convert(m, "mxfp8_fwd_nvfp4_bwd", args)
    assert not any(isinstance(mod, hq.Linear) for mod in m.modules()), "layers were converted"


def test_readme_conversion_snippet_converts_fresh_layers_in_every_call(monkeypatch):
    """The docs/formats-and-recipes.md "Presets and your own recipe" example: every convert_linears call converts
    nn.Linear layers (none of them re-converts a model an earlier call converted)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "formats-and-recipes.md").read_text()
    section = text[text.index("## Presets and your own recipe"):text.index("## The Linear module")]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    reports = []

    def recording(*args, **kw):
        reports.append(real(*args, **kw))
        return reports[-1]

    real = hq.convert_linears
    monkeypatch.setattr(hq, "convert_linears", recording)
    monkeypatch.setattr("builtins.print", lambda *a, **k: None)
    exec(compile(snippet, "formats-and-recipes.md", "exec"), {})
    assert len(reports) == 2, f"the snippet calls convert_linears {len(reports)} times"
    for i, report in enumerate(reports):
        statuses = [l.status for l in report.layers]
        # fresh layers only: converted, or skipped for a shape (the example's 100-row layer), never re-converted
        assert "converted" in statuses and set(statuses) <= {"converted", "skipped"}, f"call {i + 1}: {statuses}"


def _sharded(tmp_path, recipe_name):
    """A world-1 gloo group and a model prepared by apply_hybrid_fsdp(recipe_name) + fully_shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    m = _model()
    hq.apply_hybrid_fsdp(m, hq.recipe(recipe_name) if isinstance(recipe_name, str) else recipe_name)
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    return m


@pytest.mark.distributed
def test_another_weight_format_after_fully_shard_is_refused_with_nothing_changed(tmp_path):
    import torch.distributed as dist

    try:
        m = _sharded(tmp_path, "fp8_tensorwise")
        m(torch.randn(2, 32, IN)).sum().backward()
        with pytest.raises(hq.RecipeError, match=r"0: its weight is already sharded by fully_shard .* FP8 E4M3"):
            hq.convert_linears(m, hq.recipe("nvfp4"))
        with pytest.raises(hq.RecipeError, match="must be set before fully_shard"):
            m[2].recipe = hq.recipe("mxfp8")
        assert [m[0].recipe.name, m[2].recipe.name] == ["fp8_tensorwise"] * 2
    finally:
        dist.destroy_process_group()


def _tensorwise_weight_mxfp8_grads(role):
    return hq.MXFP8Quantizer() if role.tensor_type == "grad_output" else hq.Float8Quantizer()


@pytest.mark.distributed
def test_same_weight_format_after_fully_shard_trains_like_a_fresh_sharded_model(tmp_path):
    """Input / grad_output formats may change after fully_shard: the next step equals a model sharded with the
    new recipe from the start."""
    import torch.distributed as dist

    new = hq.CustomRecipe(_tensorwise_weight_mxfp8_grads, name="tensorwise_weight_mxfp8_grads")
    x = torch.randn(2, 32, IN)
    try:
        results = []
        for first in ("fp8_tensorwise", new):
            m = _sharded(tmp_path, first)
            m(x).sum().backward()
            m.zero_grad(set_to_none=True)
            hq.convert_linears(m, new)
            y = m(x)
            y.sum().backward()
            results.append((y.detach(), [p.grad.full_tensor() for p in m.parameters()]))
        _assert_same_run(*results)
    finally:
        dist.destroy_process_group()


def test_converting_again_with_an_equal_recipe_checks_the_override_in_force(monkeypatch):
    m = _model()
    hq.convert_linears(m, hq.recipe("fp8_delayed"))
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "high_precision")
    with pytest.raises(hq.RecipeError, match="cannot be combined with delayed scaling"):
        hq.convert_linears(m, hq.recipe("fp8_delayed"))
