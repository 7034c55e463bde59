"""QuantizedTensor serialization: pickle and torch.save / torch.load(weights_only=True) give back the same
parts, bit for bit, in every format and direction."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from _format_cases import DIRECTIONS, FORMATS, assert_parts_bitwise
from hybridq import QuantizedTensor


def quantized(fmt: str, rowwise: bool, columnwise: bool) -> QuantizedTensor:
    x = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    return FORMATS[fmt]().quantize(x, rowwise=rowwise, columnwise=columnwise)


def via_pickle(t):
    return pickle.loads(pickle.dumps(t))


def via_torch_save(t):
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["w"]


ROUND_TRIPS = {"pickle": via_pickle, "torch.save/load(weights_only=True)": via_torch_save}
USAGES = {d: (d == "rowwise", d == "columnwise") for d in DIRECTIONS} | {"both": (True, True)}


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bitwise(fmt, usage, how):
    t = quantized(fmt, *USAGES[usage])
    u = ROUND_TRIPS[how](t)
    assert type(u) is QuantizedTensor, f"{fmt} {how}: got {type(u).__name__}"
    assert (u.shape, u.dtype, u.usage) == (t.shape, t.dtype, t.usage), \
        f"{fmt} {how}: {(u.shape, u.dtype, u.usage)} != {(t.shape, t.dtype, t.usage)}"
    assert_parts_bitwise(u.rowwise, t.rowwise, f"{fmt} {how} rowwise")
    assert_parts_bitwise(u.columnwise, t.columnwise, f"{fmt} {how} columnwise")


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_round_trip_keeps_requires_grad(how):
    t = FORMATS["mxfp8_e4m3"]().quantize(torch.randn(32, 32))
    t.requires_grad_(True)
    assert ROUND_TRIPS[how](t).requires_grad


def test_unknown_part_type_names_it():
    from hybridq.tensor import _rebuild_quantized_tensor
    with pytest.raises(ValueError, match="no_such.Part"):
        _rebuild_quantized_tensor({"rowwise": ("no_such.Part", 1, 1, {}, {})}, (1, 1), torch.float32, False)
