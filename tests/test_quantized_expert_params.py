"""Quantized parameters of GroupedLinear and converted expert modules (quantized_model_init / quantize_parameters):
each expert computes exactly what the GroupedLinear with the same high-precision weight computes, takes the bytes
of the equivalent Linear's quantized weight, state_dict / DCP round-trip quantizing, and a held weight format
cannot be changed silently."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import hybridq as hq
from hybridq.errors import RecipeError
from hybridq.nn.quantized_experts import QuantizedExpertWeights
from hybridq.nn.quantized_params import quantized_param_info

from _compare import assert_bitwise, assert_parts_bitwise

PRESETS = [p for p in hq.preset_names() if p != "fp8_delayed"]
E, N, K = 3, 128, 256  # whole FP8 tiles, MXFP8 / NVFP4 blocks in both directions
SPLITS = [40, 0, 77]  # an expert without tokens, counts no format's columnwise blocks divide


def _devices():
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


def _pair(preset: str, device: str = "cpu"):
    """A GroupedLinear and one built under quantized_model_init holding the same bf16 weight."""
    torch.manual_seed(0)
    ref = hq.GroupedLinear(E, K, N, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="moe", device=device)
    with hq.quantized_model_init():
        ql = hq.GroupedLinear(E, K, N, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="moe", device=device)
    with torch.no_grad():
        ql.weight.copy_(ref.weight)  # copy_ into quantized experts quantizes each
    return ref, ql


def _expected_experts(layer: hq.GroupedLinear, weight: torch.Tensor) -> list:
    """Each expert's weight quantized as a quantized Linear parameter holds it."""
    out = []
    for e, info in enumerate(quantized_param_info(layer.weight).experts):
        out.append(info.quantizer.quantize(weight[e].to(layer.weight.dtype), rowwise=True,
                                           columnwise=info.columnwise_stored))
    return out


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_backward_equal_high_precision_weight(preset, device):
    ref, ql = _pair(preset, device)
    ref.packed_path = False  # quantized experts take the per-expert path (the packed one's grouped GEMMs may round
    # differently on a GPU: docs/numerics.md, "Row groups and grouped GEMMs")
    assert isinstance(ql.weight, QuantizedExpertWeights) and isinstance(ql.weight, nn.Parameter)
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16, device=device)
    outs = []
    for layer in (ref, ql):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)  # stochastic rounding of grad_output draws alike
        y = layer(xi, SPLITS)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, layer.weight.grad))
    for what, got, want in zip(("output", "grad input", "grad weight"), outs[1], outs[0]):
        assert type(got) is torch.Tensor, f"{preset}: {what} is a {type(got).__name__}"
        assert_bitwise(got, want, f"{preset}: {what} of the quantized-parameter GroupedLinear")
    assert ql.weight.grad.shape == (E, N, K) and ql.weight.grad[1].abs().sum() == 0, "expert 1 has no tokens"
    with torch.no_grad():  # forward-only calls read the rowwise forms only
        assert_bitwise(ql(x, SPLITS), ref(x, SPLITS), f"{preset}: no-grad output")


@pytest.mark.parametrize("preset", PRESETS)
def test_parameter_memory_is_each_experts_linear_bytes(preset):
    """Each expert stores what a quantized Linear weight of [out, in] stores (the directions it cannot derive)."""
    _, ql = _pair(preset)
    with hq.quantized_model_init():
        lin = hq.Linear(K, N, bias=False, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="fc")
    mem = hq.parameter_memory(ql)
    assert mem.before == E * N * K * 2
    assert mem.after == E * lin.weight.nbytes_quantized(), f"{preset}: {mem.after} bytes, not {E} x the Linear's"
    assert [r[0] for r in mem.rows] == ["weight"]


def test_state_dict_is_high_precision_and_loads_quantizing(tmp_path):
    ref, ql = _pair("mxfp8_fwd_nvfp4_bwd")
    sd = ql.state_dict()
    assert type(sd["weight"]) is torch.Tensor and sd["weight"].shape == (E, N, K)
    assert_bitwise(sd["weight"], ql.weight.dequantize(), "state_dict weight (each expert's rowwise values)")
    torch.save(sd, tmp_path / "w.pt")
    assert_bitwise(torch.load(tmp_path / "w.pt", weights_only=True)["weight"], sd["weight"], "torch.load round trip")
    new = torch.randn(E, N, K)
    ql.load_state_dict({"weight": new})
    buffers = [t for ex in ql.weight.experts for p in (ex.rowwise, ex.columnwise) if p is not None
               for t in p.tensors().values() if t is not None]
    for e, (got, want) in enumerate(zip(ql.weight.experts, _expected_experts(ql, new))):
        for d in ("rowwise", "columnwise"):
            assert got.has(d) == want.has(d), f"expert {e}: {d} presence"
            if want.has(d):
                assert_parts_bitwise(got.part(d), want.part(d), f"expert {e} {d} after load_state_dict")
    after = [t for ex in ql.weight.experts for p in (ex.rowwise, ex.columnwise) if p is not None
             for t in p.tensors().values() if t is not None]
    assert all(a is b for a, b in zip(buffers, after)), "load_state_dict must fill the experts' own buffers"


