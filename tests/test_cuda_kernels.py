"""CUDA kernels == the pure-PyTorch references (run on the CPU), bit for bit: data, scales, amaxes.

Runs on a CUDA machine with the extension built (`pip install --no-build-isolation -e .` or
`python setup.py build_ext --inplace`); skipped otherwise. Inputs are fresh random tensors on every run (the
seed is printed on failure) plus fixed edge cases: zeros, powers of two at block maxima, saturation,
subnormals, inf / NaN (both signs), partial blocks, and shapes that are not multiples of 128.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from _format_cases import FORMATS
from hybridq.formats import (Float8BlockQuantizer, Float8Quantizer, MXFP8Quantizer, NVFP4Part, NVFP4Quantizer,
                             swizzle_mx_scales)
from hybridq.formats._numerics import (e2m1_values, e2m1_decode, expand_blocks, rht16, unpack_nibbles)
from hybridq.formats.nvfp4 import element_multiplier, global_encode_scale

import _compare
from _gpu import extension_ready

HAVE_CUDA = torch.cuda.is_available()


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device"),
              pytest.mark.skipif(HAVE_CUDA and not extension_ready(), reason="the hybridq CUDA extension is not built")]

SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- helpers ------------------------------------------------------------------------------------------------

def assert_bitwise(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    # NaN payloads of fp32 results are not part of the contract (docs/numerics.md, "Non-finite values")
    _compare.assert_bitwise(got, ref, f"{what} (seed {SEED})", nan_payload=(torch.float32,))


def assert_parts_equal(got, ref, what: str) -> None:
    _compare.assert_parts_bitwise(got, ref, f"{what} (seed {SEED})", nan_payload=(torch.float32,))


def uses_kernel(q, x, rowwise, columnwise, **kw) -> bool:
    from hybridq.kernels import lookup_quantize
    return lookup_quantize(q, x, rowwise, columnwise, **kw) is not None


def check_quantizer(factory, x: torch.Tensor, rowwise=True, columnwise=True, what="", **kw):
    """Quantize x on the GPU (kernel) and on the CPU (reference) with two fresh quantizers; compare."""
    q_gpu, q_ref = factory(), factory()
    xg = x.cuda()
    assert uses_kernel(q_gpu, xg, rowwise, columnwise, **kw), f"{what}: the CUDA kernel declined"
    got = q_gpu.quantize_parts(xg, rowwise, columnwise, **kw)
    ref = q_ref.reference_parts(x.cpu(), rowwise, columnwise, **{k: v.cpu() for k, v in kw.items()})
    for d, g, r in zip(("rowwise", "columnwise"), got, ref):
        assert_parts_equal(g, r, f"{what} {d}")
    return got


def rand_input(m: int, k: int, dtype: torch.dtype, gen: torch.Generator, kind: str = "wide") -> torch.Tensor:
    """Random [m, k]; 'wide': magnitudes varying by 2^±12 across rows and 32-column groups (many scales)."""
    x = torch.randn(m, k, generator=gen)
    if kind == "wide":
        rs = torch.exp2(torch.randint(-12, 12, (m, 1), generator=gen).float())
        cs = torch.exp2(torch.randint(-6, 6, (1, -(-k // 32)), generator=gen).float()).repeat_interleave(32, 1)[:, :k]
        x = x * rs * cs
        if dtype == torch.float16:
            x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


def edge_input(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random data with special values sprinkled in: zero rows/blocks, powers of two at block maxima,
    values that saturate, subnormals, +-inf, +-NaN (including a negative NaN bit pattern)."""
    x = torch.randn(m, k, generator=gen)
    fin = torch.finfo(dtype)
    specials = [0.0, -0.0, 448.0, -448.0, 57344.0, 2.0 ** -9, 2.0 ** -16, 6.0, -6.0, 1.0, 2.0, 0.25, 0.75,
                fin.max, -fin.max, fin.tiny, fin.tiny / 4, float("inf"), float("-inf"), float("nan"), 1e-30, 3e38]
    s = torch.tensor(specials).to(dtype)
    n = max(1, m * k // 50)
    idx = torch.randint(0, m * k, (n,), generator=gen)
    pick = torch.randint(0, len(specials), (n,), generator=gen)
    flat = x.to(dtype).reshape(-1).clone()
    flat[idx] = s[pick]
    x = flat.reshape(m, k)
    if m >= 2 and k >= 2:
        x[0, :] = 0  # a zero row
        x[: min(m, 40), : min(k, 40)] = 0  # zero blocks in both directions
        x[1, 0] = 2.0 ** 5  # a power of two at a block maximum
    if m * k > 64:  # a negative NaN bit pattern
        nan_bits = {torch.float32: -4194304, torch.bfloat16: -64, torch.float16: -512}[dtype]
        v = x.reshape(-1).view(torch.int32 if dtype == torch.float32 else torch.int16)
        v[m * k // 2] = nan_bits
    return x


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)


# ---- per-tensor FP8 -------------------------------------------------------------------------------------------

FP8_SHAPES = [(1, 1), (7, 13), (128, 128), (200, 136), (257, 520), (1000, 264), (33, 4096)]


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("opts", [{}, {"power_2_scale": True}, {"amax_epsilon": 1e-3}], ids=["plain", "pow2", "eps"])
def test_fp8_tensor_current(dtype, fp8, opts, gen):
    for m, k in FP8_SHAPES:
        for kind in ("wide", "randn", "edge"):
            x = edge_input(m, k, dtype, gen) if kind == "edge" else rand_input(m, k, dtype, gen, kind)
            for r, c in ((True, True), (True, False), (False, True)):
                check_quantizer(lambda: Float8Quantizer(fp8, **opts), x, r, c, what=f"fp8 {fp8} {m}x{k} {kind} {r}{c}")


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
def test_fp8_tensor_amax_override(dtype, gen):
    x = rand_input(300, 260, dtype, gen)
    for amax in (torch.tensor(3.5), torch.tensor([0.0]), torch.tensor([float("inf")]), x.float().abs().amax() * 4):
        check_quantizer(Float8Quantizer, x, True, True, what=f"fp8 amax={amax}", amax=amax.reshape(-1)[:1])


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_tensor_delayed(fp8, gen):
    """The delayed-scaling state (scale, amax history) evolves identically over several steps."""
    q_gpu = Float8Quantizer(fp8, scaling="delayed", amax_history_len=4)
    q_ref = Float8Quantizer(fp8, scaling="delayed", amax_history_len=4)
    for step in range(6):
        x = rand_input(130, 200, torch.bfloat16, gen) * (4.0 ** (step % 3 - 1))
        if step == 4:
            x[3, 3] = float("inf")
        xg = x.cuda()
        assert uses_kernel(q_gpu, xg, True, True)
        got = q_gpu.quantize_parts(xg, True, step % 2 == 0)
        ref = q_ref.reference_parts(x, True, step % 2 == 0)
        for d, g, r in zip(("rowwise", "columnwise"), got, ref):
            assert_parts_equal(g, r, f"delayed step {step} {d}")
        assert_bitwise(q_gpu.scale, q_ref.scale, f"delayed step {step} scale")
        assert_bitwise(q_gpu.amax_history, q_ref.amax_history, f"delayed step {step} history")


# ---- FP8 block -------------------------------------------------------------------------------------------------

BLOCK_SHAPES = [(1, 1), (5, 130), (128, 128), (200, 136), (257, 520), (1000, 264), (384, 1024)]


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("opts", [{}, {"power_2_scale": False}, {"amax_epsilon": 1e-3}], ids=["pow2", "nopow2", "eps"])
def test_fp8_block(dtype, block_dim, fp8, opts, gen):
    for m, k in BLOCK_SHAPES:
        for kind in ("wide", "edge"):
            x = edge_input(m, k, dtype, gen) if kind == "edge" else rand_input(m, k, dtype, gen, kind)
            for r, c in ((True, True), (True, False), (False, True)):
                check_quantizer(lambda: Float8BlockQuantizer(fp8, block_dim=block_dim, **opts), x, r, c,
                                what=f"fp8 block{block_dim} {fp8} {m}x{k} {kind} {r}{c}")


def row_shards(q, shape, ws: int, gen):
    """(x, [(shard, rows of x)], MAX-reduced statistics) of a random bf16 `shape` split into FSDP2's dim-0 chunks."""
    from hybridq.formats._sharding import dim0_chunks
    x = rand_input(*shape, torch.bfloat16, gen)
    shards = dim0_chunks(shape, ws)
    pieces = [(s, x[s.offset:s.end]) for s in shards]
    return x, pieces, torch.stack([q.shard_stats(xi, s) for s, xi in pieces]).amax(0)


def check_row_shards(q, cases, gen, what: str) -> None:
    """Every rank's row shard quantized by the CUDA kernel with the reduced statistics == the reference's sharded
    quantization, bit for bit, in every direction combination."""
    for shape, ws in cases:
        _, pieces, stats = row_shards(q, shape, ws, gen)
        for s, xi in pieces:
            for r, c in ((True, True), (True, False), (False, True)):
                label = f"{what} rows [{s.offset}, {s.end}) of {shape[0]}x{shape[1]} {r}{c}"
                xg, sg = xi.cuda(), stats.cuda()
                assert uses_kernel(q, xg, r, c, shard=s, stats=sg), f"{label}: the CUDA kernel declined"
                got = q.quantize_parts(xg, r, c, shard=s, stats=sg)
                ref = q.reference_parts(xi, r, c, shard=s, stats=stats)
                for d, g_, r_ in zip(("rowwise", "columnwise"), got, ref):
                    assert_parts_equal(g_, r_, f"{label} {d}")


def test_fp8_block_128x128_row_shard_with_reduced_tile_grid(gen):
    """FSDP row shards of 128x128 tiles that split no tile: the kernel quantizes the shard's rows and the parts carry
    the whole tile-scale grid of the reduced statistics; a shard that splits a tile is left to the reference."""
    q = Float8BlockQuantizer(block_dim=2)
    check_row_shards(q, (((512, 256), 2), ((640, 384), 5), ((1024, 160), 4)), gen, "fp8 block 128x128")
    _, pieces, stats = row_shards(q, (320, 128), 2, gen)  # 160 rows each: splits the tile of rows [128, 256)
    s, xi = pieces[0]
    assert not uses_kernel(q, xi.cuda(), True, True, shard=s, stats=stats.cuda()), "split tile: reference"


# ---- MXFP8 -----------------------------------------------------------------------------------------------------

MX_SHAPES = [(32, 32), (96, 160), (224, 96), (1056, 320), (128, 4096)]


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "32x32"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_mxfp8(dtype, block_2d, fp8, gen):
    for m, k in MX_SHAPES:
        for kind in ("wide", "edge"):
            x = edge_input(m, k, dtype, gen) if kind == "edge" else rand_input(m, k, dtype, gen, kind)
            for r, c in ((True, True), (True, False), (False, True)):
                check_quantizer(lambda: MXFP8Quantizer(fp8, block_2d=block_2d), x, r, c,
                                what=f"mxfp8 {fp8} 2d={block_2d} {m}x{k} {kind} {r}{c}")
    if not block_2d:  # one direction only: the other dimension need not be a multiple of 32
        check_quantizer(lambda: MXFP8Quantizer(fp8), rand_input(37, 64, dtype, gen), True, False, what="mx rows 37")
        check_quantizer(lambda: MXFP8Quantizer(fp8), rand_input(64, 37, dtype, gen), False, True, what="mx cols 37")


def test_mxfp8_powers_of_two_at_block_max(gen):
    """Block maxima exactly at 448 * 2^k and just around it: where the rcp_rn multiply matters."""
    x = torch.randn(64, 256, generator=gen)
    for j in range(8):
        v = 448.0 * 2.0 ** (j - 4)
        x[:, 32 * j] = torch.tensor([v, torch.nextafter(torch.tensor(v), torch.tensor(0.0)).item(),
                                     torch.nextafter(torch.tensor(v), torch.tensor(1e9)).item(), 2.0 ** (j - 4)]
                                    ).repeat(16)
    check_quantizer(MXFP8Quantizer, x, True, True, what="mx pow2 maxima")
    check_quantizer(lambda: MXFP8Quantizer("e5m2"), x * 128, True, True, what="mx e5m2 pow2 maxima")


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "32x32"])
def test_mxfp8_swizzled_scales(block_2d, gen):
    from hybridq.kernels.cuda_mxfp8 import mxfp8_quantize
    for m, k in ((32, 32), (160, 96), (256, 1024), (96, 4128)):
        x = rand_input(m, k, torch.bfloat16, gen).cuda()
        row, rs, col, cs = mxfp8_quantize(x, block_2d=block_2d, rowwise=True, columnwise=True, swizzle=False)
        row2, rs2, col2, cs2 = mxfp8_quantize(x, block_2d=block_2d, rowwise=True, columnwise=True, swizzle=True)
        assert_bitwise(row2, row.cpu(), "swizzled run data")
        assert_bitwise(col2, col.cpu(), "swizzled run col data")
        assert_bitwise(rs2, swizzle_mx_scales(rs.cpu()), f"row scales swizzled {m}x{k}")
        assert_bitwise(cs2, swizzle_mx_scales(cs.cpu()), f"col scales swizzled {m}x{k}")


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "32x32"])
def test_mxfp8_swizzled_columnwise_only(block_2d, gen):
    """The columnwise part alone (32x32 tiles: the column phase, not the byte transpose) equals the one of a run with
    both parts, in both scale layouts; whole and partial 128-row tiles (the tile's scale bytes are written together)."""
    from hybridq.kernels.cuda_mxfp8 import mxfp8_quantize
    for m, k in ((32, 32), (160, 96), (256, 1024), (96, 4128), (416, 224)):
        x = rand_input(m, k, torch.bfloat16, gen).cuda()
        for swizzle in (False, True):
            _, _, col, cs = mxfp8_quantize(x, block_2d=block_2d, rowwise=True, columnwise=True, swizzle=swizzle)
            _, _, col1, cs1 = mxfp8_quantize(x, block_2d=block_2d, rowwise=False, columnwise=True, swizzle=swizzle)
            assert_bitwise(col1, col.cpu(), f"columnwise-only data {m}x{k} swizzle={swizzle}")
            assert_bitwise(cs1, cs.cpu(), f"columnwise-only scales {m}x{k} swizzle={swizzle}")


