"""The stacked payload of FP8 128x128-tile experts written by one Triton launch (hybridq/kernels/triton_tile_payload.py,
distributed/grouped_blocks_payload.py [Note: tile payload]): the held experts cast to the gather dtype and quantized in
tiles straight into their payload slots, bitwise the general path (cast, quantize, one copy per tensor kind).

The kernel runs on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with a Triton install; skipped otherwise,
e.g. in CI), against the format's reference quantization; on CUDA against the general path (GPU tests)."""

from __future__ import annotations

import collections
import os
import types

import pytest
import torch

from _gpu import gpu
from hybridq.distributed import grouped_blocks_payload as gbp
from hybridq.distributed.layout import ExpertLayout
from hybridq.formats import Float8BlockQuantizer, MXFP8Quantizer
from hybridq.kernels import triton_tile_payload as tile

INTERPRETER = tile.available() and os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 and Triton")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _weight(rows: int, k: int, dtype, seed: int, nonfinite: bool, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    if nonfinite:
        w[3, 5], w[rows - 1, 0], w[2, k - 1], w[1, 1] = float("nan"), float("inf"), -float("inf"), 3.0e38
    return w.to(dtype).to(device)


# (held experts, rows each, K, slot bytes, data offset, scale offset, x dtype, quantizer options, non-finite)
KERNEL_CASES = [
    (2, 128, 256, 2 * 128 * 256, 0, 128 * 256, torch.float32, {}, False),
    (3, 256, 200, 256 * 200 + 64, 16, 256 * 200 + 32, torch.float32, {}, False),  # (a partial tile along K)
    (2, 128, 130, 128 * 130 + 48, 0, 128 * 130 + 16, torch.float32, {}, True),
    (2, 128, 256, 2 * 128 * 256, 0, 128 * 256, torch.bfloat16, {}, True),
    (1, 128, 128, 128 * 128 + 16, 0, 128 * 128, torch.float32, dict(power_2_scale=False, amax_epsilon=1e-3), False),
    (2, 128, 256, 2 * 128 * 256, 0, 128 * 256, torch.float32, dict(fp8=E5M2), True),
    (2, 128, 256, 2 * 128 * 256, 0, 128 * 256, torch.float32, dict(gather=torch.float32), True),  # (no cast)
    (2, 128, 256, 2 * 128 * 256, 0, 128 * 256, torch.float32, dict(gather=torch.float16), True),
]
KERNEL_IDS = [f"held{c[0]}-n{c[1]}-k{c[2]}-{str(c[6])[6:]}-{c[7]}{'-nonfinite' if c[8] else ''}" for c in KERNEL_CASES]


@interpreter
@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_kernel_writes_each_experts_reference_quantization_into_its_slot(case):
    """Every expert's bytes and tile scales at their offsets of its slot, bitwise the format's reference quantization
    of its rows cast to the gather dtype (bf16 unless the case says; non-finite values included); no other byte of
    the payload written."""
    held, n, k, slot, data_offset, scale_offset, dtype, opts, nonfinite = case
    opts = dict(opts)
    gather = opts.pop("gather", torch.bfloat16)
    q = Float8BlockQuantizer(block_dim=2, **opts)
    x = _weight(held * n, k, dtype, seed=1, nonfinite=nonfinite)
    payload = torch.full((held, slot), 0xAB, dtype=torch.uint8)
    tile.tile_payload(x, payload, n, slot, data_offset, scale_offset, q.dtype, gather,
                      fp8_max=torch.finfo(q.dtype).max, eps=q.amax_epsilon, pow2=q.power_2_scale)
    written = torch.zeros(slot, dtype=torch.bool)
    for g in range(held):
        want, _ = q.reference_parts(x[g * n:(g + 1) * n].to(gather), True, False)
        got = payload[g, data_offset:data_offset + n * k].view(n, k)
        assert torch.equal(got, want.data.view(torch.uint8)), \
            f"expert {g}: {int((got != want.data.view(torch.uint8)).sum())} bytes differ from the reference"
        nbytes = want.scale_inv.numel() * 4
        scales = payload[g, scale_offset:scale_offset + nbytes].view(torch.int32)
        assert torch.equal(scales, want.scale_inv.contiguous().view(-1).view(torch.int32)), \
            f"expert {g}: tile scales {scales.view(torch.float32)} differ from {want.scale_inv}"
        written[data_offset:data_offset + n * k] = True
        written[scale_offset:scale_offset + nbytes] = True
    assert bool((payload[:, ~written] == 0xAB).all()), "bytes outside the experts' data and scales were written"


