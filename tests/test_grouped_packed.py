"""GroupedLinear's packed paths for per-tensor FP8 with current scaling (every expert quantized in one pass per
tensor) give the per-expert path's numbers: bitwise on the CPU, for any token counts (zeros, uneven, padded); they run
only for the recipes they implement. The jagged path (tokens where the router put them, group bounds on the device,
hybridq/nn/grouped_jagged.py) runs where its kernels do (the CPU reference; CUDA sm_90 with Triton); elsewhere the
padded packed path (TokenLayout). On a GPU: the row-group kernel is bitwise the reference; the grouped GEMMs agree
with the per-expert GEMMs within the stated tolerance, with no host sync."""

import pytest
import torch

import hybridq as hq
import hybridq.nn.grouped as grouped_mod
from _compare import assert_bitwise, assert_results_bitwise
from hybridq.formats import Float8Quantizer
from hybridq.gemm import JaggedFP8Kernels
from hybridq.nn.grouped_jagged import JaggedFP8Experts, TokenGroups
from hybridq.nn.grouped_packed import BLOCKS, FP8_TENSOR, ROW_GROUPS, PackedFP8Experts, TokenLayout, packed_quantizers
from _gpu import extension_ready, no_host_sync

E, IN, OUT = 4, 64, 64
SPLITS = [[5, 0, 17, 40], [16, 32, 0, 48], [0, 0, 3, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
HAVE_CUDA = torch.cuda.is_available()


def _run(packed: bool, splits, dtype=torch.bfloat16, x_grad=True, w_grad=True, grad=True, device="cpu",
         recipe="fp8_tensorwise"):
    torch.manual_seed(1)
    recipe = hq.recipe(recipe) if isinstance(recipe, str) else recipe
    m = hq.GroupedLinear(E, IN, OUT, recipe=recipe, dtype=dtype, device=device, name="moe")
    m.packed_path = packed
    m.weight.requires_grad_(w_grad)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(splits), IN, generator=gen).to(device, dtype).requires_grad_(x_grad)
    dy = torch.randn(sum(splits), OUT, generator=gen).to(device, dtype)
    with torch.set_grad_enabled(grad):
        y = m(x, splits)
    if grad and (x_grad or w_grad):
        y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW": m.weight.grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", SPLITS, ids=[str(s) for s in SPLITS])
def test_jagged_path_is_bitwise_the_per_expert_path(splits, dtype):
    assert_results_bitwise(_run(True, splits, dtype), _run(False, splits, dtype), f"splits {splits}, {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", SPLITS, ids=[str(s) for s in SPLITS])
def test_padded_packed_path_is_bitwise_the_per_expert_path(splits, dtype, monkeypatch):
    """Where the jagged kernels do not run (a GPU without them): each expert's tokens padded to 16 as on a GPU, in
    the packed layout and in the per-expert path alike (the zero rows must change nothing)."""
    monkeypatch.setattr(grouped_mod, "native_row_multiple", lambda device: 16)
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: None)
    assert_results_bitwise(_run(True, splits, dtype), _run(False, splits, dtype), f"splits {splits}, {dtype}, x16")


class _Counting(JaggedFP8Kernels):
    """The reference kernels, counting the calls of each operation."""

    def __init__(self):
        self.calls = []

    def quantize(self, q, x2d, groups, columnwise, name):
        self.calls.append(("quantize", name.split(" of ")[0], columnwise))
        return super().quantize(q, x2d, groups, columnwise, name)

    def mm(self, *a, name="", **kw):
        self.calls.append(("mm", name.split(" of ")[0]))
        return super().mm(*a, name=name, **kw)

    def wgrad(self, *a, name="", **kw):
        self.calls.append(("wgrad", name.split(" of ")[0]))
        return super().wgrad(*a, name=name, **kw)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_jagged_path_quantizes_each_operand_once_and_runs_one_grouped_gemm_per_phase(as_tensor, monkeypatch):
    kernels = _Counting()
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: kernels)
    m = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe("fp8_tensorwise"), name="moe")
    splits = [5, 0, 17, 40]
    x = torch.randn(sum(splits), IN, requires_grad=True)
    m(x, torch.tensor(splits) if as_tensor else splits).sum().backward()
    assert kernels.calls == [("quantize", "input", True), ("quantize", "weight", True), ("mm", "fprop"),
                             ("quantize", "grad_output", True), ("mm", "dgrad"), ("wgrad", "wgrad")], kernels.calls


def test_jagged_path_makes_only_the_columnwise_forms_backward_reads(monkeypatch):
    kernels = _Counting()
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: kernels)
    m = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe("fp8_tensorwise"), name="moe")
    m.weight.requires_grad_(False)
    x = torch.randn(30, IN, requires_grad=True)
    m(x, [10, 0, 20, 0]).sum().backward()  # dgrad only: no columnwise input, no wgrad
    assert kernels.calls == [("quantize", "input", False), ("quantize", "weight", True), ("mm", "fprop"),
                             ("quantize", "grad_output", False), ("mm", "dgrad")], kernels.calls


