"""update_delayed_scaling (many Float8Quantizer.update() calls in one CUDA launch) == the per-quantizer Python update
run on the CPU, bit for bit (history and scale), over many steps and edge cases. The CPU fallback test runs
everywhere; the GPU tests need a CUDA device and the built extension."""

from __future__ import annotations

import os
import random

import pytest
import torch

from hybridq.formats import Float8Quantizer
from hybridq.kernels import update_delayed_scaling
from _gpu import extension_ready

HAVE_CUDA = torch.cuda.is_available()
SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))


needs_gpu = pytest.mark.skipif(not extension_ready(), reason="needs a CUDA device and the built hybridq extension")

SPECIALS = [0.0, float("inf"), float("nan"), 1e-38, 1e-45, 3e38, 448.0, 1.0, 2.0 ** -130]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _make(gen: torch.Generator, n: int, lengths=(1, 2, 3, 16, 1024, 4096)):
    qs = []
    for i in range(n):
        q = Float8Quantizer(fp8=("e4m3", "e5m2")[i % 2], scaling="delayed",
                            amax_history_len=lengths[i % len(lengths)],
                            amax_compute_algo=("max", "most_recent")[(i // 2) % 2], margin=(0, 2, -3, 7)[i % 4])
        h = torch.rand(q.amax_history_len, generator=gen) * torch.exp2(
            torch.randint(-20, 20, (q.amax_history_len,), generator=gen).float())
        if i % 3 == 0:  # zeros and specials at random places (the first slot too)
            k = torch.randint(0, q.amax_history_len, (max(1, q.amax_history_len // 8),), generator=gen)
            h[k] = torch.tensor(SPECIALS)[torch.randint(0, len(SPECIALS), k.shape, generator=gen)]
        if i % 7 == 0:
            h.zero_()
        q.amax_history = h
        q.scale = torch.rand(1, generator=gen) * 100
        qs.append(q)
    return qs


def _clone_state(qs, device):
    out = []
    for q in qs:
        c = Float8Quantizer(fp8=q.fp8, scaling="delayed", amax_history_len=q.amax_history_len,
                            amax_compute_algo=q.amax_compute_algo, margin=q.margin)
        c.amax_history = q.amax_history.clone().to(device)
        c.scale = q.scale.clone().to(device)
        c.record_amax(torch.zeros(1, device=device))  # pending, as after a cast (amaxes are >= 0)
        out.append(c)
    return out


def test_update_delayed_scaling_cpu_fallback():
    gen = torch.Generator().manual_seed(SEED)
    qs = _make(gen, 12)
    a, b = _clone_state(qs, "cpu"), _clone_state(qs, "cpu")
    update_delayed_scaling(a + [Float8Quantizer()])  # a current-scaling quantizer is skipped
    for q in b:
        q.update()
    for i, (x, y) in enumerate(zip(a, b)):
        assert _bits_equal(x.amax_history, y.amax_history) and _bits_equal(x.scale, y.scale), f"quantizer {i}"
        assert not x.update_pending


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [1, 16, 40])  # up to 16 entries go by value in the launch, more through a buffer
@pytest.mark.parametrize("steps", [1, 5])
def test_update_delayed_scaling_cuda_bitwise(steps, n):
    gen = torch.Generator().manual_seed(SEED)
    qs = _make(gen, n)
    g, r = _clone_state(qs, "cuda"), _clone_state(qs, "cpu")
    hist_ids = [id(q.amax_history) for q in g]
    for step in range(steps):
        update_delayed_scaling(g)
        for q in r:
            q.update()
        assert [id(q.amax_history) for q in g] == hist_ids, "the CUDA op did not run (the Python update rebinds)"
        for i, (x, y) in enumerate(zip(g, r)):
            assert _bits_equal(x.amax_history, y.amax_history), (
                f"step {step} quantizer {i} ({x.amax_compute_algo}, len {x.amax_history_len}): history differs "
                f"(seed {SEED})")
            assert _bits_equal(x.scale, y.scale), (
                f"step {step} quantizer {i} ({x.amax_compute_algo}, margin {x.margin}): scale {x.scale.item()!r} != "
                f"{y.scale.item()!r} (seed {SEED})")
            assert not x.update_pending
        # record new amaxes the way a cast does, identically on both sides
        for x, y in zip(g, r):
            v = (torch.rand(1, generator=gen) * 10 ** float(torch.randint(-5, 5, (1,), generator=gen))).float()
            if step == 2:
                v = torch.tensor([float("nan")])
            y.amax_history[:1] = torch.maximum(y.amax_history[:1], v)
            x.amax_history[:1] = torch.maximum(x.amax_history[:1], v.cuda())


@pytest.mark.gpu
@needs_gpu
def test_update_delayed_scaling_cuda_mixed_fallbacks():
    """Long histories, CPU states and shared state tensors take the Python update, in the same call."""
    gen = torch.Generator().manual_seed(SEED + 1)
    qs = _make(gen, 6, lengths=(5000, 8, 1))
    g = _clone_state(qs[:4], "cuda") + _clone_state(qs[4:], "cpu")
    r = _clone_state(qs, "cpu")
    update_delayed_scaling(g)
    for q in r:
        q.update()
    for i, (x, y) in enumerate(zip(g, r)):
        assert _bits_equal(x.amax_history, y.amax_history) and _bits_equal(x.scale, y.scale), f"quantizer {i}"
    # shared state: sequential semantics of the Python update
    a = _clone_state(qs[1:2], "cuda")[0]
    b = Float8Quantizer(scaling="delayed", amax_history_len=a.amax_history_len)
    b.amax_history, b.scale = a.amax_history, a.scale
    ra = _clone_state(qs[1:2], "cpu")[0]
    rb = Float8Quantizer(scaling="delayed", amax_history_len=ra.amax_history_len)
    rb.amax_history, rb.scale = ra.amax_history, ra.scale
    update_delayed_scaling([a, b])
    ra.update()
    rb.update()
    for x, y in ((a, ra), (b, rb)):
        assert _bits_equal(x.amax_history, y.amax_history) and _bits_equal(x.scale, y.scale)


@pytest.mark.gpu
@needs_gpu
def test_delayed_cast_uses_batched_update():
    """The CUDA quantize path of delayed scaling runs the same update (via the op) as the reference."""
    gen = torch.Generator().manual_seed(SEED + 2)
    qg = Float8Quantizer(scaling="delayed", amax_history_len=16, margin=1)
    qr = Float8Quantizer(scaling="delayed", amax_history_len=16, margin=1)
    for step in range(8):
        x = torch.randn(64, 96, generator=gen) * 2.0 ** (step - 4)
        pg = qg.quantize_parts(x.cuda().to(torch.bfloat16), True, True)
        pr = qr.reference_parts(x.to(torch.bfloat16), True, True)
        assert torch.equal(pg[0].data.view(torch.uint8).cpu(), pr[0].data.view(torch.uint8)), f"step {step} data"
        assert _bits_equal(qg.scale, qr.scale) and _bits_equal(qg.amax_history, qr.amax_history), f"step {step}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_cast_records_its_amax_in_the_history_in_place(algo):
    """The cast kernel max-combines max|x| into amax_history[0] itself (no separate record op, the history tensor
    kept): history and scale equal the reference's over steps that include all-zero and infinite inputs."""
    gen = torch.Generator().manual_seed(SEED + 3)
    qg = Float8Quantizer(scaling="delayed", amax_history_len=8, amax_compute_algo=algo)
    qr = Float8Quantizer(scaling="delayed", amax_history_len=8, amax_compute_algo=algo)
    for step in range(7):
        x = torch.randn(96, 160, generator=gen) * 2.0 ** (3 * step - 9)
        if step == 2:
            x.zero_()
        if step == 4:
            x[5, 7] = float("inf")
        x = x.to(torch.bfloat16)
        qg.quantize_parts(x.cuda(), True, step % 2 == 0)
        history = qg.amax_history
        qr.reference_parts(x, True, step % 2 == 0)
        assert qg.amax_history is history, f"step {step}: the history was replaced, not written in place"
        assert qg.update_pending, f"step {step}: the cast left no update pending"
        assert _bits_equal(qg.amax_history, qr.amax_history), (
            f"step {step}: history {qg.amax_history.tolist()} != {qr.amax_history.tolist()} (seed {SEED})")
        assert _bits_equal(qg.scale, qr.scale), f"step {step}: scale {qg.scale.item()!r} != {qr.scale.item()!r}"


@pytest.mark.gpu
@needs_gpu
def test_kernel_record_is_torch_maximum_of_the_slot_and_the_amax():
    """fp8_tensor_quantize_delayed's in-place record equals torch.maximum(history[0], the amax fp8_tensor_quantize
    returns), for first slots from 0 to inf; the other entries and the cast are untouched."""
    ops = torch.ops.hybridq
    gen = torch.Generator().manual_seed(SEED + 4)
    x = (torch.randn(64, 96, generator=gen) * 3).to(torch.bfloat16).cuda()
    scale = torch.full((1,), 2.0, device="cuda")
    *cast, amax = ops.fp8_tensor_quantize(x, torch.float8_e4m3fn, scale, None, 0.0, False, True, True, True)
    for first in (0.0, 1e-30, float(amax) / 2, float(amax), float(amax) * 2, float("inf")):
        h = torch.tensor([first, 5.0, 0.0, 7.0], device="cuda")
        want = h.clone()
        want[:1] = torch.maximum(want[:1], amax)
        got = ops.fp8_tensor_quantize_delayed(x, torch.float8_e4m3fn, scale, h, 0.0, False, True, True)
        assert _bits_equal(h, want), f"history[0] = {first!r}: got {h.tolist()}, want {want.tolist()}"
        for name, a, b in zip(("rowwise", "columnwise", "scale_inv"), got, cast):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} differs from fp8_tensor_quantize's"