def test_kernel_refuses_a_payload_it_cannot_fill():
    x = torch.zeros(256, 128)
    for what, payload, n, scale_offset in (("n not whole tiles", torch.zeros(2, 70000, dtype=torch.uint8), 96, 65536),
                                           ("scales past the slot", torch.zeros(2, 16400, dtype=torch.uint8), 128,
                                            16400),
                                           ("unaligned scales", torch.zeros(2, 16400, dtype=torch.uint8), 128, 16386)):
        with pytest.raises(ValueError, match="tile payload"):
            tile.tile_payload(x, payload, n, payload.shape[1], 0, scale_offset, E4M3, torch.bfloat16, fp8_max=448.0)


# ---- where the payload takes the kernel ------------------------------------------------------------------------------

def _template(q, out: int, k: int, send, experts: int = 4, world: int = 2, rank: int = 0, device="cpu"):
    layout = ExpertLayout(0, experts, out, k, world, rank)
    return gbp._make_template(q, layout, send, torch.bfloat16, torch.device(device)), layout


@pytest.mark.parametrize("q, out, k, send, want", [
    (Float8BlockQuantizer(block_dim=2), 256, 128, ("rowwise",), True),
    (Float8BlockQuantizer(block_dim=2), 128, 200, ("rowwise",), True),
    (Float8BlockQuantizer(block_dim=2, fp8="e5m2"), 128, 256, ("rowwise",), True),
    (Float8BlockQuantizer(block_dim=2), 256, 128, ("rowwise", "columnwise"), False),  # (two directions sent)
    (Float8BlockQuantizer(block_dim=1), 256, 128, ("rowwise",), False),  # (1x128 blocks: scales are a buffer)
    (MXFP8Quantizer(), 256, 128, ("rowwise",), False),
], ids=["fp8-tiles", "fp8-tiles-partial-k", "fp8-tiles-e5m2", "both-directions", "fp8-1x128", "mxfp8"])
def test_kernel_writes_exactly_the_payloads_laid_out_as_it_writes(q, out, k, send, want):
    """The template keeps the kernel's offsets only for FP8 128x128 tiles sent rowwise alone: one data buffer of the
    part's own bytes and the tile scales as the one replica."""
    tpl, _ = _template(q, out, k, send)
    assert tpl is not None, "the layout should join"
    assert (tpl.tile is not None) == want, f"{q.describe()} {send}: tile offsets {tpl.tile}, expected {want}"
    if want:
        (b,), (r,) = tpl.metas[0].buffers, tpl.stacked.replicas
        assert tpl.tile == (b.offset, r.offset), f"offsets {tpl.tile} vs data {b.offset}, scales {r.offset}"


def test_kernel_runs_only_on_real_cuda_tensors_with_its_switch_on(monkeypatch):
    monkeypatch.setattr(tile, "available", lambda: True)
    assert gbp._tile_kernel_runs(torch.zeros(2, 2)) is False, "the kernel was asked to run on the CPU"
    with tile.ENABLED.turned(False):
        assert gbp._tile_kernel_runs(torch.zeros(2, 2)) is False


def _local(x: torch.Tensor):
    """What prepare_stacked_blocks reads of the sharded weight: its local data and its state's name, counters and
    per-weight caches (the real function runs; FSDP2 is not needed to call it)."""
    return types.SimpleNamespace(_data=x, _hq=types.SimpleNamespace(name="moe.w1", counters=collections.Counter()))


def _payloads(q, x, layout, kernel: bool, monkeypatch) -> tuple[torch.Tensor, collections.Counter]:
    local = _local(x)
    with monkeypatch.context() as m:
        m.setattr(gbp, "_tile_kernel_runs", lambda t: kernel)
        payload, metas, slot, stacked = gbp.prepare_stacked_blocks(local, [q] * layout.experts, ("rowwise",), layout,
                                                                   torch.bfloat16)
    return payload, local._hq.counters


# (experts, out, in, world, rank, x dtype, non-finite): held 2 of 4; K a partial tile; uneven (rank 1 holds 1 of 3)
PAYLOAD_CASES = [(4, 256, 128, 2, 0, torch.float32, False), (4, 128, 200, 2, 1, torch.float32, True),
                 (3, 128, 256, 2, 1, torch.bfloat16, True), (2, 256, 256, 1, 0, torch.float32, True)]


@interpreter
@pytest.mark.parametrize("case", PAYLOAD_CASES, ids=[f"e{c[0]}-out{c[1]}-in{c[2]}-ws{c[3]}-r{c[4]}" for c in
                                                     PAYLOAD_CASES])
