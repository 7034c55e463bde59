"""The compiled Linear's gathered FP8 fast path (`hybridq::gathered_linear_forward` / `_backward` on FSDP2's gathered
weight, called as a compiled graph calls them: through the weight's handle) runs each phase on CUDA as ONE extension
op -- per-tensor scaling: `hybridq::fp8_linear_fprop` / `fp8_linear_grads` (csrc/linear_fp8.cpp); FP8 blocks
(fp8_block's 1x128 / 128x128 casts) where every GEMM of the call is the extension's block GEMM:
`hybridq::fp8_block_linear_fprop` / `fp8_block_linear_grads` (csrc/linear_fp8_block.cpp) -- bit for bit what
float8_graph's Python `_fprop` / `_grads` compute (`gathered_cpp_ops(False)`) -- output, saved tensors, gradients --
and what the general path computes (`eager_fast_path(False)`), for every cast case, with and without bias, with
save_original_input, without wgrad or dgrad, in each input dtype, and on inf/NaN. The ops refuse inconsistent
arguments, naming themselves. On the CPU (no extension) the Python ops run, bitwise the general path;
HYBRIDQ_LINEAR_CPP_OPS=0 starts a process with the C++ phases off. (The C++ block phases on the CPU, without a GPU:
tests/test_fp8_block_linear_host.py.)"""

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
PER_TENSOR_CASES = ["fp8_e4m3", "fp8_e4m3_pow2", "fp8_tensorwise", "mixed"]
# FP8 block casts (1x128 input and grad_output blocks): the preset (128x128 weight tiles), 1x128 weights, no
# power-of-2 scales; E5M2 blocks, whose GEMMs the extension's block GEMM does not take: the Python phases run on CUDA
# too (through hybridq's GEMM dispatch)
BLOCK_CASES = ["fp8_block", "fp8blk_1x128_e4m3", "fp8blk_1x128_e4m3_nopow2", "fp8blk_1x128_e5m2"]
CASES = PER_TENSOR_CASES + BLOCK_CASES
# variant -> (dtype, bias, save_original_input, need_dgrad, need_wgrad)
VARIANTS = {
    "plain": (torch.bfloat16, True, False, True, True),
    "no_bias": (torch.bfloat16, False, False, True, True),
    "save_original_input": (torch.bfloat16, True, True, True, True),
    "no_wgrad": (torch.bfloat16, True, False, True, False),
    "no_dgrad": (torch.bfloat16, True, False, False, True),
    "no_dgrad_save_original_input": (torch.bfloat16, False, True, False, True),
    "no_grad": (torch.bfloat16, True, False, False, False),  # (forward only: nothing saved; backward gives db alone)
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


def _run(s) -> tuple[dict, int]:
    """({name: tensor} of the forward op's outputs (y, saved tensors) and the backward op's gradients, whether the
    forward took the fast path: float8_graph's `_fast_call` answer, 0 where not), the backward op given what the
    forward op's autograd keeps (compiled_linear)."""
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


def _cpp_phases_run(case: str) -> bool:
    """Whether the C++ phases run a gathered call of `case` on this device: per-tensor casts always; FP8 blocks where
    the extension's block GEMM takes every GEMM (sm_90, E4M3; the shapes here are multiples of 128)."""
    if case in PER_TENSOR_CASES:
        return True
    return case != "fp8blk_1x128_e5m2" and torch.cuda.get_device_capability() == (9, 0)


def _three_paths(s, monkeypatch, case: str) -> dict:
    """{"cpp", "python", "general"}: the gathered ops' results with the C++ phases (default), with them off, and on
    the general path; asserts which path each ran."""
    calls = _Calls(monkeypatch)
    out = {}
    python = {"_fprop": 1, "_grads": 1}
    # (each switch built when its block starts: the switches take effect when built)
    for path, ctx in (("cpp", lambda: gathered_cpp_ops(True)), ("python", lambda: gathered_cpp_ops(False)),
                      ("general", lambda: eager_fast_path(False))):
        with ctx():
            out[path], fast = _run(s)
        n = calls.take()
        want = {"cpp": {"_fprop": 0, "_grads": 0} if _cpp_phases_run(case) else python, "python": python,
                "general": {"_fprop": 0, "_grads": 0}}[path]
        assert (bool(fast), n) == (path != "general", want), \
            f"the {path} run took the fast path: {fast}, called float8_graph's Python phases {n} times"
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CASES)
@gpu
def test_cpp_phases_are_bitwise_the_python_phases_and_the_general_path(case, variant, monkeypatch):
    s = _setup(case, variant, "cuda")
    out = _three_paths(s, monkeypatch, case)
    _assert_same(out["cpp"], out["python"], f"{case}/{variant}: C++ vs Python phases")
    # (the general path saves the input as a flattened quantized tensor: its outputs and gradients compared)
    _assert_same({k: v for k, v in out["cpp"].items() if not k.startswith("saved")},
                 {k: v for k, v in out["general"].items() if not k.startswith("saved")},
                 f"{case}/{variant}: C++ phases vs general path")


