"""GroupedLinear's packed path for NVFP4 and its hybrids (`ROW_GROUPS`: one `quantize_groups` call per tensor, each
expert with its own global amaxes): output, dx and dW are bitwise the per-expert path's for every NVFP4-bearing preset
(stochastic rounding of grad_output included: each expert draws as its own call would, in the per-expert path's
order) and custom recipes (no SR, SR on the input, 16x16 weight tiles, RHT), over token counts with zeros, uneven
counts and non-multiples of 16 / 32, with and without the GPU's padding; the path is taken (and quantizes every tensor
in one call per format, never per expert); a weight with stochastic rounding runs per expert, by rule; the argument
errors are unchanged. On a GPU: the packed path (the row-groups CUDA kernel) is bitwise the per-expert path (the
per-expert CUDA kernel), stochastic rounding included."""

import pytest
import torch

import hybridq as hq
import hybridq.nn.grouped as grouped_mod
from _compare import assert_results_bitwise
from _packed_experts import expert_layer, expert_step, tokens_by_expert
from hybridq.formats import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer
from hybridq.formats.base import Quantizer
from hybridq.nn.grouped_packed import ROW_GROUPS, packed_quantizers
from hybridq.nn.grouped_packed_blocks import PackedBlockExperts
from _gpu import extension_ready

E, IN = 4, 96  # K: six 16-blocks, three 32-blocks
PRESETS = ["nvfp4", "mxfp8_fwd_nvfp4_bwd"]
SPLITS = [[5, 0, 17, 40], [33, 1, 0, 16], [0, 0, 70, 0], [0, 0, 0, 0], [1, 1, 1, 1], [32, 48, 16, 64]]
OUTS = [64, 48]  # N: NVFP4's columnwise weight blocks and 16x16 tiles need N % 16 == 0
HAVE_CUDA = torch.cuda.is_available()


def _rn(role):  # NVFP4 without stochastic rounding (RHT on the activations' columnwise form, 16x16 weight tiles)
    return NVFP4Quantizer(block_2d=True) if role.tensor_type == "weight" else NVFP4Quantizer(rht=role.tensor_type != "weight")


def _sr_input(role):  # stochastic rounding on the input's columnwise form (a hybrid), not on the weight
    if role.tensor_type == "input":
        return HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer(rht=True, stochastic_rounding=True))
    if role.tensor_type == "weight":
        return NVFP4Quantizer()
    return NVFP4Quantizer(stochastic_rounding=True)


def _sr_weight(role):  # a weight drawing random numbers: not packed (the per-expert path's draw order differs)
    return NVFP4Quantizer(stochastic_rounding=role.tensor_type != "input")


CUSTOM = {"nvfp4_round_to_nearest": hq.CustomRecipe(_rn, name="nvfp4_round_to_nearest"),
          "nvfp4_sr_input": hq.CustomRecipe(_sr_input, name="nvfp4_sr_input"),
          "nvfp4_sr_weight": hq.CustomRecipe(_sr_weight, name="nvfp4_sr_weight")}


def _recipe(name):
    return CUSTOM[name] if name in CUSTOM else hq.recipe(name)


def _layer(recipe, out, packed, dtype=torch.bfloat16, device="cpu", k=IN):
    return expert_layer(_recipe(recipe), E, k, out, packed, dtype, device)


def _data(splits, out, dtype, device="cpu", k=IN):
    return tokens_by_expert(splits, k, out, dtype, device)


def _run(packed, splits, recipe, out, dtype=torch.bfloat16, x_grad=True, w_grad=True, grad=True, device="cpu",
         k=IN):
    # stochastic rounding draws from torch's default generators: the same stream for both paths
    x, dy = _data(splits, out, dtype, device, k)
    return expert_step(_layer(recipe, out, packed, dtype, device, k), splits, x, dy, x_grad, w_grad, grad,
                       seed=7)


@pytest.mark.parametrize("multiple", [1, 16], ids=["cpu-counts", "gpu-padding"])
@pytest.mark.parametrize("out", OUTS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_nvfp4_path_is_bitwise_the_per_expert_path(preset, splits, out, multiple, monkeypatch):
    monkeypatch.setattr(grouped_mod, "native_row_multiple", lambda device: multiple)
    assert_results_bitwise(_run(True, splits, preset, out), _run(False, splits, preset, out),
                           f"{preset}, splits {splits}, N={out}, x{multiple}")


@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [33, 1, 0, 16]], ids=str)
@pytest.mark.parametrize("recipe", ["nvfp4_round_to_nearest", "nvfp4_sr_input"])
def test_packed_nvfp4_path_is_bitwise_for_custom_recipes(recipe, splits):
    assert_results_bitwise(_run(True, splits, recipe, 64), _run(False, splits, recipe, 64), f"{recipe}, {splits}")


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_nvfp4_path_is_bitwise_in_fp32(preset):
    splits = [5, 0, 17, 40]
    assert_results_bitwise(_run(True, splits, preset, 48, torch.float32), _run(False, splits, preset, 48, torch.float32),
                           f"{preset} fp32")


@pytest.mark.parametrize("x_grad,w_grad,grad", [(True, False, True), (False, True, True), (True, True, False)],
                         ids=["dgrad-only", "wgrad-only", "no-grad"])
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_nvfp4_path_computes_only_the_gradients_asked_for(preset, x_grad, w_grad, grad):
    splits = [33, 1, 0, 17]
    assert_results_bitwise(_run(True, splits, preset, 64, x_grad=x_grad, w_grad=w_grad, grad=grad),
                           _run(False, splits, preset, 64, x_grad=x_grad, w_grad=w_grad, grad=grad),
                           f"{preset} x_grad={x_grad} w_grad={w_grad} grad={grad}")


