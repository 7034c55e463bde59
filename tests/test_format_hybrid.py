"""Hybrid quantizer (docs/numerics.md "Hybrid"): a pair (rowwise quantizer, columnwise quantizer)."""

from __future__ import annotations

import pytest
import torch

from hybridq.formats import (Float8BlockQuantizer, Float8Quantizer, HybridQuantizer, IdentityQuantizer,
                             MXFP8Quantizer, NVFP4Quantizer)

from _format_cases import DIRECTIONS, FORMATS, assert_bitwise, assert_parts_bitwise

BOTH = dict(rowwise=True, columnwise=True)
# 192 x 288: valid for every format (M % 32, K % 32), with partial 128-blocks and 128x128 tiles
SHAPE = (192, 288)
# stochastic rounding draws from each quantizer's own generator, so a hybrid of two SR quantizers matches
# the plain one per direction (each from a fresh generator), not when both come from one generator
NON_SR = [f for f in FORMATS if f not in ("nvfp4_sr", "fp8_e4m3_delayed")]


def gaussian(seed=0, dtype=torch.float32, shape=SHAPE):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


def same_format_hybrid(fmt, **kw):
    return HybridQuantizer(rowwise=FORMATS[fmt](), columnwise=FORMATS[fmt](), **kw)


@pytest.mark.parametrize("fmt", NON_SR)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_format_in_both_directions_equals_plain_format(fmt, dtype):
    x = gaussian(1, dtype)
    h = same_format_hybrid(fmt).quantize(x, **BOTH)
    p = FORMATS[fmt]().quantize(x, **BOTH)
    for d in DIRECTIONS:
        assert_parts_bitwise(h.part(d), p.part(d), f"{fmt} {d} part")
        assert_bitwise(h.dequantize(direction=d), p.dequantize(direction=d), f"{fmt} {d} dequantized")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_same_format_equals_plain_per_direction(fmt, direction):
    """One direction at a time (fresh quantizers each): also holds for stochastic rounding and delayed
    scaling."""
    x = gaussian(2)
    dirs = dict(rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    h = same_format_hybrid(fmt).quantize(x, **dirs)
    p = FORMATS[fmt]().quantize(x, **dirs)
    assert_parts_bitwise(h.part(direction), p.part(direction), f"{fmt} {direction} part")


def test_same_delayed_format_equals_plain_over_steps():
    """Two delayed-scaling quantizers (one per direction) see the same amaxes as one plain quantizer, so
    every step's parts match."""
    mk = lambda: Float8Quantizer(scaling="delayed", amax_history_len=3, margin=1)  # noqa: E731
    h, p = HybridQuantizer(mk(), mk()), mk()
    for step, scale in enumerate([1.0, 8.0, 0.5, 2.0]):
        x = gaussian(10 + step) * scale
        th, tp = h.quantize(x, **BOTH), p.quantize(x, **BOTH)
        for d in DIRECTIONS:
            assert_parts_bitwise(th.part(d), tp.part(d), f"step {step} {d}")


PAIRS = {
    "mxfp8->nvfp4": (MXFP8Quantizer, NVFP4Quantizer),
    "fp8blk->mxfp8": (Float8BlockQuantizer, lambda: MXFP8Quantizer(fp8="e5m2")),
    "fp8->nvfp4_rht": (Float8Quantizer, lambda: NVFP4Quantizer(rht=True)),
    "nvfp4_16x16->fp8_e5m2": (lambda: NVFP4Quantizer(block_2d=True), lambda: Float8Quantizer(fp8="e5m2")),
    "fp8blk_128x128->fp8blk_1x128": (lambda: Float8BlockQuantizer(block_dim=2), Float8BlockQuantizer),
    "identity_bf16->mxfp8": (lambda: IdentityQuantizer(dtype=torch.bfloat16), MXFP8Quantizer),
}


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_original_source_takes_each_direction_from_its_quantizer(pair, dtype):
    r, c = PAIRS[pair]
    x = gaussian(3, dtype)
    t = HybridQuantizer(r(), c()).quantize(x, **BOTH)
    assert_parts_bitwise(t.rowwise, r().quantize(x).rowwise, f"{pair} rowwise")
    assert_parts_bitwise(t.columnwise, c().quantize(x, rowwise=False, columnwise=True).columnwise,
                         f"{pair} columnwise")


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "col-only"])
def test_rowwise_dequantized_source_is_double_quantization(pair, dtype, rowwise):
    """columnwise_source="rowwise_dequantized": the columnwise form is the columnwise quantizer applied to
    dequantize(rowwise form) (in the input's dtype)."""
    r, c = PAIRS[pair]
    x = gaussian(4, dtype)
    t = HybridQuantizer(r(), c(), columnwise_source="rowwise_dequantized").quantize(
        x, rowwise=rowwise, columnwise=True)
    src = r().quantize(x).dequantize()
    assert src.dtype == dtype
    expected = c().quantize(src, rowwise=False, columnwise=True).columnwise
    assert_parts_bitwise(t.columnwise, expected, f"{pair} double-quantized columnwise")
    assert (t.rowwise is not None) == rowwise
    if rowwise:
        assert_parts_bitwise(t.rowwise, r().quantize(x).rowwise, f"{pair} rowwise")