def test_token_groups_from_a_list_or_a_tensor():
    for splits in ([3, 0, 5], torch.tensor([3, 0, 5])):
        g = TokenGroups.build(splits, 8, torch.device("cpu"))
        assert g.ends.tolist() == [3, 3, 8] and g.ends.dtype == torch.int32, g.ends
        assert g.row_group.tolist() == [0, 0, 0, 2, 2, 2, 2, 2] and g.row_group.dtype == torch.int32, g.row_group
        assert g.host_sizes() == [3, 0, 5], g.host_sizes()


@pytest.mark.parametrize("x_grad,w_grad,grad", [(True, False, True), (False, True, True), (True, True, False)],
                         ids=["dgrad-only", "wgrad-only", "no-grad"])
def test_packed_path_computes_only_the_gradients_asked_for(x_grad, w_grad, grad):
    splits = [5, 0, 17, 40]
    assert_results_bitwise(_run(True, splits, x_grad=x_grad, w_grad=w_grad, grad=grad),
                 _run(False, splits, x_grad=x_grad, w_grad=w_grad, grad=grad), f"x_grad={x_grad} w_grad={w_grad}")


# the packed path these presets take (None: per expert): a fast path they keep. Which path a preset takes follows
# from its quantizers' declared properties (Quantizer.local_scaling, packs_row_groups); whichever it is, it computes
# the per-expert path's numbers (test_every_preset_packed_path_is_bitwise_the_per_expert_path), so a new preset
# needs no line here
PACKED_KIND = {"fp8_tensorwise": FP8_TENSOR, "fp8_delayed": None, "fp8_block": BLOCKS, "mxfp8": BLOCKS,
               "nvfp4": ROW_GROUPS, "mxfp8_fwd_nvfp4_bwd": ROW_GROUPS, "fp8_block_fwd_mxfp8_bwd": BLOCKS,
               "fp8_fwd_high_precision_bwd": None}


@pytest.mark.parametrize("preset", sorted(PACKED_KIND))
def test_each_preset_takes_its_packed_path(preset):
    m = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe(preset), name="moe")
    kind = packed_quantizers(m.expert_quantizers)
    got = None if kind is None else kind.kind
    assert got == PACKED_KIND[preset], (
        f"{preset}: packed path {got!r}, expected {PACKED_KIND[preset]!r}; describe_formats={m.describe_formats()}")


@pytest.mark.parametrize("preset", hq.preset_names())
def test_every_preset_packed_path_is_bitwise_the_per_expert_path(preset):
    splits = [5, 0, 17, 42]
    packed, per_expert = _run(True, splits, recipe=preset), _run(False, splits, recipe=preset)
    assert_results_bitwise(packed, per_expert, f"{preset}: packed path vs per expert, splits {splits}")


def test_experts_with_different_quantizers_take_the_per_expert_path():
    def factory(role):  # expert 1's input uses another amax epsilon: not one quantizer for all experts
        eps = 1e-3 if role.name.endswith("experts.1") and role.tensor_type == "input" else 0.0
        return Float8Quantizer("e5m2" if role.tensor_type == "grad_output" else "e4m3", amax_epsilon=eps)
    m = hq.GroupedLinear(E, IN, OUT, recipe=hq.CustomRecipe(factory), name="moe")
    assert packed_quantizers(m.expert_quantizers) is None, "experts with different quantizers were packed"


@pytest.mark.parametrize("bias,override,save_original_input", [(True, None, False), (False, "dequantized", False),
                                                               (False, None, True)])
def test_what_the_packed_path_does_not_implement_runs_per_expert(bias, override, save_original_input, monkeypatch):
    calls = []
    for fn in (PackedFP8Experts, JaggedFP8Experts):
        monkeypatch.setattr(fn, "apply", lambda *a, real=fn.apply: calls.append(1) or real(*a))
    m = hq.GroupedLinear(E, IN, OUT, bias=bias, recipe=hq.recipe("fp8_tensorwise", backward_override=override),
                         save_original_input=save_original_input, name="moe")
    m(torch.randn(10, IN), [10, 0, 0, 0]).sum().backward()
    assert not calls, f"bias={bias} override={override} save_original_input={save_original_input} took the packed path"


def test_token_layout_packs_each_expert_at_its_padded_offset():
    layout = TokenLayout.build([2, 0, 3], [16, 0, 16], torch.device("cpu"))
    x = torch.arange(1, 6, dtype=torch.float32)[:, None]
    packed = layout.pack(x)
    assert packed.shape == (32, 1), f"packed shape {tuple(packed.shape)}"
    assert packed[:2, 0].tolist() == [1, 2] and packed[16:19, 0].tolist() == [3, 4, 5], packed[:, 0].tolist()
    assert packed[2:16].abs().sum() == 0 and packed[19:].abs().sum() == 0, "padding rows are not zero"
    assert torch.equal(layout.unpack(packed), x), "unpack(pack(x)) != x"


