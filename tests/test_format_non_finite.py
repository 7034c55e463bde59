"""The non-finite rule (docs/numerics.md, "Non-finite values"): a non-finite input value never comes out
finite, dequantized or through any GEMM, in every format, direction and Linear preset."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from _format_cases import DIRECTIONS, FORMATS
from hybridq.gemm import emulated_gemm, gemm
from hybridq.recipe import BACKWARD_OVERRIDE_ENV

VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
M = K = 64
AT = (5, 37)  # the poisoned element


def poisoned(value: float, seed: int = 0) -> torch.Tensor:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[AT] = value
    return x


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_element_dequantizes_non_finite(fmt, direction, value):
    q = FORMATS[fmt]()(poisoned(VALUES[value]), rowwise=direction == "rowwise",
                       columnwise=direction == "columnwise")
    got = q.dequantize(torch.float32, direction=direction)
    assert not torch.isfinite(got[AT]), f"{fmt} {direction}: input {value} at {AT} dequantized to {got[AT].item()}"


@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8blk_1x128_e5m2", "mxfp8_e5m2"])
@pytest.mark.parametrize("value", ["inf", "-inf"])
def test_e5m2_keeps_infinity_and_its_sign(fmt, value):
    got = FORMATS[fmt]()(poisoned(VALUES[value]), rowwise=True, columnwise=False).dequantize(torch.float32)
    assert got[AT].item() == VALUES[value], f"{fmt}: {value} dequantized to {got[AT].item()}"


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_row_touching_a_non_finite_element_is_non_finite(fmt, direction, value):
    """`a @ b^T` with a's poisoned row: every output in that row is non-finite (the emulated GEMM and, for
    operands in the same transformed domain, the product taken there)."""
    kw = dict(rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    a = FORMATS[fmt]()(poisoned(VALUES[value]), **kw).part(direction)
    b = FORMATS[fmt]()(torch.randn(M, K, generator=torch.Generator().manual_seed(1)), **kw).part(direction)
    row = AT[0] if direction == "rowwise" else AT[1]
    for what, out in (("gemm", gemm(a, b, torch.float32)), ("emulated_gemm", emulated_gemm(a, b, torch.float32))):
        bad = torch.isfinite(out[row])
        assert not bad.any(), f"{fmt} {direction} {what}: {int(bad.sum())} finite outputs in row {row} of {value}"


# ---- Linear, every preset ------------------------------------------------------------------------

IN, OUT, TOKENS = 96, 64, 64


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV, raising=False)


def linear(preset: str, dtype: torch.dtype) -> hq.Linear:
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT, dtype=dtype)
    q = hq.Linear(IN, OUT, dtype=dtype, recipe=hq.recipe(preset), name="fc")
    q.load_state_dict(ref.state_dict())
    return q


def step(q: hq.Linear, x: torch.Tensor, gy: torch.Tensor):
    x = x.clone().requires_grad_()
    y = q(x)
    y.backward(gy)
    return y.detach(), x.grad, q.weight.grad


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("preset", hq.preset_names())
def test_linear_non_finite_input_gives_non_finite_output(preset, value, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(TOKENS, IN, generator=g).to(DTYPES[dtype])
    x[3, 17] = VALUES[value]
    y, _, _ = step(linear(preset, DTYPES[dtype]), x, torch.randn(TOKENS, OUT, generator=g).to(DTYPES[dtype]))
    assert not torch.isfinite(y[3]).any(), f"{preset} {dtype}: {value} in input row 3 left y[3] finite somewhere"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("preset", hq.preset_names())
def test_linear_non_finite_grad_output_gives_non_finite_grads(preset, value, dtype):
    """Overflow checks (GradScaler, loss-spike guards) must see a non-finite gradient."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, IN, generator=g).to(DTYPES[dtype])
    gy = torch.randn(TOKENS, OUT, generator=g).to(DTYPES[dtype])
    gy[7, 11] = VALUES[value]
    _, dx, dw = step(linear(preset, DTYPES[dtype]), x, gy)
    assert not torch.isfinite(dx[7]).all(), f"{preset} {dtype}: {value} in grad_output row 7 left dx[7] finite"
    assert not torch.isfinite(dw[11]).all(), f"{preset} {dtype}: {value} in grad_output column 11 left dW[11] finite"
