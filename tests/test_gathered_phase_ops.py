"""The compiled Linear's gathered per-tensor FP8 fast path (`hybridq::gathered_linear_forward` / `_backward` on
FSDP2's gathered weight, called as a compiled graph calls them: through the weight's handle) runs each phase on CUDA
as ONE extension op, `hybridq::fp8_linear_fprop` / `fp8_linear_grads` (csrc/linear_fp8.cpp), bit for bit what
float8_graph's Python `_fprop` / `_grads` compute (`gathered_cpp_ops(False)`) -- output, saved tensors, gradients --
and what the general path computes (`eager_fast_path(False)`), for every per-tensor cast case, with and without
bias, with save_original_input, without wgrad or dgrad, in each input dtype, and on inf/NaN. The ops refuse
inconsistent arguments, naming themselves. On the CPU (no extension) the Python ops run, bitwise the general path;
HYBRIDQ_LINEAR_CPP_OPS=0 starts a process with the C++ phases off."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import hybridq as hq
from hybridq.nn import compiled_linear, float8_graph
from hybridq.nn.float8_graph import eager_fast_path, gathered_cpp_ops

from _compare import assert_bitwise
from _format_cases import case_recipe

IN, OUT, TOKENS = 256, 128, (2, 64)
# per-tensor casts with current scaling in the three roles (as tests/test_fp8_linear_op.py): "fp8_tensorwise" and
# "mixed" have an E5M2 grad_output; "mixed" makes the three casts differ (_format_cases.MIXED_PER_TENSOR)
CASES = ["fp8_e4m3", "fp8_e4m3_pow2", "fp8_tensorwise", "mixed"]
# variant -> (dtype, bias, save_original_input, need_dgrad, need_wgrad)
VARIANTS = {
    "plain": (torch.bfloat16, True, False, True, True),
    "no_bias": (torch.bfloat16, False, False, True, True),
    "save_original_input": (torch.bfloat16, True, True, True, True),
    "no_wgrad": (torch.bfloat16, True, False, True, False),
    "no_dgrad": (torch.bfloat16, True, False, False, True),
    "no_dgrad_save_original_input": (torch.bfloat16, False, True, False, True),
    "fp32": (torch.float32, True, False, True, True),
    "fp16": (torch.float16, True, False, True, True),
}


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and float8_graph._cuda_fp8_ready(0)


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device with FP8 tensor cores "
                                                                         "and the extension")(test))


class _Owner:
    """What a handle names the weight of (weakly referenced: FSDP2's module)."""

    def __init__(self, weight):
        self.weight = weight


def _setup(case: str, variant: str, device: str, nonfinite: str | None = None, seed: int = 0):
    """A gathered weight's handle and a call's inputs: the layer's configuration key, the quantized weight (both
    directions, as FSDP2's gathered weight holds them) and x, dy, bias; inf and NaN in `nonfinite` (input,
    grad_output or weight)."""
    dtype, bias, soi, need_dgrad, need_wgrad = VARIANTS[variant]
    key = hq.Linear(IN, OUT, bias=bias, recipe=case_recipe(case), name="fc", save_original_input=soi
                    )._configuration_key
    g = torch.Generator().manual_seed(seed)
    w, x, dy, b = (torch.randn(*s, generator=g) for s in ((OUT, IN), (*TOKENS, IN), (*TOKENS, OUT), (OUT,)))
    if nonfinite is not None:
        t = {"input": x, "grad_output": dy, "weight": w}[nonfinite]
        for i, v in ((3, float("inf")), (100, float("-inf")), (257, float("nan"))):
            t.view(-1)[i] = v
    w, x, dy, b = (t.to(device, dtype) for t in (w, x, dy, b))
    owner = _Owner(compiled_linear._LAYERS[key][1]["weight"].quantize(w, rowwise=True, columnwise=True,
                                                                      name="fc.weight"))
    return SimpleNamespace(key=key, owner=owner, handle=compiled_linear.weight_handle(owner, lambda o: o.weight),
                           x=x, dy=dy, bias=b if bias else None, dtype=dtype, soi=soi, need_dgrad=need_dgrad,
                           need_wgrad=need_wgrad)


def _run(s) -> tuple[dict, bool]:
    """({name: tensor} of the forward op's outputs (y, saved tensors) and the backward op's gradients, whether the
    forward took the fast path), the backward op given what the forward op's autograd keeps (compiled_linear)."""
    y, *saved = torch.ops.hybridq.gathered_linear_forward(s.x, s.handle, s.bias, s.key, None, s.need_dgrad,
                                                          s.need_wgrad, [OUT, IN], s.dtype)
    lkey = compiled_linear._layout_key(s.key, None, s.need_dgrad, s.need_wgrad, s.x.shape, [OUT, IN], s.dtype, True)
    fast = compiled_linear._LAYOUTS[lkey][1]
    dx, dw, db = torch.ops.hybridq.gathered_linear_backward(
        s.dy, s.x if s.need_wgrad and s.soi else None, s.handle, saved, s.key, None, s.need_dgrad, s.need_wgrad,
        s.bias is not None, list(s.x.shape), [OUT, IN], s.dtype, s.dtype, s.dtype)
    out = {"output": y, "grad_input": dx, "grad_weight": dw, "grad_bias": db}
    out.update({f"saved tensor {i}": t for i, t in enumerate(saved)})
    return out, fast


def _assert_same(got: dict, want: dict, what: str, names=None, nan_payload=False) -> None:
    names = sorted(want) if names is None else names
    assert sorted(got) == sorted(want), f"{what}: outputs {sorted(got)} vs {sorted(want)}"
    for n in names:
        assert_bitwise(got[n], want[n], f"{what}: {n}", nan_payload=nan_payload)


class _Calls:
    """Counts the calls of float8_graph's Python phases (`_fprop`, `_grads`) while installed."""

    def __init__(self, monkeypatch):
        self.n = {"_fprop": 0, "_grads": 0}
        for name in self.n:
            real = getattr(float8_graph, name)
            monkeypatch.setattr(float8_graph, name, self._counted(name, real))

    def _counted(self, name, real):
        def f(*args, **kwargs):
            self.n[name] += 1
            return real(*args, **kwargs)
        return f

    def take(self) -> dict:
        n, self.n = self.n, {k: 0 for k in self.n}
        return n


def _three_paths(s, monkeypatch) -> dict:
    """{"cpp", "python", "general"}: the gathered ops' results with the C++ phases (default), with them off, and on
    the general path; asserts which path each ran."""
    calls = _Calls(monkeypatch)
    out = {}
    # (each switch built when its block starts: the switches take effect when built)
    for path, ctx in (("cpp", lambda: gathered_cpp_ops(True)), ("python", lambda: gathered_cpp_ops(False)),
                      ("general", lambda: eager_fast_path(False))):
        with ctx():
            out[path], fast = _run(s)
        n = calls.take()
        want = {"cpp": {"_fprop": 0, "_grads": 0}, "python": {"_fprop": 1, "_grads": 1},
                "general": {"_fprop": 0, "_grads": 0}}[path]
        assert (fast, n) == (path != "general", want), \
            f"the {path} run took the fast path: {fast}, called float8_graph's Python phases {n} times"
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CASES)
@gpu
def test_cpp_phases_are_bitwise_the_python_phases_and_the_general_path(case, variant, monkeypatch):
    s = _setup(case, variant, "cuda")
    out = _three_paths(s, monkeypatch)
    _assert_same(out["cpp"], out["python"], f"{case}/{variant}: C++ vs Python phases")
    # (the general path saves the input as a flattened quantized tensor: its outputs and gradients compared)
    _assert_same({k: v for k, v in out["cpp"].items() if not k.startswith("saved")},
                 {k: v for k, v in out["general"].items() if not k.startswith("saved")},
                 f"{case}/{variant}: C++ phases vs general path")