def test_payload_by_the_kernel_is_bitwise_the_general_payload(case, monkeypatch):
    """prepare_stacked_blocks with the kernel (its CUDA predicate forced under the interpreter) and without: the same
    payload bytes, the gaps zero; the kernel's launch counted."""
    experts, out, k, world, rank, dtype, nonfinite = case
    layout = ExpertLayout(0, experts, out, k, world, rank)
    held = layout.slots_held
    x = _weight(held * out, k, dtype, seed=7, nonfinite=nonfinite).view(held, out, k)
    q = Float8BlockQuantizer(block_dim=2)
    by_kernel, counters = _payloads(q, x, layout, True, monkeypatch)
    general, general_counters = _payloads(q, x, layout, False, monkeypatch)
    assert counters["tile_payloads"] == 1 and general_counters["tile_payloads"] == 0, (counters, general_counters)
    assert torch.equal(by_kernel, general), \
        f"{case}: {int((by_kernel != general).sum())} payload bytes differ from the general path's"


@gpu
@pytest.mark.parametrize("case", PAYLOAD_CASES + [(16, 1024, 2048, 1, 0, torch.float32, True),
                                                  (16, 2048, 1024, 1, 0, torch.float32, False)],
                         ids=[f"e{c[0]}-out{c[1]}-in{c[2]}-ws{c[3]}-r{c[4]}" for c in PAYLOAD_CASES] +
                         ["moe-w1", "moe-w2"])
def test_cuda_payload_by_the_kernel_is_bitwise_the_general_payload(case):
    """On CUDA (the compiled kernel: an fp32 shard cast to bf16 in the kernel, the hardware's FP8 conversion):
    bitwise the general path (torch's cast, the extension's tile quantize, the copies), non-finite values
    included."""
    if not tile.available():
        pytest.skip("needs Triton")
    experts, out, k, world, rank, dtype, nonfinite = case
    layout = ExpertLayout(0, experts, out, k, world, rank)
    held = layout.slots_held
    x = _weight(held * out, k, dtype, seed=7, nonfinite=nonfinite, device="cuda").view(held, out, k)
    q = Float8BlockQuantizer(block_dim=2)
    local = _local(x)
    payload, *_ = gbp.prepare_stacked_blocks(local, [q] * experts, ("rowwise",), layout, torch.bfloat16)
    assert local._hq.counters["tile_payloads"] == 1, f"{case}: the kernel did not run ({local._hq.counters})"
    with tile.ENABLED.turned(False):
        general, *_ = gbp.prepare_stacked_blocks(_local(x), [q] * experts, ("rowwise",), layout, torch.bfloat16)
    assert torch.equal(payload, general), \
        f"{case}: {int((payload != general).sum())} payload bytes differ from the general path's"


@pytest.mark.skipif(not tile.available() or INTERPRETER, reason="needs Triton compiling (not its interpreter)")
@pytest.mark.parametrize("x_dtype, fp8, k", [(torch.float32, E4M3, 2048), (torch.float32, E4M3, 200),
                                             (torch.bfloat16, E5M2, 1024)], ids=["fp32-e4m3", "fp32-partial-k",
                                                                                 "bf16-e5m2"])
def test_kernel_compiles_for_sm90(x_dtype, fp8, k):
    """The kernel builds for sm_90 (no GPU needed) at its launch's constexprs: the hardware conversions (the fp32 ->
    bf16 cast in the kernel, the satfinite FP8 one) and the division's PTX."""
    from _triton_aot import compile_sm90
    grid, head, kw = tile._make_plan(k, x_dtype, fp8, x_dtype == torch.float32, 448.0, 0.0, True, 16 * 1024)
    assert kw["USE_ASM"], "the plan outside the interpreter should use the hardware's instructions"
    x_type = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}[x_dtype]
    sig = {"x_ptr": x_type, "out_ptr": "*u8", "scale_ptr": "*fp32", "K": "i32", "stride_x": "i32", "n": "i32",
           "slot": "i32", "data_offset": "i32", "scale_offset": "i32", "scale_cols": "i32", "fp8_max": "fp32",
           "eps": "fp32"}
    consts = {n: v for n, v in kw.items() if n != "num_warps"}
    compiled = compile_sm90(tile._tile_payload_kernel, sig, consts, ("x_ptr", "out_ptr", "scale_ptr"),
                            kw["num_warps"], 1)
    ptx = compiled.asm["ptx"]
    assert "div.rn.f32" in ptx, "the scale's correctly rounded division is not in the PTX"
    assert ("cvt.rn.bf16.f32" in ptx or "cvt.rn.bf16x2.f32" in ptx) == (x_dtype == torch.float32), \
        "the fp32 -> bf16 cast in the kernel is not the hardware's round-to-nearest conversion"
