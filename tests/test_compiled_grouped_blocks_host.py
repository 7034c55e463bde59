"""Host work of the compiled block-format GroupedLinear ops' bodies per call (hybridq/nn/compiled_grouped_blocks.py;
issue 30: compiled fp8_block is host-bound), and that what they keep between calls is never stale:

- the quantized forms travel between the ops as plain tensors, rebuilt by a `_Form` kept per call signature ([Note:
  block op forms]) -- bitwise what tensor.py's flatten / unflatten rebuilt, reused only for a part it fits;
- the bodies issue no aten op of their own beyond the eager code they run (backward made two meta tensors per call
  to look its record up);
- outputs are copied only where they would alias an input or one another;
- the input quantize op's slot multiple is kept per configuration and gradient flags."""

from __future__ import annotations

import pytest
import torch

import hybridq as hq
from _compare import assert_parts_bitwise
from _dispatch import OpLog
from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.nn import compiled_grouped, compiled_grouped_blocks as blocks, grouped_device_blocks as device_blocks
from hybridq.nn.grouped_packed import BLOCKS, SlotLayout, packed_quantizers
from hybridq.nn.grouped_packed_blocks import ExpertWeights
from hybridq.tensor import QuantizedTensor, flatten_quantized, unflatten_quantized

E, D, H = 3, 256, 128
SPLITS = [100, 0, 28]
PRESETS = [p for p in hq.preset_names()
           if getattr(packed_quantizers(hq.GroupedLinear(E, D, H, recipe=p).expert_quantizers), "kind", None) == BLOCKS]


def _call(preset: str, tokens: int = sum(SPLITS), splits=SPLITS):
    """(key, quantizers, x, counts, weight, dy) of one block-format layer call on the CPU."""
    layer = hq.GroupedLinear(E, D, H, recipe=preset, name="moe")
    key = compiled_grouped.graph_key(layer)
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(tokens, D, generator=gen), torch.randn(tokens, H, generator=gen)
    return key, blocks._LAYERS[key][1], x, torch.tensor(splits), layer.weight.detach(), dy


def test_the_block_presets_are_listed():
    assert {"fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd"} <= set(PRESETS), PRESETS


# ---- forms kept per call signature --------------------------------------------------------------------------------

def _quantized_input(preset: str) -> QuantizedTensor:
    key, qs, x, m, _, _ = _call(preset)
    layout = device_blocks.slot_layout(m, x, D, H, qs, True, True, "moe")
    return device_blocks._quantize(qs["input"], x, layout, True, True, "input of moe")


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_form_rebuilds_what_flatten_and_unflatten_rebuilt(preset, direction):
    """The part a `_Form` rebuilds from its tensors is the part tensor.py's generic flatten / unflatten rebuilt (the
    path it replaces): same type, rows, cols, direction, metadata, the very tensors; `quantized` holds it in its
    direction, with the QuantizedTensor's shape and dtype."""
    xq = _quantized_input(preset)
    part = xq.part(direction)
    only = QuantizedTensor(part if direction == ROWWISE else None, part if direction == COLUMNWISE else None,
                           shape=xq.shape, dtype=xq.dtype)
    flat, entries = flatten_quantized([only])
    (want,) = unflatten_quantized(flat, entries)
    form = blocks._Form.of(part, xq.shape, xq.dtype)
    tensors = form.tensors(part)
    assert [t is f for t, f in zip(tensors, flat)] == [True] * len(flat) and len(tensors) == len(flat), \
        f"{preset} {direction}: the form's tensors are not flatten's ({len(tensors)} vs {len(flat)})"
    got = form.quantized(iter(tensors))
    assert (got.shape, got.dtype, got.has(ROWWISE), got.has(COLUMNWISE)) == \
        (want.shape, want.dtype, want.has(ROWWISE), want.has(COLUMNWISE)), f"{preset} {direction}: {got!r} vs {want!r}"
    g, w = got.part(direction), want.part(direction)
    assert type(g) is type(w) and (g.rows, g.cols, g.columnwise, g.meta()) == (w.rows, w.cols, w.columnwise, w.meta())
    assert all(g.tensors()[n] is w.tensors()[n] for n in w.tensor_fields), f"{preset} {direction}: other tensors"
    assert_parts_bitwise(form.part(tensors), part, f"{preset} {direction}: rebuilt part")


def _other_meta(part):
    meta = part.meta()
    name = next(iter(meta))
    value = meta[name]
    return type(part)(rows=part.rows, cols=part.cols, columnwise=part.columnwise, **part.tensors(),
                      **{**meta, name: (2 if value == 1 else 1) if isinstance(value, int) else None})


