"""NVFP4 row groups (`NVFP4Quantizer.quantize_groups`, docs/numerics.md "Row groups and grouped GEMMs"): one call
quantizes consecutive row groups of a buffer, each with its own global amax (after the transform with RHT; one for
both directions with 16x16 tiles), and `row_slice(start, stop, group=g)` cuts out group g bitwise as quantizing it
alone gives it -- for every NVFP4 option, empty groups, groups of very different magnitudes and non-finite values in
one group. Stochastic rounding draws each group's numbers as its own call would, in the given order. Hybrids with
NVFP4 do the same per direction. Shape rules hold per group (errors name the group, tensor, format and rule). On a
GPU: the CUDA kernel (one amax launch and one quantize launch) is bitwise the reference, and its stochastic rounding
bitwise the per-group CUDA launches made in the same order."""

from __future__ import annotations

import pytest
import torch

from hybridq.errors import FormatShapeError
from hybridq.formats import Float8Quantizer, HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer

from _compare import assert_parts_bitwise
from _gpu import extension_ready

K = 64
OPTIONS = {
    "plain": {},
    "rht": {"rht": True},
    "16x16": {"block_2d": True},
    "sr": {"stochastic_rounding": True},
    "rht_sr": {"rht": True, "stochastic_rounding": True},
    "16x16_sr": {"block_2d": True, "stochastic_rounding": True},
}
SIZES = [[16, 0, 48, 32], [0, 0, 0], [32], [0, 16, 0, 16, 0], [96, 16]]
DIRECTIONS = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}
HAVE_CUDA = torch.cuda.is_available()