# ---- NVFP4 -----------------------------------------------------------------------------------------------------

NV_SHAPES = [(16, 16), (48, 80), (272, 144), (1040, 528), (128, 4096)]
NV_CONFIGS = {"1d": {}, "16x16": {"block_2d": True}, "rht": {"rht": True}}


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("cfg", list(NV_CONFIGS))
def test_nvfp4(dtype, cfg, gen):
    opts = NV_CONFIGS[cfg]
    for m, k in NV_SHAPES:
        for kind in ("wide", "randn", "edge"):
            x = edge_input(m, k, dtype, gen) if kind == "edge" else rand_input(m, k, dtype, gen, kind)
            for r, c in ((True, True), (True, False), (False, True)):
                check_quantizer(lambda: NVFP4Quantizer(**opts), x, r, c, what=f"nvfp4 {cfg} {m}x{k} {kind} {r}{c}")
    if cfg != "16x16":
        check_quantizer(lambda: NVFP4Quantizer(**opts), rand_input(37, 64, dtype, gen), True, False, what="rows 37")
        check_quantizer(lambda: NVFP4Quantizer(**opts), rand_input(64, 36, dtype, gen), False, True, what="cols 36")


@pytest.mark.parametrize("cfg", list(NV_CONFIGS))
def test_nvfp4_row_shard_with_global_amaxes(cfg, gen):
    """FSDP row shards whose blocks lie inside them: the kernel takes the all-reduced global amaxes; a shard that
    splits a block is left to the reference."""
    q = NVFP4Quantizer(**NV_CONFIGS[cfg])
    check_row_shards(q, (((256, 160), 2), ((512, 96), 4), ((96, 64), 3)), gen, f"nvfp4 {cfg}")
    _, pieces, stats = row_shards(q, (40, 64), 2, gen)  # 20 rows each: the 16-row block [16, 32) is split
    s, xi = pieces[0]
    assert not uses_kernel(q, xi.cuda(), True, True, shard=s, stats=stats.cuda()), "split block: reference"


