"""MXFP8 (docs/numerics.md "MXFP8"): 1x32 / 32x1 blocks with E8M0 scales, 32x32 tiles, swizzled scale layout."""

from __future__ import annotations

import math

import pytest
import torch

from hybridq.formats import MXFP8Part, MXFP8Quantizer, swizzle_mx_scales

from _format_cases import assert_bitwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {"e4m3": (E4M3, 448.0), "e5m2": (E5M2, 57344.0)}


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def f32_bits(b: int) -> float:
    return torch.tensor([b], dtype=torch.int32).view(torch.float32).item()


def one_block(values, k: int = 32) -> torch.Tensor:
    x = torch.zeros(1, k)
    x[0, :len(values)] = f32(values)
    return x


def test_defaults():
    q = MXFP8Quantizer()
    assert q.dtype == E4M3 and not q.block_2d


# (block amax, fmt, expected e, expected q of the amax element, why)
EXPONENT_CASES = [
    (448.0, "e4m3", 127, 448.0, "amax = 448: 448 * rcp_rn(448) rounds to exactly 1 -> e = 127, no bump"),
    (256.0, "e4m3", 127, 256.0, "power-of-two amax 2^8: 2^8 * rcp_rn(448) = 0.571 -> e = 127"),
    (1.0, "e4m3", 119, 256.0, "power-of-two amax 1: v = rcp_rn(448) ~ 2^-8.8 -> e = 119, q = 2^8"),
    (2.0 ** -20, "e4m3", 99, 256.0, "power-of-two amax 2^-20 -> e = 99"),
    (448.0 * 2 ** 10, "e4m3", 137, 448.0, "amax = 448 * 2^10 -> e = 137"),
    (f32_bits(0x43E00001), "e4m3", 128, 224.0, "one ulp above 448 -> e = 128, q = 224"),
    (f32_bits(0x43DFFFFF), "e4m3", 127, 448.0, "one ulp below 448 -> e = 127, q = 448 (rounded)"),
    (449.0, "e4m3", 128, 224.0, "449 -> e = 128, q = 224.5 -> 224"),
    (57344.0, "e5m2", 127, 57344.0, "E5M2 amax = 57344 -> e = 127"),
    (2.0 ** 15, "e5m2", 127, 32768.0, "E5M2 power-of-two amax 2^15 -> e = 127"),
    (1.0, "e5m2", 112, 32768.0, "E5M2 power-of-two amax 1 -> e = 112, q = 2^15"),
]


@pytest.mark.parametrize("amax,fmt,e,qmax,why", EXPONENT_CASES, ids=[c[4] for c in EXPONENT_CASES])
def test_block_exponent_hand_cases(amax, fmt, e, qmax, why):
    dtype, fmax = FP8[fmt]
    p = MXFP8Quantizer(fp8=fmt).quantize(one_block([amax, -amax / 2])).rowwise
    assert isinstance(p, MXFP8Part) and p.scale.dtype == torch.uint8 and p.scale.shape == (1, 1)
    assert p.scale.item() == e, f"{why}: e = {p.scale.item()}, expected {e}"
    assert p.data.float()[0, 0].item() == qmax, f"{why}: q = {p.data.float()[0, 0].item()}, expected {qmax}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("amax", [2.0 ** k for k in (-100, -9, -1, 0, 1, 8, 9, 15, 16, 100)]
                         + [448.0 * 2.0 ** k for k in (-20, 0, 3)] + [57344.0, 3.0, 1000.0])
