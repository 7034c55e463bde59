"""Several weights' columnwise forms derived in place at once (`Float8Quantizer.derive_parts_into`,
`formats.base.transposed_copies_into`: a `fully_shard` unit's backward unshard, distributed/unit_fill.py [Note: unit
fill]): bitwise what `derive_part_into` writes for each weight alone, every item checked before any is written. On the
CPU one strided copy per weight and one `_foreach_copy_` of the scales; on CUDA the byte transposes in one call of the
extension's list transpose (`hybridq::transpose_bytes_into_list`, GPU tests below)."""

from __future__ import annotations

import pytest
import torch

from _compare import assert_bitwise, assert_parts_bitwise
from _format_cases import FORMATS
from _gpu import gpu
from hybridq.enums import Scaling
from hybridq.formats.base import transposed_copies_into, transposed_copy_into

C = "columnwise"
PER_TENSOR = ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_pow2", "fp8_e5m2_pow2"]
TILES = ["fp8blk_128x128_e4m3"]
BATCHES = [[n] for n in PER_TENSOR + TILES] + [PER_TENSOR]
# a unit's weight shapes (q, k, v, o, up, down of tests/distributed/_unit_cast_jobs.py) and odd ones
SHAPES = [(64, 64), (48, 64), (80, 64), (64, 192), (192, 64), (3, 130), (257, 200), (1, 33)]


def _weight(shape, seed: int, device="cpu", non_finite: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)
    if non_finite:
        flat = w.view(-1)
        for i, v in zip((0, flat.numel() // 2, flat.numel() - 1), ("nan", "inf", "-inf")):
            flat[i] = float(v)
    return w.to(torch.bfloat16).to(device)


def _bytes_of(part) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8).clone() for t in part.tensors().values() if t is not None]


def _items(names, device="cpu"):
    """(quantizer, rowwise part, columnwise part of other values) per shape, the quantizers cycling through `names`
    (one object each, as every Linear has its own), the third weight non-finite."""
    items = []
    for i, shape in enumerate(SHAPES):
        q = FORMATS[names[i % len(names)]]()
        r, _ = q.quantize_parts(_weight(shape, 2 * i, device, non_finite=i == 2), True, True)
        _, into = q.quantize_parts(_weight(shape, 2 * i + 1, device), True, True)
        items.append((q, r, into))
    return items


@pytest.mark.parametrize("names", BATCHES, ids=lambda n: "+".join(n))
def test_derived_at_once_equals_derived_one_by_one(names):
    items = _items(names)
    want = []
    for q, r, into in _items(names):  # (the same values, derived one weight at a time)
        assert q.derive_part_into(r, into, torch.bfloat16)
        want.append(into)
    assert items[0][0].derive_parts_into(items, torch.bfloat16) is True
    for i, ((q, r, into), w) in enumerate(zip(items, want)):
        assert_parts_bitwise(into, w, f"weight {i} {SHAPES[i]} ({q.describe()}): derived at once vs alone")
        assert_parts_bitwise(into, q.derive_part(r, C, torch.bfloat16), f"weight {i}: derived at once vs derive_part")


@pytest.mark.parametrize("bad", ["delayed_scaling", "same_direction", "other_format", "scale_shape"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8blk_128x128_e4m3"])
def test_an_item_not_so_derived_declines_the_batch_before_anything_is_written(name, bad):
    """One item the batch cannot take (the last): False, and no item written (its own `derive_part_into` then
    declines it, or raises naming the shapes)."""
    items = _items([name])
    q, r, into = items[-1]
    if bad == "delayed_scaling":
        if name != "fp8_e4m3":
            q.block_dim = 1  # (1x128 blocks: derived by no transpose)
        else:
            q.scaling = Scaling.DELAYED
    elif bad == "same_direction":
        items[-1] = (q, r, q.quantize_parts(_weight(SHAPES[-1], 99), True, False)[0])
    elif bad == "other_format":
        items[-1] = (FORMATS["fp8_e4m3" if name != "fp8_e4m3" else "fp8blk_128x128_e4m3"](), r, into)
    else:
        into.scale_inv = torch.zeros(2, dtype=into.scale_inv.dtype)
    before = [_bytes_of(i) for _, _, i in items]
    assert items[0][0].derive_parts_into(items, torch.bfloat16) is False, f"{bad}: the batch took it"
    for n, ((_, _, i), b) in enumerate(zip(items, before)):
        assert all(torch.equal(x, y) for x, y in zip(_bytes_of(i), b)), f"{bad}: item {n} written by a declined batch"


def test_transposed_copies_into_checks_every_pair_first():
    """A wrong `out` in the last pair: ValueError naming it (transposed_copy_into's message), the first pair's out not
    written."""
    x = torch.arange(24, dtype=torch.uint8).view(4, 6)
    out0 = torch.zeros(6, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"must be the contiguous transpose of \(4, 6\) torch.uint8"):
        transposed_copies_into([(x, out0), (x, torch.zeros(4, 6, dtype=torch.uint8))])
    assert not out0.any(), "the first pair was written before the second was refused"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bfloat16])