@pytest.mark.parametrize("where", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "mixed"])
@gpu
def test_cpp_phases_on_non_finite_values_are_bitwise_the_python_phases(case, where, monkeypatch):
    """inf and NaN in x, dy or the weight: every result as the Python phases' and the general path's (NaN where
    they have NaN; payloads aside), and non-finite where they are."""
    s = _setup(case, "plain", "cuda", nonfinite=where)
    out = _three_paths(s, monkeypatch)
    _assert_same(out["cpp"], out["python"], f"{case}, inf/NaN in {where}: C++ vs Python phases", nan_payload=True)
    _assert_same(out["cpp"], out["general"], f"{case}, inf/NaN in {where}: C++ phases vs general path",
                 names=["output", "grad_input", "grad_weight", "grad_bias"], nan_payload=True)
    n = "grad_input" if where == "grad_output" else "output"
    assert not torch.isfinite(out["cpp"][n]).all(), f"{case}: the {n} became finite with inf/NaN in {where}"


@gpu
def test_the_phase_ops_refuse_inconsistent_arguments():
    x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, OUT, device="cuda", dtype=torch.bfloat16)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    w_row, w_col, s, _ = torch.ops.hybridq.fp8_tensor_quantize(
        torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16), e4, None, None, 0.0, False, True, True, False)
    x_col, x_s = torch.ops.hybridq.fp8_linear_fprop(x, w_row, s, None, e4, 0.0, False, True, False, True)[1:]
    fprop = torch.ops.hybridq.fp8_linear_fprop
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_linear_fprop: input of shape \[64, 128\] and weight "
                                           r"rowwise part of shape \[128, 256\] do not make x @ weight\^T"):
        fprop(x[:, :128], w_row, s, None, e4, 0.0, False, True, False, True)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_linear_fprop: bias of shape \[64\] does not match 128 "
                                           r"output features"):
        fprop(x, w_row, s, dy[0, :64], e4, 0.0, False, True, False, True)

    def grads(x_saved, xs, wc, ws, soi=False, need_dgrad=True, need_wgrad=True):
        return torch.ops.hybridq.fp8_linear_grads(dy, x_saved, xs, wc, ws, e4, 0.0, False, e5, 0.0, False, soi,
                                                  need_dgrad, need_wgrad, True, [64, IN], torch.bfloat16,
                                                  torch.bfloat16)

    bad = {
        r"dgrad needs the weight's columnwise part \(w_col and w_col_scale_inv\)": (x_col, x_s, None, s),
        r"wgrad needs what the forward kept of x \(x_saved, and x_col_scale_inv unless save_original_input\)":
            (x_col, None, w_col, s),
        r"w_col of shape \[128, 256\] is not the columnwise part \[in_features, out_features\] = \[256, 128\]":
            (x_col, x_s, w_row, s),
    }
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=f"hybridq::fp8_linear_grads: {message}"):
            grads(*args)
    grads(x, None, w_col, s, soi=True)  # save_original_input: x's values, no scale_inv
    dx, dw, db = grads(None, None, w_col, s, need_wgrad=False)  # no wgrad: nothing of x needed
    assert dw.shape == (0,) and dx.shape == (64, IN) and db.shape == (OUT,), \
        f"a gradient not asked for is an empty tensor: dx {tuple(dx.shape)}, dw {tuple(dw.shape)}"


