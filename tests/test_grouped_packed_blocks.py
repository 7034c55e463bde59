"""GroupedLinear's packed path for block formats without tensor-wide statistics (FP8 1x128 / 128x128 blocks, MXFP8,
hybrids of them): one quantize call per tensor type for all experts, each expert's GEMMs on its row slice of the
quantized parts. Its output, dx and dW are bitwise the per-expert path's on the CPU for every applicable preset and
any token counts (zeros, uneven, not multiples of 16 / 32 / 128, all tokens in one expert), with and without the
GPU's padding; each expert's slot is whole scaling blocks along the tokens even where padded_tokens leaves the count
as it is; the weight is packed only where N keeps its blocks inside one expert; what the path does not implement
runs per expert. On a GPU: packed and per-expert paths are compared bitwise (same quantized operands, same GEMMs
with the same shapes)."""

import pytest
import torch

import hybridq as hq
import hybridq.nn.grouped as grouped_mod
from _compare import assert_results_bitwise
from _packed_experts import expert_layer, expert_step, tokens_by_expert
from hybridq.formats import Float8BlockQuantizer, HybridQuantizer, MXFP8Quantizer
from hybridq.formats.base import Quantizer
from hybridq.nn.grouped_packed import padded_tokens
from hybridq.nn.grouped_packed import BLOCKS, FP8_TENSOR, ROW_GROUPS, TokenLayout, packed_quantizers
from hybridq.nn.grouped_packed_blocks import ExpertWeights, PackedBlockExperts, packed_path_pays, token_multiple
from _gpu import extension_ready

E, IN = 4, 160  # K: five 32-blocks, one and a partial 128-block
PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]
SPLITS = [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 200, 0], [0, 0, 0, 0], [1, 1, 1, 1], [32, 64, 128, 16]]
# N = 128: the weight is quantized packed; N = 96: 128x128 tiles would straddle experts, so the FP8-block weight is
# quantized per expert (MXFP8's 32-blocks still pack)
OUTS = [128, 96]
HAVE_CUDA = torch.cuda.is_available()


def _double_quantized(role):  # a hybrid whose columnwise form is quantized from the dequantized rowwise one
    row = Float8BlockQuantizer(block_dim=2 if role.tensor_type == "weight" else 1)
    return HybridQuantizer(rowwise=row, columnwise=MXFP8Quantizer(), columnwise_source="rowwise_dequantized")


def _mx_tiles(role):  # MXFP8 with 32x32 weight tiles
    return MXFP8Quantizer(block_2d=role.tensor_type == "weight")


CUSTOM = {"double_quantized": hq.CustomRecipe(_double_quantized, name="double_quantized"),
          "mxfp8_32x32_weights": hq.CustomRecipe(_mx_tiles, name="mxfp8_32x32_weights")}


def _recipe(name):
    return CUSTOM[name] if name in CUSTOM else hq.recipe(name)


def _layer(recipe, out, packed, dtype=torch.bfloat16, device="cpu", k=IN, **kw):
    return expert_layer(_recipe(recipe), E, k, out, packed, dtype, device, **kw)


def _data(splits, out, dtype, device="cpu", k=IN):
    return tokens_by_expert(splits, k, out, dtype, device)


def _run(packed, splits, recipe, out, dtype=torch.bfloat16, x_grad=True, w_grad=True, grad=True, device="cpu",
         k=IN):
    x, dy = _data(splits, out, dtype, device, k)
    return expert_step(_layer(recipe, out, packed, dtype, device, k), splits, x, dy, x_grad, w_grad, grad)


@pytest.mark.parametrize("multiple", [1, 16], ids=["cpu-counts", "gpu-padding"])
@pytest.mark.parametrize("out", OUTS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_block_path_is_bitwise_the_per_expert_path(preset, splits, out, multiple, monkeypatch):
    # multiple=16 pads each expert's tokens as on a GPU (to 16 and to the columnwise blocks along the tokens)
    monkeypatch.setattr(grouped_mod, "native_row_multiple", lambda device: multiple)
    assert_results_bitwise(_run(True, splits, preset, out), _run(False, splits, preset, out),
                 f"{preset}, splits {splits}, N={out}, x{multiple}")


@pytest.mark.parametrize("recipe", sorted(CUSTOM))
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127]], ids=str)
def test_packed_block_path_is_bitwise_for_double_quantization_and_weight_tiles(recipe, splits):
    assert_results_bitwise(_run(True, splits, recipe, 128), _run(False, splits, recipe, 128), f"{recipe}, splits {splits}")


def test_packed_block_path_is_bitwise_in_fp32():
    splits = [5, 0, 17, 40]
    assert_results_bitwise(_run(True, splits, "fp8_block", 96, torch.float32),
                 _run(False, splits, "fp8_block", 96, torch.float32), "fp8_block fp32")


