"""Run by tests/test_delayed_linear_host.py in a process of its own: csrc/linear_fp8.cpp (hybridq::fp8_linear_delayed,
the one-op path of an fp8_delayed Linear: a C++ autograd node) built for the CPU with tests/_linear_host_shim.cpp,
the per-tensor casts and GEMM it calls given the CPU code the general path runs for them (the format's reference:
`Float8Quantizer.reference_parts`' delayed cast -- max|x| max-combined into the history slot, the data at the given
scale -- and `native_gemm.fp8_tensor_emulated_mm`), then nn/delayed_linear.py's one-op path (its Python state steps,
the op, the node's pre-hook) compared bit for bit with the general path over several steps: outputs, gradients and
every quantizer's amax history, scale and pending flag, over the variants the op and its Python side distinguish.
The CUDA conditions of `_one_op` (a CUDA input, the update kernel for dy's state) are replaced by the rest of them, so
the updates here are the Python ones, which replace the state tensors: the pre-hook's copy into the node's held
tensors runs at every step (on CUDA the update is in place: the GPU tests). A process of its own: the ops defined
here must not meet a built extension's or another test's.

    python tests/_delayed_linear_host.py BUILD_DIR CUDA_INCLUDE_DIR    # prints "bitwise: N runs of S steps" or fails
"""

from __future__ import annotations

import itertools
import os
import re
import sys

import torch
from torch.utils.checkpoint import checkpoint

import hybridq as hq
from hybridq.formats import Float8Quantizer, Float8TensorPart
from hybridq.formats._numerics import rcp, satfinite_fp8
from hybridq.kernels import cuda_fp8_tensor, native_gemm
from hybridq.nn import delayed_linear
from hybridq.nn.float8_graph import eager_fast_path
from hybridq.nn.linear import shared_input_quantization

ROOT = __file__.rsplit("/tests/", 1)[0]
ONE_OP, GENERAL = "torch::autograd::CppNode<hybridq::ops::Fp8Linear>", "_LinearFunctionBackward"
STEPS = 4
RECIPES = {
    "fp8_delayed": lambda: hq.recipe("fp8_delayed"),
    "margin1_most_recent": lambda: hq.CustomRecipe(
        lambda role: Float8Quantizer("e5m2" if role.tensor_type.startswith("grad") else "e4m3", scaling="delayed",
                                     amax_history_len=3, margin=1, amax_compute_algo="most_recent"),
        name="margin1-most-recent"),
}


def _schema(op: str) -> str:
    """The schema string of `op` as csrc/quantize_fp8_tensor.cu declares it (its m.def's string literals joined)."""
    text = open(f"{ROOT}/csrc/quantize_fp8_tensor.cu").read()
    for call in text.split("m.def(")[1:]:
        literal = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', call.split(");", 1)[0]))
        if literal.startswith(op + "("):
            return literal
    raise AssertionError(f"quantize_fp8_tensor.cu declares no {op}")


def _parts(data: torch.Tensor, scale_inv: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple:
    m, k = data.shape
    row = Float8TensorPart(rows=m, cols=k, columnwise=False, data=data, scale_inv=scale_inv)
    empty = data.new_empty(0)
    return (row.data if rowwise else empty), (row.transposed().data if columnwise else empty), scale_inv


def _quantize(x, dtype, scale, amax, eps, pow2, rowwise, columnwise, want_amax):
    # (the op path calls it with a scale only: a replayed cast, Float8Quantizer.reference_parts with the given scale)
    assert scale is not None and amax is None and not want_amax, "host check: only the replayed delayed cast"
    r, c, s = _parts(satfinite_fp8(x.float() * scale, dtype), rcp(scale), rowwise, columnwise)
    return r, c, s, x.new_empty(0, dtype=torch.float32)


def _quantize_delayed(x, dtype, scale, amax_history, eps, pow2, rowwise, columnwise):
    # Float8Quantizer._delayed_scale + record_amax + reference_parts (x is never empty here: the fast path declines)
    slot = amax_history[:1]
    torch.maximum(slot, x.float().abs().amax().reshape(1), out=slot)
    return _parts(satfinite_fp8(x.float() * scale, dtype), rcp(scale), rowwise, columnwise)


def define_ops() -> list:
    lib = torch.library.Library("hybridq", "FRAGMENT")
    for op in ("fp8_linear", "fp8_linear_delayed", "fp8_linear_fprop", "fp8_linear_grads"):
        lib.define(_schema(op))
    host = torch.library.Library("hybridq_host", "DEF")
    host.define("quantize(Tensor x, ScalarType dtype, Tensor? scale, Tensor? amax, float eps, bool pow2, bool rowwise, "
                "bool columnwise, bool want_amax) -> (Tensor, Tensor, Tensor, Tensor)")
    host.define("quantize_delayed(Tensor x, ScalarType dtype, Tensor scale, Tensor(a!) amax_history, float eps, "
                "bool pow2, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor)")
    host.define("mm(Tensor a, Tensor b, Tensor sa, Tensor sb, ScalarType out_dtype, bool fast) -> Tensor")
    host.impl("quantize", _quantize, "CPU")
    host.impl("quantize_delayed", _quantize_delayed, "CPU")
    host.impl("mm", lambda a, b, sa, sb, out_dtype, fast: native_gemm.fp8_tensor_emulated_mm(a, sa, b, sb, out_dtype),
              "CPU")
    return [lib, host]


def _distinct_states(cfg) -> bool:
    qs = (cfg.input_q, cfg.weight_q, cfg.grad_output_q)
    return len({id(t) for q in qs for t in (q.scale, q.amax_history)}) == 6 and len({id(q) for q in qs}) == 3


def _state(layer) -> list:
    return [v for q in layer.quantizers().values() for v in (q.amax_history.clone(), q.scale.clone(),
                                                               q.update_pending)]


def _inputs(step: int, dtype) -> tuple:
    g = torch.Generator().manual_seed(step)
    scale = 2.0 ** (step - 1)
    return ((torch.randn(2, 32, 64, generator=g) * scale).to(dtype),
            (torch.randn(2, 32, 48, generator=g) / scale).to(dtype))


def run(recipe: str, dtype, bias: bool, x_grad: bool, w_grad: bool, mode: str, fast: bool) -> list:
    """Every step's [y, dx, dW, db, node, state...] of a layer run STEPS steps on one path."""
    torch.manual_seed(0)
    layer = hq.Linear(64, 48, bias=bias, recipe=RECIPES[recipe](), name="fc", dtype=dtype)
    layer.weight.requires_grad_(w_grad)
    out, saved = [], None  # (saved: the state_dict after step 1, loaded in the last step of mode "load")
    with eager_fast_path(fast):
        for s in range(STEPS):
            x, gy = _inputs(s, dtype)
            x.requires_grad_(x_grad)
            layer.zero_grad(set_to_none=True)
            call = (lambda t: checkpoint(layer, t, use_reentrant=False)) if mode == "recompute" else layer
            y = call(x)
            node = y.grad_fn.name() if type(y.grad_fn).__name__ == "CppFunction" else type(y.grad_fn).__name__
            if mode == "twice":
                y = y + call(x * 0.5)
            if mode == "load" and s == STEPS - 1:  # a state loaded between this forward and its backward
                layer.load_state_dict(saved)
            y.backward(gy)
            if mode == "batched":
                hq.update_delayed_scaling(layer.quantizers().values())
            if s == 1:
                saved = {k: v.clone() for k, v in layer.state_dict().items()}
            out.append([y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad, node]
                       + _state(layer))
    return out


def same(a, b) -> bool:
    if a is None or b is None or not isinstance(a, torch.Tensor):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1
                                                                      else a, b.view(torch.uint8)
                                                                      if b.element_size() == 1 else b)


