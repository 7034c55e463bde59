"""The mixture-of-experts option of the training job (launch/model.py MoE, `train.py --moe E --top-k K`): the
router's dispatch and combine against a dense per-token loop, the load-balancing loss, the flags, and one tiny
torchrun launch (2 processes, gloo) whose loss falls."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import config  # noqa: E402
import model as job_model  # noqa: E402
from metrics import read_metrics, runs_of  # noqa: E402
from _gpu import no_host_sync  # noqa: E402


def _moe(e=4, k=2, d=32, h=64, seed=0):
    torch.manual_seed(seed)
    cfg = job_model.ModelConfig(d_model=d, n_heads=2, hidden=h, moe_experts=e, moe_top_k=k)
    moe = job_model.MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


@pytest.mark.parametrize("e, k", [(4, 1), (4, 2), (3, 3), (8, 2)])
def test_route_sorts_slots_by_expert_and_counts_them(e, k):
    probs = torch.randn(37, e).softmax(-1)
    order, token, weight, m_splits = job_model.route(probs, k)
    top_p, top_e = probs.topk(k, -1)
    expert_of_slot = top_e.reshape(-1)[order]
    assert m_splits.dtype == torch.int64 and m_splits.device == probs.device, "m_splits: int64 counts on probs' device"
    assert int(m_splits.sum()) == 37 * k and len(m_splits) == e
    assert torch.equal(expert_of_slot, torch.repeat_interleave(torch.arange(e), m_splits)), \
        "slots are not grouped by expert in m_splits order"
    for ex in range(e):  # stable: token order within an expert
        toks = token[expert_of_slot == ex]
        assert torch.equal(toks, toks.sort().values), f"expert {ex}: tokens out of order {toks.tolist()}"
    want = (top_p / top_p.sum(-1, keepdim=True)) if k > 1 else top_p
    assert torch.equal(weight, want.reshape(-1)[order])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_route_counts_stay_on_the_device_without_a_host_sync():
    """The router's counts stay on the device (no bincount max, no .tolist()): routing issues no host sync."""
    probs = torch.randn(4096, 16, device="cuda").softmax(-1)
    with no_host_sync():
        order, token, weight, m_splits = job_model.route(probs, 2)
    ref = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=16)
    assert torch.equal(m_splits, ref), (m_splits.tolist(), ref.tolist())


@pytest.mark.parametrize("e, k", [(4, 1), (4, 2), (3, 3)])
def test_moe_equals_a_dense_per_token_loop(e, k):
    """Each token's output is sum over its top-k experts of p_e * SwiGLU_e(x), p renormalised over the k."""
    moe = _moe(e, k).double()  # fp64: only the summation order differs from the loop
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    y = moe(x)
    flat = x.reshape(-1, 32)
    probs = moe.router(flat).float().softmax(-1)
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        p, idx = probs[t].topk(k)
        p = (p / p.sum() if k > 1 else p).double()
        for pe, ex in zip(p, idx):
            h = F.silu(flat[t] @ w1[ex].t()) * (flat[t] @ w3[ex].t())
            want[t] += pe * (h @ w2[ex].t())
    torch.testing.assert_close(y.reshape(-1, 32), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dispatch_gradient_sums_each_tokens_slots(k):
    """The dispatch's backward (slots back to token order, summed over the k choices) is autograd's gradient of
    `flat[token]` (fp64: only the order of the k-term sums may differ)."""
    probs = torch.randn(10, 4).softmax(-1)
    order, token, _, _ = job_model.route(probs, k)
    flat = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(10 * k, 6, dtype=torch.float64)
    y = job_model.DispatchTokens.apply(flat, token, order, k)
    assert torch.equal(y, flat[token]), "the dispatched rows differ from flat[token]"
    (got,) = torch.autograd.grad(y, flat, dy)
    (want,) = torch.autograd.grad(flat[token], flat, dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15,
                               msg=lambda m: f"top-{k} dispatch gradient: {m}")


@pytest.mark.parametrize("k", [1, 2])
def test_moe_backward_runs_no_accumulating_index_put(k):
    """Every gather of the MoE layer reads a permutation or its k-fold repeat, so its backward needs no accumulating
    index_put: autograd's backward of `t[idx]` is one (on CUDA a sort-based kernel, ~1.4 ms per layer at 16k tokens x
    top-2 on an H200, for the 1-D combine weights as for the dispatched rows)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func, (kwargs or {}).get("accumulate", args[3] if len(args) > 3 else False)))
            return func(*args, **(kwargs or {}))

    moe = _moe(4, k)
    loss = moe(torch.randn(2, 16, 32)).square().mean() + 0.01 * moe.aux_loss
    with Ops() as ops:
        loss.backward()
    bad = [str(f) for f, acc in ops.seen if "index_put" in str(f) and acc]
    assert not bad, f"top-{k} MoE backward ran accumulating index_put: {bad}"


def test_compiled_moe_runs_no_accumulating_index_put_and_counts_as_eager():
    """Compiled by inductor, the MoE layer's forward and backward call no aten index_put fallback (inductor lowers an
    int64 index_add -- the router's counts -- to an accumulating index_put, tl.atomic_add taking no int64: on CUDA the
    sort-based kernel, ~1.45 ms per layer on an H200 at 16k tokens x top-2 in the compiled MoE job's profile of
    2026-11-28), and the compiled router's counts are the eager ones, int64."""
    from torch._inductor.utils import run_and_get_code

    moe = _moe(4, 2)
    x = torch.randn(2, 16, 32)
    probs = torch.randn(32, 4).softmax(-1)
    compiled = torch.compile(moe)

    def step():
        loss = compiled(x).square().mean() + 0.01 * moe.aux_loss
        loss.backward()
        return torch.compile(lambda p: job_model.route(p, 2))(probs)

    routed, codes = run_and_get_code(step)
    puts = [line.strip() for code in codes for line in code.splitlines() if "index_put" in line]
    assert not puts, f"the compiled MoE layer calls aten's index_put: {puts}"
    want = job_model.route(probs, 2)
    assert routed[3].dtype == torch.int64 and torch.equal(routed[3], want[3]), (routed[3], want[3])
    assert all(torch.equal(a, b) for a, b in zip(routed, want)), "compiled route differs from eager"


