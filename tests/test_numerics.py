"""Bit-level numerics shared by the format references (hybridq/formats/_numerics.py) against docs/numerics.md."""

from __future__ import annotations

import math

import pytest
import torch

from hybridq.formats import _numerics as nx

FLT_MAX = torch.finfo(torch.float32).max


def f32_from_bits(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


def f32(v) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float32)


def next_up(v: float) -> float:
    return torch.nextafter(f32(v), f32(math.inf)).item()


# ---- e8m0_round_up -------------------------------------------------------------------------------

E8M0_CASES = [
    # (fp32 input, expected byte, rule)
    (f32(math.nan), 255, "NaN -> 255"),
    (f32(math.inf), 254, "inf -> 254"),
    (f32(0.0), 0, "0 -> 0"),
    (f32(-0.0), 0, "-0 -> 0"),
    (f32(1.0), 127, "power of two stays: 2^0"),
    (f32(0.5), 126, "power of two stays: 2^-1"),
    (f32(2.0 ** 100), 227, "power of two stays: 2^100"),
    (f32(2.0 ** -126), 1, "power of two stays: smallest normal"),
    (f32(2.0 ** 127), 254, "power of two stays: 2^127"),
    (f32(1.5), 128, "mantissa non-zero bumps the exponent"),
    (f32_from_bits(0x3F800001), 128, "one ulp above 1 bumps"),
    (f32_from_bits(0x3F7FFFFF), 127, "one ulp below 1 rounds up to 2^0"),
    (f32(1.5 * 2.0 ** 126), 254, "e == 253 with mantissa bumps to 254"),
    (f32(1.5 * 2.0 ** 127), 254, "e == 254: no bump"),
    (f32(FLT_MAX), 254, "e == 254: no bump (FLT_MAX)"),
    (f32_from_bits(0x00400000), 0, "subnormal, mantissa == 0x400000 (2^-127): 0"),
    (f32_from_bits(0x00400001), 1, "subnormal, mantissa 0x400001 > 0x400000: 1"),
    (f32_from_bits(0x00000001), 0, "smallest subnormal 2^-149: 0"),
    (f32_from_bits(0x003FFFFF), 0, "subnormal just below 2^-127: 0"),
    (f32_from_bits(0x007FFFFF), 1, "largest subnormal: 1"),
]


@pytest.mark.parametrize("v,expected,rule", E8M0_CASES, ids=[c[2] for c in E8M0_CASES])
def test_e8m0_round_up_cases(v, expected, rule):
    got = nx.e8m0_round_up(v)
    assert got.dtype == torch.uint8
    assert int(got) == expected, f"{rule}: e8m0_round_up({v.item()!r}) = {int(got)}, expected {expected}"


def test_e8m0_round_up_is_smallest_power_of_two_not_below_v():
    """For normal v with a biased exponent below 254, 2^(e-127) is the smallest power of two >= v."""
    g = torch.Generator().manual_seed(0)
    exps = torch.randint(1, 253, (4096,), generator=g, dtype=torch.int32)
    mans = torch.randint(0, 1 << 23, (4096,), generator=g, dtype=torch.int32)
    v = ((exps << 23) | mans).view(torch.float32)
    e = nx.e8m0_round_up(v).double()
    p = torch.exp2(e - 127)
    bad = ~((p >= v.double()) & (p / 2 < v.double()))
    assert not bad.any(), f"{int(bad.sum())} values violate 2^(e-128) < v <= 2^(e-127), e.g. v={v[bad][:3].tolist()}"


def test_e8m0_round_up_elementwise_on_tensor():
    v = torch.tensor([0.0, 1.0, 1.5, math.inf, math.nan, 2.0 ** -127]).reshape(2, 3)
    got = nx.e8m0_round_up(v)
    assert got.shape == (2, 3)
    assert got.flatten().tolist() == [0, 127, 128, 254, 255, 0]


# ---- e8m0_to_pow2 --------------------------------------------------------------------------------

def test_e8m0_to_pow2_every_finite_code_is_exact():
    e = torch.arange(0, 255, dtype=torch.uint8)
    expected = torch.tensor([2.0 ** (int(i) - 127) for i in range(255)], dtype=torch.float32)
    torch.testing.assert_close(nx.e8m0_to_pow2(e), expected, rtol=0, atol=0)