# ---- the CPU: float8_graph's Python phases (no extension) ------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "no_wgrad",
                                     "no_dgrad_save_original_input"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "mixed"])
def test_cpu_gathered_fast_path_is_bitwise_the_general_path(case, variant, monkeypatch):
    s = _setup(case, variant, "cpu")
    calls = _Calls(monkeypatch)
    fast, took = _run(s)
    assert took and calls.take() == {"_fprop": 1, "_grads": 1}, "the CPU fast path did not run the Python phases"
    with eager_fast_path(False):
        general, took = _run(s)
    assert not took
    names = ["output", "grad_input", "grad_weight", "grad_bias"]
    _assert_same({n: fast[n] for n in names}, {n: general[n] for n in names}, f"{case}/{variant}: CPU fast path")


def test_the_environment_switches_the_cpp_phases_off_for_a_process():
    code = "from hybridq.nn import float8_graph as f; print(f._CPP_OPS.on)"
    env = dict(os.environ, HYBRIDQ_LINEAR_CPP_OPS="0")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False", f"HYBRIDQ_LINEAR_CPP_OPS=0 left the C++ phases {got.stdout.strip()!r}"
    assert float8_graph._CPP_OPS.on, "the C++ phases are off by default in this process"
    with gathered_cpp_ops(False):
        assert not float8_graph._CPP_OPS.on
    assert float8_graph._CPP_OPS.on, "gathered_cpp_ops(False) as a block did not restore the switch"