def test_load_balancing_loss_is_one_when_routing_is_uniform():
    """E * sum_e f_e P_e: 1 for a router that spreads tokens and probability evenly, larger when it collapses."""
    moe = _moe(4, 1)
    with torch.no_grad():
        moe.router.weight.zero_()  # equal probabilities; topk then picks expert 0 for every token
    moe(torch.randn(1, 8, 32))
    assert moe.aux_loss.item() == pytest.approx(1.0)  # f = (1, 0, 0, 0), P = 1/4 each: 4 * 1/4
    moe2 = _moe(4, 1)
    moe2(torch.randn(1, 64, 32))
    assert moe2.aux_loss.item() >= 1.0 - 1e-6  # (Cauchy-Schwarz-like bound for top-1 routing fractions)


def test_moe_gradients_reach_router_and_every_used_expert():
    moe = _moe(4, 2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    (moe(x).square().mean() + 0.01 * moe.aux_loss).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    for n in ("w1", "w3", "w2"):
        g = getattr(moe.experts, n).grad
        assert g is not None and g.abs().sum() > 0, n


@pytest.mark.parametrize("flags, needle", [
    (["--moe", "4", "--top-k", "5"], "--top-k in [1, --moe]"),
    (["--moe", "-1"], "--moe must be >= 0"),
    (["--top-k", "2"], "--top-k only with --moe"),
])
def test_bad_moe_flags_are_rejected(flags, needle):
    args = config.parse_args(["--device", "cpu", *flags])
    with pytest.raises(config.ConfigError) as e:
        config.check_args(args, world=2)
    assert needle in str(e.value)


@pytest.mark.distributed
def test_tiny_moe_job_trains_under_fsdp2(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "train.py"), "--d-model", "64", "--n-layers", "1", "--n-heads", "2", "--seq", "64",
           "--batch", "2", "--steps", "8", "--eval-batches", "1", "--no-progress", "--timeout", "120", "--device",
           "cpu", "--recipe", "mxfp8_fwd_nvfp4_bwd", "--moe", "4", "--top-k", "2", "--metrics", "m.jsonl"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}"
    text = p.stdout
    assert "MoE 4 experts top-2" in text
    for w in ("w1", "w3", "w2"):
        line = next(l for l in text.splitlines() if l.startswith(f"layers.0.feed_forward.experts.{w} [E=4]"))
        assert "converted" in line and "MXFP8" in line, line
    assert "MoE router kept in high precision" in text
    assert "3 of 3 grouped expert weights converted" in text
    losses = runs_of(read_metrics(tmp_path / "m.jsonl"))["mxfp8_fwd_nvfp4_bwd"]["losses"]
    assert len(losses) == 8 and all(v == v and abs(v) < 1e9 for v in losses), losses
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.5, f"loss did not fall: {losses}"


@pytest.mark.distributed
def test_tiny_moe_job_trains_compiled_with_fp8_experts(tmp_path):
    """--compile with per-tensor FP8 experts gathered by FSDP2: the blocks compile around the experts (which run
    eagerly between compiled regions) and the loss falls (dynamo failed on the gathered experts before)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--d-model", "64", "--n-layers", "2", "--n-heads", "2",
           "--hidden", "64", "--seq", "64", "--batch", "2", "--steps", "4", "--eval-batches", "1", "--no-progress",
           "--device", "cpu", "--compile", "--recipe", "fp8_tensorwise", "--moe", "4", "--top-k", "2",
           "--metrics", "m.jsonl"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}"
    losses = runs_of(read_metrics(tmp_path / "m.jsonl"))["fp8_tensorwise"]["losses"]
    assert len(losses) == 4 and all(v == v and abs(v) < 1e9 for v in losses), losses
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"


@pytest.mark.parametrize("recipe", [r for r in config.PRESETS if r != "fp8_delayed"])
def test_moe_on_the_default_model_passes_the_pre_flight(recipe):
    """`--moe 4` on the default model (run.sh's size) for every preset that FSDP2 gathers quantized: every expert
    weight converts and the pre-flight finds nothing to refuse (the tiny launch above trains one)."""
    import trainer
    args = config.parse_args(["--device", "cpu", "--moe", "4", "--recipe", recipe, "--compare", "bf16"])
    assert list(trainer.preflight(args, world=2)) == [recipe, "bf16"]
    with torch.device("meta"):
        m = job_model.Transformer(config.model_config(args))
    rows, summary = trainer.convert_refusing(m, recipe, args)
    assert "6 of 6 grouped expert weights converted" in summary, summary


def test_fp8_delayed_with_moe_is_one_refusal_in_the_pre_flight():
    import trainer
    args = config.parse_args(["--device", "cpu", "--moe", "4", "--recipe", "fp8_delayed"])
    with pytest.raises(config.ConfigError, match="recipe fp8_delayed: apply_hybrid_fsdp: the weight of .* uses delayed "
                                                 "scaling"):
        trainer.preflight(args, world=2)
