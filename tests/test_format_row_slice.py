"""Row slices of quantized parts (`BlockScaledPart.row_slice`) and `Quantizer.local_scaling`: for the formats whose
scales depend on their own block only, row groups zero-padded to the format's row granularity and quantized as one
tensor are, cut apart by `row_slice`, bit for bit each group quantized alone (what GroupedLinear's packed path for
block formats relies on); a slice of any block-scaled part dequantizes to the same rows of the whole; cuts inside a
scaling block are refused."""

from __future__ import annotations

import pytest
import torch

from hybridq.formats.block import BlockScaledQuantizer

from _compare import assert_bitwise, assert_parts_bitwise
from _format_cases import FORMATS, hybrid

LOCAL = ["fp8blk_1x128_e4m3", "fp8blk_1x128_e5m2", "fp8blk_1x128_e4m3_nopow2", "fp8blk_128x128_e4m3",
         "mxfp8_e4m3", "mxfp8_e5m2", "mxfp8_32x32_e4m3"]
LOCAL_CASES = {n: FORMATS[n] for n in LOCAL}
LOCAL_CASES["hybrid_fp8blk_mxfp8"] = hybrid("fp8blk_1x128_e4m3", "mxfp8_e4m3")
LOCAL_CASES["hybrid_fp8blk2d_mxfp8"] = hybrid("fp8blk_128x128_e4m3", "mxfp8_e4m3")
LOCAL_CASES["hybrid_fp8blk_mxfp8_double"] = hybrid("fp8blk_1x128_e4m3", "mxfp8_e4m3",
                                                   columnwise_source="rowwise_dequantized")
NOT_LOCAL = {n: FORMATS[n] for n in ("fp8_e4m3", "fp8_e4m3_delayed", "nvfp4", "nvfp4_16x16", "nvfp4_rht", "nvfp4_sr",
                                     "identity")}
NOT_LOCAL["hybrid_mxfp8_nvfp4"] = hybrid("mxfp8_e4m3", "nvfp4")
NOT_LOCAL["hybrid_fp8blk_identity"] = hybrid("fp8blk_1x128_e4m3", "identity")
NOT_LOCAL["hybrid_fp8_fp8blk"] = hybrid("fp8_e4m3", "fp8blk_1x128_e4m3")

SIZES = [[5, 0, 40, 133], [0, 0, 3, 0], [128, 1, 256]]
K = 96  # not a multiple of 128: FP8 blocks along K have a partial edge block


def _round_up(n: int, g: int) -> int:
    return -(-n // g) * g


def _fits(q, m: int, rowwise: bool, columnwise: bool) -> int:
    """The smallest row count >= m the format takes (as GroupedLinear pads a slice)."""
    return next(n for n in range(m, m + 129) if q.shape_rule(n, K, rowwise, columnwise) is None)


@pytest.mark.parametrize("name", sorted(LOCAL_CASES))
def test_block_local_formats_report_local_scaling(name):
    assert LOCAL_CASES[name]().local_scaling, f"{name}: local_scaling is False"


@pytest.mark.parametrize("name", sorted(NOT_LOCAL))
def test_formats_with_tensor_wide_or_random_scales_do_not_report_local_scaling(name):
    assert not NOT_LOCAL[name]().local_scaling, f"{name}: local_scaling is True"


@pytest.mark.parametrize("direction", ["rowwise", "columnwise", "both"])
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("name", sorted(LOCAL_CASES))
def test_row_slices_of_padded_row_groups_are_each_group_quantized_alone(name, sizes, direction):
    q = LOCAL_CASES[name]()
    rowwise, columnwise = direction in ("rowwise", "both"), direction in ("columnwise", "both")
    g = q.split_granularity(rowwise, columnwise)[0]
    gen = torch.Generator().manual_seed(4)
    groups, slots = [], []
    for i, m in enumerate(sizes):
        n = _fits(q, m, rowwise, columnwise) if m else 0
        # groups of very different magnitudes: a block shared by two groups would change a scale
        x = torch.randn(m, K, generator=gen) * 10.0 ** (2 * i - 2)
        groups.append(torch.nn.functional.pad(x, (0, 0, 0, n - m)))
        slots.append(_round_up(n, g))
    packed = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, s - x.shape[0])) for x, s in zip(groups, slots)])
    whole = q.quantize_parts(packed, rowwise, columnwise)
    o = 0
    for i, (x, s) in enumerate(zip(groups, slots)):
        if x.shape[0]:
            alone = q.quantize_parts(x, rowwise, columnwise)
            for d, (w, a) in enumerate(zip(whole, alone)):
                got = None if w is None else w.row_slice(o, o + x.shape[0])
                assert_parts_bitwise(got, a, f"{name} group {i} of {sizes} ({('rowwise', 'columnwise')[d]})")
        o += s


SLICEABLE = {n: f for n, f in FORMATS.items() if isinstance(f(), BlockScaledQuantizer)}


@pytest.mark.parametrize("name", sorted(SLICEABLE))
def test_a_row_slice_dequantizes_to_those_rows_of_the_whole(name):
    q = SLICEABLE[name]()
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 2, 256)[:, None]
    row, col = q.quantize_parts(x, True, True)
    start, stop = 128, 256
    assert_bitwise(row.row_slice(start, stop).dequantize_2d(), row.dequantize_2d()[start:stop], f"{name} rowwise")
    assert_bitwise(col.row_slice(start, stop).dequantize_2d(), col.dequantize_2d()[:, start:stop],
                   f"{name} columnwise")


@pytest.mark.parametrize("name", ["fp8blk_1x128_e4m3", "fp8blk_128x128_e4m3", "mxfp8_e4m3", "nvfp4"])
def test_a_row_slice_cutting_a_scaling_block_is_refused(name):
    q = FORMATS[name]()
    row, col = q.quantize_parts(torch.randn(256, 128), True, True)
    with pytest.raises(ValueError, match="would cut a columnwise scaling block"):
        col.row_slice(8, 128)
    with pytest.raises(ValueError, match="outside"):
        row.row_slice(0, 257)