def main(build_dir: str, cuda_include: str) -> None:
    libs = define_ops()  # noqa: F841 (kept alive: a Library's registrations die with it)
    from torch.utils.cpp_extension import load
    fake = os.path.join(build_dir, "fake_include", "c10", "cuda", "impl")
    os.makedirs(fake, exist_ok=True)
    with open(os.path.join(fake, "cuda_cmake_macros.h"), "w") as fh:  # (the CPU wheel's headers lack it)
        fh.write("#pragma once\n")
    load(name="hybridq_linear_host", sources=[f"{ROOT}/csrc/linear_fp8.cpp", f"{ROOT}/tests/_linear_host_shim.cpp"],
         extra_include_paths=[os.path.join(build_dir, "fake_include"), cuda_include],
         is_python_module=False, build_directory=build_dir)
    shared_input_quantization(False)
    cuda_fp8_tensor.linear_op = lambda name="fp8_linear": getattr(torch.ops.hybridq, name).default
    # the one-op path's conditions less the CUDA ones (see the module docstring)
    delayed_linear._one_op = lambda x, spec, cfg: (delayed_linear._DELAYED_OP.on and not spec.save_original_input
                                                   and _distinct_states(cfg))
    n = 0
    for recipe, dtype, bias, (x_grad, w_grad), mode in itertools.product(
            RECIPES, (torch.float32, torch.bfloat16), (True, False), ((True, True), (True, False), (False, True)),
            ("plain", "twice", "recompute", "batched", "load")):
        got, want = (run(recipe, dtype, bias, x_grad, w_grad, mode, fast) for fast in (True, False))
        for s, (a, b) in enumerate(zip(got, want)):
            where = f"{recipe} {dtype} bias={bias} x_grad={x_grad} w_grad={w_grad} {mode}, step {s}"
            assert (a[4], b[4]) == (ONE_OP, GENERAL), f"{where}: nodes {a[4]}, {b[4]}"
            for i, (u, v) in enumerate(zip(a, b)):
                assert i == 4 or same(u, v), f"{where}: result {i} differs ({u!r} vs {v!r})"
        n += 1
    check_create_graph_refused()
    print(f"bitwise: {n} runs of {STEPS} steps; create_graph refused")


def check_create_graph_refused() -> None:
    """The op's node (hybridq::Fp8Linear, from the second step on) refuses create_graph=True naming the op, as the
    general path's Python node does ([Note: no double backward through quantized GEMMs]): before, its gradients had
    no graph and a second backward got None for the weight silently."""
    torch.manual_seed(0)
    layer = hq.Linear(64, 48, recipe=RECIPES["fp8_delayed"](), name="fc")
    with eager_fast_path(True):
        for s in range(2):
            x, gy = _inputs(s, torch.float32)
            x.requires_grad_()
            y = layer(x)
            if s == 0:
                y.backward(gy)
        assert y.grad_fn.name() == ONE_OP, f"create_graph check: the layer ran {y.grad_fn.name()}, not the op"
        try:
            torch.autograd.grad((y * gy).sum(), [x, layer.weight], create_graph=True)
        except NotImplementedError as e:
            assert "hybridq::fp8_linear" in str(e) and "create_graph=True" in str(e), f"create_graph=True raised {e}"
        else:
            raise AssertionError("the op's node ran its backward under create_graph=True")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