def test_e8m0_to_pow2_negated_every_finite_code_is_exact():
    e = torch.arange(0, 255, dtype=torch.uint8)
    expected = torch.tensor([2.0 ** (127 - int(i)) for i in range(255)], dtype=torch.float32)
    torch.testing.assert_close(nx.e8m0_to_pow2(e, negate=True), expected, rtol=0, atol=0)


@pytest.mark.parametrize("e,negate", [(0, False), (254, True)], ids=["e=0", "e=254 negated"])
def test_e8m0_to_pow2_subnormal_2_pow_minus_127(e, negate):
    got = nx.e8m0_to_pow2(torch.tensor([e], dtype=torch.uint8), negate=negate)
    assert got.view(torch.int32).item() == 0x00400000, f"expected the fp32 subnormal 2^-127, got {got.item()!r}"


@pytest.mark.parametrize("negate", [False, True])
def test_e8m0_to_pow2_255_is_nan(negate):
    got = nx.e8m0_to_pow2(torch.tensor([255], dtype=torch.uint8), negate=negate)
    assert torch.isnan(got).all(), f"e=255 must decode to NaN, got {got.item()!r}"


# ---- E2M1 ----------------------------------------------------------------------------------------

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_round(v: float) -> float:
    return nx.e2m1_decode(nx.e2m1_codes(f32(v))).item()


def test_e2m1_grid_values_have_codes_0_to_7():
    codes = nx.e2m1_codes(torch.tensor(E2M1_GRID))
    assert codes.tolist() == list(range(8))
    assert nx.e2m1_codes(-torch.tensor(E2M1_GRID[1:])).tolist() == list(range(9, 16)), "bit 3 is the sign"


@pytest.mark.parametrize("v,expected", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0),
                                        (3.5, 4.0), (5.0, 4.0)])
def test_e2m1_midpoints_round_to_even(v, expected):
    assert e2m1_round(v) == expected, f"midpoint {v} must round to the even neighbour {expected}"
    assert e2m1_round(-v) == -expected, f"midpoint {-v} must round to {-expected}"


@pytest.mark.parametrize("lo,mid,hi", list(zip(E2M1_GRID, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0],
                                               E2M1_GRID[1:])))
def test_e2m1_just_off_midpoints_round_to_nearest(lo, mid, hi):
    below = torch.nextafter(f32(mid), f32(-math.inf)).item()
    above = next_up(mid)
    assert e2m1_round(below) == lo, f"{below!r} (just below {mid}) must round to {lo}"
    assert e2m1_round(above) == hi, f"{above!r} (just above {mid}) must round to {hi}"


@pytest.mark.parametrize("v", [6.0, 6.5, 7.0, 100.0, FLT_MAX, math.inf])
def test_e2m1_saturates_at_6(v):
    assert e2m1_round(v) == 6.0, f"{v} must saturate to 6"
    assert e2m1_round(-v) == -6.0, f"{-v} must saturate to -6"


def test_e2m1_sign_bit_including_negative_zero():
    codes = nx.e2m1_codes(torch.tensor([-0.0, 0.0, -0.1, -0.75]))
    assert codes.tolist() == [8, 0, 8, 10], "bit 3 carries the sign (also of values rounding to zero)"


def test_e2m1_nan_maps_to_plus_6_as_documented():
    # _numerics.e2m1_codes: "NaN maps to +6 (code 7): E2M1 has no NaN"
    assert nx.e2m1_codes(f32(math.nan)).item() == 7
    assert nx.e2m1_codes(-f32(math.nan)).item() == 7, "NaN's sign bit is dropped"


def test_e2m1_stochastic_with_rand_0_and_near_1():
    """rand < frac rounds up: rand = 0 rounds up any value off the grid, rand -> 1 rounds every value down."""
    v = torch.tensor([0.1, 0.6, 1.2, 1.9, 2.2, 3.9, 5.9, -2.2, 2.0, 7.0])
    up = nx.e2m1_decode(nx.e2m1_codes_stochastic(v, torch.zeros_like(v)))
    down = nx.e2m1_decode(nx.e2m1_codes_stochastic(v, torch.full_like(v, 1 - 2 ** -24)))
    assert up.tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -3.0, 2.0, 6.0]
    assert down.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -2.0, 2.0, 6.0]