@pytest.mark.parametrize("sizes", [[3, 0, 29], [0], [64], [1, 1, 1, 1, 1]], ids=str)
def test_row_groups_are_each_group_quantized_alone(sizes):
    q = Float8Quantizer()
    x = torch.randn(sum(sizes), 32) * torch.logspace(-3, 3, sum(sizes) or 1)[:sum(sizes), None]
    groups = q.quantize_row_groups(x, sizes)
    o = 0
    for g, n in enumerate(sizes):
        if n:
            ref = q.quantize(x[o:o + n], rowwise=True, columnwise=True).rowwise
            assert_bitwise(groups.part(g).data, ref.data, f"group {g} data")
            assert_bitwise(groups.part(g).scale_inv, ref.scale_inv, f"group {g} scale_inv")
            col = groups.columnwise_part(g, groups.data.t().contiguous())
            assert_bitwise(col.data, ref.data.t().contiguous(), f"group {g} columnwise data")
        o += n


def test_row_groups_refuse_delayed_scaling_and_bad_sizes():
    with pytest.raises(ValueError, match="current scaling"):
        Float8Quantizer(scaling="delayed").quantize_row_groups(torch.randn(4, 16), [4])
    with pytest.raises(ValueError, match="sum to its 4 rows"):
        Float8Quantizer().quantize_row_groups(torch.randn(4, 16), [3], name="input of moe")


# ---- GPU --------------------------------------------------------------------------------------------------------


needs_gpu = pytest.mark.skipif(not extension_ready(), reason="needs a CUDA device and the built extension")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("sizes", [[16, 0, 48, 32], [3, 0, 29, 1000], [0, 0, 17]], ids=str)
def test_row_group_kernel_is_bitwise_the_reference(sizes, fp8, dtype):
    q = Float8Quantizer(fp8)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(sum(sizes), 96, generator=gen) * 10 ** torch.randint(-3, 4, (sum(sizes), 1), generator=gen))
    if sum(sizes) > 20:
        x[5, 7], x[20, 3] = float("inf"), float("nan")  # non-finite values stay in their group
    x = x.to(dtype)
    got = q.quantize_row_groups(x.cuda(), sizes)
    ref = q.quantize_row_groups(x, sizes)
    assert_bitwise(got.scale_inv.cpu(), ref.scale_inv, f"scale_inv, groups {sizes}")
    assert_bitwise(got.data.cpu(), ref.data, f"data, groups {sizes}")


ALL_E4M3 = hq.CustomRecipe(lambda role: Float8Quantizer("e4m3"), name="all_e4m3")  # every GEMM grouped on sm_90


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", ALL_E4M3], ids=["fp8_tensorwise", "all_e4m3"])
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [16, 32, 0, 48], [100, 3, 0, 61]], ids=str)
def test_gpu_packed_path_agrees_with_the_per_expert_path(splits, recipe):
    """The grouped GEMMs (torch._scaled_grouped_mm on sm_90 for the E4M3 x E4M3 GEMMs: fprop of fp8_tensorwise,
    all three with E4M3 gradients) multiply the same quantized operands as the per-expert torch._scaled_mm: the
    results differ only by the GEMMs' rounding."""
    got = _run(True, splits, device="cuda", recipe=recipe)
    ref = _run(False, splits, device="cuda", recipe=recipe)
    for k in ("y", "dx", "dW"):
        a, b = got[k].float(), ref[k].float()
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= 1e-2 * scale, f"{k}: max |packed - per-expert| = {err} (max |per-expert| {scale})"


def _cuda_jagged_kernels():
    """The CUDA jagged kernels when they run here (sm_90, Triton, the extension), else None."""
    if not extension_ready():
        return None
    from hybridq.gemm import jagged_fp8_kernels
    q = Float8Quantizer()
    k = jagged_fp8_kernels(torch.device("cuda"), 64, 64, {"input": q, "weight": q, "grad_output": q})
    return None if k is None or k.name == "reference" else k


needs_jagged_gpu = pytest.mark.skipif(_cuda_jagged_kernels() is None,
                                      reason="needs the CUDA jagged kernels (sm_90, Triton, the built extension)")