def test_transposed_copies_into_equals_transposed_copy_into(dtype):
    g = torch.Generator().manual_seed(3)
    pairs, want = [], []
    for shape in SHAPES:
        x = torch.randint(0, 256, (shape[0], shape[1] * torch.empty(0, dtype=dtype).element_size()),
                          dtype=torch.uint8, generator=g).view(dtype)
        pairs.append((x, torch.zeros(shape[1], shape[0], dtype=dtype)))
        want.append(transposed_copy_into(x, torch.zeros(shape[1], shape[0], dtype=dtype)))
    transposed_copies_into(pairs)
    for (x, out), w in zip(pairs, want):
        assert_bitwise(out, w, f"transposed_copies_into {tuple(x.shape)} {dtype}")


# ---- GPU: the extension's list transpose ---------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_cuda_list_transpose_equals_reference(dtype):
    """`hybridq::transpose_bytes_into_list` (a unit's weights of several shapes, one call) writes the CPU reference's
    bytes into every buffer and nothing after any of them."""
    from hybridq import dispatch
    g = torch.Generator().manual_seed(4)
    shapes = SHAPES + [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)]
    xs, outs, bases, ref = [], [], [], []
    for shape in shapes:
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
        base = torch.full((shape[0] * shape[1] + 16,), 7, dtype=torch.uint8, device="cuda")
        xs.append(x.cuda())
        outs.append(base[: shape[0] * shape[1]].view(dtype).view(shape[1], shape[0]))
        bases.append(base)
        ref.append(x.t().contiguous())
    assert dispatch.transpose_bytes_into_list(xs, outs), "the extension's list transpose declined the pairs"
    for shape, out, base, want in zip(shapes, outs, bases, ref):
        assert_bitwise(out, want, f"CUDA list transpose {shape} {dtype}")
        assert bool((base[shape[0] * shape[1]:] == 7).all()), f"{shape}: bytes after the buffer were written"


@gpu
def test_cuda_list_transpose_refuses_a_bad_pair_before_launching():
    """A pair that is not a transpose (the last): a RuntimeError naming the pair's index, and the first pair's buffer
    not written."""
    xs = [torch.ones(64, 128, dtype=torch.uint8, device="cuda"), torch.ones(64, 128, dtype=torch.uint8, device="cuda")]
    outs = [torch.zeros(128, 64, dtype=torch.uint8, device="cuda"),
            torch.zeros(64, 128, dtype=torch.uint8, device="cuda")]
    with pytest.raises(RuntimeError, match="pair 1"):
        torch.ops.hybridq.transpose_bytes_into_list(xs, outs)
    assert not bool(outs[0].any()), "the first pair was written before the second was refused"


@gpu
@pytest.mark.parametrize("names", [PER_TENSOR, TILES], ids=lambda n: "+".join(n))
def test_cuda_derived_at_once_equals_reference(names):
    """On CUDA (the kernels' quantization, the list transpose): bitwise each weight's CPU reference derivation."""
    items = _items(names, device="cuda")
    assert items[0][0].derive_parts_into(items, torch.bfloat16) is True
    for i, (q, r, into) in enumerate(items):
        cpu = r.map_tensors(lambda t: t.cpu())
        assert_parts_bitwise(into, FORMATS[names[i % len(names)]]().derive_part(cpu, C, torch.bfloat16),
                             f"weight {i} {SHAPES[i]}: CUDA at once vs CPU reference")