@pytest.mark.parametrize("where", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "mixed", "fp8_block", "fp8blk_1x128_e4m3_nopow2"])
@gpu
def test_cpp_phases_on_non_finite_values_are_bitwise_the_python_phases(case, where, monkeypatch):
    """inf and NaN in x, dy or the weight: every result as the Python phases' and the general path's (NaN where
    they have NaN; payloads aside), and non-finite where they are."""
    s = _setup(case, "plain", "cuda", nonfinite=where)
    out = _three_paths(s, monkeypatch, case)
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


@gpu
def test_the_block_phase_ops_refuse_inconsistent_arguments():
    x = torch.randn(128, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(128, OUT, device="cuda", dtype=torch.bfloat16)
    e4 = torch.float8_e4m3fn
    w_row, w_rs, w_col, w_cs = torch.ops.hybridq.fp8_block_quantize(
        torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16), e4, 2, 0.0, True, True, True)
    fprop = torch.ops.hybridq.fp8_block_linear_fprop
    x_col, x_s = fprop(x, w_row, w_rs, None, e4, 0.0, True, 2, True, False)[1:]
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear_fprop: input of shape \[128, 128\] and "
                                           r"weight rowwise part of shape \[128, 256\] do not make x @ weight\^T"):
        fprop(x[:, :128], w_row, w_rs, None, e4, 0.0, True, 2, True, False)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear_fprop: bias of shape \[64\] does not match "
                                           r"128 output features"):
        fprop(x, w_row, w_rs, dy[0, :64], e4, 0.0, True, 2, True, False)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear_fprop: w_block_dim must be 1 \(1x128 "
                                           r"blocks\) or 2 \(128x128 tiles\), got 3"):
        fprop(x, w_row, w_rs, None, e4, 0.0, True, 3, True, False)

    def grads(x_saved, xs, wc, ws, soi=False, need_dgrad=True, need_wgrad=True, w_block_dim=2):
        return torch.ops.hybridq.fp8_block_linear_grads(dy, x_saved, xs, wc, ws, e4, 0.0, True, e4, 0.0, True,
                                                        w_block_dim, soi, need_dgrad, need_wgrad, True, [128, IN],
                                                        torch.bfloat16, torch.bfloat16)

    bad = {
        r"dgrad needs the weight's columnwise part \(w_col and w_col_scale_inv\)": (x_col, x_s, None, w_cs),
        r"wgrad needs what the forward kept of x \(x_saved, and x_col_scale_inv unless save_original_input\)":
            (x_col, None, w_col, w_cs),
        r"w_col of shape \[128, 256\] is not the columnwise part \[in_features, out_features\] = \[256, 128\]":
            (x_col, x_s, w_row, w_rs),
    }
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=f"hybridq::fp8_block_linear_grads: {message}"):
            grads(*args)
    with pytest.raises(RuntimeError, match=r"hybridq::fp8_block_linear_grads: w_block_dim must be 1"):
        grads(x_col, x_s, w_col, w_cs, w_block_dim=0)
    grads(x, None, w_col, w_cs, soi=True)  # save_original_input: x's values, no scale_inv
    dx, dw, db = grads(None, None, w_col, w_cs, need_wgrad=False)  # no wgrad: nothing of x needed
    assert dw.shape == (0,) and dx.shape == (128, IN) and db.shape == (OUT,), \
        f"a gradient not asked for is an empty tensor: dx {tuple(dx.shape)}, dw {tuple(dw.shape)}"