def test_token_groups_give_the_padded_layout_bounds_without_a_host_sync():
    """Each group rounded up to a multiple of 16 tokens, cumulated on the device; the padded width exact where the host
    has the counts, else an upper bound (fewer than 16 more per group) that needs no device-to-host copy."""
    sizes = [5, 0, 17, 32, 1]
    known = TokenGroups.build(sizes, sum(sizes), torch.device("cpu"))
    assert known.padded_ends.tolist() == [16, 16, 48, 80, 96], known.padded_ends
    assert known.ends.tolist() == [5, 5, 22, 54, 55], known.ends
    assert known.ends.dtype == known.padded_ends.dtype == torch.int32, (known.ends.dtype, known.padded_ends.dtype)
    assert known.padded_width() == 96
    assert not known.aligned16() and TokenGroups.build([16, 0, 32], 48, torch.device("cpu")).aligned16()
    device_only = TokenGroups(torch.tensor(sizes), sum(sizes), None)  # (as a CUDA m_splits: no host counts)
    assert device_only.padded_width() == 144 and device_only.padded_width() % 16 == 0, device_only.padded_width()
    assert not device_only.aligned16(), "unknown counts cannot be promised aligned"
    assert device_only.known_sizes() is None, "padded_width read the device counts"


def test_token_groups_of_one_routing_are_built_once():
    """The projections of one MoE layer (same counts) share one TokenGroups: one host-to-device copy of the counts
    and one set of group bounds per layer, not per projection. New counts (other values, or the same tensor changed
    in place) or another token total build new groups."""
    cpu = torch.device("cpu")
    a = TokenGroups.build([5, 0, 17], 22, cpu)
    assert TokenGroups.build([5, 0, 17], 22, cpu) is a, "equal host counts built the groups again"
    assert TokenGroups.build([5, 1, 16], 22, cpu) is not a, "other counts reused the groups"
    counts = torch.tensor([3, 4], dtype=torch.int64)  # (as a device m_splits: kept by identity and version)
    b = TokenGroups.build(counts, 7, cpu)
    assert TokenGroups.build(counts, 7, cpu) is b, "the same unchanged counts tensor built the groups again"
    assert TokenGroups.build(counts, 8, cpu) is not b, "another token total reused the groups"
    b = TokenGroups.build(counts, 7, cpu)
    counts[0] = 4
    counts[1] = 3
    rebuilt = TokenGroups.build(counts, 7, cpu)
    assert rebuilt is not b and rebuilt.host_sizes() == [4, 3], "counts changed in place reused stale groups"


def test_token_groups_of_each_layer_are_reused_by_its_backward():
    """Every MoE layer has its own routing and its backward reads it again, last layer first: the groups of each of
    the last routings are kept (one build per layer per step, not one per layer per direction). A kept routing
    changed in place, or pushed out by newer ones, is built again."""
    from hybridq.nn import grouped_jagged
    cpu = torch.device("cpu")
    layers = [torch.tensor([i, 3], dtype=torch.int64) for i in range(4)]
    forward = [TokenGroups.build(c, int(c.sum()), cpu) for c in layers]
    backward = [TokenGroups.build(c, int(c.sum()), cpu) for c in reversed(layers)][::-1]
    rebuilt = [i for i, (f, b) in enumerate(zip(forward, backward)) if f is not b]
    assert not rebuilt, f"backward built the groups of layers {rebuilt} again"
    layers[2][0] = 5  # (the same tensor, other counts)
    assert TokenGroups.build(layers[2], 8, cpu).host_sizes() == [5, 3], "a routing changed in place reused its groups"
    for i in range(grouped_jagged._BUILT_ROUTINGS):  # newer routings push the oldest out (the cache is bounded)
        TokenGroups.build([i, 1], i + 1, cpu)
    assert len(grouped_jagged._BUILT) == grouped_jagged._BUILT_ROUTINGS, len(grouped_jagged._BUILT)
    assert TokenGroups.build(layers[0], 3, cpu) is not forward[0], "a routing pushed out of the cache was reused"


