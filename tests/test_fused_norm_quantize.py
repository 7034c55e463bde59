"""Pre-quantized norm outputs ([Note: pre-quantized norm outputs], hybridq/nn/fused_input.py): hybridq's RMSNorm and
LayerNorm write the rowwise part of their readers' input format (FP8 block 1x128, MXFP8 1x32) once a reading Linear
registered its quantizer, and the Linear takes it: results are bitwise the unfused path for every format, backward
override and save_original_input; formats with a tensor-wide statistic get max|y| instead. CUDA: the fused kernel's
part is bitwise the format's own kernel applied to the kernel's y (non-finite values, odd sizes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hybridq
from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.formats import Float8BlockQuantizer, MXFP8Quantizer
from hybridq.nn.fused_input import NormReaders, prequantized_input
from hybridq.nn.layer_norm import LayerNorm
from hybridq.nn.linear_function import shared_input_quantization
from hybridq.nn.norm import RMSNorm

from _compare import assert_parts_bitwise
from _format_cases import FORMATS, hybrid
from _gpu import gpu

# the cases whose rowwise part a norm writes (1-D blocks along K); every other case gets none
FUSED = ("fp8blk_1x128_e4m3", "fp8blk_1x128_e5m2", "fp8blk_1x128_e4m3_nopow2", "mxfp8_e4m3", "mxfp8_e5m2")
NORMS = {"rms": lambda d: nn.RMSNorm(d, eps=1e-5), "layer": lambda d: nn.LayerNorm(d)}


class Block(nn.Module):
    """A norm read by two Linear layers (q/k-like, sharing one quantization) and a third after them."""

    def __init__(self, norm: str, d: int = 128):
        super().__init__()
        self.norm = NORMS[norm](d)
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d)

    def forward(self, x):
        a = self.norm(x)
        return x + self.wo(self.wq(a) * torch.sigmoid(self.wk(a)))


def _recipe(make, override=None):
    return hybridq.CustomRecipe(lambda role: make(), backward_override=override, name="case")


def _pair(norm: str, recipe, device="cpu", dtype=torch.float32, save_original_input=False):
    """(model with hybridq norms, the same model unfused) on one recipe. Unfused: torch's norms kept on the CPU
    (hybridq's reference is torch's math, bitwise); on CUDA hybridq's norms (the same kernel) without readers."""
    torch.manual_seed(0)
    base = Block(norm).to(device=device, dtype=dtype)
    with torch.no_grad():
        base.norm.weight.uniform_(0.5, 1.5)
        if getattr(base.norm, "bias", None) is not None:
            base.norm.bias.normal_(0, 0.3)
    models = []
    for fused in (True, False):
        m = copy.deepcopy(base)
        hybridq.convert_linears(m, recipe, norms=fused or device != "cpu")
        if not fused and device != "cpu":
            m.norm._readers = None  # (no readers: the norm records nothing for the Linears)
        for lin in (m.wq, m.wk, m.wo):
            lin.save_original_input = save_original_input
        models.append(m)
    return models


def _step(m, x):
    torch.manual_seed(1)  # (stochastic rounding draws the same numbers in both models)
    m.zero_grad()
    y = m(x)
    y.float().square().mean().backward()
    return y.detach(), [p.grad.clone() for p in m.parameters()]


def _assert_same_steps(fused, plain, x, steps: int, what: str):
    for step in range(steps):
        (y0, g0), (y1, g1) = _step(fused, x), _step(plain, x)
        assert torch.equal(y0.nan_to_num(7.0), y1.nan_to_num(7.0)), f"{what} step {step}: outputs differ"
        for (name, _), a, b in zip(fused.named_parameters(), g0, g1):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{what} step {step}: grad of {name} differs"


