"""The compiled Linear's gathered per-tensor FP8 call handed its input already quantized (`hybridq::linear_input_quantize`,
[Note: one dense input quantization in the graph] in hybridq/nn/float8_graph.py): the gathered forward op on the parts
(`hybridq::fp8_linear_fprop`'s x_row / x_row_scale_inv on CUDA, `_fprop` on the parts on the CPU) and the backward op
on the parts the layer's autograd saves give bit for bit what the call quantizing x inside gives -- output, gradients,
and the parts are the tensors that call saved -- for every per-tensor cast case and variant, with the fast path on and
off (the general path, the parts' saved x read by its backward). Bad parts are refused with the rule they broke."""

from __future__ import annotations

import pytest
import torch

from hybridq.enums import ROWWISE
from hybridq.nn import compiled_linear
from hybridq.nn.float8_graph import eager_fast_path

from _compare import assert_bitwise
from test_gathered_phase_ops import IN, OUT, PER_TENSOR_CASES, VARIANTS, _cuda_ready, _run, _setup

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores and the extension")])]


def _parts(s) -> list[torch.Tensor]:
    """x's parts as compiled_linear makes them for this call."""
    dtype, eps, pow2, soi = compiled_linear._shared_input_cast(s.key)
    return torch.ops.hybridq.linear_input_quantize(s.x, dtype, eps, pow2, s.need_wgrad and not soi)


def _run_on_parts(s, parts) -> tuple[dict, list, int]:
    """`_run`'s outputs of the call handed `parts`, the tensors the layer's autograd saves of them, the fast answer."""
    x_row, x_scale_inv, x_col = parts
    out = torch.ops.hybridq.gathered_linear_forward(s.x, s.handle, s.bias, s.key, None, s.need_dgrad, s.need_wgrad,
                                                    [OUT, IN], s.dtype, x_row=x_row, x_scale_inv=x_scale_inv,
                                                    x_col=x_col)
    assert len(out) == 1, f"the op handed x's parts returned {len(out)} tensors, want y alone"
    saved = [x_col, x_scale_inv] if s.need_wgrad and not s.soi else []  # (compiled_linear._setup_context's)
    lkey = compiled_linear._layout_key(s.key, None, s.need_dgrad, s.need_wgrad, s.x.shape, [OUT, IN], s.dtype, True)
    fast = compiled_linear._LAYOUTS[lkey][1]
    dx, dw, db = torch.ops.hybridq.gathered_linear_backward(
        s.dy, s.x if s.need_wgrad and s.soi else None, s.handle, saved, s.key, None, s.need_dgrad, s.need_wgrad,
        s.bias is not None, list(s.x.shape), [OUT, IN], s.dtype, s.dtype, s.dtype)
    return {"output": out[0], "grad_input": dx, "grad_weight": dw, "grad_bias": db}, saved, fast


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "general_path"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", PER_TENSOR_CASES)
def test_call_on_handed_parts_is_bitwise_the_call_quantizing_inside(case, variant, fast_path, device):
    s = _setup(case, variant, device)
    with eager_fast_path(fast_path):
        want, want_fast = _run(s)
        parts = _parts(s)
        got, saved, fast = _run_on_parts(s, parts)
    assert bool(fast) == bool(want_fast) == fast_path, f"{case} {variant}: fast answers {fast} / {want_fast}"
    for name in ("output", "grad_input", "grad_weight", "grad_bias"):
        assert_bitwise(got[name], want[name], f"{case} {variant} on x's parts: {name}")
    want_saved = [want[k] for k in sorted(k for k in want if k.startswith("saved tensor"))]
    assert len(saved) == len(want_saved), f"{case} {variant}: {len(saved)} parts saved, the call saved {len(want_saved)}"
    for i, (a, b) in enumerate(zip(saved, want_saved)):
        assert_bitwise(a, b, f"{case} {variant}: saved part {i} vs the tensor the call quantizing x saved")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nonfinite", ["input", "weight"])
def test_call_on_handed_parts_keeps_non_finite_values(device, nonfinite):
    s = _setup("fp8_tensorwise", "plain", device, nonfinite=nonfinite)
    want, _ = _run(s)
    got, _, _ = _run_on_parts(s, _parts(s))
    for name in ("output", "grad_input", "grad_weight", "grad_bias"):
        assert_bitwise(got[name], want[name], f"non-finite {nonfinite}: {name}", nan_payload=False)


def test_input_quantize_fake_gives_the_real_shapes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(2, 8, 64)
    for columnwise in (True, False):
        real = torch.ops.hybridq.linear_input_quantize(x, torch.float8_e4m3fn, 0.0, False, columnwise)
        with FakeTensorMode() as mode:
            fake = torch.ops.hybridq.linear_input_quantize(mode.from_tensor(x), torch.float8_e4m3fn, 0.0, False,
                                                           columnwise)
        got = [(tuple(t.shape), t.stride(), t.dtype) for t in fake]
        want = [(tuple(t.shape), t.stride(), t.dtype) for t in real]
        assert got == want, f"columnwise={columnwise}: fake {got} vs real {want}"


def test_parts_come_together():
    s = _setup("fp8_tensorwise", "plain", "cpu")
    x_row, x_scale_inv, _ = _parts(s)
    with pytest.raises(ValueError, match="x_row, x_scale_inv and x_col together"):
        torch.ops.hybridq.gathered_linear_forward(s.x, s.handle, s.bias, s.key, None, True, True, [OUT, IN], s.dtype,
                                                  x_row=x_row, x_scale_inv=x_scale_inv)


def test_parts_need_a_handled_weight():
    s = _setup("fp8_tensorwise", "plain", "cpu")
    w = torch.randn(OUT, IN)
    with pytest.raises(ValueError, match="only with a weight read through its handle"):
        torch.ops.hybridq.linear_forward(s.x, w, s.bias, s.key, None, True, True, *_parts(s))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores and the extension")
@pytest.mark.parametrize("bad, rule", [
    ("no scale", "x_row and x_row_scale_inv come together"),
    ("rows", "is not x's rowwise part"),
    ("dtype", "is not x's rowwise part"),
    ("scale shape", "one per-tensor fp32 scale"),
])
def test_cuda_fprop_refuses_parts_that_are_not_x(bad, rule):
    """`hybridq::fp8_linear_fprop` names the handed part and the rule it broke."""
    s = _setup("fp8_tensorwise", "plain", "cuda")
    x_row, x_scale_inv, _ = _parts(s)
    dtype, eps, pow2, _ = compiled_linear._shared_input_cast(s.key)
    wr = s.owner.weight.part(ROWWISE)
    x_row = {"rows": x_row[1:], "dtype": x_row.view(torch.int8)}.get(bad, x_row)
    x_scale_inv = {"no scale": None, "scale shape": x_scale_inv.expand(2).contiguous()}.get(bad, x_scale_inv)
    with pytest.raises(RuntimeError, match=rule):
        torch.ops.hybridq.fp8_linear_fprop(s.x, wr.data, wr.scale_inv, s.bias, dtype, eps, pow2, True, False, False,
                                           x_row, x_scale_inv)
