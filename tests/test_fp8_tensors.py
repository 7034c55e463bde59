"""`hybridq::fp8_tensors_quantize` (csrc/fp8_tensors.cu, called by hybridq/kernels/fp8_tensors.py): many fp32 tensors,
each cast to the gather dtype in registers and quantized to per-tensor FP8 as its own tensor, in one amax and one
cast launch per 16 tensors -- bitwise the reference (the per-weight path looped, on the CPU) and the per-weight CUDA
path (`x.to(dtype)`, then the fp8_tensor_quantize kernel): bytes, zero padding, scales. Random data (the seed is
printed on failure), zeros, inf / NaN of both signs, subnormals, saturation, values whose bf16 rounding matters,
sizes that are no multiple of the vector width, a misaligned input, given amaxes, E5M2, epsilon and power-of-two
scales, more tensors than one launch takes. And under FSDP2 on one GPU (NCCL): training with the unit cast is
bitwise training without it, and the pre-all-gather hooks issue one quantize op per unit instead of one per weight.
The CPU side (argument checks, the reference): test_fp8_tensors_reference below runs everywhere."""

from __future__ import annotations

import collections
import datetime
import os
import random

import pytest
import torch

from hybridq.formats import Float8Quantizer
from hybridq.kernels import fp8_tensors

import _compare
from _gpu import extension_ready

SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
GPU = [pytest.mark.gpu, pytest.mark.skipif(not extension_ready(), reason="needs a CUDA device and the built extension")]
SHAPES = [(64, 64), (48, 64), (1, 7), (3, 5), (33, 17), (0, 64), (128, 96), (5, 1)]
QUANTIZERS = {
    "e4m3": lambda: Float8Quantizer(),
    "e5m2": lambda: Float8Quantizer(fp8="e5m2"),
    "e4m3_pow2_eps": lambda: Float8Quantizer(power_2_scale=True, amax_epsilon=1e-3),
}


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


def _tensors(shapes, gen: torch.Generator, kind: str) -> list[torch.Tensor]:
    out = []
    for i, (r, c) in enumerate(shapes):
        x = torch.randn(r, c, generator=gen) * (10.0 ** (i % 5 - 2))
        if kind == "edges" and x.numel():
            flat = x.view(-1)
            specials = torch.tensor([0.0, -0.0, 1e-40, -1e-42, 3e38, -3e38, 1.00390625, 1.0 + 2 ** -9, 448.0, 57344.0,
                                     float("inf"), float("-inf"), float("nan"), -float("nan")])
            take = specials if i % 3 == 0 else specials[:10]  # (some tensors finite, some not)
            n = min(flat.numel(), take.numel())
            flat[:n] = take[:n]
        if kind == "zeros":
            x.zero_()
        out.append(x)
    return out


def _regions(xs, extra: int = 0) -> list[int]:
    return [_aligned(x.numel()) + 16 * (extra if i % 2 else 0) for i, x in enumerate(xs)]


def _check(got, want, xs, regions, what: str) -> None:
    data, scale = got
    wdata, wscale = want
    _compare.assert_bitwise(scale.cpu(), wscale.cpu(), f"{what}: scale_inv [N, 4] (seed {SEED})")
    off = 0
    for i, (x, r) in enumerate(zip(xs, regions)):
        a, b = data[off:off + r].cpu(), wdata[off:off + r].cpu()
        assert torch.equal(a, b), (f"{what}: tensor {i} {tuple(x.shape)}: {(a != b).sum().item()} of {r} bytes differ "
                                   f"(first at {(a != b).nonzero()[0].item()}; seed {SEED})")
        assert not a[x.numel():].any(), f"{what}: tensor {i}'s padding bytes are not zero"
        off += r