def test_token_groups_answer_from_the_host_counts_once_they_are_known():
    """What the host counts say (the padded width, whether every group is 16-aligned) is derived once they are known
    and kept; before that (device counts) the answers are the count-free ones, never kept past a host read."""
    sizes = [16, 0, 32, 48]
    device_only = TokenGroups(torch.tensor(sizes), sum(sizes), None)  # (as a CUDA m_splits: no host counts)
    assert device_only.padded_width() == -(-(96 + 15 * 4) // 16) * 16 and not device_only.aligned16()
    device_only.host_sizes()  # (the reference kernels read the counts: now the host knows them)
    assert device_only.padded_width() == 96 and device_only.aligned16(), \
        (device_only.padded_width(), device_only.aligned16())
    known = TokenGroups.build([17, 0, 32], 49, torch.device("cpu"))
    for _ in range(2):  # (kept answers: the same as derived)
        assert known.padded_width() == 32 + 32 and not known.aligned16(), (known.padded_width(), known.aligned16())


@pytest.mark.parametrize("sizes", [[5, 0, 17, 32, 1], [16, 0, 32], [100] * 3, [128, 128], [0, 0]], ids=str)
def test_cuda_columnwise_pitch_is_the_layout_width_on_the_128_byte_grid(sizes):
    """The CUDA cast's columnwise rows start on 128-byte boundaries (an L2 line: a pitch off that grid split the
    cast's 128-byte column stores and cost 20-35% of its time on an H200): the pitch is the layout's width -- the
    padded layout's, or `ceil16(T)` for the plain transpose -- rounded up to 128, never less."""
    from hybridq.kernels.grouped_fp8 import CudaJaggedFP8
    kernels = CudaJaggedFP8()
    groups = TokenGroups.build(sizes, sum(sizes), torch.device("cpu"))
    width = -(-sum(sizes) // 16) * 16 if groups.aligned16() else groups.padded_width()
    pitch = kernels.columnwise_width(groups)
    assert pitch % 128 == 0 and width <= pitch < width + 128, f"groups {sizes}: pitch {pitch} for width {width}"


def test_stacked_scales_are_flattened_once_per_view():
    """The gathered experts' stacked scales `[E, 1]` (a view the weight state keeps across steps) are flattened once
    and the flat view kept on that view: the same view gives the same flat view, which reads the storage as it is
    now (FSDP2 refills it in place); another view, of the same shape or not, gets its own."""
    from hybridq.nn.grouped_jagged import flat_view
    slab = torch.arange(16, dtype=torch.float32)
    view = slab.as_strided((4, 1), (4, 1))  # (the experts' scales: one per 16-byte row of their buffer)
    flat = flat_view(view)
    assert flat_view(view) is flat, "the same stacked view was flattened again"
    assert torch.equal(flat, torch.tensor([0.0, 4.0, 8.0, 12.0])), flat
    slab[4] = 40.0  # (refilled in place)
    assert flat[1].item() == 40.0, "the kept flat view does not read the refilled storage"
    other = torch.arange(16, dtype=torch.float32).mul_(2).as_strided((4, 1), (4, 1))
    assert torch.equal(flat_view(other), torch.tensor([0.0, 8.0, 16.0, 24.0])), "another view got a kept flat view"
    shifted = slab.as_strided((4, 1), (4, 1), 1)
    assert torch.equal(flat_view(shifted), torch.tensor([1.0, 5.0, 9.0, 13.0])), "a shifted view got a kept flat view"


def _unpadded_columns(col: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, list[str]]:
    """The columnwise form of the CUDA kernels' padded layout (each group from a column multiple of 16, zero-padded
    to a multiple of 16, zeros from the padded total to the buffer's width) as the plain byte transpose, and what is
    wrong with its padding."""
    parts, wrong, o = [], [], 0
    for g, m in enumerate(sizes):
        p = -(-m // 16) * 16
        parts.append(col[:, o:o + m])
        if col[:, o + m:o + p].view(torch.uint8).any():
            wrong.append(f"group {g}: padding columns [{o + m}, {o + p}) not zero")
        o += p
    if col[:, o:].view(torch.uint8).any():
        wrong.append(f"columns [{o}, {col.shape[1]}) past the padded groups not zero")
    return torch.cat(parts, 1), wrong


# (token counts, features): one partial tile; groups across 128-row tiles, K two tiles and a partial one
_QUANTIZE_CASES = [([16, 0, 48, 32], 96), ([3, 0, 29, 1000], 96), ([0, 0, 17], 96), ([0, 0, 0], 96),
                   ([130, 7, 0, 300, 64, 1], 320)]


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """`x` in memory 2 bytes past a 16-byte boundary (contiguous: the cast reads it element by element)."""
    buf = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
    return buf[1:1 + x.numel()].view(x.shape).copy_(x)


@pytest.mark.gpu
@needs_jagged_gpu
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "cuda-tensor"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype,aligned", [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["bf16", "fp32", "bf16-misaligned"])
@pytest.mark.parametrize("sizes,k", _QUANTIZE_CASES, ids=[f"{s}x{k}" for s, k in _QUANTIZE_CASES])
def test_gpu_jagged_quantize_is_bitwise_the_reference(sizes, k, dtype, aligned, fp8, as_tensor):
    """One launch per operand for all experts: rowwise bytes and per-expert scales are bitwise the reference
    quantization of each expert alone; the columnwise bytes too, written by the cast in the padded layout the wgrad
    GEMM reads (each expert's tokens from a 16-aligned column, zeros up to a multiple of 16 and past the last group,
    rows 16-byte aligned)."""
    from hybridq.gemm import REFERENCE_JAGGED_FP8
    q = Float8Quantizer(fp8)
    gen = torch.Generator().manual_seed(3)
    t = sum(sizes)
    x = torch.randn(t, k, generator=gen) * 10 ** torch.randint(-3, 4, (t, 1), generator=gen)
    if t > 20:
        x[5, 7], x[20, 3] = float("inf"), float("nan")  # non-finite values stay in their expert
    x = x.to(dtype)
    route = torch.tensor(sizes, device="cuda") if as_tensor else sizes
    kernels = _cuda_jagged_kernels()
    assert t <= kernels.padded_max_tokens_per_expert * len(sizes), "(groups small enough to be padded)"
    groups = TokenGroups.build(route, t, torch.device("cuda"))
    xc = x.cuda() if aligned else _misaligned(x.cuda())
    got = kernels.quantize(q, xc, groups, True, "x")
    ref = REFERENCE_JAGGED_FP8.quantize(q, x, TokenGroups.build(sizes, t, torch.device("cpu")), True, "x")
    what = f"groups {sizes}, K {k}, {dtype}{'' if aligned else ' misaligned'}"
    assert_bitwise(got.scale_inv.cpu(), ref.scale_inv, f"scale_inv, {what}")
    assert_bitwise(got.row.cpu(), ref.row, f"rowwise, {what}")
    pitch = kernels.columnwise_width(groups)  # (16-aligned groups: the plain transpose, a [K, T] view)
    want_shape = (k, t if groups.aligned16() else pitch)
    assert got.col.shape == want_shape, f"columnwise shape {tuple(got.col.shape)}, want {want_shape}, {what}"
    col, wrong = _unpadded_columns(got.col.cpu(), sizes)
    assert not wrong, f"{what}: {wrong}"
    assert_bitwise(col, ref.col, f"columnwise, {what}")
    assert t == 0 or got.col.stride(0) == pitch, f"columnwise row pitch {got.col.stride(0)}, want {pitch}, {what}"


@pytest.mark.gpu
@needs_jagged_gpu
@pytest.mark.parametrize("bad", ["ends-only", "rowwise-only", "no-width", "int64-ends", "short-padded-ends"])
def test_gpu_padded_grouped_cast_refuses_incomplete_bounds(bad):
    """The grouped cast's padded columnwise layout takes both bounds (int32, one per group), the columnwise part and
    its width: anything else is refused naming the argument, before any kernel runs."""
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    groups = TokenGroups.build([8, 32], 40, torch.device("cuda"))
    ends, pends, width, columnwise = groups.ends, groups.padded_ends, groups.padded_width(), True
    if bad == "ends-only":
        pends = None
    elif bad == "rowwise-only":
        columnwise = False
    elif bad == "no-width":
        width = 0
    elif bad == "int64-ends":
        ends = ends.long()
    else:
        pends = pends[:1]
    with pytest.raises(RuntimeError, match="padded columnwise layout|ends must be|padded_ends must be"):
        torch.ops.hybridq.fp8_tensor_quantize_grouped(x, torch.float8_e4m3fn, groups.row_group, 2, 0.0, False,
                                                      columnwise, width, ends, pends)


_NARROW_WIDTH = """
import torch, hybridq.kernels as k
from hybridq.nn.grouped_jagged import TokenGroups
assert k.extension_available()
x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
g = TokenGroups.build([8, 32], 40, torch.device("cuda"))
torch.ops.hybridq.fp8_tensor_quantize_grouped(x, torch.float8_e4m3fn, g.row_group, 2, 0.0, False, True, 40, g.ends,
                                              g.padded_ends)
torch.cuda.synchronize()
print("NO ERROR")
"""


@pytest.mark.gpu
@needs_jagged_gpu
def test_gpu_padded_grouped_cast_narrower_than_its_groups_fails_on_the_device():
    """A padded width below the groups' padded total (48 > 40 here: rows would be left out of the rowwise form) is a
    device-side assert, never a silently partial cast (in a subprocess: the assert ends its CUDA context)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _NARROW_WIDTH], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "NO ERROR" not in r.stdout and "assert" in (r.stdout + r.stderr).lower(), \
        f"a narrow padded width ran: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


@pytest.mark.gpu
@needs_jagged_gpu
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "cuda-tensor"])
def test_gpu_jagged_path_runs_without_a_host_sync(as_tensor):
    """Forward and backward with m_splits as a CUDA tensor never synchronize with the host (a list: one
    host-to-device copy from pinned memory, no sync either)."""
    m = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe("fp8_tensorwise"), name="moe", device="cuda",
                         dtype=torch.bfloat16)
    splits = [5, 0, 17, 40]
    route = torch.tensor(splits, device="cuda") if as_tensor else splits
    x = torch.randn(sum(splits), IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), OUT, device="cuda", dtype=torch.bfloat16)
    m(x, route).backward(dy)  # (first call: Triton compiles, the extension loads)
    with no_host_sync():
        m(x, route).backward(dy)
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_jagged_gpu
@pytest.mark.parametrize("padded", [True, False], ids=["padded-columnwise", "plain-columnwise"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "cuda-tensor"])
@pytest.mark.parametrize("per_expert", [True, False], ids=["cublas-per-expert", "triton-grouped"])
def test_gpu_jagged_gemms_match_the_emulation_of_the_same_operands(per_expert, as_tensor, padded, monkeypatch):
    """The grouped GEMMs (one cuBLAS GEMM per expert from C++ where the host has the counts, or the Triton grouped
    kernels; wgrad on either columnwise layout, cuBLAS on the padded one) multiply the quantized operands: against the
    fp32 products of the same dequantized operands (per expert) within the tolerance of the tensor cores' summation
    (docs/numerics.md)."""
    kernels = _cuda_jagged_kernels()
    monkeypatch.setattr(kernels, "per_expert_min_us", 0.0 if per_expert else float("inf"))
    monkeypatch.setattr(kernels, "wgrad_per_expert_min_us", 0.0 if per_expert else float("inf"))
    monkeypatch.setattr(kernels, "padded_max_tokens_per_expert", float("inf") if padded else 0.0)
    padded = padded or (per_expert and not as_tensor)  # (host counts for the cuBLAS wgrad: always the padded layout)
    splits, n, k = [100, 3, 0, 61, 16, 300], 96, 128
    e, t = len(splits), sum(splits)
    dev = torch.device("cuda")
    groups = TokenGroups.build(torch.tensor(splits, device=dev) if as_tensor else splits, t, dev)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(t, k, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(e * n, k, device=dev, generator=gen, dtype=torch.bfloat16)
    dy = torch.randn(t, n, device=dev, generator=gen, dtype=torch.bfloat16)
    qx, qw, qg = Float8Quantizer("e4m3"), Float8Quantizer("e4m3"), Float8Quantizer("e5m2")
    xq = kernels.quantize(qx, x, groups, True, "x")
    wq = kernels.quantize(qw, w, TokenGroups.uniform(e, n, dev), True, "w")
    gq = kernels.quantize(qg, dy, groups, True, "dy")
    assert (xq.col.shape[1] != t) == padded, f"columnwise layout {tuple(xq.col.shape)} for {t} tokens"
    from hybridq import _C
    before = _C.cublaslt_stats()["calls"]
    y = kernels.mm(xq.row, xq.scale_inv, wq.row, n * k, k, n, wq.scale_inv, groups, torch.float32, precise=False)
    dx = kernels.mm(gq.row, gq.scale_inv, wq.col, n, wq.col.stride(0), k, wq.scale_inv, groups, torch.float32,
                    precise=True)
    dw = kernels.wgrad(gq.col, gq.scale_inv, xq.col, xq.scale_inv, groups, torch.float32)
    cublas = 3 * sum(1 for m in splits if m) if per_expert and not as_tensor else 0
    assert _C.cublaslt_stats()["calls"] - before == cublas, \
        f"cuBLAS GEMMs run: {_C.cublaslt_stats()['calls'] - before}, expected {cublas} (3 phases per expert with tokens)"
    o = 0
    for g, m in enumerate(splits):
        xs = xq.row[o:o + m].float() * xq.scale_inv[g]
        ws = wq.row[g * n:(g + 1) * n].float() * wq.scale_inv[g]
        gs = gq.row[o:o + m].float() * gq.scale_inv[g]
        for what, got, want in (("fprop", y[o:o + m], xs @ ws.t()), ("dgrad", dx[o:o + m], gs @ ws),
                                ("wgrad", dw[g], gs.t() @ xs)):
            scale = want.abs().max().item() if want.numel() else 0.0
            err = (got - want).abs().max().item() if want.numel() else 0.0
            assert err <= 1e-3 * max(scale, 1e-30) or (scale == 0 and err == 0), \
                f"{what} of expert {g} ({m} tokens): max error {err} of max {scale}"
        o += m


@pytest.mark.gpu
@needs_jagged_gpu
@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [100, 3, 0, 61]], ids=str)
def test_gpu_jagged_cublas_gemms_agree_with_the_per_expert_path(splits, monkeypatch):
    """With host counts and every phase on the per-expert cuBLAS loops (thresholds 0), the jagged layer's output is
    bitwise the per-expert path's (the same operands, the same cuBLAS GEMM per expert); dx and dW (other leading
    dimensions of the same operands, so cuBLAS may pick another algorithm) agree within the GEMMs' rounding."""
    kernels = _cuda_jagged_kernels()
    monkeypatch.setattr(kernels, "per_expert_min_us", 0.0)
    monkeypatch.setattr(kernels, "wgrad_per_expert_min_us", 0.0)
    monkeypatch.setattr(hq.GroupedLinear, "jagged_path", True)
    got = _run(True, splits, device="cuda")
    ref = _run(False, splits, device="cuda")
    assert_bitwise(got["y"], ref["y"], f"y, groups {splits}")
    for k in ("dx", "dW"):
        a, b = got[k].float(), ref[k].float()
        err = (a - b).abs().max().item()
        assert err <= 1e-2 * b.abs().max().item(), f"{k}: max |jagged - per-expert| = {err}, groups {splits}"


@pytest.mark.gpu
@needs_jagged_gpu
def test_gpu_jagged_wgrad_refuses_columnwise_forms_of_two_layouts(monkeypatch):
    """A layout setting changed between the forward's quantize of x and the backward's of dy (one padded, one plain)
    raises naming both widths instead of contracting misaligned tokens."""
    kernels = _cuda_jagged_kernels()
    splits, dev = [100, 3, 61], torch.device("cuda")
    t = sum(splits)
    groups = TokenGroups.build(torch.tensor(splits, device=dev), t, dev)
    x = torch.randn(t, 64, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(t, 32, device=dev, dtype=torch.bfloat16)
    monkeypatch.setattr(kernels, "padded_max_tokens_per_expert", float("inf"))
    xq = kernels.quantize(Float8Quantizer("e4m3"), x, groups, True, "x")
    monkeypatch.setattr(kernels, "padded_max_tokens_per_expert", 0.0)
    gq = kernels.quantize(Float8Quantizer("e5m2"), dy, groups, True, "dy")
    assert xq.col.shape[1] != gq.col.shape[1], "(the two settings give two layouts)"
    with pytest.raises(RuntimeError, match=f"have {gq.col.shape[1]} and {xq.col.shape[1]} token columns.*different"):
        kernels.wgrad(gq.col, gq.scale_inv, xq.col, xq.scale_inv, groups, torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_jagged_gpu])])
