"""GroupedLinear's packed block path on device counts (hybridq/nn/grouped_device_blocks.py, grouped_packed.SlotLayout):
with `m_splits` as a tensor the slot layout is computed from the counts tensor (no host read on CUDA), its buffers
sized by a bound from the shapes alone, and the results are bitwise the host-count packed path and the per-expert
path (CPU reference: every block preset, uneven / empty / one-token experts, counts not multiples of 16 / 32 / 128).
The Triton grouped GEMMs given the device bounds compute bitwise what they compute on the host's bounds (interpreter
on the CPU; CUDA). On a GPU: the eager layer takes the path with a CUDA counts tensor, bitwise the host-count path with
the same GEMM kernels, never synchronizes with the host, and a block with it replays bitwise from a CUDA graph."""

import pytest
import torch

import hybridq as hq
from _compare import assert_bitwise, assert_results_bitwise
from hybridq.kernels import grouped_blocks, triton_grouped_blocks
from hybridq.nn import grouped_device_blocks
from hybridq.nn.grouped_device_blocks import DeviceBlockExperts, device_path_runs, slot_layout, slot_multiple
from hybridq.nn.grouped_packed import BLOCKS, SlotLayout, TokenLayout, bound_rows, packed_quantizers
from hybridq.nn.linear import shared_input_quantization
from test_grouped_blocks_gemm import DEVICES as KERNEL_DEVICES, INTERPRETER, _interpreter_numpy  # noqa: F401
from _gpu import no_host_sync

E, IN = 4, 160  # K: five 32-blocks, one and a partial 128-block
PRESETS = ["fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"]
SPLITS = [[5, 0, 17, 40], [130, 1, 0, 127], [0, 0, 200, 0], [0, 0, 0, 0], [1, 1, 1, 1], [32, 64, 128, 16]]
OUTS = [128, 96]  # 96: the FP8-block weight's 128x128 tiles would straddle experts (quantized per expert)
GRADS = {"dgrad+wgrad": (True, True), "wgrad-only": (False, True), "dgrad-only": (True, False)}


def _quantizers(preset, n=128, k=IN):
    kind = packed_quantizers(hq.GroupedLinear(E, k, n, recipe=preset).expert_quantizers)
    assert kind is not None and kind.kind == BLOCKS, f"{preset} should take the packed block path"
    return kind.quantizers


def _data(splits, out, dtype=torch.bfloat16, device="cpu", k=IN):
    """Tokens and gradients whose magnitude differs by expert (10^-2 .. 10^2): a block shared by two experts would
    change a scale, hence bytes."""
    gen = torch.Generator().manual_seed(2)
    mag = torch.cat([torch.full((m,), 10.0 ** (e - 2)) for e, m in enumerate(splits)])[:, None]
    x = torch.randn(sum(splits), k, generator=gen) * mag
    dy = torch.randn(sum(splits), out, generator=gen) * mag.flip(0)
    return x.to(device, dtype), dy.to(device, dtype)


def _layer(preset, out, device="cpu", k=IN, packed=True):
    torch.manual_seed(1)
    m = hq.GroupedLinear(E, k, out, recipe=preset, dtype=torch.bfloat16, device=device, name="moe")
    m.packed_path = packed
    return m


def _results(m, x, dy, call):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    m.weight.grad = None
    y = call(m, x)
    if x.requires_grad or m.weight.requires_grad:
        y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW": m.weight.grad}


def _device_call(splits, dgrad, wgrad):
    """The layer's product on the device-count path, its counts a tensor on x's device (on the CPU: read there)."""
    def call(m, x):
        qs = packed_quantizers(m.expert_quantizers).quantizers
        layout = slot_layout(torch.tensor(splits, device=x.device), x, m.in_features, m.out_features, qs, dgrad,
                             wgrad, m.name)
        return DeviceBlockExperts.apply(x, m.weight, layout, qs, m.name, dgrad, wgrad)
    return call