def test_fp8_tensors_reference_is_the_per_weight_reference():
    """The reference is the per-weight path's: `Float8Quantizer.quantize_parts(x.to(dtype))` (own amax, or the given
    statistic) per tensor; regions hold zeros after each tensor's bytes. Runs on the CPU."""
    gen = torch.Generator().manual_seed(SEED)
    xs = _tensors(SHAPES, gen, "edges")
    qs = [QUANTIZERS[k]() for k in ("e4m3", "e5m2", "e4m3_pow2_eps")] * 3
    qs = qs[:len(xs)]
    amaxes = [None if i % 3 else torch.tensor([2.5]) for i in range(len(xs))]
    regions = _regions(xs, extra=2)
    data, scale = fp8_tensors.quantize_fp8_tensors(xs, torch.bfloat16, qs, amaxes, regions)
    off = 0
    for i, (x, q, a, r) in enumerate(zip(xs, qs, amaxes, regions)):
        kw = {} if a is None else {"amax": a}
        part = q.quantize_parts(x.to(torch.bfloat16), True, False, **kw)[0]
        got = data[off:off + x.numel()]
        assert torch.equal(got, part.data.reshape(-1).view(torch.uint8)), f"tensor {i}: bytes differ (seed {SEED})"
        assert torch.equal(scale[i, :1].view(torch.int32), part.scale_inv.reshape(1).view(torch.int32)), \
            f"tensor {i}: scale_inv {scale[i, 0].item()} vs {part.scale_inv.item()}"
        assert not data[off + x.numel():off + r].any() and not scale[i, 1:].any(), f"tensor {i}: padding not zero"
        off += r


@pytest.mark.parametrize("bad, match", [
    (dict(regions=[15]), "multiple of 16"),
    (dict(regions=[0]), "multiple of 16 and hold"),
    (dict(quantizers=[Float8Quantizer(scaling="delayed")]), "current"),
    (dict(amaxes=[]), "one entry per tensor"),
])
def test_bad_arguments_name_the_tensor_and_the_rule(bad, match):
    args = dict(xs=[torch.ones(2, 8)], param_dtype=torch.bfloat16, quantizers=[Float8Quantizer()], amaxes=[None],
                regions=[16])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fp8_tensors.quantize_fp8_tensors(**args)


def _on_gpu(test):
    for m in GPU:
        test = m(test)
    return test


@_on_gpu
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["random", "edges", "zeros"])
@pytest.mark.parametrize("given", [False, True], ids=["own_amax", "given_amax"])
@pytest.mark.parametrize("qname", list(QUANTIZERS))
def test_kernel_is_bitwise_the_reference(qname, given, kind, param_dtype):
    gen = torch.Generator().manual_seed(SEED)
    shapes = SHAPES * 3  # 24 tensors: more than one launch takes (16)
    xs = _tensors(shapes, gen, kind)
    qs = [QUANTIZERS[qname]() for _ in xs]
    amaxes = [torch.tensor([float(3.0 ** (i % 7 - 3))]) if given and i % 2 == 0 else None for i in range(len(xs))]
    if given:
        amaxes[2] = torch.tensor([float("inf")])
        amaxes[4] = torch.tensor([0.0])
    regions = _regions(xs, extra=3)
    xg = [x.cuda() for x in xs]
    xg[4] = torch.cat([torch.zeros(1, device="cuda"), xg[4].reshape(-1)])[1:].view(xs[4].shape)  # (misaligned)
    assert fp8_tensors._cuda_takes(xg, param_dtype, [None if a is None else a.cuda() for a in amaxes])
    got = fp8_tensors.quantize_fp8_tensors(xg, param_dtype, qs, [None if a is None else a.cuda() for a in amaxes],
                                           regions)
    what = f"{qname}, {kind}, {param_dtype}, given={given}"
    # the per-weight CUDA path: x.to(dtype) (torch's CUDA cast), then the fp8_tensor_quantize kernel
    off = 0
    for i, (x, q, a, r) in enumerate(zip(xg, qs, amaxes, regions)):
        if x.numel():
            kw = {} if a is None else {"amax": a.cuda()}
            part = q.quantize_parts(x.to(param_dtype), True, False, **kw)[0]
            b, w = got[0][off:off + x.numel()].cpu(), part.data.reshape(-1).view(torch.uint8).cpu()
            assert torch.equal(b, w), (f"{what}: tensor {i} differs from the per-weight CUDA path in "
                                       f"{(b != w).sum().item()} bytes, e.g. {b[b != w][:4].tolist()} vs "
                                       f"{w[b != w][:4].tolist()} (seed {SEED})")
            ws = part.scale_inv.reshape(1).cpu()
            assert torch.equal(got[1][i, :1].cpu().view(torch.int32), ws.view(torch.int32)), \
                f"{what}: tensor {i}'s scale_inv {got[1][i, 0].item()} vs the per-weight path's {ws.item()}"
        off += r
    # the reference (on the CPU) of the values cast to the gather dtype on the GPU: torch's CPU and CUDA casts differ
    # for NaNs (fp32 -> fp16 keeps a NaN's sign on the CPU only), and a NaN's sign may not survive torch's CUDA ops,
    # while the contract keeps it (docs/numerics.md "Non-finite values"): a reference run on the GPU is no oracle
    cast = [x.to(param_dtype).cpu() for x in xg]
    _check(got, fp8_tensors.reference(cast, param_dtype, qs, amaxes, regions), xs, regions, what + " (reference)")