def test_double_quantization_differs_from_original_source():
    x = gaussian(5)
    a = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer()).quantize(x, rowwise=False, columnwise=True)
    b = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), columnwise_source="rowwise_dequantized").quantize(
        x, rowwise=False, columnwise=True)
    assert not torch.equal(a.columnwise.data.view(torch.uint8), b.columnwise.data.view(torch.uint8))


def test_unneeded_direction_is_not_computed():
    """Delayed-scaling quantizers record every cast: the one for the direction not asked for stays untouched."""
    r = Float8Quantizer(scaling="delayed", amax_history_len=2)
    c = Float8Quantizer(scaling="delayed", amax_history_len=2)
    h = HybridQuantizer(r, c)
    h.quantize(gaussian(6), rowwise=False, columnwise=True)
    assert not r.amax_history.any() and not r.update_pending, "rowwise quantizer ran for a columnwise-only request"
    assert c.amax_history[0] > 0
    h.quantize(gaussian(7), rowwise=True, columnwise=False)
    assert r.amax_history[0] > 0
    assert c.amax_history[0].item() == gaussian(6).abs().max().item(), "columnwise quantizer ran again"


def test_double_quantization_needs_the_rowwise_form_even_for_columnwise_only():
    r = Float8Quantizer(scaling="delayed", amax_history_len=2)
    HybridQuantizer(r, MXFP8Quantizer(), columnwise_source="rowwise_dequantized").quantize(
        gaussian(8), rowwise=False, columnwise=True)
    assert r.amax_history[0] > 0


def test_new_hybrid_produces_rowwise_only_and_usage_flags():
    x = gaussian(9)
    t = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()).quantize(x)
    assert t.rowwise is not None and t.columnwise is None
    t = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise_usage=True).quantize(x)
    assert t.rowwise is not None and t.columnwise is not None
    t = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), rowwise_usage=False, columnwise_usage=True).quantize(x)
    assert t.rowwise is None and t.columnwise is not None


def test_hybrid_dequantize_reads_rowwise_unless_asked():
    x = gaussian(10)
    t = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()).quantize(x, **BOTH)
    assert t.formats == ("MXFP8", "NVFP4")
    assert_bitwise(t.dequantize(), t.dequantize(direction="rowwise"), "default dequantize")
    assert_bitwise(t.dequantize(direction="rowwise"), MXFP8Quantizer().quantize(x).dequantize(), "rowwise")
    assert_bitwise(t.dequantize(direction="columnwise"),
                   NVFP4Quantizer().quantize(x, rowwise=False, columnwise=True).dequantize(), "columnwise")


@pytest.mark.parametrize("shape,dirs,source,needles", [
    ((64, 48), dict(rowwise=True, columnwise=False), "original", ["MXFP8", "K % 32"]),
    ((24, 64), dict(rowwise=False, columnwise=True), "original", ["NVFP4", "M % 16"]),
    ((48, 64), dict(rowwise=False, columnwise=True), "original", None),  # MXFP8 rowwise M rule not needed
    ((32, 48), dict(rowwise=False, columnwise=True), "rowwise_dequantized", ["MXFP8", "K % 32"]),
], ids=["rowwise K", "columnwise M", "col-only skips rowwise rule", "double needs rowwise rule"])
def test_hybrid_shape_rules_follow_the_directions_computed(shape, dirs, source, needles):
    h = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise_source=source)
    x = torch.randn(*shape)
    if needles is None:
        assert h.quantize(x, **dirs).columnwise is not None
        return
    with pytest.raises(ValueError) as e:
        h.quantize(x, name="blocks.0.attn.qkv", **dirs)
    for n in ["blocks.0.attn.qkv", "hybrid"] + needles:
        assert n in str(e.value), f"{str(e.value)!r} does not mention {n!r}"


@pytest.mark.parametrize("kw,exc", [
    (dict(rowwise=HybridQuantizer(MXFP8Quantizer(), MXFP8Quantizer()), columnwise=MXFP8Quantizer()), TypeError),
    (dict(rowwise="mxfp8", columnwise=MXFP8Quantizer()), TypeError),
    (dict(rowwise=MXFP8Quantizer(), columnwise=MXFP8Quantizer(), columnwise_source="rowwise"), ValueError),
], ids=["nested hybrid", "not a quantizer", "bad source"])
def test_invalid_hybrid_configuration_is_rejected(kw, exc):
    with pytest.raises(exc):
        HybridQuantizer(**kw)


def test_one_delayed_scaling_quantizer_cannot_serve_both_directions():
    q = Float8Quantizer(scaling="delayed")
    with pytest.raises(ValueError, match="one delayed-scaling quantizer cannot serve both directions"):
        HybridQuantizer(rowwise=q, columnwise=q)
