"""An expert module that was not converted (`hybridq.grouped_mm` before `convert_experts`: the bf16 MoE baseline)
computes its grouped product as torchtitan's experts do: on CUDA sm_90+ with a bf16 input one `torch._grouped_mm` for
all experts, group ends on the device (no host sync with device counts); elsewhere one matmul per expert (the CPU
test of that is test_grouped_linear.py's `test_expert_protocol_before_conversion_is_high_precision`)."""

import pytest
import torch
import torch.nn as nn

import hybridq as hq

from _dispatch import OpLog
from _gpu import no_host_sync

E, IN, OUT = 4, 64, 96
SPLITS = [40, 0, 17, 71]  # an expert without tokens, counts not multiples of 16

gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                                reason="needs a CUDA sm_90+ device")


class Experts(nn.Module):
    hybridq_grouped_weights = ("w",)

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, OUT, IN) / IN ** 0.5)

    def forward(self, x, m_splits):
        return hq.grouped_mm(self, "w", x, m_splits)


@gpu
@needs_sm90
def test_gpu_unconverted_experts_run_one_grouped_mm_without_a_host_sync():
    """Device counts: forward + backward issue one `_grouped_mm` per phase (fprop, dgrad, wgrad; no per-expert
    matmul) and no host sync;
    output and gradients match the fp32 per-expert product of the same bf16 operands within bf16 rounding."""
    torch.manual_seed(0)
    m = Experts().cuda()
    x = torch.randn(sum(SPLITS), IN, device="cuda").bfloat16().requires_grad_()
    splits = torch.tensor(SPLITS, device="cuda")
    with OpLog() as ops, no_host_sync():
        y = m(x, splits)
        y.float().square().sum().backward()
    assert ops.counts["_grouped_mm"] == 3 and "mm" not in ops.counts, f"ops issued: {dict(ops.counts)}"
    xr = x.detach().float().requires_grad_()
    wr = m.w.detach().bfloat16().float().requires_grad_()
    ref = torch.cat([xe @ we.t() for xe, we in zip(xr.split(SPLITS), wr.unbind(0))])
    ref.bfloat16().float().square().sum().backward()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2, msg="output differs from the fp32 product")
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=3e-2, atol=3e-2, msg="dgrad differs")
    torch.testing.assert_close(m.w.grad.float(), wr.grad, rtol=3e-2, atol=3e-2, msg="wgrad differs")
    assert m.w.grad[1].abs().sum() == 0, "the expert without tokens got a non-zero gradient"