@pytest.mark.parametrize("recipe", PRESETS + ["nvfp4_round_to_nearest", "nvfp4_sr_input"])
def test_nvfp4_recipes_take_the_packed_path(recipe, monkeypatch):
    m = _layer(recipe, 64, True)
    kind = packed_quantizers(m.expert_quantizers)
    assert kind is not None and kind.kind == ROW_GROUPS, f"{recipe}: packed kind {kind and kind.kind}"
    calls = []
    real = PackedBlockExperts.apply
    monkeypatch.setattr(PackedBlockExperts, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(40, IN, dtype=torch.bfloat16, requires_grad=True)
    m(x, [10, 0, 30, 0]).sum().backward()
    assert calls, f"{recipe} did not take the packed path"


def test_a_weight_with_stochastic_rounding_runs_per_expert():
    m = _layer("nvfp4_sr_weight", 64, True)
    assert packed_quantizers(m.expert_quantizers) is None, "a weight drawing random numbers was packed"


def _quantize_calls(monkeypatch, packed, preset, splits):
    """(tensor name, call) of every quantization that runs in one forward + backward: `Quantizer.quantize` (a plain
    quantization, e.g. MXFP8's of a whole packed buffer) and `NVFP4Quantizer.quantize_groups` (NVFP4 row groups)."""
    calls = []
    with monkeypatch.context() as mp:
        for cls, meth in ((Quantizer, "quantize"), (NVFP4Quantizer, "quantize_groups")):
            real = getattr(cls, meth)
            mp.setattr(cls, meth, lambda self, x, *a, _real=real, _meth=meth, **kw:
                       calls.append((kw.get("name"), _meth)) or _real(self, x, *a, **kw))
        m = _layer(preset, 64, packed)
        x, dy = _data(splits, 64, torch.bfloat16)
        m(x.requires_grad_(), splits).backward(dy)
    return calls


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_nvfp4_path_quantizes_each_tensor_without_a_call_per_expert(preset, monkeypatch):
    splits = [5, 30, 17, 40]  # every expert has tokens: the per-expert path quantizes each tensor E times
    packed = _quantize_calls(monkeypatch, True, preset, splits)
    per_expert = _quantize_calls(monkeypatch, False, preset, splits)
    assert all(name in ("input of moe", "weight of moe", "grad_output of moe") for name, _ in packed), \
        f"{preset}: the packed path made a call per expert: {packed}"
    for t in ("input", "weight", "grad_output"):
        mine = [c for c in packed if c[0] == f"{t} of moe"]
        # one call per format (a hybrid: its MXFP8 rowwise form in one quantize, its NVFP4 form in one row-groups
        # call); every tensor of these presets has an NVFP4 form in a training step
        assert 1 <= len(mine) <= 2 and "quantize_groups" in [c[1] for c in mine], \
            f"{preset}: packed path quantized {t} with {mine} (all calls: {packed})"
        theirs = [c for c in per_expert if (c[0] or "").startswith(f"{t} of moe.experts.")]
        assert len(theirs) == E, f"{preset}: per-expert path quantized {t} {len(theirs)} times: {per_expert}"


def test_argument_errors_are_unchanged_on_the_packed_nvfp4_path():
    m = _layer("nvfp4", 64, True)
    x = torch.randn(40, IN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="m_splits sum to 39 but the input has 40 tokens"):
        m(x, [10, 0, 29, 0])
    with pytest.raises(ValueError, match="one count per expert"):
        m(x, [40])


# ---- GPU --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not extension_ready(), reason="needs a CUDA device and the built extension")
@pytest.mark.parametrize("k", [256, IN], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("out", [128, 48], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 300, 0]], ids=str)
@pytest.mark.parametrize("recipe", PRESETS + ["nvfp4_round_to_nearest", "nvfp4_sr_input"])
def test_gpu_packed_nvfp4_path_is_bitwise_the_per_expert_path(recipe, splits, out, k, monkeypatch):
    """Each expert's quantized operands are bitwise the per-expert path's (the row-groups CUDA kernel is bitwise the
    per-expert kernel: per-expert amaxes, the same Philox offsets and element indices), and each expert's GEMM is the
    same `gemm` call with the same shapes: the results are bitwise equal. The packed run quantizes every NVFP4 tensor
    with the row-groups kernel (one launch per tensor), never with the reference. (The grouped GEMMs, which sum in
    another order -- mxfp8_fwd_nvfp4_bwd's MXFP8 fprop -- are off here: test_grouped_blocks_gemm.py compares them.)"""
    from hybridq import dispatch
    from hybridq.kernels import grouped_blocks, grouped_emulated
    monkeypatch.setattr(grouped_blocks.ENABLED, "on", False)
    monkeypatch.setattr(grouped_emulated.ENABLED, "on", False)
    key = (NVFP4Quantizer, "cuda")
    kernel, ran = dispatch._ROW_GROUPS[key], []

    def spy(q, x, *a):  # (one call: a second one would draw stochastic-rounding numbers again)
        out = kernel(q, x, *a)
        ran.append(out is not None)
        return out
    monkeypatch.setitem(dispatch._ROW_GROUPS, key, spy)
    packed = _run(True, splits, recipe, out, device="cuda", k=k)
    assert ran and all(ran), f"{recipe}: the CUDA row-groups kernel declined a call ({ran})"
    assert_results_bitwise(packed, _run(False, splits, recipe, out, device="cuda", k=k),
                           f"{recipe} on CUDA, splits {splits}, N={out}, K={k}")