def test_a_held_weight_format_cannot_change():
    """Assigning a recipe with another weight format to a layer whose weight is held quantized raises (the
    quantized bytes would silently keep the old format), for Linear and GroupedLinear alike; nothing changes."""
    with hq.quantized_model_init():
        layers = [hq.Linear(K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="fc"),
                  hq.GroupedLinear(E, K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="moe")]
    for layer in layers:
        w = layer.weight
        with pytest.raises(RecipeError, match=rf"{layer.name}: its weight is held quantized in MXFP8"):
            layer.recipe = hq.recipe("fp8_tensorwise")
        assert layer.weight is w and layer.recipe.name == "mxfp8", f"{layer.name} changed"
        layer.recipe = hq.recipe("mxfp8", backward_override="dequantized")  # same weight format: accepted


def test_torch_optimizer_refuses_quantized_experts_before_changing_anything():
    _, ql = _pair("fp8_tensorwise")
    ql(torch.randn(sum(SPLITS), K, dtype=torch.bfloat16), SPLITS).float().sum().backward()
    before = [ex.rowwise.data.view(torch.uint8).clone() for ex in ql.weight.experts]
    opt = torch.optim.AdamW(ql.parameters())
    with pytest.raises(TypeError, match=r"AdamW would step the quantized weight of moe .*ZeroAdamW"):
        opt.step()
    assert all(torch.equal(b, ex.rowwise.data.view(torch.uint8)) for b, ex in zip(before, ql.weight.experts))


def test_other_ops_on_quantized_experts_name_the_layer():
    _, ql = _pair("fp8_tensorwise")
    with pytest.raises(NotImplementedError, match=r"sum.* quantized weight of moe: .*dequantize"):
        ql.weight.sum()


def test_master_refresh_quantizes_each_expert_alone():
    """quantize_master_weights on a grouped weight: every expert gets its own statistics (per-expert amax)."""
    _, ql = _pair("nvfp4")
    master = torch.randn(E, N, K) * torch.tensor([1e-3, 1.0, 1e3]).view(E, 1, 1)  # per-expert ranges differ
    hq.distributed.quantize_master_weights([ql.weight], [master.reshape(-1)], [0])
    for e, (got, want) in enumerate(zip(ql.weight.experts, _expected_experts(ql, master))):
        for d in ("rowwise", "columnwise"):
            if want.has(d):
                assert_parts_bitwise(got.part(d), want.part(d), f"expert {e} {d} after the refresh")


class Experts(nn.Module):
    """An expert module in the conversion protocol: `[E, out, in]` parameters it multiplies with grouped_mm."""

    hybridq_grouped_weights = ("w1", "w2")

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, N, K, dtype=torch.bfloat16) / K ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, K, N, dtype=torch.bfloat16) / N ** 0.5)

    def forward(self, x, splits):
        return hq.grouped_mm(self, "w2", F.gelu(hq.grouped_mm(self, "w1", x, splits)), splits)


@pytest.mark.parametrize("how", ["quantize_parameters", "quantized_model_init"])
def test_expert_module_holds_its_weights_quantized(how):
    torch.manual_seed(0)
    ref = Experts()
    mod = Experts()
    mod.load_state_dict(ref.state_dict())
    hq.convert_experts(ref, hq.recipe("fp8_block"))
    if how == "quantize_parameters":
        hq.convert_experts(mod, hq.recipe("fp8_block"))
        names = hq.quantize_parameters(mod)
        assert names == ["w1", "w2"], names
    else:
        with hq.quantized_model_init():
            hq.convert_experts(mod, hq.recipe("fp8_block"))
    assert all(isinstance(getattr(mod, n), QuantizedExpertWeights) for n in ("w1", "w2"))
    assert list(mod.state_dict()) == ["w1", "w2"] and all(type(v) is torch.Tensor for v in mod.state_dict().values())
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16)
    outs = []
    for m in (ref, mod):
        xi = x.clone().requires_grad_()
        y = m(xi, SPLITS)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, m.w1.grad, m.w2.grad))
    for what, got, want in zip(("output", "grad input", "grad w1", "grad w2"), outs[1], outs[0]):
        assert_bitwise(got, want, f"{how}: {what} of the expert module with quantized weights")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group: one process
