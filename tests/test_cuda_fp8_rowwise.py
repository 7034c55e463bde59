"""The rowwise FP8 CUDA quantize kernel (csrc/quantize_fp8_rowwise.cu, hybridq/kernels/cuda_fp8_rowwise.py) is bitwise
the PyTorch reference (`Float8RowwiseQuantizer.reference_parts`): both parts' fp8 bytes and per-row scale_inv, for
random inputs with scales varying across rows and columns, outlier rows and columns, zero rows, NaN / inf rows and
columns, shapes that end inside a tile, every input dtype, and amaxes given for a piece of a larger tensor. Skipped
without CUDA or the built extension."""

from __future__ import annotations

import os
import random

import pytest
import torch

from hybridq.dispatch import lookup_quantize
from hybridq.formats import Float8RowwiseQuantizer

import _compare
from _gpu import extension_ready

HAVE_CUDA = torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device"),
              pytest.mark.skipif(HAVE_CUDA and not extension_ready(), reason="the hybridq CUDA extension is not built")]

SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTIZERS = {
    "e4m3_pow2": lambda: Float8RowwiseQuantizer(),
    "e5m2": lambda: Float8RowwiseQuantizer(fp8="e5m2", power_2_scale=False),
    "e4m3_eps": lambda: Float8RowwiseQuantizer(power_2_scale=False, amax_epsilon=1e-3),
}
# whole tiles, partial tiles along either dim, a single row / column, many tiles
SHAPES = [(128, 128), (200, 72), (257, 384), (1, 33), (77, 1), (1000, 136), (512, 4096)]


def _input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N(0, 1) times 2^[-12, 12) per row and 2^[-6, 6) per column (many different scales), in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, (m, 1), generator=g).float())
    x = x * torch.exp2(torch.randint(-6, 6, (1, k), generator=g).float())
    return (x.clamp(-6e4, 6e4) if dtype == torch.float16 else x).to(dtype)


def check(make, x: torch.Tensor, what: str, rowwise=True, columnwise=True, **kw):
    """The kernel's parts of x (on the GPU) are bitwise the reference's (on the CPU), each from a fresh quantizer."""
    q = make()
    xg = x.cuda()
    kw_gpu = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in kw.items()}
    assert lookup_quantize(q, xg, rowwise, columnwise, **kw_gpu) is not None, f"{what}: the CUDA kernel declined"
    got = q.quantize_parts(xg, rowwise, columnwise, **kw_gpu)
    want = make().reference_parts(x, rowwise, columnwise, **kw)
    for d, g, w in zip(("rowwise", "columnwise"), got, want):
        assert (g is None) == (w is None), f"{what} {d}: kernel {g!r}, reference {w!r}"
        if w is not None:
            _compare.assert_parts_bitwise(g, w, f"{what} {d} (seed {SEED})", nan_payload=(torch.float32,))


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_random_input_is_bitwise_the_reference(shape, quantizer, dtype):
    check(QUANTIZERS[quantizer], _input(*shape, dtype, SEED), f"{quantizer} {dtype} {shape}")


@pytest.mark.parametrize("directions", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
def test_one_direction_is_bitwise_the_reference(directions):
    check(QUANTIZERS["e4m3_pow2"], _input(200, 72, torch.bfloat16, SEED), f"{directions}", *directions)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
def test_outlier_and_zero_rows_and_columns(dtype):
    """An outlier row / column takes its own scale and leaves the others' alone; a zero row / column has scale 1."""
    x = _input(257, 384, torch.float32, SEED)
    x[5] *= 1e4
    x[:, 7] *= 1e4
    x[9] = 0
    x[:, 11] = 0
    x[13, 17] = 3e4  # one element far above its row and column
    x[200] = 1e-30 * torch.sign(x[200])  # a row of tiny values (fp32 only: zero in 16 bits): its own scale
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # (outliers, not overflow: the non-finite test has those)
    check(QUANTIZERS["e4m3_pow2"], x.to(dtype), f"outliers {dtype}")
    check(QUANTIZERS["e5m2"], x.to(dtype), f"outliers e5m2 {dtype}")


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_nan_and_inf_rows_and_columns(quantizer, dtype):
    """A NaN or inf stays non-finite in its row (rowwise) and column (columnwise), whose scale is 1; the other rows
    and columns are unchanged."""
    x = _input(200, 160, dtype, SEED)
    x[3, 5] = float("nan")
    x[7, 2] = float("inf")
    x[9, 100] = -float("inf")
    x[11] = float("nan")
    x[:, 130] = float("inf")
    check(QUANTIZERS[quantizer], x, f"non-finite {quantizer} {dtype}")


def test_given_amaxes_are_bitwise_the_reference():
    """A row shard with the columns' reduced amaxes (`stats`), and tensor-parallel pieces with the amaxes along the
    cut dim (`global_stats`, `cut`): larger than the piece's own (as reduced over the other pieces)."""
    x = _input(256, 192, torch.bfloat16, SEED)
    q = QUANTIZERS["e4m3_pow2"]()
    cols = q.shard_stats(x, None) * 4
    check(QUANTIZERS["e4m3_pow2"], x, "row shard with column stats", stats=cols)
    rows = q.piece_stats(x, True, False, "K") * 2
    check(QUANTIZERS["e4m3_pow2"], x, "column piece", rowwise=True, columnwise=False, global_stats=rows, cut="K")
    cols = q.piece_stats(x, False, True, "M") * 3
    check(QUANTIZERS["e4m3_pow2"], x, "row piece", rowwise=False, columnwise=True, global_stats=cols, cut="M")


def test_fake_shapes_match_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.hybridq.fp8_rowwise_quantize
    x = torch.randn(96, 160, device="cuda", dtype=torch.bfloat16)
    for directions in [(True, True), (True, False), (False, True)]:
        real = op(x, torch.float8_e4m3fn, 0.0, True, *directions)
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), torch.float8_e4m3fn, 0.0, True, *directions)
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), f"{directions}: {r.shape} vs {f.shape}"


def test_bad_arguments_raise_naming_the_op_and_the_rule():
    op = torch.ops.hybridq.fp8_rowwise_quantize
    x = torch.randn(64, 96, device="cuda")
    with pytest.raises(RuntimeError, match=r"fp8_rowwise_quantize: row_amax needs 64 values"):
        op(x, torch.float8_e4m3fn, 0.0, True, True, False, torch.ones(63, device="cuda"), None)
    with pytest.raises(RuntimeError, match=r"fp8_rowwise_quantize: x must have elements"):
        op(x[:0], torch.float8_e4m3fn, 0.0, True, True, True)
    with pytest.raises(RuntimeError, match=r"fp8 dtype must be"):
        op(x, torch.bfloat16, 0.0, True, True, True)