@pytest.mark.parametrize("x_grad,w_grad,grad", [(True, False, True), (False, True, True), (True, True, False)],
                         ids=["dgrad-only", "wgrad-only", "no-grad"])
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_block_path_computes_only_the_gradients_asked_for(preset, x_grad, w_grad, grad):
    splits = [130, 1, 0, 17]
    assert_results_bitwise(_run(True, splits, preset, 128, x_grad=x_grad, w_grad=w_grad, grad=grad),
                 _run(False, splits, preset, 128, x_grad=x_grad, w_grad=w_grad, grad=grad),
                 f"{preset} x_grad={x_grad} w_grad={w_grad} grad={grad}")


def _quantize_calls(monkeypatch, packed, preset, out, splits):
    """The tensor names of every `Quantizer.quantize` call of one forward + backward."""
    names = []
    real = Quantizer.quantize
    with monkeypatch.context() as mp:
        mp.setattr(Quantizer, "quantize", lambda self, x, **kw: names.append(kw.get("name")) or real(self, x, **kw))
        m = _layer(preset, out, packed)
        x, dy = _data(splits, out, torch.bfloat16)
        m(x.requires_grad_(), splits).backward(dy)
    return names


def _count(names, tensor):
    return sum(1 for n in names if n.startswith(f"{tensor} of"))


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_block_path_quantizes_each_tensor_once_for_all_experts(preset, monkeypatch):
    splits = [5, 30, 17, 40]  # every expert has tokens: the per-expert path quantizes each tensor E times
    packed = _quantize_calls(monkeypatch, True, preset, 128, splits)
    per_expert = _quantize_calls(monkeypatch, False, preset, 128, splits)
    for t in ("input", "weight", "grad_output"):
        assert _count(packed, t) == 1, f"{preset}: packed path quantized {t} {_count(packed, t)} times: {packed}"
        assert _count(per_expert, t) == E, f"{preset}: per-expert path quantized {t} {_count(per_expert, t)} times"


def test_weight_whose_tiles_would_straddle_experts_is_quantized_per_expert(monkeypatch):
    # fp8_block, N = 96: 128x128 weight tiles would span two experts; tokens and gradients are still packed
    names = _quantize_calls(monkeypatch, True, "fp8_block", 96, [5, 30, 17, 40])
    counts = {t: _count(names, t) for t in ("input", "weight", "grad_output")}
    assert counts == {"input": 1, "weight": E, "grad_output": 1}, f"quantize calls {counts}: {names}"


@pytest.mark.parametrize("preset,out,packed", [("fp8_block", 128, True), ("fp8_block", 96, False),
                                               ("mxfp8", 96, True), ("fp8_block_fwd_mxfp8_bwd", 96, False)])
def test_the_weight_is_packed_only_when_n_keeps_its_blocks_inside_an_expert(preset, out, packed):
    q = hq.GroupedLinear(E, IN, out, recipe=hq.recipe(preset), name="moe").expert_quantizers[0]["weight"]
    w = ExpertWeights.quantize(q, torch.randn(E, out, IN), columnwise=True, name="weight of moe")
    assert w.packed == packed, f"{preset}, N={out}: packed={w.packed}, expected {packed}"


@pytest.mark.parametrize("preset,wgrad,multiple", [("fp8_block", True, 128), ("fp8_block", False, 1),
                                                   ("mxfp8", True, 32), ("mxfp8", False, 1),
                                                   ("fp8_block_fwd_mxfp8_bwd", True, 32)])
def test_token_slots_are_whole_scaling_blocks_along_the_tokens(preset, wgrad, multiple):
    qs = hq.GroupedLinear(E, IN, 128, recipe=hq.recipe(preset), name="moe").expert_quantizers[0]
    assert token_multiple(qs, True, wgrad) == multiple, f"{preset} wgrad={wgrad}"


def test_cpu_counts_of_fp8_blocks_are_padded_to_whole_blocks_in_the_packed_layout():
    # on the CPU padded_tokens leaves FP8-block counts as they are (partial edge blocks are allowed): the packed
    # layout alone must round each slot up to 128 rows, or a 128x1 block would mix two experts
    qs = hq.GroupedLinear(E, IN, 128, recipe=hq.recipe("fp8_block"), name="moe").expert_quantizers[0]
    splits = [5, 0, 130, 1]
    padded = [padded_tokens(m, IN, 128, qs, True, True, 1) if m else 0 for m in splits]
    assert padded == splits, f"padded_tokens on the CPU: {padded}"
    layout = TokenLayout.build(splits, padded, torch.device("cpu"), token_multiple(qs, True, True))
    assert layout.slots == [128, 0, 256, 128] and layout.offsets == [0, 128, 128, 384], (layout.slots, layout.offsets)
    packed = layout.pack(torch.arange(1, 137, dtype=torch.float32)[:, None])
    assert packed[128:258, 0].tolist() == list(range(6, 136)) and packed[384, 0] == 136, "tokens not at their slots"
    assert packed[5:128].abs().sum() == 0 and packed[258:384].abs().sum() == 0, "slot padding is not zero"


