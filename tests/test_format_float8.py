"""Per-tensor FP8 (docs/numerics.md "Per-tensor FP8 (current, delayed)")."""

from __future__ import annotations

import math

import pytest
import torch

from hybridq.formats import Float8Quantizer, Float8TensorPart

from _format_cases import FLT_MAX, assert_bitwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {"e4m3": (E4M3, 448.0), "e5m2": (E5M2, 57344.0)}


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def fp8(values, dtype) -> torch.Tensor:
    """Expected fp8 tensor from exactly representable values."""
    t = f32(values)
    q = t.to(dtype)
    assert torch.equal(q.float(), t) or torch.isnan(t).any(), f"test bug: {values} not exact in {dtype}"
    return q


def quantize_rw(q, x):
    return q.quantize(x, rowwise=True, columnwise=False).rowwise


# ---- current scaling -----------------------------------------------------------------------------

def test_defaults_are_e4m3_current_scaling():
    q = Float8Quantizer()
    assert q.dtype == E4M3 and q.scaling == "current" and not q.is_stateful


def test_current_scaling_hand_case_exact_scale():
    """amax 7 -> scale 448/7 = 64; q = x * 64; scale_inv = 1/64."""
    x = f32([[1.0, -2.0, 3.5], [0.25, 0.0, -7.0]])
    p = quantize_rw(Float8Quantizer(), x)
    assert isinstance(p, Float8TensorPart)
    assert_bitwise(p.data, fp8([[64.0, -128.0, 224.0], [16.0, 0.0, -448.0]], E4M3), "data")
    assert_bitwise(p.scale_inv, f32([1 / 64]), "scale_inv")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_current_scaling_inexact_scale_follows_fp32_rule(fmt):
    """amax 3: scale = fp32(fp8_max / 3), q = satfinite(x * scale), scale_inv = rcp_rn(scale)."""
    dtype, fmax = FP8[fmt]
    x = f32([[3.0, -1.0, 0.1, 2.9]])
    p = quantize_rw(Float8Quantizer(fp8=fmt), x)
    scale = f32([fmax]) / f32([3.0])
    assert_bitwise(p.data, (x * scale).clamp(-fmax, fmax).to(dtype), "data")
    assert_bitwise(p.scale_inv, torch.ones(1) / scale, "scale_inv")
    assert p.data.float()[0, 0].item() == fmax, "amax maps to fp8_max"


def test_current_scaling_power_2_scale_rounds_down():
    """amax 3: 448/3 = 149.33 -> 128; scale_inv = 2^-7; nothing saturates."""
    x = f32([[3.0, -1.0, 0.5]])
    p = quantize_rw(Float8Quantizer(power_2_scale=True), x)
    assert_bitwise(p.data, fp8([[384.0, -128.0, 64.0]], E4M3), "data")
    assert_bitwise(p.scale_inv, f32([2.0 ** -7]), "scale_inv")


def test_current_scaling_amax_epsilon():
    """amax 1e-6 < eps 1e-3 -> amax := eps; scale = 448 / eps."""
    x = f32([[1e-6, -5e-7]])
    p = quantize_rw(Float8Quantizer(amax_epsilon=1e-3), x)
    scale = f32([448.0]) / f32([1e-3])
    assert_bitwise(p.scale_inv, torch.ones(1) / scale, "scale_inv")
    assert_bitwise(p.data, (x * scale).to(E4M3), "data")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_zeros_give_scale_1_and_zero_bytes(fmt):
    p = quantize_rw(Float8Quantizer(fp8=fmt), torch.zeros(4, 8))
    assert_bitwise(p.scale_inv, f32([1.0]), "scale_inv")
    assert not p.data.view(torch.uint8).any(), "zero input must give zero bytes"


def test_fp32_subnormal_amax_gives_flt_max_scale():
    """amax 2^-149: 448 / amax = inf -> FLT_MAX; scale_inv = rcp_rn(FLT_MAX); 2^-149 * FLT_MAX ~ 2^-21 -> 0."""
    x = f32([[2.0 ** -149, 0.0]])
    p = quantize_rw(Float8Quantizer(), x)
    assert_bitwise(p.scale_inv, torch.ones(1) / f32([FLT_MAX]), "scale_inv")
    assert not p.data.view(torch.uint8).any()


