"""`hybridq::fp8_block_tensors_quantize` (csrc/fp8_block_tensors.cu, called by hybridq/kernels/fp8_block_tensors.py):
many 2-D fp32 tensors, each cast to the gather dtype in registers and quantized in FP8 128x128 tiles as its own tensor,
in one launch per 16 tensors -- bitwise the reference (the per-weight path looped, on the CPU) and the per-weight CUDA
path (`x.to(dtype)`, then the fp8_block_quantize tile kernel): bytes, zero padding, tile scales. Random data (the seed
is printed on failure), tiles of zeros, inf / NaN of both signs, subnormals, saturation, values whose bf16 rounding
matters, partial edge tiles along both dims, rows and columns that are no multiple of the vector width, a
misaligned input, E5M2, epsilon and power-of-two scales, more tensors than one launch takes. And under FSDP2 on one
GPU (NCCL): training with the unit cast is bitwise training without it, and the pre-all-gather hooks issue one
quantize op per unit instead of a cast and a tile quantize per weight. The CPU side (argument checks, the reference)
runs everywhere."""

from __future__ import annotations

import collections
import datetime
import os
import random
import sys

import pytest
import torch

from hybridq.formats import Float8BlockQuantizer, Float8Quantizer
from hybridq.kernels import fp8_block_tensors as fbt

from _gpu import gpu

SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))
# (rows, cols): whole tiles, partial last tile rows / columns, a tensor smaller than a tile, odd sizes, no rows
SHAPES = [(256, 256), (255, 256), (200, 711), (128, 96), (1, 7), (33, 17), (0, 64), (130, 129), (5, 1), (384, 128)]
QUANTIZERS = {
    "e4m3_pow2": lambda: Float8BlockQuantizer(block_dim=2),
    "e5m2_pow2": lambda: Float8BlockQuantizer(fp8="e5m2", block_dim=2),
    "e4m3_eps": lambda: Float8BlockQuantizer(block_dim=2, power_2_scale=False, amax_epsilon=1e-3),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


def _tensors(shapes, gen: torch.Generator, kind: str) -> list[torch.Tensor]:
    """Random tensors of `shapes` (magnitudes 1e-2 .. 1e2); "edges": special values at the start of some tiles and a
    tile of zeros; "zeros": all zero."""
    out = []
    for i, (r, c) in enumerate(shapes):
        x = torch.randn(r, c, generator=gen) * (10.0 ** (i % 5 - 2))
        if kind == "edges" and x.numel():
            specials = torch.tensor([0.0, -0.0, 1e-40, -1e-42, 3e38, -3e38, 1.00390625, 1.0 + 2 ** -9, 448.0, 57344.0,
                                     float("inf"), float("-inf"), float("nan"), -float("nan")])
            take = specials if i % 3 == 0 else specials[:10]  # (some tensors finite, some not)
            n = min(c, take.numel())
            x[0, :n] = take[:n]
            if r > 128 and c > 128:  # (a finite tile next to the non-finite one; a tile of zeros)
                x[128:256, 128:256] = 0.0
                x[-1, -min(c - 128, take.numel()):] = take[:min(c - 128, take.numel())]
        if kind == "zeros":
            x.zero_()
        out.append(x)
    return out


def _regions(xs, extra: int = 0) -> list[int]:
    return [_aligned(x.numel()) + 16 * (extra if i % 2 else 0) for i, x in enumerate(xs)]


def _check(got, want, xs, regions, what: str) -> None:
    """Every tensor's bytes, its padding (zeros) and its tile-scale grid (bitwise) of `got` vs `want`."""
    data, scales = got[0].cpu(), got[1].cpu()
    wdata, wscales = want[0].cpu(), want[1].cpu()
    slots = fbt.scale_slots([tuple(x.shape) for x in xs])[0]
    off = 0
    for i, (x, r, s) in enumerate(zip(xs, regions, slots)):
        a, b = data[off:off + r], wdata[off:off + r]
        assert torch.equal(a, b), (f"{what}: tensor {i} {tuple(x.shape)}: {(a != b).sum().item()} of {r} bytes differ "
                                   f"(first at {(a != b).nonzero()[0].item()}; seed {SEED})")
        assert not a[x.numel():].any(), f"{what}: tensor {i}'s padding bytes are not zero"
        tm, tk = fbt.tiles_of(*x.shape)
        ga, gb = scales[s:s + tm * tk].view(torch.int32), wscales[s:s + tm * tk].view(torch.int32)
        assert torch.equal(ga, gb), (f"{what}: tensor {i} {tuple(x.shape)}: tile scale_inv {scales[s:s + tm * tk]} vs "
                                     f"{wscales[s:s + tm * tk]} (seed {SEED})")
        off += r


def _per_weight(xs, param_dtype, qs, regions) -> tuple[torch.Tensor, torch.Tensor]:
    """What the per-weight path gives for each tensor -- `quantize_parts(x.to(dtype))`, its rowwise part (the CUDA
    tile kernel on a CUDA tensor) -- laid out as `quantize_fp8_block_tensors` lays it out."""
    device = xs[0].device
    slots, n = fbt.scale_slots([tuple(x.shape) for x in xs])
    data = torch.zeros(sum(regions), dtype=torch.uint8, device=device)
    scales = torch.zeros(n, dtype=torch.float32, device=device)
    off = 0
    for x, q, r, s in zip(xs, qs, regions, slots):
        if x.numel():
            part = q.quantize_parts(x.to(param_dtype), True, False)[0]
            data[off:off + x.numel()] = part.data.reshape(-1).view(torch.uint8)
            scales[s:s + part.scale_inv.numel()] = part.scale_inv.reshape(-1)
        off += r
    return data, scales


@pytest.mark.parametrize("kind", ["random", "edges"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_is_the_per_weight_path(kind, dtype):
    """The reference (what runs on the CPU) is the per-weight path's quantization of each tensor cast to the gather
    dtype: bytes in row order, zeros to its region's end, its tile-scale grid at its slot."""
    gen = torch.Generator().manual_seed(SEED)
    xs = _tensors(SHAPES, gen, kind)
    qs = [QUANTIZERS[k]() for k in QUANTIZERS] * 4
    qs = qs[:len(xs)]
    regions = _regions(xs, extra=2)
    got = fbt.quantize_fp8_block_tensors(xs, DTYPES[dtype], qs, regions)
    _check(got, _per_weight(xs, DTYPES[dtype], qs, regions), xs, regions, f"reference, {kind}, {dtype}")


def test_scale_slots_start_16_byte_aligned():
    offsets, n = fbt.scale_slots([(256, 256), (1, 7), (255, 711), (0, 64)])
    assert offsets == [0, 4, 8, 20] and n == 20, (offsets, n)


@pytest.mark.parametrize("bad, match", [
    (dict(regions=[15]), "multiple of 16"),
    (dict(regions=[0]), "multiple of 16 and hold"),
    (dict(quantizers=[Float8BlockQuantizer(block_dim=1)]), "128x128"),
    (dict(quantizers=[Float8Quantizer()]), "128x128"),
    (dict(xs=[torch.ones(16)]), "2-D"),
    (dict(regions=[]), "one entry per tensor"),
])
def test_bad_arguments_name_the_tensor_and_the_rule(bad, match):
    args = dict(xs=[torch.ones(2, 8)], param_dtype=torch.bfloat16, quantizers=[Float8BlockQuantizer(block_dim=2)],
                regions=[16])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fbt.quantize_fp8_block_tensors(**args)


@gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["random", "edges", "zeros"])
@pytest.mark.parametrize("qname", list(QUANTIZERS))
def test_kernel_is_bitwise_the_per_weight_path(qname, kind, dtype):
    param_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(SEED)
    shapes = SHAPES * 2  # 20 tensors: more than one launch takes (16)
    xs = _tensors(shapes, gen, kind)
    qs = [QUANTIZERS[qname]() for _ in xs]
    regions = _regions(xs, extra=3)
    xg = [x.cuda() for x in xs]
    xg[3] = torch.cat([torch.zeros(1, device="cuda"), xg[3].reshape(-1)])[1:].view(xs[3].shape)  # (misaligned)
    assert fbt._cuda_takes(xg, param_dtype)
    got = fbt.quantize_fp8_block_tensors(xg, param_dtype, qs, regions)
    what = f"{qname}, {kind}, {dtype}"
    # the per-weight CUDA path: x.to(dtype) (torch's CUDA cast), then the fp8_block_quantize tile kernel
    _check(got, _per_weight(xg, param_dtype, qs, regions), xs, regions, what + " (per-weight CUDA path)")
    # the reference (on the CPU) of the values cast to the gather dtype on the GPU: torch's CPU and CUDA casts differ
    # for NaNs (fp32 -> fp16 keeps a NaN's sign on the CPU only), so the cast is the GPU's
    cast = [x.to(param_dtype).cpu() for x in xg]
    _check(got, fbt.reference(cast, param_dtype, qs, regions), xs, regions, what + " (reference)")


@pytest.fixture
def one_gpu(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def _block_jobs():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
    import _unit_cast_block_jobs as jobs
    return jobs


@gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["fp8_block", "with_tensorwise_weights"])
@pytest.mark.parametrize("precompute", [False, True], ids=["own_stats", "precomputed"])
def test_fsdp_training_on_one_gpu_is_bitwise_the_per_weight_path(one_gpu, precompute, mixed):
    jobs = _block_jobs()
    counts = jobs.parity(0, 1, one_gpu, precompute, mixed=mixed, steps=3)
    assert sum(counts["unit_batches"].values()) == (8 if mixed else 4), f"unit batches {counts['unit_batches']}"


@gpu
def test_fsdp_non_finite_weights_on_one_gpu(one_gpu):
    r = _block_jobs().nonfinite(0, 1, one_gpu, precompute=False)
    assert r["batches"] == 2, f"{r['batches']} unit batches in the recorded forward"


@gpu
def test_fsdp_hooks_issue_one_quantize_per_unit(one_gpu, monkeypatch):
    """The ops the pre-all-gather hooks dispatch in a training step's forward (each a kernel launch), with the unit
    cast on and off: one fp8_block_tensors_quantize per unit instead of a cast and an fp8_block_quantize per weight."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridq.distributed import unit_cast
    from hybridq.distributed import weights as W
    jobs = _block_jobs()

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
            for step in range(3):  # (counted: the third step's forward; the second is the first batched one)
                mode = Count()
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
    assert off["hybridq.fp8_block_quantize"] == weights and on["hybridq.fp8_block_quantize"] == 0, (off, on)
    assert on["hybridq.fp8_block_tensors_quantize"] == units, on
    assert sum(on.values()) < sum(off.values()), f"ops in the hooks: on {dict(on)}, off {dict(off)}"
    print(f"pre-all-gather ops per forward: off {sum(off.values())} {dict(off)}; on {sum(on.values())} {dict(on)}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