# ---- the layout -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("multiple", [16, 32, 128])
@pytest.mark.parametrize("splits", SPLITS, ids=str)
def test_slot_layout_from_a_counts_tensor_is_the_host_layout_of_the_same_slots(splits, multiple):
    """Table (slot start, first token, tokens, slot size, slot end, token end), source-row map, token rows and packed
    buffer computed from the counts tensor equal those the host's counts give; the rows past the last slot (up to the
    shape bound) are padding: -1 in the map, zero in the buffer."""
    t = sum(splits)
    layout = SlotLayout.build(torch.tensor(splits), t, torch.device("cpu"), multiple, lambda m: m, "moe")
    host = layout.host()
    assert host.slots == [-(-m // multiple) * multiple for m in splits]
    assert layout.rows == bound_rows(t, E, multiple) >= host.total, (layout.rows, host.total)
    assert layout.rows % multiple == 0
    want_table = grouped_blocks.GroupBounds(host.offsets, host.splits, host.slots, torch.device("cpu")).table
    assert_bitwise(layout.table, want_table, f"{splits}: device-built group bounds")
    src = layout.source_rows()
    assert_bitwise(src[:host.total], host.source_rows(torch.device("cpu")), f"{splits}: source rows of the slots")
    assert bool((src[host.total:] == -1).all()), f"{splits}: rows past the last slot must be padding"
    x = torch.randn(t, 8)
    packed = layout.pack(x)
    assert_bitwise(packed[:host.total], host.pack(x) if host.rows is not None else x, f"{splits}: packed buffer")
    assert not packed[host.total:].any(), f"{splits}: rows past the last slot must be zero"


def test_the_shape_bound_holds_every_routing_of_the_shapes():
    """Whatever the counts (here the worst: every expert one row past a multiple), the slots fit the bound."""
    for multiple in (16, 32, 128):
        for t in range(0, 3 * multiple, 7):
            for first in range(0, t + 1, max(1, t // 5)):
                splits = [first] + [(t - first) // (E - 1)] * (E - 2)
                splits.append(t - sum(splits))
                slots = sum(-(-m // multiple) * multiple for m in splits)
                assert slots <= bound_rows(t, E, multiple), (multiple, splits)
        worst = [multiple + 1] * E
        assert sum(2 * multiple for _ in worst) == bound_rows(sum(worst), E, multiple)


@pytest.mark.parametrize("preset", PRESETS)
def test_slots_are_whole_scaling_blocks_of_every_cast(preset):
    qs = _quantizers(preset)
    for dgrad, wgrad in GRADS.values():
        m = slot_multiple(qs, dgrad, wgrad)
        for t in ("input", "grad_output"):
            for row, col in ((True, False), (False, wgrad)):
                assert m % qs[t].split_granularity(row, col)[0] == 0, (preset, t, row, col, m)
        assert m % 16 == 0


# ---- the path on the CPU reference: bitwise the host-count and per-expert paths -----------------------------------

@pytest.mark.parametrize("out", OUTS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_device_count_path_is_bitwise_the_host_count_and_per_expert_paths(preset, splits, out):
    x, dy = _data(splits, out)
    got = _results(_layer(preset, out), x.requires_grad_(), dy, _device_call(splits, True, True))
    host = _results(_layer(preset, out), x, dy, lambda m, x: m(x, splits))
    per_expert = _results(_layer(preset, out, packed=False), x, dy, lambda m, x: m(x, splits))
    assert_results_bitwise(got, host, f"{preset} {splits} N={out}: device counts vs host counts")
    assert_results_bitwise(got, per_expert, f"{preset} {splits} N={out}: device counts vs the per-expert path")


@pytest.mark.parametrize("grads", GRADS)
@pytest.mark.parametrize("preset", PRESETS)
def test_device_count_path_computes_only_the_gradients_asked_for(preset, grads):
    dgrad, wgrad = GRADS[grads]
    splits = [5, 0, 130, 40]
    x, dy = _data(splits, 128)
    runs = []
    for call in (_device_call(splits, dgrad, wgrad), lambda m, x: m(x, splits)):
        m = _layer(preset, 128)
        m.weight.requires_grad_(wgrad)
        runs.append(_results(m, x.requires_grad_(dgrad), dy, call))
    assert (runs[0]["dx"] is None) == (not dgrad) and (runs[0]["dW"] is None) == (not wgrad), grads
    assert_results_bitwise(runs[0], runs[1], f"{preset} {grads}: device counts vs host counts")


@pytest.mark.parametrize("splits, rule", [([10, -1, 55, 0], ">= 0"), ([10, 1, 1, 0], "sum to")],
                         ids=["negative", "sum"])
def test_bad_counts_on_the_cpu_raise_before_anything_is_quantized(splits, rule, monkeypatch):
    """On the CPU (the reference) the counts are read: a ValueError naming the layer and the rule, raised while the
    layout is built (before any quantize)."""
    calls = []
    monkeypatch.setattr(grouped_device_blocks, "_quantize", lambda *a, **k: calls.append(a))
    x = torch.zeros(64, IN)
    with pytest.raises(ValueError, match=rf"moe: m_splits.*{rule}"):
        slot_layout(torch.tensor(splits), x, IN, 128, _quantizers("fp8_block"), True, True, "moe")
    assert not calls


def test_the_device_path_is_taken_only_on_cuda_where_every_phase_runs_grouped():
    """device_path_runs: never on the CPU (there a list or CPU tensor m_splits is read: the host-count path)."""
    for preset in PRESETS:
        assert not device_path_runs(_quantizers(preset), torch.device("cpu"), E, 128, IN), preset


# ---- the Triton grouped GEMMs on the device's bounds ---------------------------------------------------------------

@pytest.mark.parametrize("weight_blocks", [2, 1], ids=["tiles", "rows"])
@pytest.mark.parametrize("splits", [[5, 0, 130, 1], [0, 300, 0, 17], [1, 0, 0, 0]], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_grouped_block_kernels_on_device_bounds_are_bitwise_the_host_bounds(device, splits, weight_blocks):
    """fprop, dgrad and wgrad of the Triton grouped kernels on the slot layout built from the counts tensor (buffer
    of the shape bound, grids bounded by the shapes) vs the same kernels on the host's layout and bounds."""
    from hybridq.enums import COLUMNWISE, ROWWISE
    from hybridq.formats import Float8BlockQuantizer
    n, k = 256, 200
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(5)
    x, dy = torch.randn(sum(splits), k, generator=gen), torch.randn(sum(splits), n, generator=gen)
    w = torch.randn(E, n, k, generator=gen)
    qt, qw = Float8BlockQuantizer(block_dim=1), Float8BlockQuantizer(block_dim=weight_blocks)
    wq = qw.quantize_groups(w.reshape(E * n, k).to(dev), [n] * E, rowwise=True, columnwise=True, name="w")
    layout = SlotLayout.build(torch.tensor(splits, device=dev), sum(splits), dev, 128, lambda m: m, "moe")
    host = TokenLayout.build(splits, splits, dev, 128)
    results = {}
    for what, lay, bounds, pack in (
            ("device", layout, layout.bounds(), layout.pack),
            ("host", host, grouped_blocks.GroupBounds(host.offsets, host.splits, host.slots, dev), host.pack)):
        xq = qt.quantize(pack(x.to(dev)), rowwise=True, columnwise=True, name="x")
        dyq = qt.quantize(pack(dy.to(dev)), rowwise=True, columnwise=True, name="dy")
        results[what] = {
            "fprop": grouped_blocks.mm(xq.part(ROWWISE), wq.part(ROWWISE), E, bounds, torch.bfloat16),
            "dgrad": grouped_blocks.mm(dyq.part(ROWWISE), wq.part(COLUMNWISE), E, bounds, torch.bfloat16),
            "wgrad": grouped_blocks.wgrad(dyq.part(COLUMNWISE), xq.part(COLUMNWISE), bounds, torch.bfloat16)}
    assert_results_bitwise(results["device"], results["host"], f"{splits}: kernels on device bounds vs host bounds")


def _stacked_experts(parts):
    """The experts' parts laid out as FSDP2's stacked gather leaves them (`GroupedWeightState._stack_buffers`): each
    tensor kind one allocation, expert g's tensor its own contiguous copy at g x a 16-byte aligned pitch; (expert 0's
    part, {field: `[E, ...]` view}) as `GroupedWeightState.stacked` gives them."""
    from hybridq.formats._stacking import stacked_view
    per_expert = []
    for p in parts:
        fields = {}
        for name, t in p.tensors().items():
            if t is not None:
                fields[name] = t.contiguous()
        per_expert.append(fields)
    views = {}
    for name, t0 in per_expert[0].items():
        pitch = -(-t0.numel() * t0.element_size() // 16) * 16 // t0.element_size() + 16  # (a gap between experts)
        slab = torch.zeros(len(parts) * pitch, dtype=t0.dtype, device=t0.device)
        members = [slab[g * pitch:g * pitch + t0.numel()].view(t0.shape) for g in range(len(parts))]
        for m, f in zip(members, per_expert):
            m.copy_(f[name])
        views[name] = stacked_view(members)
    p0 = type(parts[0])(rows=parts[0].rows, cols=parts[0].cols, columnwise=parts[0].columnwise,
                        **{**parts[0].tensors(), **{n: v[0] for n, v in views.items()}}, **parts[0].meta())
    return p0, views


@pytest.mark.parametrize("weight_blocks", [2, 1], ids=["tiles", "rows"])
@pytest.mark.parametrize("splits", [[5, 0, 130, 1], [0, 300, 0, 17]], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_grouped_block_mm_on_stacked_experts_is_bitwise_the_joined_weight(device, splits, weight_blocks):
    """fprop (rowwise weight) and dgrad (columnwise) of the Triton grouped kernel reading FSDP2's stacked experts in
    place (`grouped_blocks.mm_stacked`: each expert at its own pitch) vs the same kernel on the experts joined into one
    part (`grouped_packed_blocks._joined`, what the gathered weight's `whole` gives: a copy across experts
    columnwise)."""
    from hybridq.enums import COLUMNWISE, ROWWISE
    from hybridq.formats import Float8BlockQuantizer
    from hybridq.nn.grouped_packed_blocks import _joined
    n, k = 256, 384
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(sum(splits), k, generator=gen)
    dy = torch.randn(sum(splits), n, generator=gen)
    w = torch.randn(E, n, k, generator=gen) * 4.0 ** torch.arange(E)[:, None, None]  # (scales differ by expert)
    qt, qw = Float8BlockQuantizer(block_dim=1), Float8BlockQuantizer(block_dim=weight_blocks)
    experts = [qw.quantize(w[g].to(dev), rowwise=True, columnwise=True, name=f"w{g}") for g in range(E)]
    layout = SlotLayout.build(torch.tensor(splits, device=dev), sum(splits), dev, 128, lambda m: m, "moe")
    bounds = layout.bounds()
    for what, t, d in (("fprop", x, ROWWISE), ("dgrad", dy, COLUMNWISE)):
        a = qt.quantize(layout.pack(t.to(dev, torch.bfloat16)), rowwise=True, columnwise=False, name="a")
        parts = [wq.part(d) for wq in experts]
        p0, views = _stacked_experts(parts)
        assert grouped_blocks.stacked_supported(p0, views), f"{what}: the stacked views were refused"
        got = grouped_blocks.mm_stacked(a.part(ROWWISE), p0, views, bounds, torch.bfloat16)
        want = grouped_blocks.mm(a.part(ROWWISE), _joined(None, parts), E, bounds, torch.bfloat16)
        assert_bitwise(got, want, f"{what} {splits} {weight_blocks}: stacked experts in place vs joined")


@pytest.mark.parametrize("splits", [[5, 0, 130, 1], [0, 300, 0, 17], [1, 0, 0, 0], [0, 0, 0, 0]], ids=str)
def test_grouped_mxfp8_emulation_on_the_device_layout_is_bitwise_the_host_layout(splits, monkeypatch):
    """The device path's fprop / dgrad / wgrad calls of the grouped MXFP8 emulation (`_mm` / `_wgrad`: the device's
    token rows and token ends, the empty experts zeroed on the device) vs the host-count path's calls (host layout,
    its bounds and list of empty experts), on the CPU (its `torch._grouped_mm`; `supports` asks for CUDA)."""
    from hybridq.enums import COLUMNWISE, ROWWISE
    from hybridq.formats import MXFP8Quantizer
    from hybridq.kernels import grouped_emulated
    from hybridq.nn.grouped_packed_blocks import ExpertWeights
    monkeypatch.setattr(grouped_emulated, "supports", lambda a, b: True)
    n, k, dev = 256, 256, torch.device("cpu")
    gen = torch.Generator().manual_seed(6)
    x, dy = torch.randn(sum(splits), k, generator=gen), torch.randn(sum(splits), n, generator=gen)
    q = MXFP8Quantizer()
    wq = ExpertWeights.quantize(q, torch.randn(E, n, k, generator=gen), True, "w")
    assert wq.packed
    layout = SlotLayout.build(torch.tensor(splits), sum(splits), dev, 32, lambda m: m, "moe")
    xq = q.quantize(layout.pack(x), rowwise=True, columnwise=True, name="x")
    dyq = q.quantize(layout.pack(dy), rowwise=True, columnwise=True, name="dy")
    got = {"fprop": grouped_device_blocks._mm(xq.part(ROWWISE), wq, E, ROWWISE, layout, torch.bfloat16, "fprop"),
           "dgrad": grouped_device_blocks._mm(dyq.part(ROWWISE), wq, E, COLUMNWISE, layout, torch.bfloat16, "dgrad"),
           "wgrad": grouped_device_blocks._wgrad(dyq.part(COLUMNWISE), xq.part(COLUMNWISE), layout, E, n, k,
                                                 torch.bfloat16, "wgrad")}
    host = TokenLayout.build(splits, [-(-m // 32) * 32 for m in splits], dev, 32)
    bounds = grouped_blocks.GroupBounds(host.offsets, host.splits, host.slots, dev)
    xh = q.quantize_groups(host.pack(x), host.slots, rowwise=True, columnwise=True, name="x")
    dyh = q.quantize_groups(host.pack(dy), host.slots, rowwise=True, columnwise=True, name="dy")
    w = wq.tensors[0]
    if sum(splits) == 0:  # (the host path computes no product: no token)
        want = {"fprop": got["fprop"].new_zeros(0, n), "dgrad": got["dgrad"].new_zeros(0, k),
                "wgrad": torch.zeros(E, n, k, dtype=torch.bfloat16)}
    else:
        want = {"fprop": grouped_emulated.mm(xh.part(ROWWISE), w.part(ROWWISE), E, bounds.table[4], host.rows,
                                             torch.bfloat16, token_ends=bounds.table[5]),
                "dgrad": grouped_emulated.mm(dyh.part(ROWWISE), w.part(COLUMNWISE), E, bounds.table[4], host.rows,
                                             torch.bfloat16, token_ends=bounds.table[5]),
                "wgrad": grouped_emulated.wgrad(dyh.part(COLUMNWISE), xh.part(COLUMNWISE), bounds.table[4],
                                                bounds.empty, torch.bfloat16)}
    assert_results_bitwise(got, want, f"{splits}: grouped MXFP8 emulation on the device layout vs the host layout")


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8"])
@pytest.mark.parametrize("splits", [[5, 0, 130, 1], [1, 0, 0, 0]], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_slot_quantize_fed_the_device_source_rows_is_bitwise_the_packed_quantization(device, splits, fmt):
    """The grouped slot quantize given the device-built source-row map (slots, then padding up to the shape bound)
    writes the bytes and scales of the packed buffer's quantization."""
    from _compare import assert_parts_bitwise
    from hybridq.enums import COLUMNWISE, ROWWISE
    from hybridq.formats import Float8BlockQuantizer, MXFP8Quantizer
    from hybridq.kernels import grouped_slots, triton_slot_quantize as t
    q, mode, kw = ((Float8BlockQuantizer(), t.MODE_FP8_BLOCK, dict(eps=0.0, pow2=True)) if fmt == "fp8_block"
                   else (MXFP8Quantizer(), t.MODE_MXFP8, {}))
    dev = torch.device(device)
    x = torch.randn(sum(splits), 160, generator=torch.Generator().manual_seed(7)).to(dev, torch.bfloat16)
    layout = SlotLayout.build(torch.tensor(splits, device=dev), sum(splits), dev, 128, lambda m: m, "moe")
    want = q.quantize(layout.pack(x), rowwise=True, columnwise=True, name="x")
    src = layout.source_rows()
    rq, rs, cq, cs = t.slot_quantize(x, src, mode, q.dtype, True, True, fp8_max=float(torch.finfo(q.dtype).max), **kw)
    s = layout.rows
    assert_parts_bitwise(grouped_slots._part(q, rq, rs, s, 160, False), want.part(ROWWISE), f"{fmt} rowwise")
    assert_parts_bitwise(grouped_slots._part(q, cq, cs, 160, s, True), want.part(COLUMNWISE), f"{fmt} columnwise")


# ---- on a GPU ------------------------------------------------------------------------------------------------------

def _device_path_here(preset) -> bool:
    return torch.cuda.is_available() and device_path_runs(_quantizers(preset), torch.device("cuda"), E, 128, IN)


GPU_PRESETS = [pytest.param(p, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _device_path_here(p), reason="needs CUDA sm_90 with the grouped kernels (Triton, the built extension)")])
    for p in ("fp8_block", "mxfp8")]


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_device_counts_take_the_path_bitwise_the_host_count_path(preset, splits, monkeypatch):
    """A CUDA counts tensor takes the device-count path; bitwise the host-count packed path (list counts) with the
    same grouped GEMM kernels (the Triton kernels: the cuBLAS loop needs host counts)."""
    monkeypatch.setitem(grouped_blocks.FORCE, "backend", grouped_blocks.TRITON)
    taken = []
    orig = DeviceBlockExperts.forward

    def spy(*a, **k):
        taken.append(True)
        return orig(*a, **k)
    monkeypatch.setattr(DeviceBlockExperts, "forward", staticmethod(spy))
    x, dy = _data(splits, 128, device="cuda")
    got = _results(_layer(preset, 128, "cuda"), x.requires_grad_(), dy,
                   lambda m, x: m(x, torch.tensor(splits, device="cuda")))
    assert taken, f"{preset}: a CUDA counts tensor should take the device-count path"
    want = _results(_layer(preset, 128, "cuda"), x, dy, lambda m, x: m(x, splits))
    assert_results_bitwise(got, want, f"{preset} {splits}: device counts vs host counts on CUDA")


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_device_count_path_runs_without_a_host_sync(preset):
    m = _layer(preset, 128, "cuda")
    splits = [5, 0, 130, 40]
    route = torch.tensor(splits, device="cuda")
    x, dy = _data(splits, 128, device="cuda")
    x.requires_grad_()
    m(x, route).backward(dy)  # (first call: Triton compiles, the extension loads)
    with no_host_sync():
        m(x, route).backward(dy)
    torch.cuda.synchronize()


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_block_with_device_counts_replays_bitwise_from_a_cuda_graph(preset):
    """Two GroupedLinears (up, SiLU, down) on a CUDA counts tensor: forward and backward captured in a CUDA graph (a
    host sync inside a capture is an error); a replay computes bitwise what eager computes, and a new routing written
    into the counts tensor replays bitwise eager on it."""
    torch.manual_seed(0)
    up = hq.GroupedLinear(E, IN + 96, 128, recipe=preset, device="cuda", dtype=torch.bfloat16, name="up")
    down = hq.GroupedLinear(E, 128, IN + 96, recipe=preset, device="cuda", dtype=torch.bfloat16, name="down")
    route = torch.tensor([5, 0, 130, 121], device="cuda")
    x = torch.randn(256, IN + 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, IN + 96, device="cuda", dtype=torch.bfloat16)
    params = [x, up.weight, down.weight]

    def step():
        for p in params:
            p.grad = None
        out = down(torch.nn.functional.silu(up(x, route)), route)
        out.backward(dy)
        return out

    def eager():
        out = step().detach().clone()
        return [out] + [p.grad.clone() for p in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, the extension loads
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = step()
    captured = [out] + [p.grad for p in params]  # (the graph's own tensors: each replay writes them)
    for splits in ([5, 0, 130, 121], [0, 256, 0, 0]):
        route.copy_(torch.tensor(splits))
        want = eager()
        graph.replay()
        torch.cuda.synchronize()
        for name, g, w in zip(("output", "dx", "dW up", "dW down"), captured, want):
            assert_bitwise(g, w, f"{preset} routing {splits}: {name} replayed from the CUDA graph vs eager")


# ---- the slot layout kernel ----------------------------------------------------------------------------------------

# (counts, tokens): valid routings (empty experts, one expert, more tokens than a program's block, many experts), then
# invalid ones (a negative count, sums off either way) whose table, token rows and validity must still be the aten ops'
LAYOUT_CASES = [([5, 0, 17, 40], 62), ([0, 0, 0, 0], 0), ([0, 300, 0, 0], 300), ([130, 1, 0, 127], 258),
                ([7] * 64, 448), ([(g * 37) % 101 for g in range(200)], sum((g * 37) % 101 for g in range(200))),
                ([5, -3, 17, 40], 59), ([5, 0, 17, 40], 70), ([5, 0, 17, 40], 50), ([-40, 90, -7, 20], 63),
                ([0, 0, 0, 9], 0)]


def _aten_layout(counts: torch.Tensor, tokens: int, multiple: int) -> dict:
    """The layout SlotLayout's aten ops make (CPU counts, read nowhere: the same code as on a GPU)."""
    layout = SlotLayout(counts, tokens, multiple, lambda m: m, None)
    return {"table": layout.table, "token_rows": layout.token_rows, "source": layout.source_rows(),
            "valid": ((counts >= 0).all() & (counts.sum() == tokens)).to(torch.int32).reshape(1)}


@pytest.mark.parametrize("multiple", [16, 32, 128])
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[str(c[0][:6]) + f"-{c[1]}" for c in LAYOUT_CASES])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_slot_layout_kernel_is_bitwise_the_aten_ops(device, case, multiple):
    """kernels/triton_slot_layout.py: table, token rows, source-row map and validity in one launch, bitwise what
    SlotLayout's aten ops (and `source_rows`' scatter) give; for invalid counts the table and validity (0), the token
    rows too where no count is negative, every row inside its tensor (the device assert reports such counts)."""
    from hybridq.kernels import triton_slot_layout
    counts, tokens = case
    want = _aten_layout(torch.tensor(counts), tokens, multiple)
    rows = bound_rows(max(tokens, 0), len(counts), multiple)
    want_rows = SlotLayout(torch.tensor(counts), tokens, multiple, lambda m: m, None).rows
    assert rows == want_rows
    table, token_rows, source, valid = triton_slot_layout.slot_layout(torch.tensor(counts, device=device), tokens,
                                                                      rows, multiple)
    got = {"table": table, "token_rows": token_rows, "source": source, "valid": valid}
    # (a negative count leaves the token ends unsorted: searchsorted's answer is then its binary search's)
    exact = ("table", "valid") + (("token_rows",) if min(counts) >= 0 else ()) + (
        ("source",) if min(counts) >= 0 and sum(counts) == tokens else ())
    for name in exact:
        assert_bitwise(got[name].cpu(), want[name], f"{counts} ({tokens} tokens, slots of {multiple}): {name}")
    assert bool(((token_rows >= 0) & (token_rows < rows)).all()), f"{counts}: token rows out of the buffer"
    assert bool(((source >= -1) & (source < max(tokens, 1))).all()), f"{counts}: source rows out of the tokens"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_slot_layout_built_by_the_kernel_is_the_aten_layout(device, monkeypatch):
    """SlotLayout.build takes the kernel where it runs (forced on the CPU's interpreter), keeps its validity for the
    device assert, and gives the layout of the aten ops: table, token rows, source rows, bounds, packed buffer."""
    from hybridq.nn import grouped_packed
    dev = torch.device(device)
    monkeypatch.setattr(grouped_packed, "_SLOTS", {})
    if dev.type == "cpu":
        monkeypatch.setattr(grouped_packed, "_layout_kernel_takes", lambda counts: True)
    splits = [5, 0, 130, 40]
    layout = SlotLayout.build(torch.tensor(splits, device=dev), 175, dev, 128, lambda m: m, "moe")
    assert layout.valid is not None and int(layout.valid) == 1, "the kernel's validity was not kept (or is wrong)"
    want = SlotLayout(torch.tensor(splits), 175, 128, lambda m: m, None)
    for name, g, w in (("table", layout.table, want.table), ("token rows", layout.token_rows, want.token_rows),
                       ("source rows", layout.source_rows(), want.source_rows()),
                       ("bounds", layout.bounds().gemm_rows, want.bounds().gemm_rows)):
        assert_bitwise(g.cpu(), w, f"{splits}: {name} of the kernel's layout vs the aten ops'")
    x = torch.randn(175, 8)
    assert_bitwise(layout.pack(x.to(dev)).cpu(), want.pack(x), f"{splits}: packed buffer")


@pytest.mark.gpu
@pytest.mark.skipif(not (_device_path_here("fp8_block")), reason="needs CUDA sm_90 with Triton")
def test_gpu_slot_layout_of_a_new_routing_costs_one_launch_and_the_assert():
    """A new routing's layout on a GPU: the kernel's four outputs and the assert of its validity (before: ~20 aten
    ops -- the check's five, the table's nine, the token rows' seven -- and the source map's three at first use)."""
    from _dispatch import OpLog
    from hybridq.nn import grouped_packed
    dev = torch.device("cuda")
    counts = torch.tensor([5, 0, 130, 40], device=dev)
    SlotLayout.build(counts.clone(), 175, dev, 128, lambda m: m, "moe")  # (first call: Triton compiles)
    with OpLog() as log:
        layout = SlotLayout.build(counts, 175, dev, 128, lambda m: m, "moe")
        layout.source_rows()
    assert log.ops == ["aten.empty.memory_format"] * 4 + ["aten._assert_async.msg"], \
        f"a new routing's slot layout issued {log.ops}"
    assert grouped_packed._layout_kernel_takes(counts)


@pytest.mark.skipif(not triton_grouped_blocks.available() or INTERPRETER,
                    reason="needs Triton compiling (not its interpreter)")
@pytest.mark.parametrize("experts", [4, 200])
def test_slot_layout_kernel_compiles_for_sm90(experts):
    """The kernel builds for sm_90 (no GPU needed) at its launch's constexprs, for few and many experts."""
    from _triton_aot import compile_sm90
    from hybridq.kernels import triton_slot_layout as t
    grid, kw = t._plan(32768, 34816, experts, 128)
    sig = {"counts_ptr": "*i64", "table_ptr": "*i32", "token_rows_ptr": "*i64", "source_ptr": "*i32",
           "valid_ptr": "*i32", "T": "i32", "R": "i32", "E": "i32"}
    consts = {k: v for k, v in kw.items() if k != "num_warps"}
    k = compile_sm90(t._slot_layout_kernel, sig, consts, ("counts_ptr", "table_ptr", "token_rows_ptr", "source_ptr",
                                                          "valid_ptr"), kw["num_warps"], 1)
    assert "ptx" in k.asm, "no PTX"


# ---- one slot quantization of an input read by two projections ------------------------------------------------------

def _two_projections(preset, splits, shared_layout=True, between=None):
    """w1 and w3 of an MoE layer on the same dispatched tokens x and routing (one layout, as the eager layer's
    `SlotLayout.build` gives both on CUDA), through the device-count Function; (outputs and gradients, the input
    quantizations made)."""
    m1, m3 = _layer(preset, 128), _layer(preset, 128)
    with torch.no_grad():
        m3.weight.mul_(-0.5)
    x, dy = _data(splits, 128)
    x = x.detach().clone().requires_grad_()
    qs = packed_quantizers(m1.expert_quantizers).quantizers
    made = []
    real = grouped_device_blocks._quantize

    def counted(q, t, *a, **k):
        if t is x:
            made.append(q)
        return real(q, t, *a, **k)

    def layout():
        return slot_layout(torch.tensor(splits), x, IN, 128, qs, True, True, "moe")
    grouped_device_blocks._quantize = counted
    try:
        first = layout()
        y1 = DeviceBlockExperts.apply(x, m1.weight, first, qs, "w1", True, True)
        if between is not None:
            between(x)
        y3 = DeviceBlockExperts.apply(x, m3.weight, first if shared_layout else layout(), qs, "w3", True, True)
    finally:
        grouped_device_blocks._quantize = real
    (y1 * y3).float().sum().backward()
    return {"y1": y1.detach(), "y3": y3.detach(), "dx": x.grad, "dW1": m1.weight.grad, "dW3": m3.weight.grad}, made


@pytest.mark.parametrize("splits", [[5, 0, 17, 40], [130, 1, 0, 127]], ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_an_input_read_by_two_projections_is_quantized_once_bitwise_twice(preset, splits):
    """[Note: shared slot input]: the second projection on the same tokens and routing reuses the first one's slot
    quantization (before: quantized again), bitwise the run with sharing off (each projection its own)."""
    got, made = _two_projections(preset, splits)
    assert len(made) == 1, f"{preset}: the input was quantized {len(made)} times for two projections"
    with shared_input_quantization(False):
        want, made_off = _two_projections(preset, splits)
    assert len(made_off) == 2, f"{preset}: with sharing off the input was quantized {len(made_off)} times"
    assert_results_bitwise(got, want, f"{preset} {splits}: shared input quantization vs each projection's own")


def _double_in_place(x):
    with torch.no_grad():
        x.mul_(2.0)  # (a new version of x)


@pytest.mark.parametrize("what", ["changed in place", "another routing's layout"])
def test_a_shared_input_quantization_serves_only_the_same_values_and_routing(what):
    """An input changed in place between the projections, or another layout's source map (another routing, or a
    layout built anew), is quantized again; the results stay those of two separate quantizations."""
    splits = [5, 0, 17, 40]
    kw = (dict(between=_double_in_place) if what == "changed in place" else dict(shared_layout=False))
    got, made = _two_projections("fp8_block", splits, **kw)
    assert len(made) == 2, f"{what}: the input's quantization was reused ({len(made)} made)"
    with shared_input_quantization(False):
        want, _ = _two_projections("fp8_block", splits, **kw)
    assert_results_bitwise(got, want, f"{what}: vs sharing off")


def test_compiled_op_bodies_never_share_the_input_quantization():
    """`forward` as the compiled ops' body (no `share`): each call quantizes its input (an op's outputs are its own)."""
    m1, m3 = _layer("fp8_block", 128), _layer("fp8_block", 128)
    x, _ = _data([5, 0, 17, 40], 128)
    qs = packed_quantizers(m1.expert_quantizers).quantizers
    layout = slot_layout(torch.tensor([5, 0, 17, 40]), x, IN, 128, qs, True, True, "moe")
    outs = [grouped_device_blocks.forward(x, m.weight, layout, qs, "moe", True, True) for m in (m1, m3)]
    assert outs[0][1].part("columnwise").data is not outs[1][1].part("columnwise").data, \
        "two op bodies returned one saved input quantization"


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_gate_and_up_projections_quantize_their_input_once_bitwise(preset, monkeypatch):
    """Two GroupedLinears (w1, w3) on the same tokens and CUDA counts tensor: the layouts of one routing share their
    source map, so the second projection reuses the first one's slot quantization of the input (slot quantizes per
    step: 3 -- the input once, each grad_output -- where they were 4); bitwise the layers with sharing off."""
    splits = [5, 0, 130, 40]
    x, dy = _data(splits, 128, device="cuda")
    route = torch.tensor(splits, device="cuda")
    calls = []
    real = grouped_device_blocks._quantize

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(grouped_device_blocks, "_quantize", counted)

    def run():
        m1, m3 = _layer(preset, 128, "cuda"), _layer(preset, 128, "cuda")
        xx = x.detach().clone().requires_grad_()
        calls.clear()
        y = m1(xx, route) * m3(xx, route)
        y.backward(dy)
        return {"y": y.detach(), "dx": xx.grad, "dW1": m1.weight.grad, "dW3": m3.weight.grad}, len(calls)
    got, on = run()
    with shared_input_quantization(False):
        want, off = run()
    assert (on, off) == (3, 4), f"{preset}: slot quantizes per step with sharing {on}, without {off}"
    assert_results_bitwise(got, want, f"{preset}: shared input quantization vs each projection's own (CUDA)")
