"""QuantizedTensor's narrow op surface: aliasing, cloning and device moves keep the parts; every other op
raises and names itself."""

from __future__ import annotations

import pytest
import torch

from hybridq import QuantizedTensor
from hybridq.formats import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer

from _format_cases import DIRECTIONS, FORMATS, assert_parts_bitwise

CASES = {
    **{f: FORMATS[f] for f in ("fp8_e4m3", "fp8blk_128x128_e4m3", "mxfp8_e4m3", "nvfp4_rht", "identity")},
    "hybrid_mxfp8_nvfp4": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
}


def quantized(case):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return CASES[case]().quantize(x, rowwise=True, columnwise=True)


def assert_same_tensor(a: QuantizedTensor, b: QuantizedTensor, what: str):
    assert type(b) is QuantizedTensor, f"{what} returned {type(b).__name__}"
    assert (b.shape, b.dtype, b.device) == (a.shape, a.dtype, a.device)
    for d in DIRECTIONS:
        assert_parts_bitwise(a.part(d), b.part(d), f"{what}: {d} part")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", ["detach", "clone", "to_cpu", "to_cpu_copy", "alias"])
def test_supported_ops_keep_the_parts(case, op):
    t = quantized(case)
    fn = {"detach": lambda t: t.detach(), "clone": lambda t: t.clone(), "to_cpu": lambda t: t.to("cpu"),
          "to_cpu_copy": lambda t: t.to("cpu", copy=True),
          "alias": lambda t: torch.ops.aten.alias.default(t)}[op]
    assert_same_tensor(t, fn(t), op)


@pytest.mark.parametrize("case", list(CASES))
def test_clone_copies_storage_detach_shares_it(case):
    t = quantized(case)
    c, d = t.clone(), t.detach()
    for direction in DIRECTIONS:
        for name, x in t.part(direction).tensors().items():
            if x is None:
                continue
            assert c.part(direction).tensors()[name].data_ptr() != x.data_ptr(), f"clone shares {direction}.{name}"
            assert d.part(direction).tensors()[name].data_ptr() == x.data_ptr(), f"detach copied {direction}.{name}"


def test_same_dtype_to_is_allowed():
    t = quantized("mxfp8_e4m3")
    assert_same_tensor(t, t.to(torch.bfloat16, copy=True), "to(own dtype)")


UNSUPPORTED = {
    "add": (lambda t: t + 1, "aten.add"),
    "mul": (lambda t: t * 2, "aten.mul"),
    "sum": (lambda t: t.sum(), "aten.sum"),
    "view": (lambda t: t.view(-1), "aten.view"),
    "index": (lambda t: t[0], "aten.select"),
    "matmul": (lambda t: t @ torch.ones(96, 4, dtype=torch.bfloat16), "aten."),
    "transpose": (lambda t: t.t(), "aten."),
    "cast fp16": (lambda t: t.to(torch.float16), "float16"),
    "cast fp32": (lambda t: t.float(), "float32"),
}


@pytest.mark.parametrize("case", ["mxfp8_e4m3", "hybrid_mxfp8_nvfp4"])
@pytest.mark.parametrize("op", list(UNSUPPORTED))
def test_unsupported_op_raises_naming_it(case, op):
    fn, needle = UNSUPPORTED[op]
    with pytest.raises(NotImplementedError) as e:
        fn(quantized(case))
    msg = str(e.value)
    assert needle in msg, f"{op}: message {msg!r} does not name the op ({needle!r})"
    assert "dequantize" in msg, f"{op}: message {msg!r} does not point to .dequantize()"


def test_tensor_reports_the_high_precision_shape_dtype_and_usage():
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    t = MXFP8Quantizer().quantize(x, rowwise=False, columnwise=True)
    assert t.shape == (2, 32, 64) and t.dtype == torch.bfloat16
    assert t.usage == "columnwise" and t.has("columnwise") and not t.has("rowwise")
    assert t.formats == (None, "MXFP8")
    assert t.nbytes_quantized() == 64 * 64 + 64 * 2
    with pytest.raises(ValueError, match="direction"):
        t.part("sideways")


def test_quantized_tensor_needs_a_part():
    with pytest.raises(ValueError, match="at least one"):
        QuantizedTensor(None, None, shape=(2, 2), dtype=torch.float32)
