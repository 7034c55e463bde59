"""Rowwise FP8 (docs/numerics.md "Rowwise FP8"): one power-of-two scale per row of each part, the columnwise part
scaled per column of x; its FSDP buffer protocol gathers the whole tensor's quantization from row shards; its GEMM
is selected by the parts' declared scale layout (the native rowwise `torch._scaled_mm` on sm_90, emulated
elsewhere); a format without the FSDP hooks is refused when apply_hybrid_fsdp runs. The properties every format
shares (usage, shapes, edge values, bounds, pieces) are checked for it through tests/_format_cases.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq import dispatch
from hybridq.formats import Float8RowwisePart, Float8RowwiseQuantizer, QuantizedPart, Quantizer, ScaleLayout
from hybridq.formats._sharding import dim0_chunks
from hybridq.gemm import emulated_gemm, gemm

from _compare import assert_bitwise

HAVE_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _x(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None] * torch.logspace(-1, 1, k)


def _spec(x2d: torch.Tensor, fp8=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, written out: per row, scale = 2^floor(log2(fp8_max / amax)) in fp32 (amax 0: scale 1), values
    x * scale rounded to nearest-even and saturated to +-fp8_max, scale_inv = 1 / scale."""
    fp8_max = torch.finfo(fp8).max
    amax = x2d.float().abs().amax(dim=1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(torch.tensor(fp8_max) / amax)))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    data = (x2d.float() * scale).clamp(-fp8_max, fp8_max).to(fp8)
    return data, 1.0 / scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_part_has_one_power_of_two_scale_per_stored_row(dtype):
    x = _x(96, 160).to(dtype)
    x[5] = 0.0  # a zero row: scale 1
    t = Float8RowwiseQuantizer().quantize(x, rowwise=True, columnwise=True)
    for part, src in ((t.rowwise, x), (t.columnwise, x.t())):
        data, scale_inv = _spec(src)
        assert part.scale_inv.shape == (src.shape[0], 1), f"{part!r}: scale_inv {tuple(part.scale_inv.shape)}"
        assert_bitwise(part.scale_inv, scale_inv, f"{part.direction} scale_inv")
        assert_bitwise(part.data.view(torch.uint8), data.view(torch.uint8), f"{part.direction} fp8 bytes")


def test_a_large_outlier_row_leaves_the_other_rows_scales_alone():
    x = _x(64, 64)
    y = x.clone()
    y[3] *= 1e6
    a, b = (Float8RowwiseQuantizer().quantize(v).rowwise for v in (x, y))
    keep = [i for i in range(64) if i != 3]
    assert_bitwise(a.scale_inv[keep], b.scale_inv[keep], "scales of the rows without the outlier")


def test_a_nan_stays_in_its_row_and_column():
    """A NaN gives its row (rowwise) and its column (columnwise) scale 1 and stays NaN; every other row and column is
    quantized as without it."""
    x = _x(32, 48)
    y = x.clone()
    y[4, 7] = float("nan")
    a, b = (Float8RowwiseQuantizer().quantize(v, rowwise=True, columnwise=True) for v in (x, y))
    for d, line in (("rowwise", 4), ("columnwise", 7)):
        pa, pb = a.part(d), b.part(d)
        assert pb.scale_inv[line].item() == 1.0, f"{d}: the NaN's line has scale_inv {pb.scale_inv[line].item()}"
        keep = [i for i in range(pa.rows) if i != line]
        assert_bitwise(pb.data[keep].view(torch.uint8), pa.data[keep].view(torch.uint8), f"{d}: the other lines")
        assert_bitwise(pb.scale_inv[keep], pa.scale_inv[keep], f"{d}: the other lines' scales")
    assert torch.isnan(b.dequantize(direction="rowwise")[4, 7]) and torch.isnan(b.dequantize(direction="columnwise")[4, 7])