def test_e2m1_stochastic_nan_maps_to_plus_6():
    assert nx.e2m1_codes_stochastic(f32(math.nan), torch.zeros(1)).item() == 7


# ---- nibble packing ------------------------------------------------------------------------------

def test_pack_nibbles_element_2i_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4], [0xF, 0x0, 0x0, 0xA]], dtype=torch.uint8)
    packed = nx.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xA0]]


def test_unpack_nibbles_inverts_pack():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(nx.unpack_nibbles(nx.pack_nibbles(codes)), codes)


# ---- RHT -----------------------------------------------------------------------------------------

FORMATS_MD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def sylvester_h16() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix() -> torch.Tensor:
    return torch.diag(torch.tensor(FORMATS_MD_SIGNS, dtype=torch.float64)) @ sylvester_h16() / 4


def test_rht_sign_vector_is_the_formats_md_one():
    assert list(nx.RHT_SIGNS) == FORMATS_MD_SIGNS


def test_rht_matrix_is_diag_s_times_h16_over_4():
    """A row group g maps to g @ (diag(s) H16 / 4): transforming the identity gives the matrix itself."""
    got = nx.rht16(torch.eye(16))
    torch.testing.assert_close(got, rht_matrix().float(), rtol=0, atol=0)


def test_rht_inverse_matrix_is_transpose():
    torch.testing.assert_close(nx.rht16_inverse(torch.eye(16)), rht_matrix().t().float(), rtol=0, atol=0)
    torch.testing.assert_close(rht_matrix() @ rht_matrix().t(), torch.eye(16, dtype=torch.float64),
                               rtol=0, atol=0)


def test_rht_inverse_recovers_input_to_bf16_precision():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    back = nx.rht16_inverse(nx.rht16(x))
    rel = ((back - x).norm() / x.norm()).item()
    assert rel < 2 ** -8, f"inverse(rht(x)) differs from x by relative {rel:.2e} (> bf16 precision 2^-8)"


def test_rht_output_is_bf16_representable():
    y = nx.rht16(torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 100)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.to(torch.bfloat16).float(), y, rtol=0, atol=0)


def test_rht_rounds_inputs_to_bf16_first():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(nx.rht16(x), nx.rht16(x.to(torch.bfloat16).float()), rtol=0, atol=0)


def test_rht_equals_exact_product_rounded_to_bf16():
    """With inputs whose fp32 butterflies are exact, the result is the exact product rounded once to bf16."""
    g = torch.Generator().manual_seed(3)
    mag = torch.exp2(torch.empty(32, 64).uniform_(-4, 2, generator=g))
    sign = torch.where(torch.rand(32, 64, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mag).to(torch.bfloat16).float()
    exact = (x.double().reshape(32, 4, 16) @ rht_matrix()).reshape(32, 64)
    torch.testing.assert_close(nx.rht16(x), exact.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_rht_groups_of_16_are_independent():
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4))
    y = nx.rht16(x)
    for g in range(3):
        torch.testing.assert_close(y[:, 16 * g:16 * (g + 1)], nx.rht16(x[:, 16 * g:16 * (g + 1)]), rtol=0, atol=0)


# ---- scale_from_amax -----------------------------------------------------------------------------

def fdiv(a: float, b: float) -> float:
    """IEEE fp32 a / b."""
    return (f32(a) / f32(b)).item()