def test_a_non_finite_input_stays_in_its_expert(device):
    """A NaN in expert 0's tokens makes expert 0's outputs and weight gradient non-finite and no other expert's (the
    grouped GEMMs never mix two experts' tokens, even inside one tile)."""
    m = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe("fp8_tensorwise"), name="moe", device=device)
    splits = [5, 0, 17, 40]
    x = torch.randn(sum(splits), IN, device=device)
    x[2, 3] = float("nan")
    x.requires_grad_(True)
    y = m(x, splits)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(y[5:]).all(), "another expert's outputs are not finite"
    assert torch.isfinite(m.weight.grad[1:]).all(), "another expert's weight gradient is not finite"
    assert not torch.isfinite(m.weight.grad[0]).all(), "expert 0's weight gradient lost its NaN"


class _PrefersPerExpert(_Counting):
    def prefers_per_expert_path(self, sizes, in_features, out_features):
        return True


@pytest.mark.parametrize("jagged_path", [None, True], ids=["automatic", "forced"])
def test_kernels_that_measure_the_per_expert_path_faster_send_host_counts_there(jagged_path, monkeypatch):
    """jagged_path=None: where the device's kernels measure the per-expert path faster for these host token counts,
    it runs (bitwise the same numbers on the CPU); jagged_path=True keeps the jagged layout."""
    kernels = _PrefersPerExpert()
    monkeypatch.setattr(grouped_mod, "jagged_fp8_kernels", lambda *a: kernels)
    monkeypatch.setattr(hq.GroupedLinear, "jagged_path", jagged_path)
    splits = [5, 0, 17, 40]
    got = _run(True, splits)
    assert bool(kernels.calls) == (jagged_path is True), kernels.calls
    assert_results_bitwise(got, _run(False, splits), f"jagged_path={jagged_path}")