def test_dcp_checkpoint_of_a_high_precision_model_loads_into_quantized_parameters(tmp_path):
    """A DCP checkpoint (standard get/set_model_state_dict helpers, no process group) of a high-precision MoE
    model loads into the same model with quantized parameters: each weight is the quantization of the saved one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def model():
        return nn.ModuleDict({"dense": hq.Linear(K, K, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="d"),
                              "moe": hq.GroupedLinear(E, K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16,
                                                      name="moe")})
    torch.manual_seed(0)
    saved = model()
    dcp.save({"model": get_model_state_dict(saved)}, checkpoint_id=str(tmp_path / "ck"))
    torch.manual_seed(1)
    with hq.quantized_model_init():
        target = model()
    state = {"model": get_model_state_dict(target)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
    set_model_state_dict(target, state["model"])
    want = _expected_experts(target["moe"], saved["moe"].weight.detach())
    for e, (got, w) in enumerate(zip(target["moe"].weight.experts, want)):
        assert_parts_bitwise(got.part("rowwise"), w.part("rowwise"), f"expert {e} rowwise after the DCP load")
        assert_parts_bitwise(got.part("columnwise"), w.part("columnwise"), f"expert {e} columnwise after DCP load")
    q = target["dense"].weight_quantizer.quantize(saved["dense"].weight.detach(), rowwise=True, columnwise=True)
    assert_parts_bitwise(target["dense"].weight.part("rowwise"), q.part("rowwise"), "dense rowwise after DCP load")
    assert_bitwise(target["dense"].bias, saved["dense"].bias, "dense bias after the DCP load")


def _held_tensors(w) -> list[torch.Tensor]:
    experts = w.experts if isinstance(w, QuantizedExpertWeights) else [w]
    return [t for ex in experts for p in (ex.rowwise, ex.columnwise) if p is not None
            for t in p.tensors().values() if t is not None]


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_module_conversion_replaces_what_the_parameter_holds(kind):
    """nn.Module._apply (model.to / .cuda / .half-free conversions) swaps the parameter's contents: the quantized
    buffers are the converted ones and the parameter stays a described quantized parameter."""
    with hq.quantized_model_init():
        layer = (hq.Linear(K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="m") if kind == "Linear" else
                 hq.GroupedLinear(E, K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="m"))
    w, before = layer.weight, _held_tensors(layer.weight)
    layer._apply(lambda t: t.to("cpu", copy=True))
    after = _held_tensors(layer.weight)
    assert layer.weight is w and quantized_param_info(layer.weight) is not None
    assert all(a is not b for a, b in zip(after, before)), f"{kind}: the parameter still holds its old buffers"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_quantized_model_built_on_the_cpu_moves_to_the_gpu(kind):
    torch.manual_seed(0)
    with hq.quantized_model_init():
        layer = (hq.Linear(K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="m") if kind == "Linear" else
                 hq.GroupedLinear(E, K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="m"))
    want = [t.cuda() for t in _held_tensors(layer.weight)]
    layer.cuda()
    got = _held_tensors(layer.weight)
    assert all(t.is_cuda for t in got), f"{kind}: quantized buffers left on the CPU after .cuda()"
    for g, w in zip(got, want):
        assert_bitwise(g, w, f"{kind}: buffer moved to the GPU")
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():  # (forward only: no columnwise rule on the 117 tokens for the Linear)
        assert (layer(x) if kind == "Linear" else layer(x, SPLITS)).is_cuda


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_deepcopy_of_a_quantized_model_owns_its_buffers(kind):
    import copy

    with hq.quantized_model_init():
        layer = (hq.Linear(K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="m") if kind == "Linear" else
                 hq.GroupedLinear(E, K, N, recipe=hq.recipe("mxfp8"), dtype=torch.bfloat16, name="m"))
    twin = copy.deepcopy(layer)
    assert quantized_param_info(twin.weight) is not None, f"{kind}: the copy's weight is no longer described"
    assert all(a is not b and torch.equal(a, b) for a, b in zip(_held_tensors(twin.weight),
                                                                _held_tensors(layer.weight)))
    x = torch.randn(64, K, dtype=torch.bfloat16)
    with torch.no_grad():
        run = (lambda m: m(x)) if kind == "Linear" else (lambda m: m(x, [40, 0, 24]))
        assert_bitwise(run(twin), run(layer), f"{kind}: output of the deep copy")


def _pickled(obj, how: str):
    import io
    import pickle

    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_pickled_quantized_model_loads_with_its_quantized_parameters(preset, kind, how):
    """A model pickled whole (torch.save(model), pickle) loads holding the same quantized parameters -- described
    (quantized_param_info, each expert's too), parameters, the same bytes -- and trains bitwise as the original.
    Before the fix its weights came back as bare QuantizedTensors: no longer parameters nor described, so a derived
    columnwise form was missing (per-tensor FP8, NVFP4: backward raised) and the optimizer guard was gone."""
    with hq.quantized_model_init():
        layer = (hq.Linear(K, N, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="m") if kind == "Linear" else
                 hq.GroupedLinear(E, K, N, recipe=hq.recipe(preset), dtype=torch.bfloat16, name="m"))
    twin = _pickled(layer, how)
    w, tw = layer.weight, twin.weight
    assert type(tw) is type(w) and isinstance(tw, nn.Parameter) and tw.requires_grad, \
        f"{preset} {kind}: loaded weight is a {type(tw).__name__} (parameter: {isinstance(tw, nn.Parameter)})"
    assert quantized_param_info(tw) == quantized_param_info(w), f"{preset} {kind}: the loaded weight's description"
    if kind == "GroupedLinear":
        for e, (a, b) in enumerate(zip(tw.experts, w.experts)):
            assert quantized_param_info(a) == quantized_param_info(b), f"{preset}: expert {e}'s description"
    for i, (a, b) in enumerate(zip(_held_tensors(tw), _held_tensors(w), strict=True)):
        assert_bitwise(a, b, f"{preset} {kind}: held tensor {i}")
    x = torch.randn(128 if kind == "Linear" else sum(SPLITS), K, dtype=torch.bfloat16)  # (whole blocks for Linear)
    grads = []
    for m in (layer, twin):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)
        y = m(xi) if kind == "Linear" else m(xi, SPLITS)
        y.float().square().sum().backward()
        grads.append((y, xi.grad, m.weight.grad))
    for what, got, want in zip(("output", "grad input", "grad weight"), grads[1], grads[0]):
        assert_bitwise(got, want, f"{preset} {kind}: {what} of the loaded model")
    with pytest.raises(TypeError, match="quantized"):  # the optimizer guard knows the loaded weight
        torch.optim.SGD(twin.parameters(), lr=0.1).step()


@pytest.mark.parametrize("convert", ["double", "half", "float"])
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_a_dtype_conversion_of_a_quantized_parameter_raises_naming_the_layer(kind, convert):
    with hq.quantized_model_init():
        layer = (hq.Linear(K, N, recipe=hq.recipe("fp8_tensorwise"), dtype=torch.bfloat16, name="m.fc")
                 if kind == "Linear" else
                 hq.GroupedLinear(E, K, N, recipe=hq.recipe("fp8_tensorwise"), dtype=torch.bfloat16, name="m.fc"))
    with pytest.raises(NotImplementedError, match=r"quantized weight of m\.fc"):
        getattr(layer, convert)()
    assert layer.weight.dtype == torch.bfloat16 and quantized_param_info(layer.weight) is not None


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_load_state_dict_with_assign_quantizes_into_a_new_parameter(kind):
    """assign=True (e.g. after building on the meta device) gives a quantized parameter holding the loaded values
    on their device, never the high-precision tensor itself (which would silently undo the quantized storage)."""
    def build():
        return (hq.Linear(K, N, bias=False, recipe=hq.recipe("nvfp4"), dtype=torch.bfloat16, name="m")
                if kind == "Linear" else
                hq.GroupedLinear(E, K, N, recipe=hq.recipe("nvfp4"), dtype=torch.bfloat16, name="m"))
    with torch.device("meta"), hq.quantized_model_init():
        layer = build()
    value = torch.randn(*layer.weight.shape, dtype=torch.bfloat16)
    with hq.quantized_model_init():
        want = build()
    want.load_state_dict({"weight": value})  # copy_ quantizes
    layer.load_state_dict({"weight": value}, assign=True)
    assert quantized_param_info(layer.weight) is not None and not layer.weight.is_meta, \
        f"{kind}: load_state_dict(assign=True) left {type(layer.weight).__name__} on {layer.weight.device}"
    for got, exp in zip(_held_tensors(layer.weight), _held_tensors(want.weight)):
        assert_bitwise(got, exp, f"{kind}: quantized buffer after load_state_dict(assign=True)")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_without_grad_equals_high_precision_weight(preset, mode):
    """A quantized-parameter GroupedLinear runs under inference_mode (where unbind's views of the held experts
    once raised "Cannot set version_counter for inference tensor") and no_grad, bitwise as the high-precision one."""
    ref, ql = _pair(preset)
    ref.packed_path = False
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        torch.manual_seed(3)
        want = ref(x, SPLITS)
        torch.manual_seed(3)
        got = ql(x, SPLITS)
    assert_bitwise(got, want, f"{preset}: {mode} output of the quantized-parameter GroupedLinear")
    assert isinstance(ql.weight, QuantizedExpertWeights), "the forward replaced the quantized parameter"