def test_exponent_is_round_up_of_amax_times_rcp_rn_of_fp8_max(fmt, amax):
    """e = e8m0_round_up(amax * rcp_rn(fp8_max)): a multiply by the fp32 reciprocal, computed by hand here
    (smallest power of two >= the fp32 product)."""
    dtype, fmax = FP8[fmt]
    v = (f32([amax]) * (torch.ones(1) / f32([fmax]))).item()  # fp32 multiply by rcp_rn
    m, ex = math.frexp(v)  # v = m * 2^ex, 0.5 <= m < 1
    expected = ex - 1 + 127 if m == 0.5 else ex + 127
    e = MXFP8Quantizer(fp8=fmt).quantize(one_block([amax])).rowwise.scale.item()
    assert e == expected, f"amax {amax}: e = {e}, expected {expected} (v = {v!r})"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_q_is_x_times_2_pow_127_minus_e_satfinite(fmt):
    dtype, fmax = FP8[fmt]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 30
    p = MXFP8Quantizer(fp8=fmt).quantize(x).rowwise
    mult = torch.exp2(127.0 - p.scale.double()).float().repeat_interleave(32, dim=1)
    assert_bitwise(p.data, (x * mult).clamp(-fmax, fmax).to(dtype), "data")
    assert p.data.float().abs().max().item() <= fmax


def test_zero_block_e0_q0():
    x = torch.zeros(2, 64)
    x[0, 40] = 1.0
    p = MXFP8Quantizer().quantize(x).rowwise
    assert p.scale.tolist() == [[0, 119], [0, 0]]
    assert p.data.view(torch.uint8)[0, :32].eq(0).all() and p.data.view(torch.uint8)[1].eq(0).all()
    assert not p.dequantize_2d()[1].any()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_inf_in_a_block_e254_inf_stays_non_finite(fmt):
    """Block amax inf -> e = 254; -inf * 2^-127 is -inf: E5M2 -inf / E4M3 NaN with the sign bit; finite
    neighbours underflow to 0."""
    dtype, fmax = FP8[fmt]
    x = torch.ones(1, 64)
    x[0, 2] = -math.inf
    p = MXFP8Quantizer(fp8=fmt).quantize(x).rowwise
    assert p.scale[0].tolist() == [254, 127 - 8 if fmt == "e4m3" else 127 - 15]
    assert p.data.view(torch.uint8)[0, 2].item() == {"e4m3": 0xFF, "e5m2": 0xFC}[fmt]
    others = torch.cat([p.data.float()[0, :2], p.data.float()[0, 3:32]])
    assert (others == 0).all(), "the other elements of the inf block are 0"


def test_nan_in_a_block_e255_block_is_nan():
    x = torch.ones(1, 64)
    x[0, 5] = math.nan
    p = MXFP8Quantizer().quantize(x).rowwise
    assert p.scale[0].tolist() == [255, 119]
    d = p.dequantize_2d()
    assert torch.isnan(d[0, :32]).all(), "e = 255 decodes to NaN for the whole block"
    assert (d[0, 32:] == 1).all()


def test_subnormal_block_amax_e0_and_e1():
    """amax 2^-130: v = amax * rcp_rn(448) is subnormal with mantissa <= 0x400000 -> e = 0 (scale 2^-127),
    round trip exact; amax 320 * 2^-126 -> v ~ 0.714 * 2^-126 (mantissa 0x5B6DB7 > 0x400000) -> e = 1, q = 320."""
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 2.0 ** -130, -(2.0 ** -133)
    x[1, 0] = 320 * 2.0 ** -126
    p = MXFP8Quantizer().quantize(x).rowwise
    assert p.scale.flatten().tolist() == [0, 1]
    assert p.data.float()[0, :2].tolist() == [0.125, -2.0 ** -6]
    assert p.data.float()[1, 0].item() == 320.0
    torch.testing.assert_close(p.dequantize_2d(), x, rtol=0, atol=0)


def test_dequantize_is_q_times_2_pow_e_minus_127():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    p = MXFP8Quantizer().quantize(x).rowwise
    expected = p.data.double() * torch.exp2(p.scale.double() - 127).repeat_interleave(32, dim=1)
    torch.testing.assert_close(p.dequantize_2d(), expected.float(), rtol=0, atol=0)


