"""Saved activations leave the device and come back: torch's `save_on_cpu` and `hybridq.CPUOffload`.

hybridq layers save their quantized activations as the plain tensors of their parts, so every hook that copies
saved tensors into plain buffers (`save_on_cpu(pin_memory=True)` does `torch.empty(...).copy_(t)`) round-trips
every part of both directions, and the gradients are bit for bit those of the run without offload.

On a machine without an accelerator `save_on_cpu(pin_memory=True)` cannot pin but still copies each saved tensor
into a fresh buffer, and `CPUOffload(copy_cpu_tensors=True)` copies CPU tensors through its own bookkeeping: both
exercise the round trip here. The GPU-marked tests run the asynchronous pinned path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hybridq as hq
from hybridq.tensor import save_quantized, saved_quantized

from _compare import assert_bitwise, assert_parts_bitwise
from _format_cases import FORMATS, hybrid

HAVE_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")]
PRESETS = hq.preset_names()
D, HIDDEN, TOKENS = 64, 96, (2, 32)


# -- QuantizedTensor parts through a copying hook ------------------------------------------------------------------

class _SaveAndReturn(torch.autograd.Function):
    """Saves a QuantizedTensor for backward and hands what backward unpacked to `out`."""

    @staticmethod
    def forward(ctx, x, qt, out):
        save_quantized(ctx, qt)
        ctx.out = out
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.out.extend(saved_quantized(ctx))
        return g, None, None


CASES = {**{k: FORMATS[k] for k in FORMATS},
         "hybrid_mxfp8_nvfp4_rht": hybrid("mxfp8_e4m3", "nvfp4_rht"),
         "hybrid_fp8blk_mxfp8": hybrid("fp8blk_128x128_e4m3", "mxfp8_e4m3"),
         "hybrid_fp8_identity": hybrid("fp8_e4m3", "identity")}


def _storages(qt):
    return {t.untyped_storage().data_ptr() for p in (qt.rowwise, qt.columnwise) if p is not None
            for t in p.tensors().values() if t is not None and t.numel()}


@pytest.mark.parametrize("case", CASES)
def test_save_on_cpu_copy_round_trips_both_directions_of_every_part(case):
    """`save_on_cpu(pin_memory=True)` copies each saved tensor into a new plain buffer: the QuantizedTensor
    backward unpacks has both directions, bit for bit, in storage of its own (nothing aliased to the original)."""
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    qt = CASES[case]().quantize(x, rowwise=True, columnwise=True)
    out = []
    leaf = torch.zeros(1, requires_grad=True)
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        y = _SaveAndReturn.apply(leaf, qt, out)
    y.sum().backward()
    (got,) = out
    assert isinstance(got, hq.QuantizedTensor) and got.shape == qt.shape and got.dtype == qt.dtype
    assert_parts_bitwise(got.rowwise, qt.rowwise, f"{case} rowwise after save_on_cpu")
    assert_parts_bitwise(got.columnwise, qt.columnwise, f"{case} columnwise after save_on_cpu")
    shared = _storages(got) & _storages(qt)
    assert not shared, f"{case}: the unpacked tensor shares {len(shared)} storages with the one saved"


# -- hybridq Linear models: gradients with and without offload -------------------------------------------------------

class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(D) + 0.5)  # saved by the multiply: a parameter, kept
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x * self.norm)))


def _model(preset, override=None, device="cpu"):
    torch.manual_seed(0)
    m = nn.Sequential(_Block(), _Block(), _Block()).to(device)
    report = hq.convert_linears(m, hq.recipe(preset, backward_override=override), on_incompatible="error")
    assert len(report.converted) == 6
    return m


def _grads(model, x, offload=None):
    """Loss and every gradient of one step; `offload(block_index)` gives the context each block runs in."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)  # stochastic rounding draws from the default generator: the same stream in both runs
    h = x
    for i, block in enumerate(model):
        with (offload(i) if offload else _null()):
            h = block(h)
    loss = h.float().square().mean()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _assert_same(got, want, what):
    names = ["loss", "grad_input"] + [f"grad {i}" for i in range(len(want) - 2)]
    for n, a, b in zip(names, got, want):
        assert_bitwise(a, b, f"{what}: {n}")


def _inputs(device="cpu"):
    return torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_save_on_cpu_gives_the_gradients_of_the_run_without_it(preset, pin):
    x = _inputs()
    want = _grads(_model(preset).to(torch.bfloat16), x)  # (fresh models: delayed scaling keeps state)
    got = _grads(_model(preset).to(torch.bfloat16), x, lambda i: torch.autograd.graph.save_on_cpu(pin_memory=pin))
    _assert_same(got, want, f"{preset} under save_on_cpu(pin_memory={pin})")


