"""`hybridq::fp8_linear` given the weight already quantized (w_row, w_row_scale_inv, w_col, w_col_scale_inv: how the
eager fast path hands it FSDP2's gathered weight): fprop reads the rowwise part; the C++ node holds the columnwise
tensors by reference and reads them when backward runs -- after FSDP2's backward unshard refilled the storage it
freed at reshard -- giving bit for bit what the op computes quantizing the weight itself. Inconsistent weight parts
are refused before anything runs. (CUDA only: the extension is CUDA-only; the op on FSDP2's real gathered weights
is tests/distributed/test_fsdp_one_op.py.)"""

from __future__ import annotations

import pytest
import torch

from hybridq.nn import float8_graph

from _compare import assert_bitwise

IN, OUT, M = 256, 128, 64
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and float8_graph._cuda_fp8_ready(0)),
    reason="needs a CUDA device with FP8 tensor cores and the extension")]

# x, w, grad_output casts: (dtype, amax epsilon, power-of-2 scales); the weight's differs from the others
CASTS = (E4, 0.0, True, E4, 4.0, False, E5, 0.0, False)


def _op(x, w, bias, need_dgrad=True, need_wgrad=True, weight_parts=(None,) * 4):
    return torch.ops.hybridq.fp8_linear(x, w, bias, None, None, None, None, *CASTS, need_dgrad, need_wgrad, False,
                                        True, *weight_parts)


def _data(seed: int = 0, nonfinite: bool = False):
    g = torch.Generator().manual_seed(seed)
    x, w, b, gy = (torch.randn(*s, generator=g) for s in ((2, M // 2, IN), (OUT, IN), (OUT,), (2, M // 2, OUT)))
    if nonfinite:
        x[0, 0, 0], gy[1, 2, 3] = float("inf"), float("nan")
    return [t.to("cuda", torch.bfloat16) for t in (x, w, b, gy)]


def _run(x, w, b, gy, weight_parts=None, refill=None):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = _op(x, w, b, weight_parts=weight_parts) if weight_parts else _op(x, w, b)
    if refill is not None:
        refill()
    y.backward(gy)
    return [y.detach(), x.grad, w.grad, b.grad]


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_the_columnwise_part_is_read_when_backward_runs(nonfinite):
    x, w, b, gy = _data(nonfinite=nonfinite)
    want = _run(x, w, b, gy)
    # the weight's parts as the op's own cast makes them (what FSDP2's gathered weight holds, bit for bit)
    row, col, s, _ = torch.ops.hybridq.fp8_tensor_quantize(w, CASTS[3], None, None, CASTS[4], CASTS[5], True, True,
                                                           False)
    # the columnwise tensors as FSDP2 leaves them after forward: storage freed at reshard
    w_col, w_col_s = torch.empty_like(col), torch.empty_like(s)
    for t in (w_col, w_col_s):
        t.untyped_storage().resize_(0)

    def backward_unshard():  # refills the same tensors in place (storage allocated, bytes copied)
        for t, src in ((w_col, col), (w_col_s, s)):
            t.untyped_storage().resize_(src.numel() * src.element_size())
            t.copy_(src)

    got = _run(x, w, b, gy, weight_parts=(row, s, w_col, w_col_s), refill=backward_unshard)
    for name, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert_bitwise(a, e, f"weight given quantized, {name}", nan_payload=nonfinite)


def test_the_op_refuses_inconsistent_weight_parts():
    x, w, b, _ = _data()
    row, col, s, _ = torch.ops.hybridq.fp8_tensor_quantize(w, CASTS[3], None, None, CASTS[4], CASTS[5], True, True,
                                                           False)
    bad = {
        "w_row given without w_row_scale_inv": (row, None, col, s),
        "w_col given without w_col_scale_inv": (row, s, col, None),
        "w_col given without w_row": (None, None, col, s),
        r"a quantized weight needs its columnwise part \(w_col\) for dgrad": (row, s, None, None),
        r"w_row is \[128, 128\] Float8_e4m3fn, the weight's rowwise part must be \[128, 256\] Float8_e4m3fn":
            (row[:, :128], s, col, s),
        r"w_col is \[256, 128\] Float8_e5m2, the weight's columnwise part must be \[256, 128\] Float8_e4m3fn":
            (row, s, col.view(E5), s),
    }
    for message, parts in bad.items():
        with pytest.raises(RuntimeError, match=f"hybridq::fp8_linear: {message}"):
            _op(x, w, b, weight_parts=parts)
    _op(x, w, b, need_dgrad=False, weight_parts=(row, s, None, None))  # no dgrad: no columnwise part needed