# (what differs from the part the form was made of)
MISFITS = {
    "another part type": lambda p, other: other,
    "other rows": lambda p, other: type(p)(rows=p.rows + 1, cols=p.cols, columnwise=p.columnwise, **p.tensors(),
                                           **p.meta()),
    "other cols": lambda p, other: type(p)(rows=p.rows, cols=p.cols * 2, columnwise=p.columnwise, **p.tensors(),
                                           **p.meta()),
    "other direction": lambda p, other: type(p)(rows=p.rows, cols=p.cols, columnwise=not p.columnwise,
                                                **p.tensors(), **p.meta()),
    "a tensor missing": lambda p, other: type(p)(rows=p.rows, cols=p.cols, columnwise=p.columnwise,
                                                 **{**p.tensors(), p.tensor_fields[-1]: None}, **p.meta()),
    "other metadata": lambda p, other: _other_meta(p),
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_a_kept_form_serves_only_a_part_it_fits(misfit):
    fp8, mx = _quantized_input("fp8_block").part(ROWWISE), _quantized_input("mxfp8").part(ROWWISE)
    form = blocks._Form.of(fp8, (sum(SPLITS), D), torch.float32)
    assert form.fits(fp8), "a form does not fit the part it was made of"
    other = MISFITS[misfit](fp8, mx)
    assert not form.fits(other), f"a form made of an FP8 block part fits {misfit}"
    made = blocks._form_of(other, form, (sum(SPLITS), D), torch.float32)
    assert made is not form and made.fits(other), f"{misfit}: the kept form was served"
    assert blocks._form_of(fp8, form, (sum(SPLITS), D), torch.float32) is form, "a fitting kept form was not served"


@pytest.mark.parametrize("preset", PRESETS)
def test_the_input_forms_are_kept_per_call_signature(preset):
    """A second call of one signature reuses the kept forms; other tokens or gradient flags keep their own."""
    key, _, x, m, _, _ = _call(preset)
    blocks._run_input_quantize(x, m, key, True, True, fake=False)
    kept = blocks._INPUTS[blocks._input_key(key, True, True, x.shape, x.dtype)]
    blocks._run_input_quantize(x, m, key, True, True, fake=False)
    assert blocks._INPUTS[blocks._input_key(key, True, True, x.shape, x.dtype)] is kept, "made anew for one signature"
    _, _, x2, m2, _, _ = _call(preset, tokens=400, splits=[400, 0, 0])
    blocks._run_input_quantize(x2, m2, key, True, True, fake=False)
    other = blocks._INPUTS[blocks._input_key(key, True, True, x2.shape, x2.dtype)]
    assert other[0].rows != kept[0].rows, "another token count reused a form"
    blocks._run_input_quantize(x, m, key, True, False, fake=False)
    frozen = blocks._INPUTS[blocks._input_key(key, True, False, x.shape, x.dtype)]
    assert frozen[1] is None and kept[1] is not None, "a frozen projection's call kept a columnwise form"
    assert blocks._INPUTS[blocks._input_key(key, True, True, x.shape, x.dtype)] is kept, "another signature replaced it"


@pytest.mark.parametrize("preset", PRESETS)
def test_the_saved_forms_are_kept_per_call_signature(preset):
    key, _, x, m, w, _ = _call(preset)
    parts = blocks._run_input_quantize(x, m, key, True, True, fake=False)
    blocks._run_forward(x, parts, w, m, key, True, True, fake=False)
    sk = blocks._saved_key(key, True, True, x.shape, w.shape, x.dtype, w.dtype, False)
    kept = blocks._SAVED[sk]
    blocks._run_forward(x, parts, w, m, key, True, True, fake=False)
    assert blocks._SAVED[sk] is kept, "the saved forms were made anew for one signature"
    assert kept[0] is blocks._INPUTS[blocks._input_key(key, True, True, x.shape, x.dtype)][1], \
        "backward does not read the input quantize op's columnwise form"
    w2 = torch.randn(E, 2 * H, D)
    blocks._run_forward(x, parts, w2, m, key, True, True, fake=False)
    other = blocks._SAVED[blocks._saved_key(key, True, True, x.shape, w2.shape, x.dtype, w2.dtype, False)]
    assert [f.rows for f in other[1]] != [f.rows for f in kept[1]] or [f.cols for f in other[1]] != \
        [f.cols for f in kept[1]], "another weight shape reused the saved forms"


# ---- the bodies' own aten ops ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_the_backward_body_issues_no_aten_op_of_its_own(preset):
    """Its aten ops are those of the eager code it runs (the slot layout, `grouped_device_blocks.backward`) on the
    same operands, in the same order. (fails before: two `aten.empty` on the meta device per call, the shapes its
    record was looked up by)"""
    key, qs, x, m, w, dy = _call(preset)
    parts = blocks._run_input_quantize(x, m, key, True, True, fake=False)
    out = blocks._run_forward(x, parts, w, m, key, True, True, fake=False)
    n_row = len(blocks._INPUTS[blocks._input_key(key, True, True, x.shape, x.dtype)][0].names)
    saved = parts[n_row:] + out[1:]
    col_form, w_forms, packed = blocks._SAVED[blocks._saved_key(key, True, True, x.shape, w.shape, x.dtype, w.dtype,
                                                                False)]
    tensors = iter(saved)
    x_col, w_saved = col_form.quantized(tensors), [f.quantized(tensors) for f in w_forms]
    with OpLog() as eager:
        layout = device_blocks.slot_layout(m, dy, D, H, qs, True, True, "moe")
        device_blocks.backward(dy, layout, qs, "moe", x_col, w_saved, packed, (E, H, D), w.dtype, True, True)
    with OpLog() as body:
        blocks._run_backward(dy, m, saved, key, True, True, True, True, list(x.shape), list(w.shape), x.dtype,
                             w.dtype)
    assert body.ops == eager.ops, f"{preset}: the backward body issued {len(body.ops)} aten ops, its eager code " \
                                  f"{len(eager.ops)}; of its own: {sorted((body.counts - eager.counts).elements())}"


@pytest.mark.parametrize("preset", PRESETS)
def test_the_input_quantize_and_forward_bodies_issue_no_aten_op_of_their_own(preset):
    """The input quantize op: the slot layout and the input's quantization; the forward op: the weight's
    quantization, the slot layout and the fprop GEMM (no copy of a fresh output)."""
    key, qs, x, m, w, _ = _call(preset)
    parts = blocks._run_input_quantize(x, m, key, True, True, fake=False)
    with OpLog() as eager:
        layout = device_blocks.slot_layout(m, x, D, H, qs, True, True, "moe")
        xq = device_blocks._quantize(qs["input"], x, layout, True, True, "input of moe")
    with OpLog() as body:
        blocks._run_input_quantize(x, m, key, True, True, fake=False)
    assert body.ops == eager.ops, f"{preset} input quantize: of its own " \
                                  f"{sorted((body.counts - eager.counts).elements())}"
    with OpLog() as eager:
        wq = ExpertWeights.quantize(qs["weight"], w.detach(), True, "weight of moe")
        layout = device_blocks.slot_layout(m, x, D, H, qs, True, True, "moe")
        device_blocks._mm(xq.part(ROWWISE), wq, E, ROWWISE, layout, x.dtype, "fprop of moe")
    with OpLog() as body:
        blocks._run_forward(x, parts, w, m, key, True, True, fake=False)
    assert body.ops == eager.ops, f"{preset} forward: of its own {sorted((body.counts - eager.counts).elements())}"


# ---- outputs fresh, copied only where they alias -----------------------------------------------------------------

def test_outputs_are_copied_only_where_they_alias_an_input_or_one_another():
    x = torch.randn(8, 4)
    own, shared = torch.randn(3, 3), torch.randn(6)
    flat = [own, x[2:], shared[:3], shared[3:], torch.empty(0), torch.randn(4, 2).t()]
    out = blocks._fresh(flat, (x,), fake=False)
    assert out[0] is own, "a fresh contiguous output was copied"
    assert out[2] is flat[2], "the first of two views of one buffer was copied"
    for i in (1, 3):
        assert out[i].untyped_storage().data_ptr() != flat[i].untyped_storage().data_ptr(), \
            f"output {i} still aliases {'the input' if i == 1 else 'another output'}"
    assert out[5].is_contiguous(), "a non-contiguous output kept its strides (the fake's are contiguous)"
    for i, (o, f) in enumerate(zip(out, flat)):
        assert torch.equal(o, f), f"output {i} changed value"


def test_fake_outputs_are_copies():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.randn(8, 4)
        flat = [x[2:], torch.randn(3)]
        out = blocks._fresh(flat, (x,), fake=True)
    assert all(o is not f for o, f in zip(out, flat)) and [o.shape for o in out] == [f.shape for f in flat]


# ---- the slot multiple, kept per configuration -------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_the_input_layouts_slot_multiple_is_kept_per_configuration_and_gradients(preset, monkeypatch):
    key, qs, x, m, _, _ = _call(preset)
    multiples = []
    real = SlotLayout.build.__func__

    def build(cls, m_splits, tokens, device, multiple, *args, **kwargs):
        multiples.append(multiple)
        return real(cls, m_splits, tokens, device, multiple, *args, **kwargs)

    monkeypatch.setattr(SlotLayout, "build", classmethod(build))
    flags = [(True, True), (True, False), (False, True), (False, False)]
    for _ in range(2):
        for d, w in flags:
            blocks._run_input_quantize(x, m, key, d, w, fake=False)
    want = [device_blocks.slot_multiple(qs, d, w) for d, w in flags]
    assert multiples == want * 2, f"{preset}: layouts of multiples {multiples}, want {want} twice"