@pytest.mark.parametrize("shape", [(96, 64), (97, 48), (5, 32), (1, 16)], ids=str)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_row_shards_gather_into_the_whole_quantization(shape, world_size):
    """The FSDP buffer protocol: each shard quantized with the MAX of the shards' column amaxes (`shard_stats`),
    its buffers concatenated along dim 0, rebuilt by `assign_gathered`, is bitwise the whole tensor's part."""
    q = Float8RowwiseQuantizer()
    w = _x(*shape).to(torch.bfloat16)
    m, k = shape
    whole = q.quantize_parts(w, True, True)
    shards = dim0_chunks(shape, world_size)
    reduced = torch.stack([q.shard_stats(w[s.offset:s.end], s) for s in shards]).amax(0)  # the all-reduce
    for d, want in enumerate(whole):
        gathered, replicated = {}, None
        for s in shards:
            parts = q.reference_parts(w[s.offset:s.end], d == 0, d == 1, shard=s, stats=reduced)
            bufs, rep = parts[d].extract_buffers(s)
            for name, t, _ in bufs:
                gathered.setdefault(name, []).append(t)
            if replicated is not None:
                for n, t in rep.items():
                    assert_bitwise(t, replicated[n], f"replicated {n} differs between shards")
            replicated = rep
        full = Float8RowwisePart.assign_gathered({n: torch.cat(ts) for n, ts in gathered.items()}, replicated,
                                                 rows=want.rows, cols=want.cols, columnwise=d == 1, meta={})
        for n in ("data", "scale_inv"):
            assert_bitwise(getattr(full, n), getattr(want, n), f"{want.direction}.{n}, shape {shape}, {world_size} "
                                                               f"shards")


# ---- the preset ---------------------------------------------------------------------------------------------------

def test_fp8_rowwise_is_torchaos_rowwise_recipe():
    """torchao's Float8LinearRecipeName.ROWWISE: E4M3 for input, weight and grad_output, axiswise scales rounded down
    to powers of two (docs/numerics.md "Rowwise FP8")."""
    r = hq.recipe("fp8_rowwise")
    for t in ("input", "weight", "grad_output"):
        q = r.quantizer(hq.Role("linear", t, "fc"))
        assert isinstance(q, Float8RowwiseQuantizer), f"{t}: {q!r}"
        assert q.dtype == torch.float8_e4m3fn and q.power_2_scale, f"{t}: {q.describe()}, pow2={q.power_2_scale}"


def test_the_format_module_declares_its_preset():
    from hybridq.formats import float8_rowwise
    from hybridq.formats._presets import declared_presets
    assert declared_presets()["fp8_rowwise"][0] is float8_rowwise.fp8_rowwise
    assert "fp8_rowwise" in hq.preset_names() and hq.recipe("fp8_rowwise").qfactory is float8_rowwise.fp8_rowwise


def test_declaring_a_preset_name_twice_is_refused():
    from hybridq.formats._presets import declare_preset
    with pytest.raises(ValueError, match="'fp8_rowwise' is declared twice"):
        declare_preset("fp8_rowwise", "another")(lambda role: None)


# ---- GEMM: selected by the declared scale layout ----------------------------------------------------------------

def test_rowwise_parts_declare_the_row_scale_layout():
    t = Float8RowwiseQuantizer().quantize(_x(32, 64), rowwise=True, columnwise=True)
    assert t.rowwise.scale_layout is ScaleLayout.ROW and t.columnwise.scale_layout is ScaleLayout.ROW


class _OtherRowPart(Float8RowwisePart):
    """A part type the GEMM table was never told about, declaring the ROW layout."""


def test_a_layout_gemm_takes_any_part_type_declaring_its_layouts():
    calls = []

    def run(a, b, out_dtype):
        calls.append((type(a), type(b)))
        return emulated_gemm(a, b, out_dtype)

    a = Float8RowwiseQuantizer().quantize(_x(32, 64)).rowwise
    b = Float8RowwiseQuantizer().quantize(_x(16, 64, seed=1)).rowwise
    b = _OtherRowPart(rows=b.rows, cols=b.cols, columnwise=False, data=b.data, scale_inv=b.scale_inv)
    dispatch.register_layout_gemm(ScaleLayout.ROW, ScaleLayout.ROW, "test-row", run, lambda a, b: True)
    try:
        y = gemm(a, b, torch.float32)
    finally:
        dispatch._LAYOUT_GEMM[(ScaleLayout.ROW, ScaleLayout.ROW)] = [
            g for g in dispatch._LAYOUT_GEMM[(ScaleLayout.ROW, ScaleLayout.ROW)] if g.name != "test-row"]
    assert calls == [(Float8RowwisePart, _OtherRowPart)], f"layout GEMM calls: {calls}"
    assert_bitwise(y, a.dequantize_2d() @ b.dequantize_2d().t(), "layout GEMM result")