def _takes_packed_path(monkeypatch, m, x, splits, **kw):
    calls = []
    real = PackedBlockExperts.apply
    monkeypatch.setattr(PackedBlockExperts, "apply", lambda *a: calls.append(1) or real(*a))
    m(x, splits, **kw).sum().backward()
    return bool(calls)


@pytest.mark.parametrize("preset", PRESETS)
def test_block_presets_take_the_packed_path(preset, monkeypatch):
    m = _layer(preset, 128, True)
    assert packed_quantizers(m.expert_quantizers).kind == BLOCKS
    x = torch.randn(40, IN, dtype=torch.bfloat16, requires_grad=True)
    assert _takes_packed_path(monkeypatch, m, x, [10, 0, 30, 0]), f"{preset} did not take the packed block path"


@pytest.mark.parametrize("what", ["bias", "override", "save_original_input", "is_first_microbatch",
                                  "per_expert_quantizers", "quantized_weight", "packed_path_off"])
def test_what_the_packed_block_path_does_not_implement_runs_per_expert(what, monkeypatch):
    kw = {}
    recipe = hq.recipe("fp8_block", backward_override="dequantized" if what == "override" else None)
    if what == "per_expert_quantizers":  # expert 1's input uses other scales: not one quantizer for all experts
        recipe = hq.CustomRecipe(lambda role: Float8BlockQuantizer(
            block_dim=2 if role.tensor_type == "weight" else 1,
            power_2_scale=not (role.name.endswith("experts.1") and role.tensor_type == "input")))
    args = dict(bias=what == "bias", save_original_input=what == "save_original_input")
    if what == "quantized_weight":
        with hq.quantized_model_init():
            m = hq.GroupedLinear(E, IN, 128, recipe=recipe, name="moe", dtype=torch.bfloat16, **args)
    else:
        m = hq.GroupedLinear(E, IN, 128, recipe=recipe, name="moe", dtype=torch.bfloat16, **args)
    m.packed_path = what != "packed_path_off"
    if what == "is_first_microbatch":
        kw["is_first_microbatch"] = True
    x = torch.randn(40, IN, dtype=torch.bfloat16, requires_grad=True)
    assert not _takes_packed_path(monkeypatch, m, x, [10, 0, 30, 0], **kw), f"{what}: took the packed path"


# ---- GPU --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not extension_ready(), reason="needs a CUDA device and the built extension")
@pytest.mark.parametrize("k", [256, IN], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("out", [128, 96], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 300, 0]], ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_packed_block_path_is_bitwise_the_per_expert_path(preset, splits, out, k, monkeypatch):
    """Each expert's quantized operands are bitwise the per-expert path's (the CUDA quantize kernels are bitwise the
    reference, and no block spans two experts), and each expert's GEMM is the same `gemm` call with the same shapes
    (K=256: the hardware FP8 block GEMM on sm_90, MXFP8's on sm_100+; K=160: the emulation): the results are
    bitwise equal. (The grouped GEMMs -- FP8 blocks in Triton, MXFP8's grouped emulation -- which sum in another
    order, are off here: they are compared with this path in tests/test_grouped_blocks_gemm.py.)"""
    from hybridq.kernels import grouped_blocks, grouped_emulated
    monkeypatch.setattr(grouped_blocks.ENABLED, "on", False)
    monkeypatch.setattr(grouped_emulated.ENABLED, "on", False)
    assert_results_bitwise(_run(True, splits, preset, out, device="cuda", k=k),
                 _run(False, splits, preset, out, device="cuda", k=k),
                 f"{preset} on CUDA, splits {splits}, N={out}, K={k}")


@pytest.mark.parametrize("kind", [BLOCKS, ROW_GROUPS])
def test_long_experts_take_the_per_expert_path_on_cuda(kind):
    """Experts long enough for one GEMM each (8 x 4096 tokens, 4096 x 14336): on CUDA the per-expert path (the
    same bits, no packing copy); short experts (64 x 2048 tokens, 2048 x 3072) and the CPU keep the packed path."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    long_experts, short_experts = [4096] * 8, [2048] * 64
    assert not packed_path_pays(kind, long_experts, 4096, 14336, cuda), "long experts on CUDA stayed packed"
    assert packed_path_pays(kind, short_experts, 2048, 3072, cuda), "short experts on CUDA left the packed path"
    assert packed_path_pays(kind, long_experts, 4096, 14336, cpu), "the CPU left the packed path"
    assert packed_path_pays(FP8_TENSOR, long_experts, 4096, 14336, cuda), "per-tensor FP8 decides elsewhere"