def test_columnwise_blocks_run_along_m_from_the_input():
    """32x1 columnwise: stored [K, M], bitwise the rowwise quantization of x^T (from the original input)."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    q = MXFP8Quantizer()
    t = q.quantize(x, rowwise=True, columnwise=True)
    c = t.columnwise
    assert (c.rows, c.cols, c.columnwise) == (96, 64, True) and c.scale.shape == (96, 2)
    ref = q.quantize(x.t().contiguous()).rowwise
    assert_bitwise(c.data, ref.data, "columnwise data vs rowwise(x^T)")
    assert_bitwise(c.scale, ref.scale, "columnwise scale vs rowwise(x^T)")


def test_32x32_tiles_share_one_exponent_and_transpose():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    x[40, 70] = 1000.0  # tile (1, 2)
    t = MXFP8Quantizer(block_2d=True).quantize(x, rowwise=True, columnwise=True)
    r, c = t.rowwise, t.columnwise
    assert r.scale.shape == (64, 3) and c.scale.shape == (96, 2)
    tile_e = r.scale[::32]  # [M/32, K/32]
    assert torch.equal(r.scale, tile_e.repeat_interleave(32, dim=0)), "each tile's e is repeated on its rows"
    tile_amax = x.abs().reshape(2, 32, 3, 32).amax(dim=(1, 3))
    v = tile_amax * (torch.ones(1) / f32([448.0]))
    from hybridq.formats._numerics import e8m0_round_up
    assert torch.equal(tile_e, e8m0_round_up(v)), "tile e = e8m0_round_up(tile amax * rcp_rn(448))"
    assert tile_e[1, 2].item() == e8m0_round_up(f32([1000.0]) / 448).item()
    assert_bitwise(c.data, r.data.t().contiguous(), "columnwise data vs rowwise data^T")
    assert torch.equal(c.scale[::32], tile_e.t()), "columnwise tile exponents = rowwise tile exponents^T"


# ---- swizzled GEMM-ready scale layout ------------------------------------------------------------

def swizzle_by_formula(scale: torch.Tensor) -> torch.Tensor:
    rows, cols = scale.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(rp * cp, dtype=torch.uint8)
    tiles_per_row = cp // 4
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_per_row + (c // 4)
            rr, cc = r % 128, c % 4
            out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = scale[r, c]
    return out


def test_swizzle_single_tile_unique_values():
    """64 x 4 distinct bytes padded to one 128 x 4 tile: every byte lands at (r%32)*16 + (r//32)*4 + c."""
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(64, 4)
    got = swizzle_mx_scales(scale)
    assert got.dtype == torch.uint8 and got.shape == (512,)
    for r, c in [(0, 0), (0, 3), (1, 0), (31, 2), (32, 0), (33, 1), (63, 3)]:
        off = (r % 32) * 16 + (r // 32) * 4 + c
        assert got[off].item() == scale[r, c].item(), f"scale ({r},{c}) not at offset {off}"
    assert_bitwise(got, swizzle_by_formula(scale), "swizzled layout")


@pytest.mark.parametrize("rows,cols", [(128, 4), (130, 6), (300, 9), (1, 1)])
def test_swizzle_padding_and_tile_row_major(rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    scale = torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
    got = swizzle_mx_scales(scale)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert got.numel() == rp * cp, f"padded size {got.numel()} != {rp} x {cp}"
    expected = swizzle_by_formula(scale)
    assert_bitwise(got, expected, f"swizzle of [{rows}, {cols}]")
    assert int((got == 0).sum()) == rp * cp - rows * cols, "padding bytes are 0 (scales here are non-zero)"


def test_part_swizzled_scale_is_swizzle_of_compact_scale():
    x = torch.randn(160, 64, generator=torch.Generator().manual_seed(4))
    p = MXFP8Quantizer().quantize(x).rowwise
    assert p.scale.shape == (160, 2), "compact scales are the storage form"
    assert_bitwise(p.swizzled_scale(), swizzle_mx_scales(p.scale), "part.swizzled_scale()")