def test_cpu_gemm_is_the_product_of_the_dequantized_parts():
    q = Float8RowwiseQuantizer()
    x, w = _x(48, 64), _x(32, 64, seed=2)
    a, b = q.quantize(x).rowwise, q.quantize(w).rowwise
    assert dispatch.find_native_gemm(a, b) is None, "a native GEMM took CPU parts"
    assert_bitwise(gemm(a, b, torch.float32), a.dequantize_2d() @ b.dequantize_2d().t(), "emulated GEMM")


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_SM90, reason="needs an sm_90+ GPU (torch._scaled_mm rowwise)")
@pytest.mark.parametrize("gemm_name", ["fprop", "dgrad", "wgrad"])
def test_gpu_native_rowwise_gemm_matches_the_emulation(gemm_name):
    """torch._scaled_mm with per-row scales, selected by ScaleLayout.ROW: within the stated GEMM tolerance of the
    fp32 emulation (bf16 output; fast accumulation in fprop), and bitwise torch._scaled_mm on the same bytes."""
    from hybridq.kernels import native_gemm
    q = Float8RowwiseQuantizer()
    x, w, dy = (q.quantize(_x(*s, seed=i).cuda(), rowwise=True, columnwise=True)
                for i, s in enumerate([(256, 512), (384, 512), (256, 384)]))
    a, b = {"fprop": (x.rowwise, w.rowwise), "dgrad": (dy.rowwise, w.columnwise),
            "wgrad": (dy.columnwise, x.columnwise)}[gemm_name]
    g = dispatch.find_native_gemm(a, b)
    assert g is not None and g.name == "cuda-scaled-mm-rowwise", f"selected {g}"
    y = gemm(a, b, torch.bfloat16)
    fast = native_gemm.FAST_ACCUM_FPROP and not a.columnwise and not b.columnwise
    want = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv.reshape(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=fast)
    assert_bitwise(y, want, "native rowwise GEMM vs torch._scaled_mm")
    ref = emulated_gemm(a, b, torch.float32)
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-2, f"native rowwise GEMM vs the fp32 emulation: max relative error {err:.2e} > 1e-2"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_quantization_is_bitwise_the_cpu_reference():
    x = _x(256, 384).to(torch.bfloat16)
    q = Float8RowwiseQuantizer()
    cpu, gpu = q.quantize(x, rowwise=True, columnwise=True), q.quantize(x.cuda(), rowwise=True, columnwise=True)
    for d in ("rowwise", "columnwise"):
        for n, t in cpu.part(d).tensors().items():
            assert_bitwise(gpu.part(d).tensors()[n].cpu(), t, f"{d}.{n} on the GPU vs the CPU reference")


# ---- a format without the FSDP hooks ------------------------------------------------------------------------------

class _PlainPart(QuantizedPart):
    format_name = "plain-bf16"
    tensor_fields = ("data",)

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        return self.data.float().t() if self.columnwise else self.data.float()


@dataclasses.dataclass
class _PlainQuantizer(Quantizer):
    """A toy format with a reference and no FSDP hooks (neither ShardableQuantizer nor GatherablePart)."""

    format_name = "plain-bf16"

    def reference_parts(self, x2d, rowwise, columnwise, **kw):
        m, k = x2d.shape
        d = x2d.to(torch.bfloat16)
        return (_PlainPart(rows=m, cols=k, columnwise=False, data=d) if rowwise else None,
                _PlainPart(rows=k, cols=m, columnwise=True, data=d) if columnwise else None)


def test_a_format_without_fsdp_hooks_is_refused_when_apply_hybrid_fsdp_runs():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    recipe = hq.CustomRecipe(lambda role: _PlainQuantizer() if role.tensor_type == "weight" else None, name="toy")
    with pytest.raises(NotImplementedError, match=r"apply_hybrid_fsdp: the weight of 0 uses plain-bf16.*"
                                                  r"ShardableQuantizer"):
        hq.apply_hybrid_fsdp(model, recipe)
    assert type(model[0]) is nn.Linear and type(model[0].weight) is nn.Parameter, "the model changed before the error"
    hq.Linear.from_linear(model[0], recipe)(torch.randn(4, 32)).sum().backward()  # the format itself works