@pytest.mark.parametrize("override", ["dequantized", "high_precision"])
def test_save_on_cpu_with_a_backward_override(override):
    """The overrides save the rowwise forms (dequantized) or high-precision tensors: they round-trip too."""
    m = _model("mxfp8_fwd_nvfp4_bwd", override).to(torch.bfloat16)
    x = _inputs()
    want = _grads(m, x)
    got = _grads(m, x, lambda i: torch.autograd.graph.save_on_cpu(pin_memory=True))
    _assert_same(got, want, f"backward_override={override} under save_on_cpu")


@pytest.mark.parametrize("preset", PRESETS)
def test_cpu_offload_gives_the_gradients_of_the_run_without_it(preset):
    x = _inputs()
    want = _grads(_model(preset).to(torch.bfloat16), x)
    off = hq.CPUOffload(copy_cpu_tensors=True)
    got = _grads(_model(preset).to(torch.bfloat16), x, lambda i: off.layer())
    _assert_same(got, want, f"{preset} under CPUOffload")


def test_cpu_offload_copies_activations_keeps_parameters_and_prefetches_the_previous_layer():
    m = _model("mxfp8_fwd_nvfp4_bwd").to(torch.bfloat16)
    off = hq.CPUOffload(copy_cpu_tensors=True)
    _grads(m, _inputs(), lambda i: off.layer())
    s = off.stats()
    # per block: x*norm saves x and the norm parameter; each Linear its quantized input and weight (2 parts' tensors
    # each), tanh its output
    assert s["blocks"] == 3, s
    assert s["kept"] == 3, f"only the 3 norm parameters are kept: {s}"
    assert s["offloaded"] > 0 and s["offloaded_bytes"] > 0, s
    assert s["prefetched"] == 2, f"backward of block i prefetches block i-1 (blocks 1 and 0): {s}"
    assert s["reloaded"] == s["offloaded"], f"every offloaded tensor comes back once: {s}"


def test_cpu_offload_on_cpu_tensors_is_a_no_op_move():
    m = _model("fp8_tensorwise").to(torch.bfloat16)
    off = hq.CPUOffload()
    x = _inputs()
    want = _grads(m, x)
    got = _grads(m, x, lambda i: off.layer())
    _assert_same(got, want, "CPUOffload on CPU tensors")
    s = off.stats()
    assert s["offloaded"] == 0 and s["kept"] > 0 and s["blocks"] == 0, s


def test_cpu_offload_layers_do_not_nest():
    off = hq.CPUOffload()
    with off.layer():
        with pytest.raises(RuntimeError, match="do not nest"):
            with off.layer():
                pass


# -- on a GPU: pinned memory, the copy stream, device memory released -------------------------------------------------

@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd", "nvfp4"])
@pytest.mark.parametrize("how", ["save_on_cpu_pinned", "cpu_offload"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")
def test_gpu_offload_gives_the_gradients_of_the_run_without_it(preset, how):
    x = _inputs("cuda")
    want = _grads(_model(preset, device="cuda").to(torch.bfloat16), x)
    off = hq.CPUOffload(pin_memory=True)
    ctx = (lambda i: torch.autograd.graph.save_on_cpu(pin_memory=True)) if how == "save_on_cpu_pinned" \
        else (lambda i: off.layer())
    got = _grads(_model(preset, device="cuda").to(torch.bfloat16), x, ctx)
    torch.cuda.synchronize()
    _assert_same(got, want, f"{preset} under {how} on CUDA")
    if how == "cpu_offload":
        s = off.stats()
        assert s["offloaded"] > 0 and s["prefetched"] == 2 and s["reloaded"] == s["offloaded"], s


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")
def test_gpu_cpu_offload_releases_device_memory_of_saved_activations():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                             for _ in range(4)]).cuda().to(torch.bfloat16)
    hq.convert_linears(blocks, hq.recipe("mxfp8"), on_incompatible="error")
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def held_after_forward(offload):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        h = x
        for b in blocks:
            with (offload.layer() if offload else _null()):
                h = b(h)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        h.float().sum().backward()
        return held

    plain = held_after_forward(None)
    off = hq.CPUOffload()
    offloaded = held_after_forward(off)
    assert offloaded < plain / 2, (f"device memory held after forward: {offloaded} bytes with offload, {plain} "
                                   f"without ({off.stats()})")
