"""A direction derived in place (`ShardableQuantizer.derive_part_into`, `formats.base.transposed_copy_into`): the part
`derive_part` gives, written into a given part's own tensors -- the unsharded weight's buffers FSDP2 allocated
(distributed/buffers.py [Note: replayed fill]) -- bit for bit, or False with nothing written. On the CPU the strided
copy; on CUDA 1-byte data goes through the extension's tiled transpose into the buffer (`transpose_bytes_into`,
GPU tests below)."""

from __future__ import annotations

import pytest
import torch

from _compare import assert_bitwise, assert_parts_bitwise
from _format_cases import FORMATS, hybrid
from _gpu import gpu
from hybridq.formats.base import transposed_copy, transposed_copy_into

R, C = "rowwise", "columnwise"
# every case of tests/_format_cases.py and two hybrids: (name, factory)
CASES = {**FORMATS, "hyb_fp8_fp8": hybrid("fp8_e4m3", "fp8_e4m3"), "hyb_fp8_identity": hybrid("fp8_e4m3", "identity")}
# those whose columnwise form is derived in place: per-tensor FP8 with current scaling, 128x128 tiles
IN_PLACE = {"fp8_e4m3", "fp8_e5m2", "fp8_e4m3_pow2", "fp8_e5m2_pow2", "fp8blk_128x128_e4m3", "hyb_fp8_fp8"}
SHAPES = [(64, 128), (3, 130), (257, 200), (1, 33)]


def _weight(shape, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)
    return w.to(torch.bfloat16).to(device)


def _non_finite(shape, seed: int, device="cpu") -> torch.Tensor:
    w = _weight(shape, seed, device)
    flat = w.view(-1)
    for i, v in zip((0, flat.numel() // 2, flat.numel() - 1), ("nan", "inf", "-inf")):
        flat[i] = float(v)
    return w


def _parts(q, w):
    try:
        r, c = q.quantize_parts(w, True, True)
    except Exception:  # noqa: BLE001 - a shape the format cannot take both ways
        return None, None
    return r, c


def _bytes_of(part) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8).clone() for t in part.tensors().values() if t is not None]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_derived_in_place_equals_derived(name, shape):
    """Into the columnwise part of another weight (same shape, other values): the bytes `derive_part` gives, bitwise;
    or, for a format that derives nothing in place, False and the part untouched."""
    q = CASES[name]()
    r, _ = _parts(q, _weight(shape, seed=1))
    _, into = _parts(q, _weight(shape, seed=2))
    if r is None or into is None:
        pytest.skip(f"{name} takes no {shape} weight in both directions")
    before = _bytes_of(into)
    done = q.derive_part_into(r, into, torch.bfloat16)
    assert done == (name in IN_PLACE), f"{name}: derive_part_into returned {done}, expected {name in IN_PLACE}"
    if not done:
        assert all(torch.equal(a, b) for a, b in zip(_bytes_of(into), before)), f"{name}: declined but wrote"
        return
    assert_parts_bitwise(into, q.derive_part(r, C, torch.bfloat16), f"{name} {shape}: derived in place")


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_derived_in_place_keeps_non_finite(name):
    """NaN / inf in the weight: the in-place derivation copies the bytes as they are (NaN stays NaN)."""
    q = CASES[name]()
    w = _non_finite((130, 257), seed=3)
    r, _ = _parts(q, w)
    _, into = _parts(q, _weight((130, 257), seed=4))
    assert q.derive_part_into(r, into, torch.bfloat16)
    want = q.derive_part(r, C, torch.bfloat16)
    assert_parts_bitwise(into, want, f"{name}: non-finite weight derived in place")
    assert torch.isnan(into.data.float()).any(), f"{name}: no NaN left in the derived data"


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_derived_in_place_from_the_same_direction_declines(name):
    """Asked to derive a part of the direction it already is: False, nothing written."""
    q = CASES[name]()
    r, _ = _parts(q, _weight((64, 128), seed=5))
    r2, _ = _parts(q, _weight((64, 128), seed=6))
    before = _bytes_of(r2)
    assert q.derive_part_into(r, r2, torch.bfloat16) is False
    assert all(torch.equal(a, b) for a, b in zip(_bytes_of(r2), before)), f"{name}: declined but wrote"


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_derived_in_place_refuses_a_part_of_another_shape(name):
    """A part of another shape: ValueError naming the shapes, before anything is written."""
    q = CASES[name]()
    r, _ = _parts(q, _weight((64, 128), seed=7))
    _, into = _parts(q, _weight((128, 256), seed=8))
    before = _bytes_of(into)
    with pytest.raises(ValueError, match=r"\(256, 128\)|\(2, 1\)"):
        q.derive_part_into(r, into, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(_bytes_of(into), before)), f"{name}: refused but wrote"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (3, 130), (257, 200), (1, 33), (77, 1)], ids=str)