@pytest.mark.parametrize("kind,precise", [("mm", False), ("mm", True), ("wgrad", False), ("wgrad", True)])
def test_jagged_kernels_compile_for_sm90_to_wgmma(kind, precise):
    """The jagged grouped GEMMs' default configs compile for sm_90 without a GPU (Triton's ahead-of-time API) to
    wgmma with pipelined loads: a change to their code is checked on the CPU, not first on the device."""
    from hybridq.kernels import triton_grouped_fp8 as t
    if not t.available():
        pytest.skip("needs Triton")
    from _triton_aot import compile_sm90
    bm, bn, bk, gm, warps, stages = t.CONFIGS[(kind, precise)]
    ptrs = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
            "ends_ptr": "*i32"}
    if kind == "mm":
        ints = ("T", "N", "K", "E", "stride_am", "stride_bg", "stride_bn", "stride_cm", "stride_sb")
        kernel, cons = t._jagged_mm_kernel, dict(EP=16)
        aligned = (*ptrs, "stride_am", "stride_bn", "stride_cm")
    else:
        ints = ("M", "N", "E", "pitch_a", "pitch_b", "stride_cg", "stride_cm")
        kernel, cons = t._jagged_wgrad_kernel, dict(ALIGNED=False)
        aligned = (*ptrs, "pitch_a", "pitch_b", "stride_cm")
    cons = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, **cons, PRECISE=precise)
    k = compile_sm90(kernel, {**ptrs, **dict.fromkeys(ints, "i32")}, cons, aligned, warps, stages)
    assert "wgmma.mma_async" in k.asm["ptx"], f"{kind} (precise={precise}): no wgmma in the PTX"
    assert "async_copy_global_to_local" in k.asm["ttgir"] or "async_tma" in k.asm["ttgir"], \
        f"{kind} (precise={precise}): the loads are not pipelined"