# ---- the protocol (CPU reference) ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(FORMATS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_fused_norm_trains_bitwise_like_the_unfused_one(norm, case):
    fused, plain = _pair(norm, _recipe(FORMATS[case]))
    _assert_same_steps(fused, plain, torch.randn(2, 32, 128), 3, f"{norm} {case}")
    readers = fused.norm._readers
    wrote = readers.quantizer is not None and readers.produced and readers.taken
    assert wrote == (case in FUSED), (f"{norm} {case}: the norm {'wrote' if wrote else 'did not write'} its readers' "
                                      f"rowwise part (registered: {readers.quantizer})")


@pytest.mark.parametrize("variant", ["high_precision", "dequantized", "save_original_input"])
@pytest.mark.parametrize("case", ["fp8blk_1x128_e4m3", "mxfp8_e4m3"])
def test_backward_overrides_and_save_original_input_stay_bitwise(case, variant):
    override = None if variant == "save_original_input" else variant
    fused, plain = _pair("rms", _recipe(FORMATS[case], override), save_original_input=override is None)
    _assert_same_steps(fused, plain, torch.randn(2, 32, 128), 3, f"{case} {variant}")
    assert fused.norm._readers.taken, f"{case} {variant}: the Linear did not take the norm's part"


@pytest.mark.parametrize("source, fused_expected", [("original", True), ("rowwise_dequantized", False)])
def test_a_hybrids_rowwise_block_format_is_fused_unless_its_columnwise_form_comes_from_it(source, fused_expected):
    make = hybrid("mxfp8_e4m3", "nvfp4", columnwise_source=source)
    fused, plain = _pair("layer", _recipe(make))
    _assert_same_steps(fused, plain, torch.randn(2, 32, 128), 3, f"hybrid {source}")
    assert (fused.norm._readers.quantizer is not None) == fused_expected, \
        f"hybrid {source}: registered {fused.norm._readers.quantizer}"


def test_sharing_off_each_reader_takes_the_norms_part():
    fused, plain = _pair("rms", _recipe(FORMATS["fp8blk_1x128_e4m3"]))
    with shared_input_quantization(False):
        _assert_same_steps(fused, plain, torch.randn(2, 32, 128), 3, "sharing off")
    assert fused.norm._readers.taken


def test_a_registration_no_reader_takes_ends_and_the_new_reader_registers():
    fused, plain = _pair("layer", _recipe(FORMATS["mxfp8_e4m3"]))
    x = torch.randn(2, 32, 128)
    _assert_same_steps(fused, plain, x, 2, "mxfp8")
    assert isinstance(fused.norm._readers.quantizer, MXFP8Quantizer)
    for m in (fused, plain):  # the readers change format
        hybridq.convert_linears(m, _recipe(FORMATS["fp8blk_1x128_e4m3"]), norms=False)
    _assert_same_steps(fused, plain, x, 1, "after re-conversion")  # (writes an MXFP8 part nobody takes)
    assert not fused.norm._readers.taken
    _assert_same_steps(fused, plain, x, 2, "re-registered")
    assert isinstance(fused.norm._readers.quantizer, Float8BlockQuantizer) and fused.norm._readers.taken, \
        f"the new readers' quantizer was not registered: {fused.norm._readers.quantizer}"


def test_eval_without_grad_and_inference_mode_are_bitwise():
    fused, plain = _pair("rms", _recipe(FORMATS["fp8blk_1x128_e4m3"]))
    x = torch.randn(2, 32, 128)
    _assert_same_steps(fused, plain, x, 1, "train")
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            a, b = fused(x), plain(x)
        assert torch.equal(a, b), f"{ctx.__name__}: outputs differ"


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_non_finite_inputs_give_the_plain_casts_bits(norm):
    fused, plain = _pair(norm, _recipe(FORMATS["mxfp8_e4m3"]))
    x = torch.randn(2, 32, 128)
    x[0, 3, 7], x[1, 5, 100] = float("inf"), float("nan")
    _assert_same_steps(fused, plain, x, 2, f"{norm} non-finite")
    assert fused.norm._readers.taken