@gpu
def test_block_calls_whose_gemms_the_block_gemm_op_does_not_take_run_the_python_phases(monkeypatch):
    """A row count that is no multiple of 128 (wgrad's contracted dim: the GEMM dispatch pads or emulates it), or
    the block GEMM op switched off: the gathered phases are the Python ones (the dispatch decides per GEMM), bitwise
    the general path."""
    from hybridq.kernels import native_gemm
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block GEMM op runs on sm_90")
    for what, tokens, op_on in (("80 rows", (2, 40), True), ("the block GEMM op off", TOKENS, False)):
        s = _setup("fp8_block", "plain", "cuda")
        if tokens != TOKENS:
            g = torch.Generator().manual_seed(1)
            s.x = torch.randn(*tokens, IN, generator=g).to("cuda", s.dtype)
            s.dy = torch.randn(*tokens, OUT, generator=g).to("cuda", s.dtype)
        calls = _Calls(monkeypatch)
        monkeypatch.setattr(native_gemm.BLOCK_GEMM_OP, "on", op_on)
        got, fast = _run(s)
        assert fast and calls.take() == {"_fprop": 1, "_grads": 1}, f"{what}: the Python phases did not run"
        with eager_fast_path(False):
            want, _ = _run(s)
        _assert_same({k: v for k, v in got.items() if not k.startswith("saved")},
                     {k: v for k, v in want.items() if not k.startswith("saved")}, f"fp8_block, {what}")


# ---- the CPU: float8_graph's Python phases (no extension) ------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "no_bias", "save_original_input", "no_wgrad", "no_dgrad",
                                     "no_dgrad_save_original_input", "no_grad", "fp32"])
@pytest.mark.parametrize("case", ["fp8_e4m3", "mixed", "fp8_block", "fp8blk_1x128_e4m3_nopow2"])
def test_cpu_gathered_fast_path_is_bitwise_the_general_path(case, variant, monkeypatch):
    s = _setup(case, variant, "cpu")
    calls = _Calls(monkeypatch)
    fast, took = _run(s)
    assert took and calls.take() == {"_fprop": 1, "_grads": 1}, "the CPU fast path did not run the Python phases"
    with eager_fast_path(False):
        general, took = _run(s)
    assert not took
    # (the saved tensors too: the fast path saves what the general path's flattened input holds, in its order)
    _assert_same(fast, general, f"{case}/{variant}: CPU fast path")


@pytest.mark.parametrize("where", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("case", ["mixed", "fp8_block"])
def test_cpu_gathered_fast_path_on_non_finite_values_is_bitwise_the_general_path(case, where, monkeypatch):
    s = _setup(case, "plain", "cpu", nonfinite=where)
    calls = _Calls(monkeypatch)
    fast, took = _run(s)
    assert took and calls.take() == {"_fprop": 1, "_grads": 1}, "the CPU fast path did not run the Python phases"
    with eager_fast_path(False):
        general, _ = _run(s)
    _assert_same(fast, general, f"{case}, inf/NaN in {where}: CPU fast path", nan_payload=True)
    n = "grad_input" if where == "grad_output" else "output"
    assert not torch.isfinite(fast[n]).all(), f"{case}: the {n} became finite with inf/NaN in {where}"


def test_the_environment_switches_the_cpp_phases_off_for_a_process():
    code = "from hybridq.nn import float8_graph as f; print(f._CPP_OPS.on)"
    env = dict(os.environ, HYBRIDQ_LINEAR_CPP_OPS="0")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False", f"HYBRIDQ_LINEAR_CPP_OPS=0 left the C++ phases {got.stdout.strip()!r}"
    assert float8_graph._CPP_OPS.on, "the C++ phases are off by default in this process"
    with gathered_cpp_ops(False):
        assert not float8_graph._CPP_OPS.on
    assert float8_graph._CPP_OPS.on, "gathered_cpp_ops(False) as a block did not restore the switch"