def test_transposed_copy_into_equals_transposed_copy(shape, dtype):
    g = torch.Generator().manual_seed(9)
    x = torch.randint(0, 256, (shape[0], shape[1] * torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8,
                      generator=g).view(dtype)
    out = torch.full((shape[1], shape[0]), 0, dtype=dtype)
    assert transposed_copy_into(x, out) is out
    assert_bitwise(out, transposed_copy(x), f"transposed_copy_into {shape} {dtype}")


@pytest.mark.parametrize("bad", ["shape", "dtype", "strides"])
def test_transposed_copy_into_refuses_a_wrong_out(bad):
    x = torch.zeros(4, 6, dtype=torch.uint8)
    out = {"shape": torch.zeros(4, 6, dtype=torch.uint8), "dtype": torch.zeros(6, 4, dtype=torch.int8),
           "strides": torch.zeros(4, 6, dtype=torch.uint8).t()}[bad]
    with pytest.raises(ValueError, match=r"must be the contiguous transpose of \(4, 6\) torch.uint8"):
        transposed_copy_into(x, out)


# ---- GPU: the extension's tiled transpose into a given buffer -----------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(4096, 11008), (128, 64), (3, 130), (257, 200), (130, 257), (1, 33), (77, 1),
                                   (50257 // 7, 48)], ids=str)
def test_cuda_transposed_copy_into_equals_reference(shape, dtype):
    """The tiled kernel (2-D, into a given buffer) writes the CPU reference's bytes, and nothing but the buffer: the
    bytes after it in its storage stay as they were."""
    from hybridq import dispatch
    g = torch.Generator().manual_seed(10)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
    base = torch.full((shape[0] * shape[1] + 16,), 7, dtype=torch.uint8, device="cuda")
    out = base[: shape[0] * shape[1]].view(dtype).view(shape[1], shape[0])
    xg = x.cuda()
    assert dispatch.transpose_bytes_into(xg, torch.empty_like(out)), \
        f"{shape} {dtype}: the extension's transpose declined the 2-D call transposed_copy_into makes"
    transposed_copy_into(xg, out)
    assert_bitwise(out, x.t().contiguous(), f"CUDA transposed_copy_into {shape} {dtype}")
    assert bool((base[shape[0] * shape[1]:] == 7).all()), f"{shape}: bytes after the buffer were written"


@gpu
@pytest.mark.parametrize("shape", SHAPES + [(2048, 2048), (4096, 11008)], ids=str)
@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_cuda_derived_in_place_equals_reference(name, shape):
    """On CUDA (the kernels' quantization, the tiled transpose into the buffer): bitwise `derive_part` on CUDA and the
    CPU reference's derivation of the same rowwise part, non-finite values included."""
    q = CASES[name]()
    w = _non_finite(shape, seed=11, device="cuda")
    r, _ = _parts(q, w)
    _, into = _parts(q, _weight(shape, seed=12, device="cuda"))
    assert q.derive_part_into(r, into, torch.bfloat16)
    assert_parts_bitwise(into, q.derive_part(r, C, torch.bfloat16), f"{name} {shape}: CUDA in place vs CUDA fresh")
    cpu = r.map_tensors(lambda t: t.cpu())
    assert_parts_bitwise(into, CASES[name]().derive_part(cpu, C, torch.bfloat16), f"{name} {shape}: CUDA vs CPU")


# ---- every expert at once (`ShardableQuantizer.derive_experts_into`: FSDP2's stacked block experts) ----------------

# (name, factory) of the cases above plus two equal 128x128-tile quantizers as a hybrid
EXPERT_CASES = {**CASES, "hyb_fp8blk_128x128": hybrid("fp8blk_128x128_e4m3", "fp8blk_128x128_e4m3")}
# those that derive every expert's columnwise form at once: 128x128 tiles (the transposes), alone or as both directions
AT_ONCE = {"fp8blk_128x128_e4m3", "hyb_fp8blk_128x128"}
EXPERTS = 3


def _experts(q, shape, seed: int, device="cpu"):
    """Each expert's (rowwise, columnwise) parts of a weight `[EXPERTS, *shape]` (expert 1 non-finite), or None."""
    out = []
    for g in range(EXPERTS):
        w = _non_finite(shape, seed + g, device) if g == 1 else _weight(shape, seed + g, device)
        r, c = _parts(q, w)
        if r is None or c is None:
            return None
        out.append((r, c))
    return out


def _slotted(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`[E, ...]` views of the experts' tensors laid out one per slot with a gap after each (the all-gather output's
    slots: an expert stride that is not the tensor's size)."""
    t0 = tensors[0]
    gap = 16 // t0.element_size()
    base = torch.zeros(len(tensors), t0.numel() + gap, dtype=t0.dtype, device=t0.device)
    for g, t in enumerate(tensors):
        base[g, :t.numel()] = t.reshape(-1)
    return base[:, :t0.numel()].view(len(tensors), *t0.shape)


def _stacked(parts, slotted: bool) -> dict[str, torch.Tensor]:
    names = [n for n, t in parts[0].tensors().items() if t is not None]
    join = _slotted if slotted else torch.stack
    return {n: join([p.tensors()[n].contiguous() for p in parts]) for n in names}


def _same_bytes(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a)


def _derive_experts_case(name, shape, device):
    q = EXPERT_CASES[name]()
    experts, others = _experts(q, shape, 20, device), _experts(q, shape, 40, device)
    if experts is None or others is None:
        pytest.skip(f"{name} takes no {shape} weight in both directions")
    rows = _stacked([r for r, _ in experts], slotted=True)
    cols = _stacked([c for _, c in others], slotted=False)  # (another weight's: every byte must be overwritten)
    before = {n: t.clone() for n, t in cols.items()}
    done = q.derive_experts_into(rows, cols, torch.bfloat16)
    return q, experts, cols, before, done


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_experts_derived_at_once_equal_each_experts_derivation(name, shape):
    """From the experts' rowwise tensors as the all-gather's slots hold them (an expert stride with a gap) into
    stacked columnwise buffers of other values: each expert's bytes of `derive_part`, bitwise (non-finite values
    kept); or, for a format that does not derive experts at once, False and the buffers untouched."""
    q, experts, cols, before, done = _derive_experts_case(name, shape, "cpu")
    assert done == (name in AT_ONCE), f"{name}: derive_experts_into returned {done}, expected {name in AT_ONCE}"
    if not done:
        assert _same_bytes(cols, before), f"{name}: declined but wrote"
        return
    for g, (r, _) in enumerate(experts):
        want = q.derive_part(r, C, torch.bfloat16)
        for n, t in want.tensors().items():
            if t is not None:
                assert_bitwise(cols[n][g], t, f"{name} {shape}: expert {g} {n} derived at once")


@pytest.mark.parametrize("name", sorted(AT_ONCE))
def test_experts_derived_at_once_refuse_buffers_of_another_shape(name):
    """Columnwise buffers that are not the per-expert transposes: ValueError naming the tensor, nothing written."""
    q = EXPERT_CASES[name]()
    rows = _stacked([r for r, _ in _experts(q, (128, 256), 50)], slotted=True)
    cols = _stacked([c for _, c in _experts(q, (256, 256), 60)], slotted=False)
    before = {n: t.clone() for n, t in cols.items()}
    with pytest.raises(ValueError, match=r"columnwise data \(3, 256, 256\).*transpose of the rowwise one's"):
        q.derive_experts_into(rows, cols, torch.bfloat16)
    assert _same_bytes(cols, before), f"{name}: refused but wrote"


@gpu
@pytest.mark.parametrize("shape", [(128, 256), (130, 257), (2048, 1024), (1024, 2048)], ids=str)
@pytest.mark.parametrize("name", sorted(AT_ONCE))
def test_cuda_experts_derived_at_once_equal_each_experts_derivation(name, shape):
    """On CUDA (one launch of the tiled transpose over the slots' expert stride): each expert's `derive_part` on
    CUDA, bitwise, non-finite values kept."""
    q, experts, cols, _, done = _derive_experts_case(name, shape, "cuda")
    assert done, f"{name}: derive_experts_into declined on CUDA"
    for g, (r, _) in enumerate(experts):
        for n, t in q.derive_part(r, C, torch.bfloat16).tensors().items():
            if t is not None:
                assert_bitwise(cols[n][g], t, f"{name} {shape} CUDA: expert {g} {n} derived at once")