@pytest.fixture
def one_gpu(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


@_on_gpu
@pytest.mark.parametrize("precompute", [False, True], ids=["own_stats", "precomputed"])
def test_fsdp_training_on_one_gpu_is_bitwise_the_per_weight_path(one_gpu, precompute):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
    import _unit_cast_jobs as jobs

    counts = jobs.parity(0, 1, one_gpu, precompute, mixed=True, steps=3)
    assert sum(counts["unit_batches"].values()) == 4, f"unit batches {counts['unit_batches']}"


@_on_gpu
def test_fsdp_hooks_issue_one_quantize_per_unit(one_gpu, monkeypatch):
    """The ops the pre-all-gather hooks dispatch in a training step's forward (each a kernel launch), with the unit
    cast on and off: one fp8_tensors_quantize per unit instead of an fp8_tensor_quantize (and a cast) per weight."""
    import sys
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridq.distributed import unit_cast
    from hybridq.distributed import weights as W
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
    import _unit_cast_jobs as jobs

    state = {"in": False}
    real = W.HybridWeight._pre_all_gather

    def counted(self, *a):
        state["in"] = True
        try:
            return real(self, *a)
        finally:
            state["in"] = False

    monkeypatch.setattr(W.HybridWeight, "_pre_all_gather", counted)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if state["in"] and not func.is_view:
                self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    was = unit_cast.set_unit_cast(True)
    try:
        for on in (False, True):
            unit_cast.set_unit_cast(on)
            m = jobs.build(one_gpu, 1)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            x = torch.randn(16, jobs.D, device=one_gpu)
            for step in range(3):  # (counted: the third step's forward; the second is the first batched one, which
                mode = Count()     # also lays out each weight's payload once, on the meta device)
                with mode if step == 2 else _null():
                    loss = m(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            counts[on] = mode.ops
    finally:
        unit_cast.set_unit_cast(was)
    off, on = counts[False], counts[True]
    units, weights = 2, 12
    assert off["hybridq.fp8_tensor_quantize"] == weights and on["hybridq.fp8_tensor_quantize"] == 0, (off, on)
    assert on["hybridq.fp8_tensors_quantize"] == units, on
    assert sum(on.values()) < sum(off.values()), f"ops in the hooks: on {dict(on)}, off {dict(off)}"
    print(f"pre-all-gather ops per forward: off {sum(off.values())} {dict(off)}; on {sum(on.values())} {dict(on)}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
