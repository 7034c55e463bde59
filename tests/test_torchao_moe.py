"""The torchao_moe baseline of the training job (launch/torchao_moe.py): its refusals (CPU: no torchao or no CUDA,
no MoE), the bridge from the job's experts to torch._grouped_mm on padded token groups (what torchao's converted
expert weights take over), and on a GPU with torchao the conversion itself (torchao's FP8 grouped GEMMs run)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import config  # noqa: E402
from model import Experts, ModelConfig, Transformer  # noqa: E402
from torchao_moe import GROUP_ALIGN, GroupedMMExperts, padded_groups, use_grouped_mm  # noqa: E402

HAS_TORCHAO_MOE = importlib.util.find_spec("torchao") is not None and importlib.util.find_spec(
    "torchao.prototype.moe_training") is not None


def _check(*flags: str, world: int = 1):
    config.check_args(config.parse_args(["--recipe", "torchao_moe", *flags]), world=world)


def test_torchao_moe_without_moe_is_refused_naming_the_flag():
    with pytest.raises(config.ConfigError, match=r"torchao_moe .* needs an MoE model: pass --moe E"):
        _check("--device", "cpu")


@pytest.mark.skipif(torch.cuda.is_available() and HAS_TORCHAO_MOE, reason="torchao and CUDA present: it runs")
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_torchao_moe_on_a_machine_without_torchao_or_cuda_is_refused_saying_which(device):
    with pytest.raises(config.ConfigError) as e:
        _check("--moe", "2", "--device", device)
    msg = str(e.value)
    missing = "needs torchao >= 0.18" if not HAS_TORCHAO_MOE else "needs a CUDA device"
    assert missing in msg and "torchao_moe" in msg, msg


def test_torchao_moe_with_tensor_parallelism_is_refused():
    with pytest.raises(config.ConfigError, match="--tp 2: the torchao_moe baseline is not tensor-parallelized"):
        _check("--moe", "2", "--tp", "2", "--device", "cpu", world=2)


@pytest.mark.parametrize("m_splits", [[5, 0, 16, 17], [0, 0, 0, 3], [16, 32], [1]])
def test_padded_groups_put_each_expert_s_tokens_at_the_start_of_its_16_row_group(m_splits):
    dest, offs, rows = padded_groups(m_splits, torch.device("cpu"))
    padded = [-(-n // GROUP_ALIGN) * GROUP_ALIGN for n in m_splits]
    assert offs.dtype == torch.int32 and offs.tolist() == torch.tensor(padded).cumsum(0).tolist(), offs
    bound = -(-(sum(m_splits) + len(m_splits) * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN
    assert rows == bound >= sum(padded), (rows, bound, sum(padded))  # the most any routing needs: one size a step
    expected, start = [], 0
    for n, p in zip(m_splits, padded):
        expected += range(start, start + n)
        start += p
    assert dest.tolist() == expected, (dest.tolist(), expected)


def test_grouped_mm_experts_compute_what_the_job_s_experts_compute():
    """Same parameters, same tokens: the bridge's padded torch._grouped_mm forward equals the per-expert products
    of model.Experts (bf16, forward: torch's CPU _grouped_mm has no backward for the weights)."""
    torch.manual_seed(0)
    ref = Experts(3, 32, 64)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ref = ref.to(torch.bfloat16)
    bridged = Experts(3, 32, 64).to(torch.bfloat16)
    bridged.load_state_dict(ref.state_dict())
    assert use_grouped_mm(torch.nn.ModuleDict({"e": bridged})) == ["e"] and isinstance(bridged, GroupedMMExperts)
    for m_splits in ([7, 0, 20], [16, 16, 16], [0, 0, 1]):  # (rows after the last group stay outside every group)
        x = torch.randn(sum(m_splits), 32, dtype=torch.bfloat16)
        with torch.no_grad():
            want, got = ref(x, m_splits), bridged(x, m_splits)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"bridged experts differ from model.Experts at {m_splits}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TORCHAO_MOE), reason="needs CUDA and torchao")
def test_conversion_runs_torchao_s_fp8_grouped_gemms_on_the_job_s_moe():
    """The job's MoE converted for torchao_moe: every expert weight is torchao's training wrapper, a forward and
    backward run (through torchao's FP8 grouped GEMMs) and every gradient is finite."""
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    from torchao_moe import convert_torchao_moe
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torchao's FP8 grouped GEMMs need sm_89+")
    args = config.parse_args(["--recipe", "torchao_moe", "--moe", "4", "--top-k", "2"])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=128, n_layers=1, n_heads=4, hidden=256, moe_experts=4, moe_top_k=2))
    lines = []
    convert_torchao_moe(model, args, lines.append)
    experts = model.layers[0].feed_forward.experts
    assert all(isinstance(getattr(experts, w).data, TrainingWeightWrapperBaseTensor) for w in ("w1", "w2", "w3"))
    model = model.cuda().to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 64), device="cuda")
    model(tokens).float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters()), lines