def test_nvfp4_global_amax_edge_cases(gen):
    for fill in (0.0, float("inf"), float("nan"), 1e-38, 3e38):
        x = torch.randn(64, 64, generator=gen)
        x[5, 7] = fill
        if fill == 0.0:
            x.zero_()
        for cfg, opts in NV_CONFIGS.items():
            check_quantizer(lambda: NVFP4Quantizer(**opts), x, True, True, what=f"nvfp4 {cfg} amax fill={fill}")


def _every_16bit_value(dtype: torch.dtype, finite: bool, perm: torch.Tensor | None) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float as [256, 256] (non-finite ones zeroed when `finite`); `perm`
    shuffles them so that each value meets other block maxima."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).clone()
    if finite:
        x[~torch.isfinite(x)] = 0
    if perm is not None:
        x = x[perm]
    return x.reshape(256, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", list(NV_CONFIGS))
def test_nvfp4_every_16bit_input_value(dtype, cfg, gen):
    """Every bf16 / fp16 bit pattern, in order (blocks of neighbouring values: the E2M1 grid's ties at every scale)
    and shuffled, with and without the non-finite ones (NaN blocks take the per-element rules, inf blocks the
    clamped forms, finite blocks the unclamped one), through both directions."""
    opts = NV_CONFIGS[cfg]
    perm = torch.randperm(65536, generator=gen)
    for finite in (True, False):
        for p in (None, perm):
            x = _every_16bit_value(dtype, finite, p)
            check_quantizer(lambda: NVFP4Quantizer(**opts), x, True, True,
                            what=f"nvfp4 {cfg} every {dtype} value finite={finite} shuffled={p is not None}")


def _next_value(v: torch.Tensor, step: int) -> torch.Tensor:
    """The representable neighbours of positive values in v's dtype: step = +1 the next one up, -1 down."""
    it = torch.int32 if v.dtype == torch.float32 else torch.int16
    return (v.view(it) + step).view(v.dtype)


def _e2m1_boundary_blocks(dtype: torch.dtype) -> torch.Tensor:
    """[64, 64] of 16-value blocks (along rows; the transpose puts them along columns) whose values land on the E2M1
    grid's ties and on their neighbours: with the tensor's amax 2688 the global encode scale is 1, and a block whose
    max is 6 * 2^e gets the scale byte 2^e and the element multiplier 2^-e (exact products), e in [-8, 8]. Then blocks
    whose scale byte is an E4M3 subnormal rounded down by up to half (largest products 6 .. 9: the clamped forms)."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for e in range(-8, 9):
        t = (ties * 2.0 ** e).to(dtype)
        top = torch.tensor([6.0 * 2.0 ** e]).to(dtype)
        zero = torch.zeros(1, dtype=dtype)
        rows.append(torch.cat([top, t, _next_value(t, 1), zero]))
        rows.append(torch.cat([-top, -t, -_next_value(t, -1), zero]))
    for f in (1.0, 1.25, 1.45, 1.49, 1.5, 2.9):  # block max / 6 = f * 2^-9
        blk = torch.linspace(-1, 1, 16) * (6.0 * f * 2.0 ** -9)
        blk[3] = 6.0 * f * 2.0 ** -9
        rows.append(blk.to(dtype))
    flat = torch.cat(rows).float()
    x = torch.zeros(64 * 64)
    x[: flat.numel()] = flat
    x[-1] = 2688.0  # the tensor's amax: global encode scale 1
    return x.reshape(64, 64).to(dtype)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("cfg", list(NV_CONFIGS))
def test_nvfp4_values_at_e2m1_rounding_boundaries(dtype, cfg):
    x = _e2m1_boundary_blocks(dtype)
    for t in (x, x.t().contiguous()):  # the blocks along rows, then along columns
        check_quantizer(lambda: NVFP4Quantizer(**NV_CONFIGS[cfg]), t, True, True, what=f"nvfp4 {cfg} E2M1 ties")


# ---- stochastic rounding ------------------------------------------------------------------------------------------

def _codes(part: NVFP4Part) -> torch.Tensor:
    return unpack_nibbles(part.data.cpu())


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d_rht", "16x16"])
def test_nvfp4_sr_deterministic_per_seed(block_2d, gen):
    x = rand_input(256, 512, torch.bfloat16, gen).cuda()
    opts = {"block_2d": True} if block_2d else {"rht": True}

    def run(seed):
        torch.cuda.manual_seed(seed)
        return NVFP4Quantizer(stochastic_rounding=True, **opts).quantize_parts(x, True, True)

    a, b, c = run(11), run(11), run(12)
    for d in range(2):
        for name in ("data", "scale", "amax"):
            assert_bitwise(getattr(b[d], name), getattr(a[d], name).cpu(), f"SR same seed {d} {name}")
        assert not torch.equal(a[d].data, c[d].data), "SR: different seeds gave identical codes"
    if block_2d:  # one draw per element: the columnwise form is the transpose of the rowwise one
        assert torch.equal(_codes(a[1]), _codes(a[0]).t())
    # explicit CUDA generator
    g1 = torch.Generator(device="cuda").manual_seed(5)
    g2 = torch.Generator(device="cuda").manual_seed(5)
    p1 = NVFP4Quantizer(stochastic_rounding=True, generator=g1, **opts).quantize_parts(x, True, True)
    p2 = NVFP4Quantizer(stochastic_rounding=True, generator=g2, **opts).quantize_parts(x, True, True)
    assert torch.equal(p1[0].data, p2[0].data) and torch.equal(p1[1].data, p2[1].data)


@pytest.mark.parametrize("direction", [0, 1], ids=["rowwise", "columnwise_rht"])
def test_nvfp4_sr_unbiased(direction, gen):
    """E[decoded code] == the scaled value y = x * enc (saturated at 6), per element; scales and amaxes equal the
    round-to-nearest reference; every code is one of the two neighbours of y."""
    m, k = 64, 128
    x = rand_input(m, k, torch.bfloat16, gen, "randn")
    ref = NVFP4Quantizer(rht=True).reference_parts(x, True, True)[direction]
    src = x.float() if direction == 0 else rht16(x.t())
    y = src * expand_blocks(element_multiplier(ref.scale, global_encode_scale(ref.amax)), 16, src.shape[1])
    y = y.clamp(-6, 6)
    n = 400
    acc = torch.zeros_like(y, dtype=torch.float64)
    xg = x.cuda()
    lo = e2m1_values()
    for i in range(n):
        torch.cuda.manual_seed(1000 + i)
        p = NVFP4Quantizer(rht=True, stochastic_rounding=True).quantize_parts(xg, True, True)[direction]
        if i == 0:
            assert_bitwise(p.scale, ref.scale, "SR scale")
            assert_bitwise(p.amax, ref.amax, "SR amax")
        v = e2m1_decode(_codes(p)).double()
        if i < 3:  # each code is a neighbour of y
            a = y.abs()
            below = lo[(torch.searchsorted(lo, a.float(), right=True) - 1).clamp(0, 7)]
            above = lo[(torch.searchsorted(lo, a.float(), right=True)).clamp(0, 7)]
            ok = (v.abs() == below.double()) | (v.abs() == above.double())
            assert bool(ok.all()), "SR produced a code that is not a neighbour of the scaled value"
        acc += v
    mean = acc / n
    err = mean - y.double()
    assert err.abs().max().item() < 0.45, f"SR per-element bias too large: {err.abs().max().item()}"
    assert abs(err.mean().item()) < 0.02, f"SR biased on average: {err.mean().item()}"
    # round to nearest would be biased on these values; SR's mean error must be far smaller than RN's
    rn = e2m1_decode(_codes(NVFP4Quantizer(rht=True).quantize_parts(xg, True, True)[direction])).double()
    assert (err.abs().mean() < 0.5 * (rn - y.double()).abs().mean()).item()


# ---- persistent CTAs: many tiles per CTA ------------------------------------------------------------------------

MANY_TILE_CASES = {
    "fp8": (FORMATS["fp8_e4m3"], (3000, 2900)),
    "fp8_unaligned_k": (FORMATS["fp8_e5m2"], (1500, 2901)),  # K % 8 != 0: the synchronous load path
    "block1d": (FORMATS["fp8blk_1x128_e4m3"], (3000, 2900)),
    "block2d": (FORMATS["fp8blk_128x128_e4m3"], (2900, 3001)),
    "mxfp8": (FORMATS["mxfp8_e4m3"], (2976, 2912)),
    "mxfp8_2d": (FORMATS["mxfp8_32x32_e4m3"], (2912, 2976)),
    "nvfp4": (FORMATS["nvfp4"], (2992, 2896)),
    "nvfp4_rht": (FORMATS["nvfp4_rht"], (2896, 2992)),
    "nvfp4_2d": (FORMATS["nvfp4_16x16"], (2992, 2896)),
}


@pytest.mark.parametrize("case", list(MANY_TILE_CASES))
def test_many_tiles_per_cta(case, gen):
    """More tiles than resident CTAs (>= 2 per CTA, partial edge tiles): the pipelined tile loop, both stages."""
    factory, (m, k) = MANY_TILE_CASES[case]
    x = rand_input(m, k, torch.bfloat16, gen)
    check_quantizer(factory, x, True, True, what=f"many tiles {case} {m}x{k}")
    if case in ("fp8", "block1d"):
        check_quantizer(factory, rand_input(m, k, torch.float32, gen), True, True, what=f"many tiles {case} fp32")


# ---- a long persistent tile loop of 16-bit inputs ----------------------------------------------------------------

LONG_LOOP_FORMATS = [n for n in FORMATS if not n.startswith("identity") and "sr" not in n and "delayed" not in n]
LONG_LOOP_COPIES = (12, 12)  # of a 384 x 512 block: 36 x 48 tiles of 128 x 128, >= 4 per resident CTA (<= 3 per SM)


def tiled(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t repeated along each dim to the shape of `like` (bytes repeated for 1-byte dtypes)."""
    if t.dim() == 0 or t.shape == like.shape:
        return t
    reps = [b // a for a, b in zip(t.shape, like.shape)]
    u = t.view(torch.uint8) if t.element_size() == 1 else t
    out = u.repeat(*reps)
    return out.view(t.dtype) if t.element_size() == 1 else out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("directions", [(True, True), (True, False), (False, True)],
                         ids=["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("name", LONG_LOOP_FORMATS)
def test_long_tile_loop_of_16bit_input(name, directions, dtype, gen):
    """The persistent tile loop with 16-bit inputs, every format and direction: a tensor of 12 x 12 copies of one
    384 x 512 block (every CTA runs >= 4 tiles, each shared-memory stage refilled while the other is processed)
    quantizes to the copies of that block's parts, and those equal the CPU reference (its global amaxes are the
    block's: one oracle for every tile, however many)."""
    r, c = directions
    factory = FORMATS[name]
    base = rand_input(384, 512, dtype, gen)
    want = check_quantizer(factory, base, r, c, what=f"{name} {dtype} base block")
    big = base.cuda().repeat(*LONG_LOOP_COPIES)
    got = factory().quantize_parts(big, r, c)
    for d, g, w in zip(("rowwise", "columnwise"), got, want):
        assert (g is None) == (w is None), f"{name} {d}: part presence differs"
        if w is None:
            continue
        for field, t in w.tensors().items():
            gt = g.tensors()[field]
            if t is None:
                assert gt is None, f"{name} {d}.{field}: expected None"
                continue
            assert_bitwise(gt, tiled(t, gt), f"{name} {dtype} {d}.{field} of {LONG_LOOP_COPIES} copies")


# ---- dequantize ----------------------------------------------------------------------------------------------------

DEQ_CASES = {
    "fp8": (FORMATS["fp8_e4m3"], (257, 520)),
    "fp8_e5m2": (FORMATS["fp8_e5m2"], (100, 36)),
    "block1d": (FORMATS["fp8blk_1x128_e4m3"], (257, 520)),
    "block2d": (FORMATS["fp8blk_128x128_e4m3"], (300, 200)),
    "block_nopow2": (FORMATS["fp8blk_1x128_e4m3_nopow2"], (130, 264)),
    "mxfp8": (FORMATS["mxfp8_e4m3"], (96, 160)),
    "mxfp8_e5m2_2d": (FORMATS["mxfp8_32x32_e5m2"], (224, 96)),
    "nvfp4": (FORMATS["nvfp4"], (48, 80)),
    "nvfp4_rht": (FORMATS["nvfp4_rht"], (272, 144)),
    "nvfp4_2d": (FORMATS["nvfp4_16x16"], (272, 144)),
}


@pytest.mark.parametrize("case", list(DEQ_CASES))
def test_dequantize(case, gen):
    factory, (m, k) = DEQ_CASES[case]
    from hybridq.kernels import lookup_dequantize
    for kind in ("wide", "edge"):
        x = edge_input(m, k, torch.bfloat16, gen) if kind == "edge" else rand_input(m, k, torch.bfloat16, gen)
        parts = factory().quantize_parts(x.cuda(), True, True)
        for p in parts:
            for undo in (True, False):
                assert lookup_dequantize(p, undo) is not None, f"{case}: no CUDA dequantize"
                got = p.dequantize_2d(undo)
                cpu = p.map_tensors(lambda t: t.cpu())
                assert_bitwise(got, cpu.reference_dequantize_2d(undo), f"dequantize {case} {p.direction} undo={undo}")


# ---- byte transpose (FSDP derivations, columnwise buffers) ---------------------------------------------------

@pytest.mark.parametrize("shape", [(4096, 11008), (128, 64), (96, 160), (50257 // 7, 48), (1, 33), (77, 1),
                                   (130, 257), (16, 4096)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_transpose_bytes(shape, dtype, gen):
    from hybridq.kernels import transpose_bytes
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype).cuda()
    got = transpose_bytes(x)
    assert got is not None, "transpose_bytes declined a contiguous 1-byte CUDA tensor"
    assert got.dtype == dtype and got.is_contiguous(), f"{shape}: dtype {got.dtype}, contiguous {got.is_contiguous()}"
    assert_bitwise(got, x.cpu().t().contiguous(), f"transpose_bytes {shape} {dtype}")


def test_transpose_bytes_unaligned_view(gen):
    """A contiguous view at an odd storage offset (16-byte words cannot be used) is still transposed exactly."""
    from hybridq.kernels import transpose_bytes
    base = torch.randint(0, 256, (1 + 64 * 96,), dtype=torch.uint8, generator=gen).cuda()
    x = base[1:].view(64, 96)
    assert_bitwise(transpose_bytes(x), x.cpu().t().contiguous(), "transpose_bytes at offset 1")


@pytest.mark.parametrize("shape", [(16, 1024, 2048), (3, 96, 160), (5, 130, 257), (1, 77, 1), (2, 64, 48)])
@pytest.mark.parametrize("pitch", [0, 16, 1])
def test_transpose_bytes_into_batched(shape, pitch, gen):
    """Every matrix of a batch transposed in one launch into a given buffer, also when the matrices lie `pitch`
    bytes further apart than their size in both buffers (the gathered experts' stacked buffers; 1: no 16-byte
    words)."""
    from hybridq.kernels import transpose_bytes_into
    g, r, c = shape
    src_base = torch.randint(0, 256, (g, r * c + pitch), dtype=torch.uint8, generator=gen).cuda()
    dst_base = torch.full((g, r * c + pitch), 7, dtype=torch.uint8, device="cuda")
    src, dst = src_base[:, :r * c].view(g, r, c), dst_base[:, :r * c].view(g, c, r)
    assert transpose_bytes_into(src, dst), f"transpose_bytes_into declined {shape} at pitch {pitch}"
    assert_bitwise(dst, src.cpu().transpose(1, 2), f"transpose_bytes_into {shape} pitch {pitch}")
    assert bool((dst_base[:, r * c:] == 7).all()), f"{shape} pitch {pitch}: bytes between the matrices were written"


def test_transpose_bytes_into_declines():
    from hybridq.kernels import transpose_bytes_into
    cpu = torch.zeros(2, 4, 8, dtype=torch.uint8)
    assert not transpose_bytes_into(cpu, cpu.transpose(1, 2).contiguous()), "CPU tensors"
    x = torch.zeros(2, 4, 8, device="cuda", dtype=torch.uint8)
    assert not transpose_bytes_into(x.transpose(1, 2), torch.empty(2, 4, 8, device="cuda", dtype=torch.uint8)), \
        "a source whose matrices are not row-major"
    assert not transpose_bytes_into(x.bfloat16(), torch.empty(2, 8, 4, device="cuda")), "2-byte elements"


def test_transpose_bytes_declines():
    from hybridq.kernels import transpose_bytes
    assert transpose_bytes(torch.zeros(4, 4, dtype=torch.uint8)) is None, "CPU tensor"
    assert transpose_bytes(torch.zeros(4, 4, device="cuda", dtype=torch.bfloat16)) is None, "2-byte elements"
    assert transpose_bytes(torch.zeros(8, 4, device="cuda", dtype=torch.uint8).t()) is None, "non-contiguous"


# ---- ops: fake implementations, errors -------------------------------------------------------------------------

def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.hybridq
    x = torch.randn(96, 160, device="cuda", dtype=torch.bfloat16)
    real = [ops.fp8_tensor_quantize(x, torch.float8_e4m3fn, None, None, 0.0, False, True, True, False),
            ops.fp8_block_quantize(x, torch.float8_e4m3fn, 2, 0.0, True, True, True),
            ops.mxfp8_quantize(x, torch.float8_e4m3fn, False, True, True, True),
            ops.nvfp4_quantize(x, False, True, True, None, True, True)]
    with FakeTensorMode() as mode:
        xf = mode.from_tensor(x)
        fake = [ops.fp8_tensor_quantize(xf, torch.float8_e4m3fn, None, None, 0.0, False, True, True, False),
                ops.fp8_block_quantize(xf, torch.float8_e4m3fn, 2, 0.0, True, True, True),
                ops.mxfp8_quantize(xf, torch.float8_e4m3fn, False, True, True, True),
                ops.nvfp4_quantize(xf, False, True, True, None, True, True)]
    for r, f in zip(real, fake):
        for a, b in zip(r, f):
            assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def test_opcheck():
    ops = torch.ops.hybridq
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.fp8_tensor_quantize, (x, torch.float8_e4m3fn, None, None, 0.0, False, True, True, False),
                          test_utils=tests)
    torch.library.opcheck(ops.fp8_tensor_quantize_delayed, (x, torch.float8_e4m3fn, torch.ones(1, device="cuda"),
                                                            torch.zeros(4, device="cuda"), 0.0, False, True, True),
                          test_utils=tests)
    torch.library.opcheck(ops.fp8_block_quantize, (x, torch.float8_e5m2, 1, 0.0, True, True, True), test_utils=tests)
    torch.library.opcheck(ops.mxfp8_quantize, (x, torch.float8_e4m3fn, True, True, True, False), test_utils=tests)
    torch.library.opcheck(ops.nvfp4_quantize, (x, True, False, False, None, True, True), test_utils=tests)
    torch.library.opcheck(ops.amax, (x,), test_utils=tests)
    torch.library.opcheck(ops.transpose_bytes, (x.view(torch.uint8),), test_utils=tests)
    hs = [torch.rand(4, device="cuda"), torch.rand(1, device="cuda")]
    ss = [torch.ones(1, device="cuda"), torch.ones(1, device="cuda")]
    torch.library.opcheck(ops.fp8_delayed_update, (hs, ss, [448.0, 57344.0], [1.0, 2.0], [0, 1]), test_utils=tests)
    # (the dequantize ops take fp8 tensors, which opcheck's schema test cannot compare: their fakes only)
    q8 = torch.randn(64, 96, device="cuda").to(torch.float8_e4m3fn)
    fake = ("test_faketensor",)
    torch.library.opcheck(ops.fp8_tensor_dequantize, (q8, torch.ones(1, device="cuda"), torch.bfloat16),
                          test_utils=fake)
    torch.library.opcheck(ops.fp8_block_dequantize, (q8, torch.ones(1, 1, device="cuda"), 2, torch.float32),
                          test_utils=fake)
    torch.library.opcheck(ops.mxfp8_dequantize, (q8, torch.full((64, 3), 127, device="cuda", dtype=torch.uint8),
                                                 torch.float32), test_utils=fake)
    q4 = torch.randint(0, 256, (64, 48), device="cuda", dtype=torch.uint8)
    torch.library.opcheck(ops.nvfp4_dequantize, (q4, torch.ones(64, 6, device="cuda").to(torch.float8_e4m3fn),
                                                 torch.ones(1, device="cuda"), True, True, torch.bfloat16),
                          test_utils=fake)


_BAD_CALLS = r"""
import torch, hybridq.kernels as k
assert k.extension_available()
ops = torch.ops.hybridq
e4 = torch.float8_e4m3fn
x = torch.randn(64, 96, device="cuda")
q8 = torch.zeros(64, 96, device="cuda", dtype=e4)
cases = [
    (lambda: ops.mxfp8_quantize(torch.randn(64, 40, device="cuda"), e4, False, True, False, False),
     ["mxfp8_quantize", "MXFP8 rowwise", "divisible by 32", "[64, 40]"]),
    (lambda: ops.mxfp8_quantize(torch.randn(40, 64, device="cuda"), e4, False, False, True, False),
     ["MXFP8 columnwise", "M = x.size(0) divisible by 32", "[40, 64]"]),
    (lambda: ops.mxfp8_quantize(torch.randn(64, 40, device="cuda"), e4, True, True, True, False), ["32x32 tiles"]),
    (lambda: ops.nvfp4_quantize(torch.randn(40, 64, device="cuda"), False, False, False, None, False, True),
     ["nvfp4_quantize", "NVFP4 columnwise", "divisible by 16", "[40, 64]"]),
    (lambda: ops.nvfp4_quantize(torch.randn(64, 40, device="cuda"), False, False, False, None, True, False),
     ["NVFP4 rowwise", "K = x.size(1) divisible by 16"]),
    (lambda: ops.nvfp4_quantize(x, True, True, False, None, True, True), ["rht", "16x16"]),
    (lambda: ops.amax(torch.ones(4, 4, device="cuda", dtype=torch.int32)), ["amax", "dtype Int", "bfloat16"]),
    (lambda: ops.amax(torch.ones(4, 4)), ["must be a CUDA tensor", "cpu"]),
    (lambda: ops.fp8_block_quantize(x, e4, 3, 0.0, True, True, True), ["block_dim", "got 3"]),
    (lambda: ops.fp8_block_quantize(x.t(), e4, 1, 0.0, True, True, True), ["contiguous", "[96, 64]"]),
    (lambda: ops.fp8_block_quantize(x[None], e4, 1, 0.0, True, True, True), ["2-D", "[1, 64, 96]"]),
    (lambda: ops.fp8_block_quantize(x, torch.float16, 1, 0.0, True, True, True), ["float8_e4m3fn", "Half"]),
    (lambda: ops.fp8_block_quantize(x, e4, 1, -1.0, True, True, True), ["epsilon", "-1"]),
    (lambda: ops.fp8_tensor_quantize(x, e4, torch.ones(2, device="cuda"), None, 0.0, False, True, True, True),
     ["scale must have one element", "[2]"]),
    (lambda: ops.fp8_tensor_quantize(x, e4, None, torch.ones(3), 0.0, False, True, True, False),
     ["amax must have one element"]),
    (lambda: ops.fp8_tensor_quantize_delayed(x, e4, torch.ones(1, device="cuda"), torch.zeros(4), 0.0, False, True,
                                             True), ["fp8_tensor_quantize_delayed", "amax_history must be on cuda",
                                                     "cpu"]),
    (lambda: ops.fp8_tensor_quantize_delayed(x, e4, torch.ones(1, device="cuda"), torch.zeros(4, 2, device="cuda"),
                                             0.0, False, True, True), ["amax_history must be", "[4, 2]"]),
    (lambda: ops.fp8_tensor_quantize_delayed(x, e4, torch.ones(3, device="cuda"), torch.zeros(4, device="cuda"),
                                             0.0, False, True, True), ["scale must have one element", "[3]"]),
    (lambda: ops.fp8_tensor_dequantize(q8, torch.ones(2, device="cuda"), torch.float32),
     ["fp8_tensor_dequantize", "scale_inv needs 1 scale elements", "[64, 96]"]),
    (lambda: ops.fp8_block_dequantize(q8, torch.ones(64, 1, device="cuda"), 3, torch.float32), ["block_dim", "got 3"]),
    (lambda: ops.fp8_block_dequantize(q8, torch.ones(1, 1, device="cuda"), 1, torch.float32),
     ["fp8_block_dequantize", "needs 64 scale elements", "[rows, ceil(cols/128)]"]),
    (lambda: ops.fp8_tensor_dequantize(q8, torch.ones(1, device="cuda"), torch.float16), ["out_dtype", "Half"]),
    (lambda: ops.mxfp8_dequantize(q8, torch.ones(64, 3, device="cuda"), torch.float32), ["uint8", "E8M0"]),
    (lambda: ops.nvfp4_dequantize(torch.zeros(16, 4, device="cuda", dtype=torch.uint8),
                                  torch.zeros(16, 1, device="cuda", dtype=e4), torch.ones(1, device="cuda"), False,
                                  True, torch.float32), ["divisible by 16", "[16, 4]"]),
    (lambda: ops.fp8_delayed_update([torch.zeros(4, device="cuda")], [torch.ones(1, device="cuda")], [448.0], [1.0],
                                    [0, 1]), ["one entry per quantizer"]),
    (lambda: ops.fp8_delayed_update([torch.zeros(5000, device="cuda")], [torch.ones(1, device="cuda")], [448.0],
                                    [1.0], [0]), ["histories[0]", "5000"]),
    (lambda: ops.fp8_delayed_update([torch.zeros(4, device="cuda")], [torch.ones(2, device="cuda")], [448.0], [1.0],
                                    [0]), ["scales[0]", "[2]"]),
]
for i, (call, needles) in enumerate(cases):
    try:
        call()
    except RuntimeError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"case {i}: {n!r} not in the message: {msg}"
    else:
        raise AssertionError(f"case {i}: no error (expected {needles})")
# the ops still work after the errors
r = ops.mxfp8_quantize(torch.randn(64, 64, device="cuda"), e4, False, True, True, False)
torch.cuda.synchronize()
print("OK", len(cases))
"""


def test_clear_errors():
    """Every bad argument raises a RuntimeError naming the op, the tensor (with its shape) and the rule; none
    crashes the process (run in a subprocess, so a crash fails this test and not the session). Regression test for
    the SIGSEGV of a toolchain that linked libstdc++ statically into the extension (see setup.py)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _BAD_CALLS], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"


def _elf_needed(path: str) -> list:
    """DT_NEEDED entries of an ELF64 little-endian shared object."""
    import struct
    with open(path, "rb") as fh:
        b = fh.read()
    assert b[:4] == b"\x7fELF" and b[4] == 2 and b[5] == 1, "not an ELF64 little-endian file"
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    dyn = next(s for s in secs if s[1] == 6)  # SHT_DYNAMIC
    strtab = secs[dyn[6]]  # sh_link: the string table
    out = []
    for off in range(dyn[4], dyn[4] + dyn[5], 16):
        tag, val = struct.unpack_from("<qQ", b, off)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            start = strtab[4] + val
            out.append(b[start:b.index(b"\0", start)].decode())
    return out


def test_extension_shares_torch_libstdcxx():
    """hybridq._C must use the process's shared libstdc++, not a private static copy (whose code would run on the
    process's libstdc++ data and crash in std::ostream: the old SIGSEGV of test_clear_errors)."""
    try:
        import hybridq._C as ext
    except ImportError:
        pytest.skip("the extension was loaded from HYBRIDQ_EXT_PATH")
    needed = _elf_needed(ext.__file__)
    assert "libstdc++.so.6" in needed, f"hybridq._C does not link the shared libstdc++ (NEEDED: {needed})"


def test_fallback_for_unknown_keywords(gen):
    """A keyword the kernels do not implement (e.g. a sharded quantization) goes to the reference."""
    from hybridq.kernels import lookup_quantize
    x = rand_input(64, 64, torch.bfloat16, gen).cuda()
    assert lookup_quantize(MXFP8Quantizer(), x, True, True, something=object()) is None
    assert lookup_quantize(Float8Quantizer(), x, True, True, amax=torch.ones(1)) is not None
    assert lookup_quantize(Float8Quantizer(scaling="delayed"), x, True, True, amax=torch.ones(1)) is None


# ---- non-finite values (docs/numerics.md "Non-finite values") -----------------------------------------------------
# A non-finite input never comes out finite: NaN -> NaN, +-inf -> +-inf in E5M2 and NaN with inf's sign in E4M3
# (which has no infinity). The bytes of infinite inputs are written out here; every other element, NaN inputs
# included (an MXFP8 NaN block's NaN multiplier decides their sign), must equal the reference.

FP8_NONFINITE_FACTORIES = {
    "tensor": lambda fp8: Float8Quantizer(fp8),
    "tensor_delayed": lambda fp8: Float8Quantizer(fp8, scaling="delayed", amax_history_len=4),
    "block1d": lambda fp8: Float8BlockQuantizer(fp8),
    "block2d": lambda fp8: Float8BlockQuantizer(fp8, block_dim=2),
    "mxfp8": lambda fp8: MXFP8Quantizer(fp8),
    "mxfp8_32x32": lambda fp8: MXFP8Quantizer(fp8, block_2d=True),
}
_INF_BYTE = {("e5m2", 1): 0x7C, ("e5m2", -1): 0xFC, ("e4m3", 1): 0x7F, ("e4m3", -1): 0xFF}


def nonfinite_input(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[256, 384] random values with +-inf only in the first 128x128 tile and +-NaN only in the last one (no
    scaling block, 1-D or 2-D, holds both); returns (x, +inf/-inf sign map (0: finite), NaN sign map)."""
    m, k = 256, 384
    x = torch.randn(m, k, generator=gen).to(dtype)
    inf_sign = torch.zeros(m, k, dtype=torch.int8)
    nan_sign = torch.zeros(m, k, dtype=torch.int8)
    bits = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
    nan_pos = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}[dtype]
    sign_bit = {torch.float32: -0x80000000, torch.bfloat16: -0x8000, torch.float16: -0x8000}[dtype]
    for i in range(24):
        r, c = int(torch.randint(0, 128, (1,), generator=gen)), int(torch.randint(0, 128, (1,), generator=gen))
        s = 1 if i % 2 == 0 else -1
        x[r, c] = s * float("inf")
        inf_sign[r, c] = s
        r, c = 128 + int(torch.randint(0, 128, (1,), generator=gen)), 256 + int(torch.randint(0, 128, (1,), generator=gen))
        bits[r, c] = nan_pos if s > 0 else nan_pos | sign_bit
        nan_sign[r, c] = s
    return x, inf_sign, nan_sign


def _fp8_is_nan(b: torch.Tensor, fp8: str) -> torch.Tensor:
    return (b & 0x7F) == 0x7F if fp8 == "e4m3" else (b & 0x7F) > 0x7C


def check_nonfinite_fp8(got_part, ref_part, inf_sign, nan_sign, fp8: str, what: str) -> None:
    got = got_part.data.cpu().view(torch.uint8).to(torch.int32)
    ref = ref_part.data.view(torch.uint8).to(torch.int32)
    if got_part.columnwise:  # stored [K, M]
        inf_sign, nan_sign = inf_sign.t(), nan_sign.t()
    want = ref.clone()
    for s in (1, -1):
        want[inf_sign == s] = _INF_BYTE[(fp8, s)]
    got_nan = _fp8_is_nan(got, fp8)
    assert bool(got_nan[nan_sign != 0].all()), f"{what}: a NaN input came out finite (seed {SEED})"
    kind = torch.where(inf_sign != 0, 1, torch.where(nan_sign != 0, 2, 0))
    bad = got != want
    assert not bad.any(), (f"{what}: {int(bad.sum())} bytes differ from the rule/reference, first at "
                           f"{bad.nonzero()[0].tolist()}: got {hex(int(got[bad][0]))}, want {hex(int(want[bad][0]))} "
                           f"(input {['finite', 'inf', 'NaN'][int(kind[bad][0])]}; seed {SEED})")
    for name in ref_part.tensor_fields:
        if name != "data":
            assert_bitwise(getattr(got_part, name), getattr(ref_part, name), f"{what}.{name}")


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", list(FP8_NONFINITE_FACTORIES))
def test_fp8_nonfinite_never_finite(case, fp8, dtype, gen):
    x, inf_sign, nan_sign = nonfinite_input(dtype, gen)
    for r, c in ((True, True), (True, False), (False, True)):
        q_gpu, q_ref = FP8_NONFINITE_FACTORIES[case](fp8), FP8_NONFINITE_FACTORIES[case](fp8)
        xg = x.cuda()
        assert uses_kernel(q_gpu, xg, r, c), f"{case}: the CUDA kernel declined"
        got = q_gpu.quantize_parts(xg, r, c)
        ref = q_ref.reference_parts(x, r, c)
        for d, g, rp in zip(("rowwise", "columnwise"), got, ref):
            assert (g is None) == (rp is None), f"{case} {d}: one side is None"
            if g is not None:
                check_nonfinite_fp8(g, rp, inf_sign, nan_sign, fp8, f"{case} {fp8} {str(dtype)[6:]} {r}{c} {d}")


def test_fp8_nonfinite_bytes_of_the_kernel():
    """The exact bytes, without the reference: scale 1 (the tensor's amax is inf) keeps finite values."""
    x = torch.tensor([[float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0, -2.0, 448.0, 0.0] * 4],
                     device="cuda")
    for fp8, want in (("e4m3", [0x7F, 0xFF, 0x7F, 0xFF, 0x38, 0xC0, 0x7E, 0x00]),
                      ("e5m2", [0x7C, 0xFC, 0x7F, 0xFF, 0x3C, 0xC0, 0x5F, 0x00])):
        row, col = Float8Quantizer(fp8).quantize_parts(x, True, True)
        got = row.data.view(torch.uint8).cpu()[0, :8].tolist()
        assert got == want, f"per-tensor {fp8} rowwise bytes {[hex(b) for b in got]} != {[hex(b) for b in want]}"
        got = col.data.view(torch.uint8).cpu()[:8, 0].tolist()
        assert got == want, f"per-tensor {fp8} columnwise bytes {[hex(b) for b in got]} != {[hex(b) for b in want]}"


def _nvfp4_rule_dequantize(part: NVFP4Part) -> torch.Tensor:
    """q * fp32(s) * A / 2688 with the division first when A > FLT_MAX / 2688 (in fp32), no inverse RHT."""
    vals = e2m1_decode(unpack_nibbles(part.data.cpu()))
    qs = vals * expand_blocks(part.scale.cpu().float(), 16, vals.shape[-1])
    a = part.amax.cpu().float()
    big = a > torch.tensor(torch.finfo(torch.float32).max, dtype=torch.float32) / 2688.0
    return torch.where(big, qs * (a / 2688.0), (qs * a) / 2688.0)


@pytest.mark.parametrize("amax", [1e36, 2e37, 3e38])
@pytest.mark.parametrize("cfg", list(NV_CONFIGS))
def test_nvfp4_dequantize_large_amax_is_finite(amax, cfg, gen):
    x = torch.randn(128, 256, generator=gen)
    x = x / x.abs().amax() * amax
    q = NVFP4Quantizer(**NV_CONFIGS[cfg])
    parts = q.quantize_parts(x.cuda(), True, True)
    ref = q.reference_parts(x, True, True)
    for p, r in zip(parts, ref):  # the transformed form too (groups from 2^123 on run pre-scaled butterflies)
        assert_parts_equal(p, r, f"nvfp4 {cfg} amax {amax:g} {p.direction}")
    if NV_CONFIGS[cfg].get("rht") and amax > 2.0 ** 125:
        parts = parts[:1]  # beyond the transform's documented range: the columnwise form may be non-finite
    for p in parts:
        got = p.dequantize_2d(False).cpu()
        assert bool(torch.isfinite(got).all()), (f"nvfp4 {cfg} amax {amax:g} {p.direction}: "
                                                 f"{int((~torch.isfinite(got)).sum())} non-finite values")
        assert_bitwise(got, _nvfp4_rule_dequantize(p), f"nvfp4 {cfg} amax {amax:g} {p.direction} dequantize")


# ---- pieces of a tensor (tensor parallelism): the kernels take the whole tensor's global statistics ----------

@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2_pow2", "nvfp4", "nvfp4_rht", "nvfp4_16x16"])
def test_kernel_with_global_stats_matches_the_reference(name):
    """A piece quantized by the kernel with a larger global amax (another rank's piece holds the maximum) equals
    the reference given the same `global_stats`."""
    gen = torch.Generator().manual_seed(SEED)
    x = rand_input(256, 512, torch.bfloat16, gen)
    q = FORMATS[name]()
    stats = q.global_stats(x, True, True) * 4  # the whole tensor's amaxes exceed this piece's
    check_quantizer(FORMATS[name], x, True, True, what=f"{name} piece with global stats", global_stats=stats)
