"""The compiled Linear's gathered forward op keeps each call site's plan on the weight's handle (compiled_linear.py's
[Note: a gathered call site's plans], float8_graph.py's [Note: gathered plans]): a repeated call runs the plan its
first call made, bit for bit what the call decided anew gives (`gathered_plans(False)`) -- output, saved tensors, the
layout recorded for backward, the gradients of the backward op reading it, the path taken -- and a call on which
anything the plan rests on changed is planned again: another configuration (a recipe change), another input shape, new gathered parts (another weight
object, another part, a part no longer contiguous), a switch turned (the fast path, the C++ phases), a quantizer
whose `quantize` was replaced. Each invalidation test compares against the call decided anew and fails where the plan
would be reused. The plans hold the weight only weakly. (On the CPU the phases are float8_graph's Python; the C++
phases' switch on CUDA: the GPU-marked test.)"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.nn import compiled_linear, float8_graph
from hybridq.nn.compiled_linear import gathered_plans
from hybridq.nn.float8_graph import eager_fast_path, gathered_cpp_ops
from hybridq.tensor import QuantizedTensor

from _compare import assert_bitwise
from test_gathered_phase_ops import IN, OUT, _cuda_ready, _setup

CPU_CASES = ["fp8_e4m3", "mixed", "fp8_block", "fp8blk_1x128_e4m3_nopow2"]
PER_TENSOR = {"fp8_e4m3", "fp8_e4m3_pow2", "fp8_tensorwise", "mixed"}
CPU_VARIANTS = ["plain", "no_bias", "save_original_input", "no_wgrad", "no_dgrad", "no_grad"]


class _Plans:
    """Counts the plans the gathered forward op makes (float8_graph's `forward_plan`, as compiled_linear calls it)
    while installed: a call that reuses its site's plan makes none."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = compiled_linear.forward_plan

        def counted(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(compiled_linear, "forward_plan", counted)

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def _parts(s) -> list | None:
    """x's parts as compiled_linear hands them to a per-tensor call with gradients (None: not handed over)."""
    if not (s.need_dgrad or s.need_wgrad):
        return None
    dtype, eps, pow2, soi = compiled_linear._shared_input_cast(s.key)
    return torch.ops.hybridq.linear_input_quantize(s.x, dtype, eps, pow2, s.need_wgrad and not soi)


def _call(s, handle=None, parts=None, x=None, dy=None) -> dict:
    """{name: tensor} of one gathered forward + backward call through `handle` (default: the setup's), as a compiled
    graph makes it (x's parts handed over where `parts`), with the layout the forward recorded (its fast answer)."""
    handle = s.handle if handle is None else handle
    x = s.x if x is None else x
    dy = s.dy if dy is None else dy
    kw = {} if parts is None else dict(zip(("x_row", "x_scale_inv", "x_col"), parts))
    y, *saved = torch.ops.hybridq.gathered_linear_forward(x, handle, s.bias, s.key, None, s.need_dgrad, s.need_wgrad,
                                                          [OUT, IN], s.dtype, **kw)
    lkey = compiled_linear._layout_key(s.key, None, s.need_dgrad, s.need_wgrad, x.shape, [OUT, IN], s.dtype, True)
    layout, fast = compiled_linear._LAYOUTS[lkey]
    kept = saved if parts is None else ([parts[2], parts[1]] if s.need_wgrad and not s.soi else [])
    dx, dw, db = torch.ops.hybridq.gathered_linear_backward(
        dy, x if s.need_wgrad and s.soi else None, handle, kept, s.key, None, s.need_dgrad, s.need_wgrad,
        s.bias is not None, list(x.shape), [OUT, IN], s.dtype, s.dtype, s.dtype)
    out = {"output": y, "grad_input": dx, "grad_weight": dw, "grad_bias": db, "fast": torch.tensor(fast),
           "layout": torch.tensor(list(repr(layout).encode()))}  # (its text, compared bytewise)
    out.update({f"saved tensor {i}": t for i, t in enumerate(saved)})
    return out


def _decided_anew(s, **kw) -> dict:
    """`_call` with every call decided anew, through a handle of its own (no site, no plan)."""
    with gathered_plans(False):
        return _call(s, handle=compiled_linear.weight_handle(s.owner, lambda o: o.weight), **kw)


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: outputs {sorted(got)} vs {sorted(want)}"
    for name in sorted(want):
        assert_bitwise(got[name], want[name], f"{what}: {name}")


# (case, variant, whether x's parts are handed over: a per-tensor input with gradients only)
REUSE_CASES = [(c, v, h) for c in CPU_CASES for v in CPU_VARIANTS
               for h in ((False, True) if c in PER_TENSOR and v != "no_grad" else (False,))]


@pytest.mark.parametrize("case, variant, handed", REUSE_CASES,
                         ids=[f"{c}-{v}-{'x_parts_handed' if h else 'x_quantized_inside'}" for c, v, h in REUSE_CASES])
def test_a_reused_plan_is_bitwise_the_call_decided_anew(case, variant, handed, monkeypatch):
    s = _setup(case, variant, "cpu")
    parts = _parts(s) if handed else None
    plans = _Plans(monkeypatch)
    first = _call(s, parts=parts)
    made = plans.take()
    assert made == 1, f"the first call made {made} plans"
    assert int(first["fast"]), f"{case}/{variant}: the gathered call did not take the fast path"
    again = _call(s, parts=parts)
    assert plans.take() == 0, "the repeated call did not reuse its site's plan"
    _assert_same(again, first, f"{case}/{variant}: reused plan vs first call")
    _assert_same(again, _decided_anew(s, parts=parts), f"{case}/{variant}: reused plan vs decided anew")


def test_another_configuration_on_the_same_handle_is_planned_again(monkeypatch):
    """A recipe change gives the layer another configuration key: the call with it is planned anew (here the new
    recipe's E5M2 grad_output: the old plan would cast dy to E4M3)."""
    s = _setup("fp8_e4m3", "plain", "cpu")
    other = _setup("mixed", "plain", "cpu")
    plans = _Plans(monkeypatch)
    _call(s)
    s.key = other.key  # (the same handle, weight and inputs)
    plans.take()
    got = _call(s)
    assert plans.take() == 1, "the other configuration reused the first one's plan"
    _assert_same(got, _decided_anew(s), "recipe change")


def test_another_input_shape_is_planned_again(monkeypatch):
    """An input without rows: the fast path declines (the general path runs), as decided anew -- not the plan of the
    shape before."""
    s = _setup("fp8_e4m3", "plain", "cpu")
    plans = _Plans(monkeypatch)
    _call(s)
    plans.take()
    x, dy = s.x[:, :0], s.dy[:, :0]
    got = _call(s, x=x, dy=dy)
    assert plans.take() == 1, "an input of another shape reused the plan of the shape before"
    assert not int(got["fast"]), "an input without rows took the fast path"
    _assert_same(got, _decided_anew(s, x=x, dy=dy), "input without rows")


@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8_block"])
def test_new_gathered_values_are_read_by_the_reused_plan(case, monkeypatch):
    """New bytes in the gathered weight's own tensors (what FSDP2's unshard does at every step): the plan holds and
    reads them."""
    s = _setup(case, "plain", "cpu")
    plans = _Plans(monkeypatch)
    before = _call(s)
    fresh = _setup(case, "plain", "cpu", seed=1).owner.weight
    for d in (ROWWISE, COLUMNWISE):
        mine, new = s.owner.weight.part(d), fresh.part(d)
        mine.data.copy_(new.data)
        mine.scale_inv.copy_(new.scale_inv)
    plans.take()
    got = _call(s)
    assert plans.take() == 0, "refilled parts were planned again"
    assert not torch.equal(got["output"], before["output"]), "the new weight bytes were not read"
    _assert_same(got, _decided_anew(s), f"{case}: refilled parts")


@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8_block"])
def test_a_new_gathered_weight_is_planned_again(case, monkeypatch):
    """The handle now names another weight whose rowwise part is not what the spec makes (here E5M2 data): the fast
    path declines, as decided anew."""
    s = _setup(case, "plain", "cpu")
    plans = _Plans(monkeypatch)
    _call(s)
    w = s.owner.weight
    row, col = w.part(ROWWISE), w.part(COLUMNWISE)
    other = type(row)(**{**row.__dict__, "data": row.data.view(torch.uint8).to(torch.float8_e5m2)})
    s.owner.weight = QuantizedTensor(other, col, shape=w.shape, dtype=w.dtype)
    plans.take()
    got = _call(s)
    assert plans.take() == 1, "a new gathered weight reused the plan of the weight before"
    assert not int(got["fast"]), "a weight part the spec does not make took the fast path"
    _assert_same(got, _decided_anew(s), f"{case}: new gathered weight")


def test_a_part_no_longer_contiguous_is_planned_again(monkeypatch):
    """The same weight and part objects whose rowwise data FSDP2 re-pointed (`set_`) at a non-contiguous view: the
    fast path declines (the hardware GEMM reads contiguous parts), as decided anew."""
    s = _setup("fp8_e4m3", "plain", "cpu")
    plans = _Plans(monkeypatch)
    _call(s)
    data = s.owner.weight.part(ROWWISE).data
    data.set_(data.t().contiguous().t())  # (the same values, column-major)
    assert not data.is_contiguous()
    plans.take()
    got = _call(s)
    assert plans.take() == 1, "a part no longer contiguous reused its plan"
    assert not int(got["fast"]), "a non-contiguous weight part took the fast path"
    _assert_same(got, _decided_anew(s), "non-contiguous rowwise part")


@pytest.mark.parametrize("case", ["fp8_e4m3", "fp8_block"])
def test_the_fast_path_switched_off_is_planned_again(case, monkeypatch):
    s = _setup(case, "plain", "cpu")
    plans = _Plans(monkeypatch)
    fast = _call(s)
    with eager_fast_path(False):
        plans.take()
        got = _call(s)
        assert not int(got["fast"]), "the fast path switched off reused its plan"
        _assert_same(got, _decided_anew(s), f"{case}: fast path off")
    plans.take()
    _assert_same(_call(s), fast, f"{case}: fast path on again")
    # (the general path made no plan: the site's plan, made with the switch on, holds again)
    assert plans.take() == 0, "the fast path on again did not reuse its plan"


def test_a_replaced_quantize_is_planned_again(monkeypatch):
    """A quantizer whose `quantize` an instance attribute replaced (a spy sees the general path's calls): the
    dispatch check, asked at every call, sends the call to the general path."""
    s = _setup("fp8_e4m3", "plain", "cpu")
    _call(s)
    q = compiled_linear._config(s.key, None).input_q
    seen = []
    # (an instance attribute, removed again at the end: the configuration's quantizer is shared by later tests)
    monkeypatch.setitem(q.__dict__, "quantize", lambda *a, real=q.quantize, **k: seen.append(1) or real(*a, **k))
    got = _call(s)
    assert seen and not int(got["fast"]), "a replaced quantize did not send the call to the general path"
    _assert_same(got, _decided_anew(s), "replaced quantize")
    monkeypatch.undo()
    assert "quantize" not in q.__dict__ and int(_call(s)["fast"]), "the quantizer was not restored"


def test_backward_after_a_forward_that_took_another_path_reads_its_layout(monkeypatch):
    """The forward ran the general path since a fast call of the same layout key: the backward reads the general
    path's layout, as decided anew."""
    s = _setup("fp8_e4m3", "plain", "cpu")
    _call(s)
    with eager_fast_path(False):
        y, *saved = torch.ops.hybridq.gathered_linear_forward(s.x, s.handle, s.bias, s.key, None, True, True,
                                                              [OUT, IN], s.dtype)
    lkey = compiled_linear._layout_key(s.key, None, True, True, s.x.shape, [OUT, IN], s.dtype, True)
    assert not compiled_linear._LAYOUTS[lkey][1], "the forward with the fast path off took it"
    grads = torch.ops.hybridq.gathered_linear_backward(s.dy, None, s.handle, saved, s.key, None, True, True, True,
                                                       list(s.x.shape), [OUT, IN], s.dtype, s.dtype, s.dtype)
    want = _decided_anew(s)
    with eager_fast_path(False):
        want = _decided_anew(s)
    for name, got in zip(("grad_input", "grad_weight", "grad_bias"), grads):
        assert_bitwise(got, want[name], f"backward after a general forward: {name}")


def test_plans_hold_the_weight_weakly():
    s = _setup("fp8_e4m3", "plain", "cpu")
    _call(s)
    ref = weakref.ref(s.owner.weight)
    s.owner.weight = _setup("fp8_e4m3", "plain", "cpu", seed=1).owner.weight
    gc.collect()
    assert ref() is None, "a gathered call site's plan keeps the weight it was made for alive"


def test_the_environment_switches_the_plans_off_for_a_process():
    code = "from hybridq.nn import compiled_linear as c; print(c._PLANS.on)"
    env = dict(os.environ, HYBRIDQ_GATHERED_PLANS="0")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False", f"HYBRIDQ_GATHERED_PLANS=0 left the plans {got.stdout.strip()!r}"
    assert compiled_linear._PLANS.on, "the plans are off by default in this process"
    with gathered_plans(False):
        assert not compiled_linear._PLANS.on
    assert compiled_linear._PLANS.on, "gathered_plans(False) as a block did not restore the switch"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores and the extension")
@pytest.mark.parametrize("case", ["fp8_tensorwise", "mixed", "fp8_block", "fp8blk_1x128_e4m3"])
def test_cuda_reused_plan_and_the_cpp_phases_switched_off(case, monkeypatch):
    """On CUDA: a reused plan is bitwise the call decided anew (the C++ phases), with x's parts handed over where
    the input is per-tensor; the C++ phases switched off are planned again (float8_graph's Python phases run)."""
    s = _setup(case, "plain", "cuda")
    parts = _parts(s) if case in PER_TENSOR else None
    plans = _Plans(monkeypatch)
    first = _call(s, parts=parts)
    again = _call(s, parts=parts)
    assert plans.take() == 1, "the repeated call did not reuse its site's plan"
    _assert_same(again, first, f"{case}: reused plan vs first call")
    _assert_same(again, _decided_anew(s, parts=parts), f"{case}: reused plan vs decided anew")
    calls = []
    for name in ("_fprop", "_grads"):
        monkeypatch.setattr(float8_graph, name, lambda *a, real=getattr(float8_graph, name), name=name:
                            calls.append(name) or real(*a))
    with gathered_cpp_ops(False):
        got = _call(s, parts=parts)
    assert calls == ["_fprop", "_grads"], f"the C++ phases switched off reused their plan: Python phases {calls}"
    _assert_same(got, first, f"{case}: C++ phases off vs on")