@pytest.mark.parametrize("fmt,values", [
    ("e4m3", [448.0, 2.0 ** -9, -(2.0 ** -9), 2.0 ** -10, 3 * 2.0 ** -10, 7 * 2.0 ** -9]),
    ("e5m2", [57344.0, 2.0 ** -16, -(2.0 ** -16), 2.0 ** -17, 3 * 2.0 ** -17, 3 * 2.0 ** -16]),
], ids=["e4m3", "e5m2"])
def test_fp8_subnormals_round_to_nearest_even(fmt, values):
    """amax = fp8_max -> scale 1; subnormal targets: exact, half-min ties to 0, 1.5*min ties to 2*min."""
    dtype, fmax = FP8[fmt]
    p = quantize_rw(Float8Quantizer(fp8=fmt), f32([values]))
    m = values[1]
    expected = [fmax, m, -m, 0.0, 2 * m, values[5]]
    assert p.data.float()[0].tolist() == expected


# the bytes of +inf / -inf after the FP8 element conversion (docs/numerics.md, "Non-finite values")
INF_BYTES = {"e4m3": (0x7F, 0xFF), "e5m2": (0x7C, 0xFC)}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_inf_input_scale_1_inf_stays_non_finite(fmt):
    """amax inf -> scale 1; +-inf becomes E5M2 +-inf / E4M3 NaN with its sign; finite values cast unscaled
    (large ones saturate)."""
    dtype, fmax = FP8[fmt]
    x = f32([[math.inf, -math.inf, 1.5, 1e6]])
    p = quantize_rw(Float8Quantizer(fp8=fmt), x)
    assert_bitwise(p.scale_inv, f32([1.0]), "scale_inv")
    assert p.data.view(torch.uint8)[0, :2].tolist() == list(INF_BYTES[fmt])
    assert p.data.float()[0, 2:].tolist() == [1.5, fmax]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_nan_input_scale_1_nan_stays_in_place(fmt):
    """amax NaN -> scale 1; the NaN element stays NaN; other elements cast unscaled."""
    dtype, fmax = FP8[fmt]
    x = f32([[math.nan, 2.0, -0.5]])
    t = Float8Quantizer(fp8=fmt).quantize(x, rowwise=True, columnwise=True)
    assert_bitwise(t.rowwise.scale_inv, f32([1.0]), "scale_inv")
    d = t.dequantize()
    assert math.isnan(d[0, 0].item()) and d[0, 1:].tolist() == [2.0, -0.5]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_columnwise_is_exact_byte_transpose(fmt):
    x = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * 10
    t = Float8Quantizer(fp8=fmt).quantize(x, rowwise=True, columnwise=True)
    r, c = t.rowwise, t.columnwise
    assert (c.rows, c.cols, c.columnwise) == (80, 48, True)
    assert_bitwise(c.data, r.data.t().contiguous(), "columnwise data vs rowwise data^T")
    assert_bitwise(c.scale_inv, r.scale_inv, "columnwise scale_inv vs rowwise")


def test_global_amax_override():
    """`amax=` (a sharded tensor's global amax) replaces the local max|x|."""
    x = f32([[1.0, -2.0]])
    row, _ = Float8Quantizer().reference_parts(x, True, False, amax=f32(8.0))
    assert_bitwise(row.scale_inv, torch.ones(1) / (f32([448.0]) / f32([8.0])), "scale_inv")
    assert row.data.float()[0].tolist() == [56.0, -112.0]


# ---- delayed scaling -----------------------------------------------------------------------------

def delayed(**kw) -> Float8Quantizer:
    return Float8Quantizer(scaling="delayed", **kw)


def const(amax: float, n: int = 8) -> torch.Tensor:
    x = torch.full((2, n), amax / 4)
    x[1, 3] = -amax
    return x


def test_delayed_first_cast_uses_scale_1():
    q = delayed(amax_history_len=4)
    x = f32([[3.0, -100.0, 0.3]])
    p = quantize_rw(q, x)
    assert_bitwise(p.scale_inv, f32([1.0]), "scale_inv")
    assert_bitwise(p.data, x.to(E4M3), "data = satfinite(x * 1)")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_saturates_values_above_the_previous_range(fmt):
    """Step 1 sets scale = fp8_max / 2; step 2's larger values saturate to +-fp8_max (E5M2: not inf)."""
    dtype, fmax = FP8[fmt]
    q = delayed(fp8=fmt, amax_history_len=2)
    quantize_rw(q, f32([[2.0, -1.0]]))
    p = quantize_rw(q, f32([[100.0, -3.0, 1.0]]))
    assert_bitwise(p.scale_inv, torch.ones(1) / (f32([fmax]) / f32([2.0])), "scale_inv")
    assert p.data.float()[0].tolist() == [fmax, -fmax, fmax / 2]


