"""Per-tensor FP8 of equal row groups (`hybridq.formats.float8_groups`, the batched quantization of a grouped
weight's experts under FSDP2): bitwise each group quantized alone by `Float8Quantizer.quantize_parts`, with its own
amax or a given one, on random and adversarial groups; the CUDA path (grouped kernel) bitwise the per-group one."""

from __future__ import annotations

import pytest
import torch

from hybridq.formats._stacking import stacked_view
from hybridq.formats import COLUMNWISE, ROWWISE
from hybridq.formats.float8_groups import (derive_columnwise_groups, equal_groups_apply, group_amax, group_parts,
                                           quantize_equal_groups)

from _compare import assert_bitwise
from _format_cases import FORMATS

# the per-tensor FP8 cases of the one case list that batch (current scaling)
CASES = [n for n, f in FORMATS.items() if equal_groups_apply([f()])]
HAVE_CUDA = torch.cuda.is_available()


def _groups(device="cpu", dtype=torch.bfloat16) -> torch.Tensor:
    """6 groups of 5 x 32: random at different magnitudes, all zeros, a NaN, an inf, beyond FP8's range, tiny."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, 32, generator=g) * torch.logspace(-3, 3, 6).view(6, 1, 1)
    x[1] = 0
    x[2, 1, 3] = float("nan")
    x[3, 4, 0] = float("-inf")
    x[4] *= 1e6
    x[5] = x[5] * 1e-30
    return x.to(device=device, dtype=dtype)


def _per_group(q, x, amax=None):
    return [q.quantize_parts(x[e], True, True, **({} if amax is None else {"stats": amax[e:e + 1]}))
            for e in range(x.shape[0])]


def test_the_cases_are_per_tensor_fp8():
    assert set(CASES) >= {"fp8_e4m3", "fp8_e5m2", "fp8_e4m3_pow2"}, CASES
    assert not equal_groups_apply([FORMATS["mxfp8_e4m3"]()])
    assert not equal_groups_apply([FORMATS["fp8_e4m3"](), FORMATS["fp8_e5m2"]()]), "different quantizers"


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("given", [False, True], ids=["own_amax", "given_amax"])
def test_equal_groups_are_each_group_quantized_alone(name, given):
    q = FORMATS[name]()
    x = _groups()
    amax = group_amax(x) * 2 if given else None  # (a reduced amax is larger than the local one)
    data, scale_inv = quantize_equal_groups(q, x, amax)
    for e, (r, c) in enumerate(_per_group(q, x, amax)):
        assert_bitwise(data[e], r.data, f"{name} group {e} data")
        assert_bitwise(scale_inv[e:e + 1], r.scale_inv, f"{name} group {e} scale_inv")
        parts = group_parts(data, scale_inv, 0, x.shape[0])
        assert_bitwise(parts[e].data, r.data, f"{name} group {e} part")


def test_group_parts_of_groups_held_elsewhere_are_empty_with_their_scale():
    q = FORMATS["fp8_e4m3"]()
    x = _groups()
    data, scale_inv = quantize_equal_groups(q, x[2:4])
    parts = group_parts(data, scale_inv.repeat(3), 2, 6)
    assert [p.rows for p in parts] == [0, 0, 5, 5, 0, 0]
    assert all(p.scale_inv.data_ptr() % 16 == 0 for p in parts), "scale pointers 16-byte aligned"


def test_derived_columnwise_groups_are_the_per_group_transposes():
    q = FORMATS["fp8_e5m2"]()
    x = _groups()
    data, scale_inv = quantize_equal_groups(q, x)
    rows = group_parts(data, scale_inv, 0, 6)
    slab, scales = torch.empty(6 * 160, dtype=data.dtype), torch.empty(6, 4)  # (one allocation per kind)
    cols = [q.derive_part(r, COLUMNWISE) for r in rows]
    own = [type(c)(rows=c.rows, cols=c.cols, columnwise=True, data=slab[e * 160:(e + 1) * 160].view(32, 5),
                   scale_inv=scales[e, :1]) for e, c in enumerate(cols)]
    assert derive_columnwise_groups(rows, own)
    for e, (want, got) in enumerate(zip(cols, own)):
        assert_bitwise(got.data, want.data, f"group {e} columnwise data")
        assert_bitwise(got.scale_inv, want.scale_inv, f"group {e} columnwise scale_inv")


def test_stacked_view_only_for_equally_spaced_non_overlapping_views():
    base = torch.arange(48.)
    views = [base[i * 16:i * 16 + 12].view(3, 4) for i in range(3)]
    s = stacked_view(views)
    assert s is not None and s.shape == (3, 3, 4)
    assert all(torch.equal(s[i], v) for i, v in enumerate(views))
    assert stacked_view([base[0:12], base[12:24], base[30:42]]) is None, "unequal spacing"
    assert stacked_view([base[0:12], base[6:18]]) is None, "overlapping"
    assert stacked_view([base[0:4], torch.arange(4.)]) is None, "two storages"


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("given", [False, True], ids=["own_amax_kernel", "given_amax"])
def test_equal_groups_on_cuda_are_the_per_group_quantization(name, given):
    """The grouped kernel (own amaxes) and the batched path with given amaxes, against quantize_parts per group on
    the device (the per-expert path of the FSDP2 gather)."""
    q = FORMATS[name]()
    x = _groups("cuda")
    amax = group_amax(x) * 2 if given else None
    data, scale_inv = quantize_equal_groups(q, x, amax)
    # With given amaxes the batched path is the reference's arithmetic on the device: a NaN it makes is the GPU's
    # canonical (positive) NaN where the kernel keeps the input NaN's sign, so NaN bytes are compared by position
    # (as their exact fp32 values: every other byte still bit for bit).
    for e, (r, _) in enumerate(_per_group(q, x, amax)):
        if given:
            assert_bitwise(data[e].float(), r.data.float(), f"{name} group {e} data (cuda)", nan_payload=True)
        else:
            assert_bitwise(data[e], r.data, f"{name} group {e} data (cuda)")
        assert_bitwise(scale_inv[e:e + 1], r.scale_inv, f"{name} group {e} scale_inv (cuda)")
