"""Quantized parameters (hybridq.quantized_model_init / quantize_parameters): the Linear computes exactly what a
Linear with the same high-precision weight computes, the weights take the bytes their formats say, state_dict
round-trips, and what cannot work raises naming the layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.nn.quantized_params import quantized_param_info

from _compare import assert_bitwise, assert_parts_bitwise

PRESETS = [p for p in hq.preset_names() if p != "fp8_delayed"]
M, K = 256, 384  # out, in: 2 x 3 FP8 tiles, whole MXFP8 / NVFP4 blocks


def _pair(preset: str, bias: bool = True, device: str = "cpu"):
    """A normal hybridq Linear and one built under quantized_model_init with the same bf16 weight and bias."""
    torch.manual_seed(0)
    ref = hq.Linear(K, M, bias=bias, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="fc", device=device)
    with hq.quantized_model_init():
        ql = hq.Linear(K, M, bias=bias, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="fc", device=device)
    with torch.no_grad():
        ql.weight.copy_(ref.weight)  # copy_ into a quantized parameter quantizes
        if bias:
            ql.bias.copy_(ref.bias)
    return ref, ql


def _devices():
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_backward_equal_high_precision_weight(preset, device):
    """(On a GPU: the kernels and native GEMMs on both sides.)"""
    ref, ql = _pair(preset, device=device)
    assert isinstance(ql.weight, hq.QuantizedTensor) and isinstance(ql.weight, nn.Parameter)
    x = torch.randn(64, K, dtype=torch.bfloat16, device=device)
    outs = []
    for layer in (ref, ql):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)  # stochastic rounding of grad_output draws alike
        y = layer(xi)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
    for what, got, want in zip(("output", "grad input", "grad weight", "grad bias"), outs[1], outs[0]):
        assert type(got) is torch.Tensor, f"{preset}: {what} is a {type(got).__name__}"
        assert_bitwise(got, want, f"{preset}: {what} of the quantized-parameter Linear")
    assert ql.weight.grad.dtype == torch.bfloat16 and ql.weight.grad.shape == (M, K)
    with torch.no_grad():  # forward-only calls read the rowwise form only
        assert_bitwise(ql(x), ref(x), f"{preset}: no-grad output")


def _expected_bytes(ql) -> int:
    """Bytes the stored directions take by the formats' definitions (`Quantizer.storage_bytes`, docs/numerics.md):
    the rowwise form, and the columnwise form unless the format derives it from the rowwise one at use."""
    q, w = ql.weight_quantizer, ql.weight
    row = q.quantize(torch.zeros(M, K, dtype=w.dtype), rowwise=True).rowwise
    stored_col = q.derive_part(row, "columnwise", w.dtype) is None
    return q.storage_bytes(M, K, True, stored_col, w.dtype)


@pytest.mark.parametrize("preset", PRESETS)
def test_parameter_memory_bytes_per_element(preset, summary_table):
    _, ql = _pair(preset, bias=False)
    mem = hq.parameter_memory(ql)
    assert mem.before == M * K * 2, f"{preset}: bf16 weight counted as {mem.before} bytes"
    want = _expected_bytes(ql)
    assert mem.after == want, (
        f"{preset}: quantized weight takes {mem.after} bytes ({mem.after / (M * K):.4f} B/elem), the formats say "
        f"{want}\n{mem.table()}")
    summary_table(f"quantized parameter bytes, {preset}", mem.table())


def test_state_dict_is_high_precision_and_loads_quantizing():
    _, ql = _pair("mxfp8_fwd_nvfp4_bwd")
    sd = ql.state_dict()
    assert type(sd["weight"]) is torch.Tensor and sd["weight"].dtype == torch.bfloat16
    assert_bitwise(sd["weight"], ql.weight.dequantize(), "state_dict weight (the dequantized rowwise form)")
    plain = nn.Linear(K, M, dtype=torch.bfloat16)
    plain.load_state_dict(sd)  # a plain model reads it strictly
    with hq.quantized_model_init():
        other = hq.Linear(K, M, recipe=hq.recipe("mxfp8_fwd_nvfp4_bwd"), dtype=torch.bfloat16, name="fc")
    ptr = other.weight.rowwise.data.data_ptr()
    other.load_state_dict(sd)
    want = other.weight_quantizer.quantize(sd["weight"], rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        assert_parts_bitwise(other.weight.part(d), want.part(d), f"loaded {d} form")
    assert other.weight.rowwise.data.data_ptr() == ptr, "load_state_dict replaced the parameter's buffers"


def test_quantize_parameters_converts_an_existing_model_and_keeps_the_init_value():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, M), nn.GELU(), nn.Linear(M, K)).to(torch.bfloat16)
    before = [m.weight.detach().clone() for m in (model[0], model[2])]
    hq.convert_linears(model, hq.recipe("fp8_block"))
    names = hq.quantize_parameters(model, preserve_high_precision_init_val=True)
    assert names == ["0", "2"], names
    for layer, w in zip((model[0], model[2]), before):
        want = layer.weight_quantizer.quantize(w, rowwise=True)
        assert_parts_bitwise(layer.weight.rowwise, want.rowwise, "converted rowwise form")
        assert layer.weight.columnwise is None  # 128x128 tiles: the columnwise form is derived at use
        assert_bitwise(hq.high_precision_init_value(layer.weight), w, "preserved initial value")
    model.to("cpu")  # Module._apply re-wraps the parameters: still quantized parameters
    assert hq.quantize_parameters(model) == [], "already quantized layers were converted again"


def test_torch_optimizer_refuses_quantized_parameters_before_changing_anything():
    _, ql = _pair("mxfp8")
    ql(torch.randn(32, K, dtype=torch.bfloat16)).float().sum().backward()
    opt = torch.optim.AdamW(ql.parameters(), lr=1.0)
    bias_before = ql.bias.detach().clone()
    with pytest.raises(TypeError, match=r"quantized weight of fc \(MXFP8 E4M3\).*ZeroAdamW.*quantize_master_weights"):
        opt.step()
    assert not opt.state, "the optimizer created state before refusing"
    assert_bitwise(ql.bias, bias_before, "bias after the refused step")


def test_in_place_update_of_a_quantized_parameter_names_the_layer():
    _, ql = _pair("nvfp4")
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"quantized weight of fc \(NVFP4 \(16x16\)\)"):
        ql.weight.mul_(0.5)


def test_unsupported_layers_and_formats_raise_naming_them():
    with hq.quantized_model_init(), pytest.raises(ValueError, match=r"weight of expert 0 of moe uses FP8 E4M3 \(del"):
        hq.GroupedLinear(2, 64, 64, recipe=hq.recipe("fp8_delayed"), name="moe")
    with hq.quantized_model_init(), pytest.raises(ValueError, match=r"weight of fc2 uses FP8 E4M3 \(delayed"):
        hq.Linear(64, 64, recipe=hq.recipe("fp8_delayed"), name="fc2")


def test_single_process_master_refresh_equals_quantizing_the_master():
    """Without a process group (one rank owning every element) quantize_master_weights is the cast + quantize."""
    _, ql = _pair("mxfp8_fwd_nvfp4_bwd")
    master = torch.randn(M, K)
    hq.distributed.quantize_master_weights([ql.weight, ql.bias], [master.reshape(-1), torch.ones(M)], [0, 0])
    want = ql.weight_quantizer.quantize(master.to(torch.bfloat16), rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        assert_parts_bitwise(ql.weight.part(d), want.part(d), f"{d} form after the refresh")
    assert_bitwise(ql.bias, torch.ones(M, dtype=torch.bfloat16), "plain parameter after the refresh")


def test_apply_hybrid_fsdp_refuses_quantized_parameters():
    with hq.quantized_model_init():
        model = nn.Sequential(hq.Linear(64, 64, recipe=hq.recipe("fp8_tensorwise"), name="fc"))
    with pytest.raises(NotImplementedError, match=r"0.weight is the quantized weight of fc .*ZeroAdamW"):
        hq.apply_hybrid_fsdp(model, hq.recipe("fp8_tensorwise"))
    assert quantized_param_info(model[0].weight) is not None