SCALE_CASES = [
    # (amax, fp8_max, eps, pow2, expected, rule)
    (448.0, 448.0, 0.0, False, 1.0, "fp8_max / amax"),
    (7.0, 448.0, 0.0, False, 64.0, "fp8_max / amax"),
    (3.0, 448.0, 0.0, False, fdiv(448.0, 3.0), "fp8_max / amax in fp32"),
    (3.0, 57344.0, 0.0, False, fdiv(57344.0, 3.0), "E5M2 fp8_max / amax in fp32"),
    (0.0, 448.0, 0.0, False, 1.0, "amax 0 -> scale 1"),
    (math.inf, 448.0, 0.0, False, 1.0, "amax inf -> scale 1"),
    (math.nan, 448.0, 0.0, False, 1.0, "amax NaN -> scale 1"),
    (math.nan, 448.0, 1e-3, False, 1.0, "amax NaN with eps -> scale 1"),
    (math.inf, 448.0, 0.0, True, 1.0, "amax inf with pow2 -> scale 1"),
    (0.0, 448.0, 1e-3, False, fdiv(448.0, 1e-3), "amax < eps -> eps (then 0 is no longer degenerate)"),
    (1e-4, 448.0, 1e-3, False, fdiv(448.0, 1e-3), "amax < eps -> eps"),
    (2e-3, 448.0, 1e-3, False, fdiv(448.0, 2e-3), "amax >= eps is kept"),
    (1e-45, 448.0, 0.0, False, FLT_MAX, "infinite scale -> FLT_MAX"),
    (1e-45, 448.0, 0.0, True, 2.0 ** 127, "infinite scale -> FLT_MAX -> pow2 2^127"),
    (3.0, 448.0, 0.0, True, 128.0, "pow2 rounds 149.33 down to 128"),
    (7.0, 448.0, 0.0, True, 64.0, "pow2 keeps an exact power of two"),
    (448.0 * 1.5, 448.0, 0.0, True, 0.5, "pow2 rounds 0.667 down to 0.5"),
    (1e30, 57344.0, 0.0, True, 2.0 ** -84, "pow2 rounds 5.7e-26 down to 2^-84"),
]


@pytest.mark.parametrize("amax,fp8_max,eps,pow2,expected,rule", SCALE_CASES, ids=[c[5] for c in SCALE_CASES])
def test_scale_from_amax(amax, fp8_max, eps, pow2, expected, rule):
    got = nx.scale_from_amax(f32(amax), fp8_max, eps=eps, pow2=pow2)
    assert got.dtype == torch.float32
    assert got.item() == f32(expected).item(), \
        f"{rule}: scale_from_amax({amax}, {fp8_max}, eps={eps}, pow2={pow2}) = {got.item()!r}, expected {expected!r}"


def test_clear_mantissa_rounds_down_to_power_of_two():
    v = torch.tensor([1.0, 1.9999, 3.0, 0.75, FLT_MAX, 2.0 ** -126])
    assert nx.clear_mantissa(v).tolist() == [1.0, 1.0, 2.0, 0.5, 2.0 ** 127, 2.0 ** -126]


def test_rcp_is_ieee_fp32_division():
    v = torch.tensor([3.0, 7.0, 448.0, 57344.0, FLT_MAX, 0.0])
    expected = torch.ones(6, dtype=torch.float32) / v
    torch.testing.assert_close(nx.rcp(v), expected, rtol=0, atol=0)
    assert nx.rcp(f32(448.0)).view(torch.int32).item() == 0x3B124925, "rcp_rn(448) is 0x3B124925"


# ---- satfinite -----------------------------------------------------------------------------------

SATFINITE_CASES = [
    # (dtype, input, expected, rule)
    (torch.float8_e4m3fn, 500.0, 448.0, "clamp to +max"),
    (torch.float8_e4m3fn, -1e30, -448.0, "clamp to -max"),
    (torch.float8_e4m3fn, 464.0, 448.0, "above max by half a step still saturates to max"),
    (torch.float8_e4m3fn, 272.0, 256.0, "tie 256|288 -> even 256"),
    (torch.float8_e4m3fn, 304.0, 320.0, "tie 288|320 -> even 320"),
    (torch.float8_e4m3fn, 2.0 ** -9, 2.0 ** -9, "smallest subnormal exact"),
    (torch.float8_e4m3fn, 2.0 ** -10, 0.0, "half the smallest subnormal ties to 0"),
    (torch.float8_e4m3fn, 3 * 2.0 ** -10, 2.0 ** -8, "tie 2^-9|2^-8 -> even 2^-8"),
    (torch.float8_e5m2, 60000.0, 57344.0, "clamp to +max (torch's cast alone would give inf)"),
    (torch.float8_e5m2, 1e10, 57344.0, "clamp to +max (torch's cast alone would give inf)"),
    (torch.float8_e5m2, 2.0 ** -16, 2.0 ** -16, "smallest subnormal exact"),
    (torch.float8_e5m2, 2.0 ** -17, 0.0, "half the smallest subnormal ties to 0"),
]


@pytest.mark.parametrize("dtype,v,expected,rule", SATFINITE_CASES,
                         ids=[f"{nx.FP8_NAMES[c[0]]}: {c[3]}" for c in SATFINITE_CASES])
