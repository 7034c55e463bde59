"""Float8 block scaling (docs/numerics.md "Float8 block scaling"): 1x128 / 128x1 blocks and 128x128 tiles."""

from __future__ import annotations

import math

import pytest
import torch

from hybridq.formats import Float8BlockPart, Float8BlockQuantizer

from _format_cases import FLT_MAX, assert_bitwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {"e4m3": (E4M3, 448.0), "e5m2": (E5M2, 57344.0)}


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def pow2_down(v: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= v (v > 0, finite), by frexp rather than bit masking."""
    m, e = torch.frexp(v.double())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 1).float()


def hand_block_scale(amax: float, fmax: float, pow2: bool = True) -> torch.Tensor:
    """docs/numerics.md "Terms": current-scaling rule per block (amax 0/inf/NaN -> 1, inf scale -> FLT_MAX, pow2 down)."""
    if amax == 0 or not math.isfinite(amax):
        return f32(1.0)
    s = f32(fmax) / f32(amax)
    if torch.isinf(s):
        s = f32(FLT_MAX)
    return pow2_down(s) if pow2 else s


def test_defaults():
    q = Float8BlockQuantizer()
    assert q.dtype == E4M3 and q.block_dim == 1 and q.power_2_scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "exact"])
def test_1x128_hand_case(fmt, pow2):
    """Block amaxes 1, 3, fp8_max, 0 -> scales by the current-scaling rule; q = satfinite(x * scale)."""
    dtype, fmax = FP8[fmt]
    x = torch.zeros(2, 512)
    amaxes = [1.0, 3.0, fmax, 0.0]
    for b, a in enumerate(amaxes):
        x[0, 128 * b] = a
        x[0, 128 * b + 5] = -a / 3
        x[1, 128 * b + 127] = a / 7
    p = Float8BlockQuantizer(fp8=fmt, power_2_scale=pow2).quantize(x).rowwise
    assert isinstance(p, Float8BlockPart) and p.block_dim == 1
    assert p.scale_inv.shape == (2, 4)
    row_amaxes = [amaxes, [(f32(a) / f32(7.0)).item() for a in amaxes]]
    scales = torch.stack([torch.stack([hand_block_scale(a, fmax, pow2) for a in r]) for r in row_amaxes])
    assert_bitwise(p.scale_inv, torch.ones(2, 4) / scales, "scale_inv")
    expected = (x * scales.repeat_interleave(128, dim=1)).clamp(-fmax, fmax).to(dtype)
    assert_bitwise(p.data, expected, "data")


def test_1x128_pow2_scale_literal_values():
    x = torch.zeros(1, 384)
    x[0, 0], x[0, 128], x[0, 256] = 1.0, 3.0, 448.0
    p = Float8BlockQuantizer().quantize(x).rowwise
    # 448/1 = 448 -> 256; 448/3 = 149.3 -> 128; 448/448 = 1
    assert p.scale_inv[0].tolist() == [1 / 256, 1 / 128, 1.0]
    assert p.data.float()[0, [0, 128, 256]].tolist() == [256.0, 384.0, 448.0]


def test_zero_block_scale_1():
    p = Float8BlockQuantizer().quantize(torch.zeros(3, 256)).rowwise
    assert p.scale_inv.tolist() == [[1.0, 1.0]] * 3
    assert not p.data.view(torch.uint8).any()


def test_1x128_partial_edge_block_k200():
    """K = 200: two blocks per row, the second covering columns 128..199 only."""
    x = torch.full((3, 200), 0.5)
    x[:, 199] = 12.0  # the partial block's amax
    x[:, 100] = 2.0
    p = Float8BlockQuantizer().quantize(x).rowwise
    assert p.scale_inv.shape == (3, 2) and p.data.shape == (3, 200)
    assert p.scale_inv[:, 0].tolist() == [1 / hand_block_scale(2.0, 448.0).item()] * 3
    assert p.scale_inv[:, 1].tolist() == [1 / hand_block_scale(12.0, 448.0).item()] * 3
    torch.testing.assert_close(p.dequantize_2d(), x, rtol=0, atol=0)  # all values exact here


def test_128x1_columnwise_blocks_run_along_m_with_partial_edge():
    """Columnwise: stored [K, M], blocks of 128 along M (M = 200 -> 2 blocks, the second partial);
    bitwise the rowwise quantization of x^T."""
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    x[199, 3] = 50.0
    q = Float8BlockQuantizer()
    c = q.quantize(x, rowwise=False, columnwise=True).columnwise
    assert (c.rows, c.cols, c.columnwise) == (64, 200, True)
    assert c.scale_inv.shape == (64, 2)
    assert c.scale_inv[3, 1].item() == 1 / hand_block_scale(50.0, 448.0).item()
    r_of_t = q.quantize(x.t().contiguous()).rowwise
    assert_bitwise(c.data, r_of_t.data, "columnwise data vs rowwise(x^T)")
    assert_bitwise(c.scale_inv, r_of_t.scale_inv, "columnwise scale_inv vs rowwise(x^T)")


def test_128x128_partial_tiles_m130():
    """M = 130, K = 260: 2 x 3 tiles, edge tiles partial; each tile's scale from its own amax."""
    x = torch.full((130, 260), 0.25)
    tile_amax = [[1.0, 2.0, 4.0], [8.0, 16.0, 0.5]]
    for i, r in enumerate((0, 129)):
        for j, c in enumerate((0, 200, 259)):
            x[r, c] = -tile_amax[i][j]
    p = Float8BlockQuantizer(block_dim=2).quantize(x, rowwise=True, columnwise=True)
    r, c = p.rowwise, p.columnwise
    assert r.scale_inv.shape == (2, 3) and c.scale_inv.shape == (3, 2)
    expected = torch.stack([torch.stack([1 / hand_block_scale(a, 448.0) for a in row]) for row in tile_amax])
    assert_bitwise(r.scale_inv, expected, "tile scale_inv")
    torch.testing.assert_close(r.dequantize_2d(), x, rtol=0, atol=0)  # powers of two: exact


def test_128x128_columnwise_is_exact_transpose():
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(1))
    t = Float8BlockQuantizer(block_dim=2).quantize(x, rowwise=True, columnwise=True)
    r, c = t.rowwise, t.columnwise
    assert (c.rows, c.cols, c.columnwise, c.block_dim) == (300, 130, True, 2)
    assert_bitwise(c.data, r.data.t().contiguous(), "columnwise data vs rowwise data^T")
    assert_bitwise(c.scale_inv, r.scale_inv.t().contiguous(), "columnwise tile scale_inv vs rowwise^T")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_inf_in_a_block_scale_1_inf_stays_non_finite(fmt):
    """Block amax inf -> scale 1; inf becomes E5M2 inf / E4M3 NaN; other blocks unaffected."""
    dtype, fmax = FP8[fmt]
    x = torch.ones(1, 256)
    x[0, 3] = math.inf
    x[0, 4] = 2.5
    p = Float8BlockQuantizer(fp8=fmt).quantize(x).rowwise
    assert p.scale_inv[0, 0].item() == 1.0
    assert p.data.view(torch.uint8)[0, 3].item() == {"e4m3": 0x7F, "e5m2": 0x7C}[fmt]
    assert p.data.float()[0, [0, 1, 2, 4]].tolist() == [1.0, 1.0, 1.0, 2.5]
    assert p.scale_inv[0, 1].item() == 1 / hand_block_scale(1.0, fmax).item()


