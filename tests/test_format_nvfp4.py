"""NVFP4 (docs/numerics.md "NVFP4"): E2M1 values, E4M3 block-16 scales, fp32 global amax, 16x16 tiles, RHT and
stochastic rounding. The oracle below recomputes the docs/numerics.md formulas element by element in fp32
without using the reference's helpers."""

from __future__ import annotations

import math

import pytest
import torch

from hybridq.formats import NVFP4Part, NVFP4Quantizer
from hybridq.formats._numerics import rht16, unpack_nibbles

from _format_cases import FLT_MAX, assert_bitwise, assert_parts_bitwise


def F(v) -> torch.Tensor:
    """fp32 scalar: every operation on these is one IEEE fp32 operation."""
    return torch.tensor(v, dtype=torch.float32)


def fmin(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C fminf: the non-NaN operand wins."""
    return b if torch.isnan(a) else (a if a <= b else b)


# all finite non-negative E4M3 values, index = code (the decode table is not under test; the rounding is)
E4M3_TABLE = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(a: float, table) -> int:
    """Index of the nearest table value to a >= 0 (clamped to the last), ties to the even index."""
    a = min(a, float(table[-1]))
    best = min(range(len(table)), key=lambda i: (abs(a - float(table[i])), i % 2))
    return best


def e4m3_satfinite(v: torch.Tensor) -> float:
    return float(E4M3_TABLE[nearest_even(v.item(), E4M3_TABLE)])


def e2m1_code(v: torch.Tensor) -> int:
    a = v.item()
    code = nearest_even(abs(a), E2M1_TABLE)
    return code | (8 if math.copysign(1.0, a) < 0 else 0)


def oracle(x: torch.Tensor, tile: int | None = None):
    """docs/numerics.md "NVFP4" encode of a finite fp32 [M, K] by hand: (codes [M, K], block scales [M, K/16], A).
    tile=16: one scale per 16x16 tile (repeated on the tile's rows)."""
    m, k = x.shape
    A = x.abs().max()
    s_enc = fmin(F(448.0 * 6.0) / A, F(FLT_MAX))
    if A.item() == 0 or s_enc.item() == 0:
        s_enc = F(1.0)
    s_dec = F(1.0) / s_enc
    codes = torch.zeros(m, k, dtype=torch.uint8)
    scales = torch.zeros(m, k // 16)
    for i in range(m):
        for b in range(k // 16):
            rows = slice(i // 16 * 16, i // 16 * 16 + 16) if tile else slice(i, i + 1)
            bamax = x[rows, 16 * b:16 * b + 16].abs().max()
            s = F(e4m3_satfinite(fmin(bamax * (s_enc * F(1.0 / 6.0)), F(FLT_MAX))))
            enc = fmin(F(1.0) / (s * s_dec), F(FLT_MAX))
            scales[i, b] = s
            for j in range(16 * b, 16 * b + 16):
                codes[i, j] = e2m1_code(x[i, j] * enc)
    return codes, scales, A


def check_against_oracle(part: NVFP4Part, x: torch.Tensor, tile=None, what="part"):
    codes, scales, A = oracle(x, tile)
    got_codes = unpack_nibbles(part.data)
    if not torch.equal(got_codes, codes):
        idx = (got_codes != codes).nonzero()[0].tolist()
        raise AssertionError(f"{what}: E2M1 code at {idx} is {int(got_codes[tuple(idx)])}, hand "
                             f"{int(codes[tuple(idx)])} (x = {x[tuple(idx)].item()!r})")
    torch.testing.assert_close(part.scale.float(), scales, rtol=0, atol=0, msg=f"{what}: block scales differ")
    assert part.scale.dtype == torch.float8_e4m3fn
    assert_bitwise(part.amax, A.reshape(1), f"{what}: global amax")


def test_defaults():
    q = NVFP4Quantizer()
    assert not (q.block_2d or q.rht or q.stochastic_rounding)


def test_worked_example_by_hand():
    """A = 12 -> S_enc = 2688/12 = 224. Block 0 (amax 12): s = 448, enc ~ 1/2: 12 -> 6, 5 -> 2.5 -> 2 (tie to
    even), -3 -> -1.5, 0.75 -> 0.375 -> 0.5. Block 1 (amax 3): s = 112, enc ~ 2: 3 -> 6, -1.5 -> -3,
    0.4 -> 0.8 -> 1. Dequantize q * s * A / 2688."""
    x = torch.zeros(1, 32)
    x[0, :4] = F([12.0, 5.0, -3.0, 0.75])
    x[0, 16:19] = F([3.0, -1.5, 0.4])
    p = NVFP4Quantizer().quantize(x).rowwise
    assert isinstance(p, NVFP4Part) and p.data.dtype == torch.uint8 and p.data.shape == (1, 16)
    assert p.amax.tolist() == [12.0]
    assert p.scale.float().tolist() == [[448.0, 112.0]]
    expected_bytes = [0x47, 0x1B] + [0] * 6 + [0xD7, 0x02] + [0] * 6
    assert p.data[0].tolist() == expected_bytes, [hex(b) for b in p.data[0].tolist()]
    d = p.dequantize_2d()
    assert d[0, :4].tolist() == [12.0, 4.0, -3.0, 1.0]
    assert d[0, 16:19].tolist() == [3.0, -1.5, 0.5]


def test_nibble_order_element_2i_low():
    x = torch.zeros(1, 16)
    x[0, :4] = F([6.0, -6.0, 0.0, 3.0])  # A = 6 -> S_enc = 448 -> s = 448, enc = 1: codes 7, 15, 0, 5
    p = NVFP4Quantizer().quantize(x).rowwise
    assert p.data[0, :2].tolist() == [0xF7, 0x50]


def mixed_data(m, k, seed):
    """Gaussian rows with per-block magnitudes spread over 2^-12..2^4, a zero block and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x *= torch.exp2(torch.randint(-12, 5, (m, k // 16), generator=g).float()).repeat_interleave(16, dim=1)
    x[0, :16] = 0.0
    x[1, 16:32] *= 1e-6
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_rowwise_matches_hand_oracle(seed):
    x = mixed_data(8, 64, seed)
    check_against_oracle(NVFP4Quantizer().quantize(x).rowwise, x, what="rowwise")


def test_columnwise_matches_hand_oracle_on_transpose():
    x = mixed_data(64, 16, 2).t().contiguous()  # [16, 64]: columnwise blocks of 16 along M = 16
    c = NVFP4Quantizer().quantize(x, rowwise=False, columnwise=True).columnwise
    assert (c.rows, c.cols, c.columnwise, c.rht) == (64, 16, True, False)
    check_against_oracle(c, x.t().contiguous(), what="columnwise")


def test_16x16_tiles_match_hand_oracle_and_transpose():
    x = mixed_data(32, 48, 3)
    t = NVFP4Quantizer(block_2d=True).quantize(x, rowwise=True, columnwise=True)
    r, c = t.rowwise, t.columnwise
    check_against_oracle(r, x, tile=16, what="16x16 rowwise")
    assert r.scale.shape == (32, 3) and c.scale.shape == (48, 2)
    assert torch.equal(unpack_nibbles(c.data), unpack_nibbles(r.data).t()), "columnwise codes = rowwise codes^T"
    assert_bitwise(c.scale[::16], r.scale[::16].t().contiguous(), "columnwise tile scales vs rowwise^T")
    assert_bitwise(c.amax, r.amax, "shared global amax")


def test_dequantize_is_q_times_s_times_A_over_2688_left_to_right():
    x = mixed_data(4, 64, 4)
    p = NVFP4Quantizer().quantize(x).rowwise
    vals = torch.tensor(E2M1_TABLE + [-v for v in E2M1_TABLE])[unpack_nibbles(p.data).long()]  # bit 3 = sign
    expected = vals * p.scale.float().repeat_interleave(16, dim=1) * p.amax / F(2688.0)
    torch.testing.assert_close(p.dequantize_2d(), expected, rtol=0, atol=0)


def test_zero_block_scale_0_codes_0_and_zero_tensor_s_enc_1():
    x = torch.zeros(2, 32)
    x[1, 20] = 3.0
    p = NVFP4Quantizer().quantize(x).rowwise
    assert p.scale.float().tolist() == [[0.0, 0.0], [0.0, 448.0]]
    assert unpack_nibbles(p.data)[:, :16].eq(0).all() and unpack_nibbles(p.data)[0].eq(0).all()
    z = NVFP4Quantizer().quantize(torch.zeros(16, 32), rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        part = z.part(d)
        assert part.amax.tolist() == [0.0] and not part.scale.float().any() and not part.data.any()
        assert not part.dequantize_2d().any()


def test_block_scale_underflow_to_zero_dequantizes_to_zero():
    """A block far below the global amax: s = e4m3(1e-5 * 1/6) = 0, enc = min(1/0, FLT_MAX) = FLT_MAX, the
    values saturate to +-6 but dequantize to q * 0 * A / 2688 = 0."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0  # S_enc = 1
    x[0, 16], x[0, 17] = 1e-5, -1e-5
    p = NVFP4Quantizer().quantize(x).rowwise
    assert p.scale.float()[0].tolist() == [448.0, 0.0]
    assert unpack_nibbles(p.data)[0, 16:18].tolist() == [7, 15]
    assert p.dequantize_2d()[0, 16:].abs().sum() == 0


def test_e4m3_block_scale_rounding_down_saturates_e2m1():
    """A = 2688 -> S_enc = 1; a block of amax 102: 102/6 = 17 -> E4M3 tie 16|18 -> 16; enc = 1/16;
    102/16 = 6.375 saturates to 6."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16], x[0, 17] = 102.0, -101.0
    p = NVFP4Quantizer().quantize(x).rowwise
    assert p.scale.float()[0, 1].item() == 16.0
    assert unpack_nibbles(p.data)[0, 16:18].tolist() == [7, 15]


def test_subnormal_e4m3_block_scale():
    """A = 2688 (S_enc = 1); block amax 0.03: s = e4m3(0.005) = 3 * 2^-9 (subnormal); enc = 1 / s."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16], x[0, 17] = 0.03, 0.01
    p = NVFP4Quantizer().quantize(x).rowwise
    assert p.scale.float()[0, 1].item() == 3 * 2.0 ** -9
    check_against_oracle(p, x)


def test_inf_input_documented_behaviour():
    """A = inf -> S_enc = 2688/inf = 0 -> 1. The inf block: s = e4m3(min(inf, FLT_MAX)) = 448, inf -> +6.
    Dequantize follows q * s * A / 2688 with A = inf (zeros give NaN, others +-inf): no crash."""
    x = torch.ones(1, 32)
    x[0, 3] = math.inf
    p = NVFP4Quantizer().quantize(x).rowwise
    assert p.amax.tolist() == [math.inf]
    assert p.scale.float()[0].tolist() == [448.0, e4m3_satfinite(F(1.0) * (F(1.0) * F(1 / 6)))]
    codes = unpack_nibbles(p.data)[0]
    assert codes[3].item() == 7
    d = p.dequantize_2d()
    vals = torch.tensor(E2M1_TABLE)[codes.long() & 7]
    expected = vals * p.scale.float().repeat_interleave(16, dim=1)[0] * math.inf / 2688.0
    torch.testing.assert_close(d[0], expected, rtol=0, atol=0, equal_nan=True)


def test_nan_input_documented_behaviour():
    """A = NaN -> S_enc = fminf(NaN, FLT_MAX) = FLT_MAX; NaN elements get code 7 (+6); the NaN global amax
    makes the whole dequantized tensor NaN: no crash, and the NaN is not lost."""
    x = torch.ones(16, 32)
    x[0, 5] = math.nan
    t = NVFP4Quantizer().quantize(x, rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        assert math.isnan(t.part(d).amax.item())
        assert torch.isnan(t.dequantize(direction=d)).all()
    assert unpack_nibbles(t.rowwise.data)[0, 5].item() == 7


# ---- RHT -----------------------------------------------------------------------------------------

def test_rht_columnwise_is_nvfp4_of_transformed_transpose():
    """Columnwise with RHT: groups of 16 along M transformed (bf16), global amax after the transform, then
    plain NVFP4 — bitwise."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    x[7, 3] = 40.0
    t = NVFP4Quantizer(rht=True).quantize(x, rowwise=True, columnwise=True)
    c = t.columnwise
    assert c.rht and c.transform == "rht16" and not t.rowwise.rht
    y = rht16(x.t().contiguous())
    ref = NVFP4Quantizer().quantize(y).rowwise
    assert_bitwise(c.data, ref.data, "RHT columnwise data")
    assert_bitwise(c.scale, ref.scale, "RHT columnwise scale")
    assert_bitwise(c.amax, y.abs().max().reshape(1), "RHT columnwise amax (after the transform)")
    assert c.amax.item() != x.abs().max().item()
    torch.testing.assert_close(c.dequantize_2d(undo_transform=False), ref.dequantize_2d(), rtol=0, atol=0)


def test_rht_rowwise_is_unchanged():
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(6))
    assert_parts_bitwise(NVFP4Quantizer(rht=True).quantize(x).rowwise, NVFP4Quantizer().quantize(x).rowwise,
                         "rowwise with rht=True vs without")


def test_rht_dequantize_undoes_the_transform():
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(7))
    t = NVFP4Quantizer(rht=True).quantize(x, rowwise=False, columnwise=True)
    rel = ((t.dequantize() - x).norm() / x.norm()).item()
    assert rel < 0.12, f"RHT columnwise round trip relative error {rel:.4f}"


def test_rht_with_2d_tiles_is_rejected():
    with pytest.raises(ValueError, match="rht"):
        NVFP4Quantizer(block_2d=True, rht=True)


# ---- stochastic rounding -------------------------------------------------------------------------

def sr_quantizer(seed):
    return NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(seed))


def sr_input(v: float, rows: int = 256) -> torch.Tensor:
    """Column 0 = 6 sets A = 6 and every block amax to 6: S_enc = 448, s = 448, enc = 1 (to fp32 rounding),
    so the element values are v itself and dequantize returns q exactly."""
    x = torch.full((rows, 16), v)
    x[:, 0] = 6.0
    return x


@pytest.mark.parametrize("v,lo,hi", [(0.1, 0.0, 0.5), (1.2, 1.0, 1.5), (2.3, 2.0, 3.0), (4.9, 4.0, 6.0),
                                     (-3.3, -4.0, -3.0)])
def test_sr_is_unbiased(v, lo, hi):
    q = sr_quantizer(0)
    samples = torch.cat([q.quantize(sr_input(v)).dequantize()[:, 1:].flatten() for _ in range(8)])
    assert set(samples.unique().tolist()) <= {lo, hi}, "SR picks one of the two neighbours"
    p = (v - lo) / (hi - lo)
    se = abs(hi - lo) * math.sqrt(p * (1 - p) / samples.numel())
    mean = samples.double().mean().item()
    assert abs(mean - v) < 4 * se, f"mean of SR({v}) = {mean:.5f}, off by {abs(mean - v) / se:.1f} std errors"


def test_sr_is_reproducible_for_a_seed_and_differs_across_seeds():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    a = sr_quantizer(7).quantize(x, rowwise=True, columnwise=True)
    b = sr_quantizer(7).quantize(x, rowwise=True, columnwise=True)
    c = sr_quantizer(8).quantize(x, rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        assert_parts_bitwise(a.part(d), b.part(d), f"SR {d}, same seed")
        assert not torch.equal(a.part(d).data, c.part(d).data), f"SR {d}: seeds 7 and 8 gave identical data"
        assert_bitwise(a.part(d).scale, c.part(d).scale, f"SR {d}: scales do not depend on the draws")


def test_sr_default_generator_follows_torch_manual_seed():
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(9))
    q = NVFP4Quantizer(stochastic_rounding=True)
    torch.manual_seed(123)
    a = q.quantize(x).rowwise
    torch.manual_seed(123)
    b = q.quantize(x).rowwise
    assert_parts_bitwise(a, b, "SR with torch's default generator")


def test_sr_keeps_grid_values_and_saturates():
    x = sr_input(0.0, rows=16)
    x[:, 1:9] = F([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -1.5])
    p = sr_quantizer(3).quantize(x).rowwise
    d = p.dequantize_2d()
    assert d[:, :9].eq(torch.tensor([6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -1.5])).all()


def test_sr_differs_from_round_to_nearest():
    x = sr_input(2.3)
    rn = NVFP4Quantizer().quantize(x).dequantize()[:, 1:]
    sr = sr_quantizer(0).quantize(x).dequantize()[:, 1:]
    assert rn.eq(2.0).all() and (sr == 3.0).any()


# ---- row shards whose blocks all lie inside them (what a device kernel can take) --------------------------------

@pytest.mark.parametrize("opts", [{}, {"rht": True}, {"block_2d": True}], ids=["1d", "rht", "16x16"])
def test_plain_shard_amaxes_are_the_reduced_global_amaxes(opts):
    from hybridq.formats._sharding import dim0_chunks
    q = NVFP4Quantizer(**opts)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 2, 64).unsqueeze(1)
    shards = dim0_chunks(x.shape, 2)  # 32 rows each: no block split
    stats = torch.stack([q.shard_stats(x[s.offset:s.end], s) for s in shards]).amax(0)
    whole_r, whole_c = q.reference_parts(x, True, True)
    for s in shards:
        row, col = q.plain_shard_amaxes(s, 48, stats)
        assert torch.equal(row.reshape(1), whole_r.amax), f"{opts} shard {s.offset}: rowwise amax {row} != {whole_r.amax}"
        assert torch.equal(col.reshape(1), whole_c.amax), f"{opts} shard {s.offset}: columnwise amax {col} != {whole_c.amax}"


def test_plain_shard_amaxes_none_when_a_block_is_split():
    from hybridq.formats._sharding import dim0_chunks
    q = NVFP4Quantizer()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(6))
    shards = dim0_chunks(x.shape, 2)  # 20 rows each: the block of rows [16, 32) is split
    stats = torch.stack([q.shard_stats(x[s.offset:s.end], s) for s in shards]).amax(0)
    assert all(q.plain_shard_amaxes(s, 32, stats) is None for s in shards), "a split block needs the reference path"
    assert q.plain_shard_amaxes(shards[0], 32, None) is None, "no statistics: nothing to give a kernel"


# ---- the whole finite range ----------------------------------------------------------------------

NVFP4_VARIANTS = {"1d": lambda: NVFP4Quantizer(), "16x16": lambda: NVFP4Quantizer(block_2d=True),
                  "rht": lambda: NVFP4Quantizer(rht=True)}
LARGE = FLT_MAX / 2688.0
# amaxes up to FLT_MAX; the transformed (RHT) form is bounded by bf16's range: 4 * max|x| must fit, so 2^125
AMAXES = [1e-30, 1e30, 1e35, 1e36, 1e37, LARGE, 1e38, 2.0 ** 125, FLT_MAX]


@pytest.mark.parametrize("amax", AMAXES, ids=lambda a: f"{a:.3g}")
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("variant", NVFP4_VARIANTS)
def test_every_finite_amax_dequantizes_finite_and_close(variant, direction, amax):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(6))
    x = x / x.abs().max() * amax
    t = NVFP4_VARIANTS[variant]().quantize(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    y = t.dequantize(torch.float32, direction=direction)
    if variant == "rht" and direction == "columnwise" and amax > torch.finfo(torch.bfloat16).max:
        # inputs beyond the transformed form's range (bf16): they read non-finite, never finite
        assert not torch.isfinite(y).all(), f"NVFP4 RHT columnwise at amax {amax:g} came out finite"
        return
    bad = ~torch.isfinite(y)
    assert not bad.any(), f"NVFP4 {variant} {direction} at amax {amax:g}: {int(bad.sum())} of {y.numel()} non-finite"
    err = ((y / amax) - (x / amax)).abs().max().item()
    assert err < 0.2, f"NVFP4 {variant} {direction} at amax {amax:g}: max error {err:.3g} of amax"


def test_dequantize_above_flt_max_over_2688_divides_amax_first():
    """A > FLT_MAX / 2688: q * s * (A / 2688); at or below it the left-to-right bits are kept."""
    x = mixed_data(4, 64, 4)
    for amax in (1e36, 1e38, FLT_MAX):
        p = NVFP4Quantizer().quantize(x / x.abs().max() * amax).rowwise
        vals = torch.tensor(E2M1_TABLE + [-v for v in E2M1_TABLE])[unpack_nibbles(p.data).long()]
        expected = (vals * p.scale.float().repeat_interleave(16, dim=1)) * (p.amax / F(2688.0))
        torch.testing.assert_close(p.dequantize_2d(), expected, rtol=0, atol=0)
    below = torch.tensor([LARGE]).nextafter(torch.tensor([0.0]))
    p = NVFP4Quantizer().quantize(x / x.abs().max() * below).rowwise
    vals = torch.tensor(E2M1_TABLE + [-v for v in E2M1_TABLE])[unpack_nibbles(p.data).long()]
    expected = vals * p.scale.float().repeat_interleave(16, dim=1) * p.amax / F(2688.0)
    torch.testing.assert_close(p.dequantize_2d(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("amax", [1e-36, 1e-40, 1e-44], ids=lambda a: f"{a:.0e}")
@pytest.mark.parametrize("variant", NVFP4_VARIANTS)
def test_amax_below_2688_over_flt_max_stays_finite_and_bounded(variant, amax):
    """S_enc saturates at FLT_MAX there: precision is lost (documented), but nothing overflows or grows."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(6))
    x = x / x.abs().max() * amax
    t = NVFP4_VARIANTS[variant]().quantize(x, rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        y = t.dequantize(torch.float32, direction=d)
        assert torch.isfinite(y).all(), f"NVFP4 {variant} {d} at amax {amax:g}: non-finite output"
        assert y.abs().max().item() <= 4 * amax, f"NVFP4 {variant} {d} at amax {amax:g}: |y| up to {y.abs().max().item():g}"