def test_satfinite_fp8(dtype, v, expected, rule):
    got = nx.satfinite_fp8(f32(v), dtype)
    assert got.dtype == dtype
    assert got.float().item() == expected, f"{rule}: satfinite({v}) = {got.float().item()}, expected {expected}"


NONFINITE_BYTES = [
    # (dtype, input, expected byte, rule)
    (torch.float8_e4m3fn, math.nan, 0x7F, "NaN -> NaN"),
    (torch.float8_e4m3fn, -math.nan, 0xFF, "-NaN -> NaN with the sign bit"),
    (torch.float8_e4m3fn, math.inf, 0x7F, "inf -> NaN (E4M3 has no infinity)"),
    (torch.float8_e4m3fn, -math.inf, 0xFF, "-inf -> NaN with the sign bit"),
    (torch.float8_e5m2, math.nan, 0x7F, "NaN -> NaN"),
    (torch.float8_e5m2, -math.nan, 0xFF, "-NaN -> NaN with the sign bit"),
    (torch.float8_e5m2, math.inf, 0x7C, "inf -> inf"),
    (torch.float8_e5m2, -math.inf, 0xFC, "-inf -> -inf"),
]


@pytest.mark.parametrize("dtype,v,expected,rule", NONFINITE_BYTES,
                         ids=[f"{nx.FP8_NAMES[c[0]]}: {c[3]}" for c in NONFINITE_BYTES])
def test_satfinite_fp8_non_finite_bytes(dtype, v, expected, rule):
    got = int(nx.satfinite_fp8(f32(v), dtype).view(torch.uint8).item())
    assert got == expected, f"{rule}: satfinite({v}) byte 0x{got:02X}, expected 0x{expected:02X}"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["E4M3", "E5M2"])
def test_satfinite_fp8_non_finite_never_comes_out_finite(dtype):
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0, -1e30])
    got = nx.satfinite_fp8(x, dtype).float()
    assert not torch.isfinite(got[:3]).any(), f"non-finite inputs came out {got[:3].tolist()}"
    assert torch.isfinite(got[3:]).all(), f"finite inputs came out {got[3:].tolist()}"


# ---- block / tile helpers ------------------------------------------------------------------------

def test_block_amax_partial_last_block_and_nan():
    x = torch.zeros(2, 40)
    x[0, 31] = -5.0
    x[0, 39] = 3.0
    x[1, 33] = math.nan
    got = nx.block_amax(x, 32)
    assert got.shape == (2, 2)
    assert got[0].tolist() == [5.0, 3.0]
    assert got[1, 0].item() == 0.0 and math.isnan(got[1, 1].item())


def test_tile_amax_partial_edge_tiles():
    x = torch.zeros(20, 18)
    x[17, 17] = -2.0
    x[0, 16] = 1.0
    x[15, 15] = 4.0
    got = nx.tile_amax(x, 16)
    assert got.tolist() == [[4.0, 1.0], [0.0, 2.0]]


@pytest.mark.parametrize("exp", [123, 124, 125])
def test_rht_of_large_finite_groups_is_the_exact_product_rounded_to_bf16(exp):
    """Groups whose fp32 butterflies would overflow (|x| near FLT_MAX / 16 and above) still give the exact
    product rounded once to bf16, as long as that fits bf16 (|x| <= 2^125)."""
    g = torch.Generator().manual_seed(5)
    sign = torch.where(torch.rand(8, 64, generator=g) < 0.5, -1.0, 1.0)
    x = sign * torch.exp2(torch.randint(exp - 3, exp + 1, (8, 64), generator=g).float())
    x[:, :16] = 2.0 ** exp  # a group of equal values: one output is 16 * 2^exp / 4 (fp32 sum 16 * 2^exp)
    exact = (x.double().reshape(8, 4, 16) @ rht_matrix()).reshape(8, 64)
    torch.testing.assert_close(nx.rht16(x), exact.to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(nx.rht16_inverse(nx.rht16(x)), x, rtol=0, atol=0)


def test_rht_out_of_bf16_range_is_non_finite_never_finite():
    x = torch.full((1, 16), 2.0 ** 127)  # the transform's first output, 4 * 2^127, is beyond bf16
    assert not torch.isfinite(nx.rht16(x)).all()