def _groups(sizes, device="cpu", dtype=torch.bfloat16, seed=0):
    """Row groups whose magnitudes differ by 10^2 per group (a statistic shared by two groups would change scales)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, K, generator=gen) * 10.0 ** (2 * g - 3) for g, n in enumerate(sizes)]
    return torch.cat(xs).to(device, dtype) if xs else torch.zeros(0, K, device=device, dtype=dtype)


def _offsets(sizes):
    return [sum(sizes[:g]) for g in range(len(sizes))]


def _assert_groups_are_each_group_alone(q_factory, x, sizes, rowwise, columnwise, order, what, seed=3,
                                        seed_fn=torch.manual_seed, nan_payload=False):
    """quantize_groups' row slices == each group quantized alone, the per-group calls made in `order` (with the
    generator reseeded alike, so stochastic rounding draws the same stream)."""
    seed_fn(seed)
    packed = q_factory().quantize_groups(x, sizes, rowwise=rowwise, columnwise=columnwise, draw_order=order,
                                         name="x")
    seed_fn(seed)
    q = q_factory()
    alone = {}
    for g in (order if order is not None else range(len(sizes))):
        o, n = _offsets(sizes)[g], sizes[g]
        if n:
            alone[g] = q.quantize_parts(x[o:o + n], rowwise, columnwise)
    for g, (o, n) in enumerate(zip(_offsets(sizes), sizes)):
        if not n:
            continue
        for d, direction in enumerate(("rowwise", "columnwise")):
            if (rowwise, columnwise)[d]:
                assert_parts_bitwise(packed.part(direction).row_slice(o, o + n, group=g), alone[g][d],
                                     f"{what}, group {g} of {sizes}, {direction}", nan_payload=nan_payload)


@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_row_groups_are_each_group_quantized_alone(option, sizes, direction):
    rowwise, columnwise = DIRECTIONS[direction]
    order = list(reversed(range(len(sizes))))  # (the order GroupedLinear's backward draws in)
    _assert_groups_are_each_group_alone(lambda: NVFP4Quantizer(**OPTIONS[option]), _groups(sizes), sizes, rowwise,
                                        columnwise, order, f"NVFP4 {option}")


@pytest.mark.parametrize("option", ["plain", "rht", "16x16"])
def test_rowwise_groups_need_not_be_whole_16_row_blocks(option):
    sizes = [5, 0, 17, 1]  # rowwise 1x16 blocks lie in one row (16x16 tiles take whole groups: not here)
    if option == "16x16":
        with pytest.raises(FormatShapeError, match=r"row group 0 of x"):
            NVFP4Quantizer(block_2d=True).quantize_groups(_groups(sizes), sizes, name="x")
        return
    _assert_groups_are_each_group_alone(lambda: NVFP4Quantizer(**OPTIONS[option]), _groups(sizes), sizes, True,
                                        False, None, f"NVFP4 {option} rowwise")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 3e38, 0.0], ids=["inf", "nan", "near-max", "zeros"])
@pytest.mark.parametrize("option", ["plain", "rht", "16x16"])
def test_a_non_finite_or_extreme_group_leaves_the_others_alone(option, value):
    sizes = [32, 16, 48]
    x = _groups(sizes, dtype=torch.float32)
    if value == 0.0:
        x[32:48] = 0.0
    else:
        x[32 + 3, 5] = value
    _assert_groups_are_each_group_alone(lambda: NVFP4Quantizer(**OPTIONS[option]), x, sizes, True, True, None,
                                        f"NVFP4 {option} with {value} in group 1")


def test_each_group_gets_its_own_global_amax():
    sizes = [16, 0, 32]
    x = _groups(sizes, dtype=torch.float32)
    qt = NVFP4Quantizer(rht=True).quantize_groups(x, sizes, rowwise=True, columnwise=True)
    row_amax = qt.part("rowwise").amax
    want = torch.tensor([x[:16].abs().max(), 0.0, x[16:].abs().max()])
    assert torch.equal(row_amax, want), f"rowwise amaxes {row_amax.tolist()}, want {want.tolist()}"
    assert qt.part("columnwise").amax.shape == (3,), qt.part("columnwise").amax.shape


def test_row_groups_of_a_hybrid_take_each_direction_from_its_quantizer():
    sizes = [32, 0, 16, 64]
    x = _groups(sizes)

    def q():
        return HybridQuantizer(rowwise=MXFP8Quantizer(),
                               columnwise=NVFP4Quantizer(rht=True, stochastic_rounding=True))
    _assert_groups_are_each_group_alone(q, x, sizes, True, True, [3, 2, 1, 0], "hybrid MXFP8 / NVFP4 (RHT, SR)")


@pytest.mark.parametrize("quantizer,packs", [
    (NVFP4Quantizer(), True), (NVFP4Quantizer(rht=True, stochastic_rounding=True), True),
    (NVFP4Quantizer(block_2d=True), True),
    (HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer(rht=True)), True),
    (HybridQuantizer(rowwise=NVFP4Quantizer(stochastic_rounding=True),
                     columnwise=NVFP4Quantizer(stochastic_rounding=True)), False),  # both directions draw
    (HybridQuantizer(rowwise=NVFP4Quantizer(), columnwise=MXFP8Quantizer(),
                     columnwise_source="rowwise_dequantized"), False),  # NVFP4 rowwise then dequantized whole
    (Float8Quantizer(), False), (Float8Quantizer(scaling="delayed"), False),
], ids=["nvfp4", "nvfp4_rht_sr", "nvfp4_16x16", "hybrid_mxfp8_nvfp4", "hybrid_sr_sr", "hybrid_double_nvfp4",
        "fp8_tensor", "fp8_delayed"])
def test_which_quantizers_pack_row_groups(quantizer, packs):
    assert quantizer.packs_row_groups == packs, f"{quantizer.describe()}: packs_row_groups={quantizer.packs_row_groups}"


def test_a_quantizer_that_cannot_pack_row_groups_says_so():
    with pytest.raises(NotImplementedError, match="row groups of grad_output of moe cannot be quantized in one call"):
        Float8Quantizer(scaling="delayed").quantize_groups(torch.zeros(16, K), [16], name="grad_output of moe")


def test_a_group_breaking_the_shape_rule_is_refused_naming_it():
    with pytest.raises(FormatShapeError, match=r"NVFP4.*M % 16 == 0.*row group 1 of grad_output of moe"):
        NVFP4Quantizer().quantize_groups(torch.zeros(33, K), [16, 17], columnwise=True, name="grad_output of moe")


@pytest.mark.parametrize("sizes,order,match", [([16, 16], [0, 0], "draw_order"), ([16, 16], [0], "draw_order"),
                                               ([16, 8], None, "sum to"), ([-16, 48], None, ">= 0")])
def test_bad_groups_or_draw_order_are_refused(sizes, order, match):
    with pytest.raises(ValueError, match=match):
        NVFP4Quantizer().quantize_groups(torch.zeros(32, K), sizes, draw_order=order)


def test_a_part_of_row_groups_is_sliced_by_group_only():
    qt = NVFP4Quantizer().quantize_groups(_groups([16, 16]), [16, 16])
    with pytest.raises(ValueError, match="must name its group"):
        qt.part("rowwise").row_slice(0, 16)
    with pytest.raises(ValueError, match="must name its group"):
        qt.part("rowwise").row_slice(0, 16, group=2)


# ---- GPU --------------------------------------------------------------------------------------------------------


gpu = pytest.mark.skipif(not extension_ready(), reason="needs a CUDA device and the built extension")
GPU_SIZES = [[16, 0, 48, 32], [0, 0, 160], [128, 16, 0, 256, 32], [0, 16, 0]]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
@pytest.mark.parametrize("sizes", GPU_SIZES, ids=str)
@pytest.mark.parametrize("option", ["plain", "rht", "16x16"])
def test_gpu_row_groups_kernel_is_bitwise_the_reference(option, sizes, direction, dtype):
    from hybridq.kernels import cuda_nvfp4
    rowwise, columnwise = DIRECTIONS[direction]
    q = NVFP4Quantizer(**OPTIONS[option])
    x = _groups(sizes, dtype=dtype)
    if x.shape[0]:  # edge values in the first row: only its group's statistics may change
        x[0, :3] = torch.tensor([float("inf"), 2.0 ** 126, -0.0])
    order = [g for g in range(len(sizes)) if sizes[g]]
    got = cuda_nvfp4.row_groups(q, x.cuda(), tuple(sizes), rowwise, columnwise, order)
    assert got is not None, f"NVFP4 {option}: the CUDA row-groups kernel declined {sizes}"
    want = q.reference_groups(x, tuple(sizes), rowwise, columnwise, order)
    for d, direction_name in enumerate(("rowwise", "columnwise")):
        assert_parts_bitwise(got[d], want[d], f"NVFP4 {option} {sizes} {dtype} {direction_name}", nan_payload=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
@pytest.mark.parametrize("sizes", GPU_SIZES, ids=str)
@pytest.mark.parametrize("option", ["sr", "rht_sr", "16x16_sr"])
def test_gpu_row_groups_stochastic_rounding_draws_as_the_per_group_launches(option, sizes, direction):
    rowwise, columnwise = DIRECTIONS[direction]
    order = list(reversed(range(len(sizes))))
    _assert_groups_are_each_group_alone(lambda: NVFP4Quantizer(**OPTIONS[option]), _groups(sizes, "cuda"), sizes,
                                        rowwise, columnwise, order, f"CUDA NVFP4 {option}", seed_fn=torch.cuda.manual_seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("option", ["plain", "rht", "16x16", "rht_sr"])
def test_gpu_row_groups_are_each_group_alone_on_cuda(option):
    sizes = [16, 0, 48, 32]
    _assert_groups_are_each_group_alone(lambda: NVFP4Quantizer(**OPTIONS[option]), _groups(sizes, "cuda"), sizes,
                                        True, True, None, f"CUDA NVFP4 {option}", seed_fn=torch.cuda.manual_seed,
                                        nan_payload=True)
