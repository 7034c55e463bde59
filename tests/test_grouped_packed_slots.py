"""The grouped quantize of GroupedLinear's packed block path (hybridq/kernels/grouped_slots.py: the extension's tile
kernel through the slots' row map, or triton_slot_quantize.py): the routed token rows quantized straight into the
zero-padded expert slots (one launch for both directions of one quantizer, one per direction of a hybrid whose
directions differ) are bitwise the quantization of the packed buffer (`TokenLayout.pack`, then `quantize_groups`) --
every slot's bytes and scales, padding included -- for FP8 1x128 blocks and MXFP8 1x32 blocks, alone or as a hybrid's
directions, on random and adversarial tokens (empty and one-token experts, NaN of either sign, +-inf, fp32
subnormals, values near FLT_MAX, a partial last 128-block along K).

Where they run: the Triton kernel's logic on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton
installed: the kernel against the reference; skipped otherwise, as in CI), and on CUDA (both backends against the
extension's CUDA kernel on the packed buffer; the row-mapped ops on misaligned tokens and their refusals; the layer's
outputs and gradients against the packing path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridq as hq
from _compare import assert_parts_bitwise, assert_results_bitwise
from _format_cases import FLT_MAX, FORMATS
from _gpu import extension_ready
from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.formats import Float8BlockQuantizer, HybridQuantizer, MXFP8Quantizer
from hybridq.kernels import grouped_slots, triton_slot_quantize
from hybridq.nn.grouped_packed import TokenLayout

CASES = {name: FORMATS[name] for name in ("fp8blk_1x128_e4m3", "fp8blk_1x128_e5m2", "fp8blk_1x128_e4m3_nopow2",
                                          "mxfp8_e4m3", "mxfp8_e5m2")}
CASES["fp8blk_eps"] = lambda: Float8BlockQuantizer(amax_epsilon=1e-3)
CASES["hybrid_fp8blk_mxfp8"] = lambda: HybridQuantizer(rowwise=Float8BlockQuantizer(), columnwise=MXFP8Quantizer())
SPLITS = [[5, 0, 130, 1, 40], [0, 0, 0, 1], [128, 256, 0, 3], [1, 1, 1, 1]]
DIRECTIONS = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1" and triton_slot_quantize.available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton with TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (extension_ready() and triton_slot_quantize.available()), reason="needs CUDA, the extension and Triton")])]


def _tokens(splits, k, dtype, device):
    """Tokens whose magnitude differs by expert (a block shared by two experts would change a scale), with NaN of
    both signs, +-inf, an fp32-subnormal row, a row near FLT_MAX and a zero row where the experts have the rows."""
    gen = torch.Generator().manual_seed(3)
    mag = torch.cat([torch.full((m,), 10.0 ** (e % 5 - 2)) for e, m in enumerate(splits)])[:, None]
    x = torch.randn(sum(splits), k, generator=gen) * mag
    t = x.shape[0]
    if t > 12:
        x[1, 3], x[2, 7], x[4, 0], x[5, 9] = float("nan"), -float("nan"), float("inf"), -float("inf")
        x[6] = torch.randn(k, generator=gen) * 1e-39  # fp32 subnormals (bf16 keeps some)
        x[7] = torch.randn(k, generator=gen).sign() * FLT_MAX / 4
        x[8] = 0.0
        x[9, :3] = torch.tensor([1e38, -3e-38, 5.0])
    return x.to(device, dtype)


def _layout(q, splits, rowwise, columnwise, device):
    """The packed path's slots: 16-padded counts rounded up to whole blocks along the tokens."""
    multiple = q.split_granularity(rowwise, columnwise)[0]
    padded = [-(-m // 16) * 16 if m else 0 for m in splits]
    return TokenLayout.build(splits, padded, torch.device(device), multiple)


def _kernel(q, x, layout, rowwise, columnwise):
    """The grouped quantize: through grouped_slots on CUDA (which must take the call), the Triton kernel itself under
    the interpreter (grouped_slots takes CUDA tensors only)."""
    src = layout.source_rows(x.device)
    if x.is_cuda:
        out = grouped_slots.quantize(q, x, src, rowwise, columnwise)
        assert out is not None, f"{q.describe()}: the grouped quantize did not take the call"
        return out.part(ROWWISE) if rowwise else None, out.part(COLUMNWISE) if columnwise else None
    parts = []
    for d, col in grouped_slots._direction_quantizers(q, rowwise, columnwise):
        t = triton_slot_quantize
        mode = t.MODE_FP8_BLOCK if isinstance(d, Float8BlockQuantizer) else t.MODE_MXFP8
        kw = dict(eps=d.amax_epsilon, pow2=d.power_2_scale) if mode == t.MODE_FP8_BLOCK else {}
        rq, rs, cq, cs = t.slot_quantize(x, src, mode, d.dtype, not col, col,
                                         fp8_max=float(torch.finfo(d.dtype).max), **kw)
        s, k = src.shape[0], x.shape[1]
        parts.append(grouped_slots._part(d, cq, cs, k, s, True) if col else grouped_slots._part(d, rq, rs, s, k, False))
    row = parts[0] if rowwise else None
    return row, (parts[-1] if columnwise else None)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("k", [160, 256], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("device,backend", [pytest.param(*d.values, b, marks=d.marks, id=f"{d.values[0]}-{b}")
                                            for d in DEVICES for b in ("cuda", "triton")
                                            if d.values[0] == "cuda" or b == "triton"])
def test_slots_quantized_from_token_rows_are_bitwise_the_packed_quantization(device, backend, case, splits, k,
                                                                              direction, monkeypatch):
    """Both backends of grouped_slots on CUDA (the extension's tile kernel through the row map; the Triton kernel),
    the Triton kernel under the interpreter."""
    monkeypatch.setitem(grouped_slots.BACKEND, "name", backend)
    rowwise, columnwise = DIRECTIONS[direction]
    q = CASES[case]()
    for dtype in (torch.bfloat16, torch.float32):
        x = _tokens(splits, k, dtype, device)
        layout = _layout(q, splits, rowwise, columnwise, device)
        want = q.quantize_groups(layout.pack(x), layout.slots, rowwise=rowwise, columnwise=columnwise, name="x")
        got_row, got_col = _kernel(q, x, layout, rowwise, columnwise)
        what = f"{case} ({backend}) {dtype} splits {splits} K={k}"
        assert_parts_bitwise(got_row, want.part(ROWWISE) if rowwise else None, f"{what} rowwise")
        assert_parts_bitwise(got_col, want.part(COLUMNWISE) if columnwise else None, f"{what} columnwise")


# every kernel shape a config selects: one or several rowwise blocks per tile, persistent programs looping over tiles
# (under the interpreter: 3 programs)
SHAPES = {"fp8_block": [(128, 8), (256, 8), (128, 8, 0, 2, 1)],
          "mxfp8": [(128, 8), (256, 4), (64, 4), (128, 4, 0, 3, 2)]}


@pytest.mark.parametrize("k", [160, 256], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("fmt,config", [(f, c) for f, cs in SHAPES.items() for c in cs], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_every_kernel_config_quantizes_the_slots_bitwise(device, fmt, config, k):
    """The tile shape, chunking and program loop a config picks change the schedule, never a byte or a scale."""
    t = triton_slot_quantize
    if fmt == "fp8_block":
        q, mode, kw = Float8BlockQuantizer(), t.MODE_FP8_BLOCK, dict(eps=0.0, pow2=True)
    else:
        q, mode, kw = MXFP8Quantizer(), t.MODE_MXFP8, {}
    splits = [5, 0, 130, 1, 40, 200]
    x = _tokens(splits, k, torch.bfloat16, device)
    layout = _layout(q, splits, True, True, device)
    want = q.quantize_groups(layout.pack(x), layout.slots, rowwise=True, columnwise=True, name="x")
    src = layout.source_rows(x.device)
    rq, rs, cq, cs = t.slot_quantize(x, src, mode, q.dtype, True, True, fp8_max=float(torch.finfo(q.dtype).max),
                                     config=config, **kw)
    s = src.shape[0]
    assert_parts_bitwise(grouped_slots._part(q, rq, rs, s, k, False), want.part(ROWWISE), f"{fmt} {config} rowwise")
    assert_parts_bitwise(grouped_slots._part(q, cq, cs, k, s, True), want.part(COLUMNWISE), f"{fmt} {config} columnwise")


@pytest.mark.skipif(not triton_slot_quantize.available(), reason="needs Triton")
@pytest.mark.parametrize("config,rule", [((64, 8), "whole power-of-two rowwise blocks"),
                                         ((384, 8), "whole power-of-two rowwise blocks"),
                                         ((128, 16), "a power of two up to 8 warps"),
                                         ((128, 8, 300), "a register cap within 0..255"),
                                         ((128, 8, 0, 2, 0), "programs per SM exactly where stages > 0")])
def test_a_config_the_kernel_does_not_implement_is_refused_before_anything_runs(config, rule):
    x = torch.zeros(4, 256)
    src = torch.arange(128, dtype=torch.int32) % 4
    with pytest.raises(ValueError, match=f"slot quantize config .*{rule}"):
        triton_slot_quantize.slot_quantize(x, src, triton_slot_quantize.MODE_FP8_BLOCK, torch.float8_e4m3fn, True,
                                           True, fp8_max=448.0, config=config)


@pytest.mark.skipif(not triton_slot_quantize.available(), reason="needs Triton")
def test_a_columnwise_form_of_a_slot_count_not_a_multiple_of_4_is_refused():
    """The columnwise bytes are written 4 slot rows to a word (the packed path's slot counts are 16-aligned)."""
    src = torch.arange(130, dtype=torch.int32) % 4
    with pytest.raises(ValueError, match="columnwise form of 130 slot rows: the slot count must be a multiple of 4"):
        triton_slot_quantize.slot_quantize(torch.zeros(4, 256), src, triton_slot_quantize.MODE_FP8_BLOCK,
                                           torch.float8_e4m3fn, False, True, fp8_max=448.0)


def test_source_rows_point_each_slot_row_at_its_token_or_padding():
    """Slot row r holds token source_rows[r]; the padding rows after each expert's tokens are -1."""
    layout = TokenLayout.build([3, 0, 2], [16, 0, 16], torch.device("cpu"), 128)
    src = layout.source_rows(torch.device("cpu"))
    want = torch.full((256,), -1, dtype=torch.int32)
    want[:3] = torch.arange(3)
    want[128:130] = torch.tensor([3, 4])
    assert torch.equal(src, want), f"source rows {src.tolist()} != {want.tolist()}"
    assert layout.source_rows(torch.device("cpu")) is src, "the map is made once per layout"


# ---- the layer on CUDA ------------------------------------------------------------------------------------------

LAYER_PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]


def _run(preset, splits, k, out, monkeypatch, slots_on):
    monkeypatch.setattr(grouped_slots.ENABLED, "on", slots_on)
    packs = []
    real_pack = TokenLayout.pack
    monkeypatch.setattr(TokenLayout, "pack", lambda self, t: packs.append(t.shape) or real_pack(self, t))
    torch.manual_seed(1)
    m = hq.GroupedLinear(len(splits), k, out, recipe=hq.recipe(preset), dtype=torch.bfloat16, device="cuda",
                         name="moe")
    m.packed_path = True
    x = _tokens(splits, k, torch.bfloat16, "cuda").nan_to_num(0.0, 1e4, -1e4).requires_grad_(True)
    dy = _tokens(splits[::-1], out, torch.bfloat16, "cuda").nan_to_num(0.0, 1e4, -1e4)[:x.shape[0]]
    y = m(x, splits)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW": m.weight.grad}, packs


@pytest.mark.gpu
@pytest.mark.skipif(not (extension_ready() and triton_slot_quantize.available()),
                    reason="needs CUDA, the extension and Triton")
@pytest.mark.parametrize("splits", [[5, 0, 130, 1, 40], [300, 0, 0, 2, 64]], ids=str)
@pytest.mark.parametrize("preset", LAYER_PRESETS)
def test_gpu_packed_block_path_packs_nothing_and_keeps_its_results(preset, splits, monkeypatch):
    """The tokens and gradients of FP8-block / MXFP8 experts reach the slots without a packing copy, and the layer's
    output and gradients are bitwise those of the packing path (the same parts, the same GEMMs)."""
    got, packs = _run(preset, splits, 256, 128, monkeypatch, True)
    assert packs == [], f"{preset}: the packed path still packed tensors of shapes {packs}"
    want, packs_before = _run(preset, splits, 256, 128, monkeypatch, False)
    assert packs_before, f"{preset}: the packing path did not pack (the comparison would compare nothing)"
    assert_results_bitwise(got, want, f"{preset} on CUDA, splits {splits}")


@pytest.mark.gpu
@pytest.mark.skipif(not (extension_ready() and triton_slot_quantize.available()),
                    reason="needs CUDA, the extension and Triton")
def test_gpu_a_failing_slot_quantize_is_turned_off_with_a_warning_and_the_tokens_are_packed(monkeypatch):
    """A grouped quantize that fails to compile or launch returns None after one warning and stays off: the packed
    path packs and quantizes as before, with the same bytes."""
    monkeypatch.setattr(grouped_slots.ENABLED, "on", True)
    q, splits = Float8BlockQuantizer(), [5, 0, 130]
    x = _tokens(splits, 256, torch.bfloat16, "cuda")
    layout = _layout(q, splits, True, True, "cuda")

    def fails(*a, **kw):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(grouped_slots, "_launch", fails)
    with pytest.warns(RuntimeWarning, match="grouped slot quantize failed .*no kernel image.*packs the tokens"):
        assert grouped_slots.quantize(q, x, layout.source_rows(x.device), True, True) is None
    assert grouped_slots.ENABLED.on is False, "the failing slot quantize was not turned off"
    assert grouped_slots.quantize(q, x, layout.source_rows(x.device), True, True) is None, "it did not stay off"


@pytest.mark.skipif(not triton_slot_quantize.available(), reason="needs Triton")
@pytest.mark.parametrize("mode", ["fp8_block", "mxfp8"])
def test_kernel_compiles_for_sm90_with_the_cuda_kernels_conversions(mode):
    """The default config compiles for sm_90 (no GPU needed) to the instructions the CUDA tile kernel's numerics rest
    on: `cvt.rn.satfinite` fp32 -> fp8 pairs, IEEE `div.rn.f32` for the FP8-block scales, no flush-to-zero; a
    persistent config to pipelined loads."""
    from _triton_aot import compile_sm90
    t = triton_slot_quantize
    m = t.MODE_FP8_BLOCK if mode == "fp8_block" else t.MODE_MXFP8
    c = t.CONFIGS[m]
    scale = "*fp32" if m == t.MODE_FP8_BLOCK else "*u8"
    sig = {"x_ptr": "*bf16", "src_ptr": "*i32", "rq_ptr": "*u8", "rs_ptr": scale, "cq_ptr": "*i32", "cs_ptr": scale,
           **{n: "i32" for n in ("S", "K", "stride_x", "rs_cols", "cs_cols", "n_tiles", "n_cb", "n_programs")},
           **{n: "fp32" for n in ("fp8_max", "rcp_max", "eps")}}
    k = compile_sm90(t._slot_quantize_kernel, sig,
                     dict(BLOCK_C=c.cols, BLK=t._BLOCKS[m], MODE=m, POW2=True, E5M2=False, IN_KIND=1,
                          ROWWISE=True, COLUMNWISE=True, USE_ASM=True, EVEN=True, STAGES=c.stages, INTERP_ITERS=0),
                     ("x_ptr", "src_ptr", "rq_ptr", "rs_ptr", "cq_ptr", "cs_ptr", "S", "K", "stride_x"), c.warps, 1)
    ptx = k.asm["ptx"]
    if c.stages:  # (a persistent config: the next tiles' loads in flight while one is encoded)
        assert "async_copy_global_to_local" in k.asm["ttgir"], f"{mode} {c}: the tile loads are not pipelined"
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, f"{mode}: no satfinite fp8 conversion in the PTX"
    assert ".ftz" not in ptx, f"{mode}: flush-to-zero instructions in the PTX"
    if m == t.MODE_FP8_BLOCK:
        assert "div.rn.f32" in ptx, f"{mode}: the scale division is not div.rn.f32"


ROW_MAP_GPU = [pytest.mark.gpu, pytest.mark.skipif(not extension_ready(), reason="needs CUDA and the extension")]


def _row_mapped(fmt, x, src, rowwise=True, columnwise=True):
    ops = torch.ops.hybridq
    if fmt == "fp8_block":
        return ops.fp8_block_quantize(x, torch.float8_e4m3fn, 1, 0.0, True, rowwise, columnwise, src)
    return ops.mxfp8_quantize(x, torch.float8_e4m3fn, False, rowwise, columnwise, False, src)


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=ROW_MAP_GPU) for f in ("fp8_block", "mxfp8")])
def test_gpu_row_mapped_quantize_of_misaligned_tokens_is_bitwise_the_mapped_buffers(fmt):
    """Tokens not 16-byte aligned (the kernel reads them element by element), a map with repeated rows, zero rows and
    a slot count that ends inside a tile: bitwise the quantization of the buffer the map stands for."""
    gen = torch.Generator().manual_seed(7)
    t, k = 70, 96
    base = torch.randn(t * k + 1, generator=gen).to("cuda", torch.bfloat16)
    x = base[1:].view(t, k)  # (2 bytes past the allocation's alignment)
    src = torch.tensor(([3, -1, 69, 0, 3] * 40)[:160], dtype=torch.int32, device="cuda")
    packed = torch.where(src[:, None] >= 0, x[src.clamp(min=0).long()], torch.zeros((), dtype=x.dtype, device="cuda"))
    got, want = _row_mapped(fmt, x, src), _row_mapped(fmt, packed.contiguous(), None)
    for name, g, w in zip(("rowwise", "rowwise scales", "columnwise", "columnwise scales"), got, want):
        assert g.shape == w.shape and torch.equal(g.view(torch.uint8), w.view(torch.uint8)), \
            f"{fmt} {name}: the row-mapped quantize differs from the mapped buffer's"


@pytest.mark.parametrize("call,message", [pytest.param(c, m, marks=ROW_MAP_GPU) for c, m in [
    (lambda x, s: torch.ops.hybridq.fp8_block_quantize(x, torch.float8_e4m3fn, 2, 0.0, True, True, True, s),
     "fp8_block_quantize: a row map .src_rows. is implemented for 1x128 blocks only"),
    (lambda x, s: torch.ops.hybridq.mxfp8_quantize(x, torch.float8_e4m3fn, True, True, True, False, s),
     "mxfp8_quantize: a row map .src_rows. is implemented for 1x32 blocks only"),
    (lambda x, s: torch.ops.hybridq.fp8_block_quantize(x, torch.float8_e4m3fn, 1, 0.0, True, True, True, s.long()),
     "fp8_block_quantize: src_rows must be a contiguous 1-D int32 CUDA tensor"),
    (lambda x, s: torch.ops.hybridq.mxfp8_quantize(x, torch.float8_e4m3fn, False, True, True, False, s[:40]),
     "mxfp8_quantize: MXFP8 columnwise .32x1 blocks along M. needs M = src_rows.size.0. divisible by 32, got M 40"),
]], ids=["fp8_block_tiles", "mxfp8_tiles", "int64_map", "mxfp8_slots_not_32"])
def test_gpu_row_mapped_quantize_refuses_what_it_does_not_implement(call, message):
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    src = torch.arange(64, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=message):
        call(x, src)


_BAD_MAP = """
import sys, torch
import hybridq.kernels as k
assert k.extension_available(), "the extension did not load"
x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
src = torch.arange(64, dtype=torch.int32, device="cuda")
src[37] = int(sys.argv[2])
ops = torch.ops.hybridq
if sys.argv[1] == "fp8_block":
    ops.fp8_block_quantize(x, torch.float8_e4m3fn, 1, 0.0, True, True, True, src)
else:
    ops.mxfp8_quantize(x, torch.float8_e4m3fn, False, True, True, False, src)
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("value", [64, -2], ids=["past_the_rows", "below_minus_one"])
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=ROW_MAP_GPU) for f in ("fp8_block", "mxfp8")])
def test_gpu_row_map_value_outside_the_rows_stops_with_a_device_side_assert(fmt, value):
    """A map value outside [-1, rows of x) is never read through: the quantize stops with a device-side assert that
    names the rule (a CUDA error poisons the process, hence a child process)."""
    r = subprocess.run([sys.executable, "-c", _BAD_MAP, fmt, str(value)], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode != 0 and "no error" not in r.stdout, f"{fmt} quantized through map value {value}: {r.stdout}"
    assert "row map (src_rows): a value outside [-1, rows of x)" in r.stderr or "device-side assert" in r.stderr, \
        f"{fmt} with map value {value} failed without the map's device-side assert: {r.stderr[-2000:]}"


class _MappedContract:
    """The extension's row-mapped quantize ops by their contract, on the CPU: the reference quantization (by `d`) of
    the `[S, K]` whose row r is x's row src_rows[r], zeros where < 0; the maps it was given in `seen`."""

    def __init__(self, d):
        self.d, self.seen = d, []

    def _run(self, x, rowwise, columnwise, src_rows):
        self.seen.append(src_rows)
        mapped = torch.where(src_rows[:, None] >= 0, x[src_rows.clamp(min=0).long()], 0.0)
        t = self.d.quantize(mapped, rowwise=rowwise, columnwise=columnwise)
        scales = "scale_inv" if isinstance(self.d, Float8BlockQuantizer) else "scale"
        out = []
        for direction, asked in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
            part = t.part(direction) if asked else None
            out += [part.data, getattr(part, scales)] if asked else [torch.empty(0), torch.empty(0)]
        return tuple(out)

    def fp8_block_quantize(self, x, dtype, block_dim, eps, pow2, rowwise, columnwise, src_rows):
        return self._run(x, rowwise, columnwise, src_rows)

    def mxfp8_quantize(self, x, dtype, block_2d, rowwise, columnwise, swizzle, src_rows):
        return self._run(x, rowwise, columnwise, src_rows)


@pytest.mark.parametrize("case", ["fp8blk_1x128_e4m3", "mxfp8_e5m2", "hybrid_fp8blk_mxfp8"])
def test_cuda_backend_hands_the_row_map_to_the_formats_kernel_and_keeps_its_parts(case, monkeypatch):
    """The "cuda" backend's plumbing, on the CPU: each launch calls the format's CUDA `run` with the slots' row map,
    and the parts it returns are the slot layout's. The extension's op is stood in for by its contract
    (`_MappedContract`; the op itself is tested bitwise on CUDA above)."""
    from hybridq.kernels import cuda_fp8_block, cuda_mxfp8
    q = CASES[case]()
    splits = [5, 0, 130, 1, 40]
    x = _tokens(splits, 256, torch.float32, "cpu")
    layout = _layout(q, splits, True, True, "cpu")
    src = layout.source_rows(x.device)
    monkeypatch.setitem(grouped_slots.BACKEND, "name", "cuda")
    for d, row, col in grouped_slots._launches(q, True, True):
        contract = _MappedContract(d)
        module = cuda_fp8_block if isinstance(d, Float8BlockQuantizer) else cuda_mxfp8
        monkeypatch.setattr(module, "ops", lambda contract=contract: contract)
        got = grouped_slots._launch(x, src, d, row, col, *grouped_slots._launch_args(d, row, col)[3:])
        assert contract.seen and contract.seen[-1] is src, f"{case}: the format's kernel did not get the row map"
        want = d.quantize_groups(layout.pack(x), layout.slots, rowwise=row, columnwise=col, name="x")
        for part, direction, asked in zip(got, (ROWWISE, COLUMNWISE), (row, col)):
            assert_parts_bitwise(part, want.part(direction) if asked else None, f"{case} {direction}")