def test_delayed_records_amax_in_history_0():
    q = delayed(amax_history_len=3)
    quantize_rw(q, const(5.0))
    assert q.amax_history.tolist() == [5.0, 0.0, 0.0], "the cast records its amax into history[0]"
    assert q.scale.tolist() == [1.0], "the scale changes only at the update"
    q.update()
    assert q.amax_history.tolist() == [0.0, 0.0, 5.0], "update rolls by -1 and zeroes history[0]"
    quantize_rw(q, const(3.0))
    assert q.amax_history.tolist() == [3.0, 0.0, 5.0]


def expected_delayed_run(amaxes, algo, margin, length, fp8_max=448.0):
    """docs/numerics.md "Per-tensor FP8 (current, delayed)" by hand: (scale used by each cast, history after each update, scale after)."""
    hist = [0.0] * length
    scale = f32([1.0])
    used, hists, scales = [], [], []
    for a in amaxes:
        used.append(scale.clone())
        hist[0] = max(hist[0], a)
        amax = max(hist) if algo == "max" else hist[0]
        hist = hist[1:] + hist[:1]
        hist[0] = 0.0
        if amax > 0 and math.isfinite(amax):
            s = (f32([fp8_max]) / f32([amax])) / f32([2.0 ** margin])
            scale = torch.where(torch.isinf(s), f32([FLT_MAX]), s)
        hists.append(list(hist))
        scales.append(scale.clone())
    return used, hists, scales


DELAYED_RUNS = {
    # amaxes per step; the first is the largest so dropping it out of the window is visible
    "window": [8.0, 2.0, 4.0, 1.0, 3.0],
    "rising": [1.0, 2.0, 5.0, 7.0],
    "zero step keeps scale": [4.0, 0.0, 0.0, 2.0],
    "tiny amax -> FLT_MAX": [4.0, 2.0 ** -149, 2.0 ** -149, 2.0 ** -149, 1.0],
}


@pytest.mark.parametrize("run", list(DELAYED_RUNS), ids=list(DELAYED_RUNS))
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_update_rule_against_hand_computation(run, algo, margin):
    amaxes = DELAYED_RUNS[run]
    length = 3
    q = delayed(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    used, hists, scales = expected_delayed_run(amaxes, algo, margin, length)
    for step, a in enumerate(amaxes):
        p = quantize_rw(q, const(a))
        assert_bitwise(p.scale_inv, torch.ones(1) / used[step], f"step {step}: scale_inv of the cast")
        q.update()
        assert q.amax_history.tolist() == hists[step], \
            f"step {step}: history {q.amax_history.tolist()} != hand {hists[step]}"
        assert_bitwise(q.scale, scales[step], f"step {step}: scale after update")


def test_delayed_inf_scale_becomes_flt_max():
    q = delayed(amax_history_len=1)
    quantize_rw(q, f32([[2.0 ** -149]]))
    q.update()
    assert q.scale.item() == FLT_MAX


@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan], ids=["zero", "inf", "nan"])
def test_delayed_keeps_previous_scale_on_degenerate_amax(bad):
    q = delayed(amax_history_len=1, amax_compute_algo="most_recent")
    quantize_rw(q, f32([[4.0]]))
    q.update()
    before = q.scale.clone()
    assert before.item() == 112.0
    quantize_rw(q, f32([[bad, 0.0]]))
    q.update()
    assert_bitwise(q.scale, before, f"scale after an amax of {bad}")


def test_delayed_implicit_update_before_next_cast_equals_explicit_update():
    a, b = delayed(amax_history_len=3), delayed(amax_history_len=3)
    for step, amax in enumerate([3.0, 9.0, 1.0, 2.0]):
        pa = quantize_rw(a, const(amax))
        pb = quantize_rw(b, const(amax))
        b.update()
        assert_bitwise(pa.data, pb.data, f"step {step}: data")
        assert_bitwise(pa.scale_inv, pb.scale_inv, f"step {step}: scale_inv")


def test_current_scaling_update_is_a_no_op():
    q = Float8Quantizer()
    q.quantize(const(5.0))
    q.update()
    assert q.scale.tolist() == [1.0] and not q.amax_history.any()


@pytest.mark.parametrize("kw,msg", [({"scaling": "dynamic"}, "scaling"),
                                    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
                                    ({"amax_history_len": 0}, "amax_history_len"),
                                    ({"fp8": "e3m4"}, "e3m4")])
def test_invalid_config_is_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Float8Quantizer(**kw)