def test_a_partial_last_block_is_fused_on_the_cpu():
    d = 96  # (FP8 block 1x128: one partial block per row)
    torch.manual_seed(0)
    norm, lin = RMSNorm(d), hybridq.Linear(d, 64, recipe=_recipe(FORMATS["fp8blk_1x128_e4m3"]), name="fc")
    x = torch.randn(7, d)
    lin(norm(x)).sum().backward()  # (registers)
    y = norm(x)
    with shared_input_quantization(False):
        got = prequantized_input(lin.input_quantizer, y, y, True, "input of fc")
    assert got is not None, "a registered FP8 block reader got no part for a partial last block"
    want = lin.input_quantizer.quantize(y.detach(), rowwise=True, columnwise=True)
    for d_ in (ROWWISE, COLUMNWISE):
        assert_parts_bitwise(got.part(d_), want.part(d_), f"partial block {d_}")


def test_a_width_the_format_cannot_take_leaves_the_error_to_the_linear():
    norm = LayerNorm(48)
    norm._readers.quantizer = MXFP8Quantizer()  # (as if registered: MXFP8 needs K % 32 == 0)
    y = norm(torch.randn(32, 48))  # (does not raise)
    assert prequantized_input(MXFP8Quantizer(), y, y, False, "input of fc") is None, "a part of an invalid shape"
    with pytest.raises(hybridq.FormatShapeError, match="input of fc"):
        MXFP8Quantizer().quantize(y, name="input of fc")


def test_a_copied_model_registers_its_own_readers():
    readers = NormReaders()
    readers.quantizer = MXFP8Quantizer()
    assert copy.deepcopy(readers).quantizer is None


# ---- CUDA ------------------------------------------------------------------------------------------------------

def _cuda_norm(kind: str, d: int, dtype) -> nn.Module:
    torch.manual_seed(d)
    m = (RMSNorm(d) if kind == "rms" else LayerNorm(d)).cuda()
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        if kind == "layer":
            m.bias.normal_(0, 0.3)
    return m.to(dtype)


@pytest.mark.parametrize("case", FUSED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [4096, 384, 160])  # whole vector steps, a partial last step, MXFP8-only width
@pytest.mark.parametrize("special", ["finite", "nonfinite", "zero_rows"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@gpu
def test_kernel_part_is_bitwise_the_formats_kernel_on_y(kind, special, k, dtype, case):
    q = FORMATS[case]()
    norm = _cuda_norm(kind, k, dtype)
    norm._readers.quantizer = q  # (as a reader registers it)
    x = torch.randn(37, k, device="cuda", dtype=dtype) * 3
    if special == "nonfinite":
        x[3, 5], x[9, 17], x[20, k - 1] = float("inf"), float("nan"), -float("inf")
    elif special == "zero_rows":
        x[4:8] = 0
    y = norm(x)
    with shared_input_quantization(False):
        got = prequantized_input(q, y, y, False, "input")
    if k % (128 if "fp8blk" in case else 32):
        assert got is None, f"{case} K={k}: the kernel wrote a part for a width that is not whole blocks"
        return
    assert got is not None, f"{kind} {case} {dtype} K={k}: the fused kernel wrote no part"
    want = q.quantize(y.detach().clone(), rowwise=True, columnwise=False)  # (the format's own kernel)
    assert_parts_bitwise(got.part(ROWWISE), want.part(ROWWISE), f"{kind} {case} {dtype} K={k} {special}",
                         nan_payload=True)


@pytest.mark.parametrize("case", ["fp8blk_1x128_e4m3", "mxfp8_e4m3", "nvfp4", "fp8_e4m3"])
@pytest.mark.parametrize("norm", sorted(NORMS))
@gpu
def test_a_fused_norm_trains_bitwise_like_the_unfused_one_on_cuda(norm, case):
    fused, plain = _pair(norm, _recipe(FORMATS[case]), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    _assert_same_steps(fused, plain, x, 3, f"{norm} {case} cuda")
    assert fused.norm._readers.taken == (case in FUSED)