def test_nan_in_a_block_scale_1_nan_in_place():
    x = torch.ones(1, 256)
    x[0, 7] = math.nan
    p = Float8BlockQuantizer().quantize(x).rowwise
    assert p.scale_inv[0].tolist() == [1.0, 1 / 256]
    d = p.dequantize_2d()
    assert torch.isnan(d).sum() == 1 and math.isnan(d[0, 7].item())
    assert (d[0, :7] == 1).all() and (d[0, 128:] == 1).all()


def test_fp8_subnormals_in_a_block():
    """Block amax 448 -> scale 1: fp8 subnormals 2^-9 exact, 2^-10 ties to 0, 3*2^-10 ties to 2^-8."""
    x = torch.zeros(1, 128)
    x[0, :4] = f32([448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10])
    p = Float8BlockQuantizer().quantize(x).rowwise
    assert p.data.float()[0, :4].tolist() == [448.0, 2.0 ** -9, 0.0, 2.0 ** -8]


def test_fp32_subnormal_block_scale_flt_max_pow2():
    """Block amax 2^-140: 448/amax = inf -> FLT_MAX -> pow2 2^127; scale_inv 2^-127; x*2^127 = 2^-13 -> 0."""
    x = torch.zeros(1, 128)
    x[0, 0] = 2.0 ** -140
    p = Float8BlockQuantizer().quantize(x).rowwise
    assert p.scale_inv.item() == 2.0 ** -127
    assert not p.data.view(torch.uint8).any()


def test_invalid_block_dim_is_rejected():
    with pytest.raises(ValueError, match="block_dim"):
        Float8BlockQuantizer(block_dim=3)


# ---- row shards of 128x128 tiles that split no tile (what a device kernel can take) -----------------------------

def test_tile_aligned_shard_scale_grid_is_the_reference_shard_parts():
    from hybridq.formats._sharding import dim0_chunks
    q = Float8BlockQuantizer(block_dim=2)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, 512).unsqueeze(1)
    shards = dim0_chunks(x.shape, 2)  # 256 rows each: no tile split
    stats = torch.stack([q.shard_stats(x[s.offset:s.end], s) for s in shards]).amax(0)
    for s in shards:
        assert q.tiles_inside(s), f"rows [{s.offset}, {s.end}) split no 128-row tile"
        row, col = q.reference_parts(x[s.offset:s.end], True, True, shard=s, stats=stats)
        got = q.shard_scale_inv(s, 256, stats)
        assert_bitwise(got, row.scale_inv, f"tile scale grid of rows [{s.offset}, {s.end})")
        assert_bitwise(got.t().contiguous(), col.scale_inv, f"columnwise tile scale grid of rows [{s.offset}, {s.end})")


def test_shard_splitting_a_tile_is_not_plain():
    from hybridq.formats._sharding import dim0_chunks
    shards = dim0_chunks((320, 128), 2)  # 160 rows each: the tile of rows [128, 256) is split
    assert not any(Float8BlockQuantizer(block_dim=2).tiles_inside(s) for s in shards)
    assert not Float8BlockQuantizer(block_dim=1).tiles_inside(dim0_chunks((512, 128), 2)[0]), "1-D blocks: no tiles"
