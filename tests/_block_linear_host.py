"""Run by tests/test_fp8_block_linear_host.py in a process of its own: csrc/linear_fp8_block.cpp (hybridq::
fp8_block_linear, a C++ autograd node) built for the CPU, the two ops it calls defined in this process with the CPU
code the Python node runs for them -- hybridq::fp8_block_quantize as the block reference quantize
(`float8_graph._block_reference`), hybridq::fp8_block_mm as the GEMM dispatch on the CPU (`float8_graph._block_gemm`:
the emulated GEMM) -- then the op's output and gradients compared bit for bit with float8_graph's Python node
(`_Float8GraphLinear`) over every variant the op distinguishes, on a plain weight and on a weight handed over
quantized (FSDP2's gathered weight: its columnwise tensors refilled in place between forward and backward, as the
backward unshard does, which both nodes must read). The same build's gathered phase ops
(hybridq::fp8_block_linear_fprop / fp8_block_linear_grads, the node's bodies without the node) are checked as the
compiled Linear's gathered ops call them -- float8_graph's `gathered_forward` / `gathered_grads` with the C++ phases
selected -- bit for bit those functions' Python phases (`_fprop` / `_grads`). A process of its own: the ops defined
here must not meet a built extension's (the GPU machine's) or another test's.

    python tests/_block_linear_host.py BUILD_DIR    # prints "bitwise: N variants, M phase variants" or fails
"""

from __future__ import annotations

import itertools
import re
import sys

import torch
from torch.utils.cpp_extension import load

import hybridq as hq
from _op_schemas import csrc_schemas
from hybridq.formats import Float8BlockQuantizer
from hybridq.kernels import cuda_fp8_block
from hybridq.nn import compiled_linear
from hybridq.nn import float8_graph as fg
from hybridq.tensor import QuantizedTensor

CSRC = __file__.rsplit("/tests/", 1)[0] + "/csrc/linear_fp8_block.cpp"
ONE_OP, PYTHON = "torch::autograd::CppNode<hybridq::ops::Fp8BlockLinear>", "_Float8GraphLinearBackward"
# the block casts the op takes: the preset (128x128 weight tiles), 1x128 weights, no power-of-2 scales with an epsilon
SPECS = {
    "fp8_block": {"input": lambda: Float8BlockQuantizer(), "weight": lambda: Float8BlockQuantizer(block_dim=2),
                  "grad_output": lambda: Float8BlockQuantizer()},
    "1x128 weight": {"input": lambda: Float8BlockQuantizer(), "weight": lambda: Float8BlockQuantizer(),
                     "grad_output": lambda: Float8BlockQuantizer()},
    "no pow2": {"input": lambda: Float8BlockQuantizer(power_2_scale=False),
                "weight": lambda: Float8BlockQuantizer(block_dim=2, power_2_scale=False, amax_epsilon=1e-6),
                "grad_output": lambda: Float8BlockQuantizer(power_2_scale=False)},
}


def _quantize(x, dtype, block_dim, eps, pow2, rowwise, columnwise, src_rows=None):
    """hybridq::fp8_block_quantize by the reference (the node never passes a row map)."""
    assert src_rows is None, "the Linear node passed a row map to fp8_block_quantize"
    return tuple(fg._block_reference(x, dtype, block_dim, eps, pow2, rowwise, columnwise))


def define_ops() -> torch.library.Library:
    lib = torch.library.Library("hybridq", "FRAGMENT")
    # (every schema is the format's: csrc/quantize_fp8_block.cu, read from there, so this check sees what the build
    # registers -- a typed handle in the node that no longer matches an op's schema fails here too)
    schemas = csrc_schemas()
    for name in ("fp8_block_quantize", "fp8_block_mm", "fp8_block_linear", "fp8_block_linear_fprop",
                 "fp8_block_linear_grads"):
        lib.define(schemas[name])
    lib.impl("fp8_block_quantize", _quantize, "CPU")
    lib.impl("fp8_block_mm", lambda a, a_scale, b, b_scale, b_tiles, out_dtype: fg._block_gemm(
        a, a_scale, 1, False, b, b_scale, 2 if b_tiles else 1, False, out_dtype, "host check"), "CPU")
    return lib


def step(op, spec, layer, x0, gy, x_grad, shared, hooks, gathered, one_op):
    """([y, dx, dW, db], node name, dtypes the saved-tensor hooks packed) of one forward + backward."""
    x = x0.clone().requires_grad_(x_grad)
    layer.zero_grad(set_to_none=True)
    need_dgrad, need_wgrad = fg.gradients_needed(x, layer.weight)
    w_parts = refill = None
    if gathered:  # the weight's parts as `_gathered_parts` hands them over; the columnwise one refilled after forward
        wr, wrs, wc, wcs = fg._quantize(layer.weight.detach(), spec.weight, True, True)
        w_parts = (wr, wrs, fg._part(spec.weight, wc, wcs, True) if need_dgrad else None)
        _, _, wc2, wcs2 = fg._quantize(layer.weight.detach().flip(0) * 3, spec.weight, False, True)
        refill = lambda: (wc.copy_(wc2), wcs.copy_(wcs2))  # noqa: E731
    parts = None
    if shared:  # x quantized before the call (another layer's quantization of it), as _shared_input hands it over
        parts = fg._quantize(x.reshape(-1, x.shape[-1]).detach(), spec.input, True,
                             need_wgrad and not spec.save_original_input)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.dtype) or t.clone(), lambda t: t) \
            if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if one_op:
            xi, w, g = spec.input, spec.weight, spec.grad_output
            y = op(x, layer.weight, layer.bias, *(parts or (None,) * 4), xi.dtype, xi.amax_epsilon, xi.power_2_scale,
                   w.dtype, w.block_dim, w.amax_epsilon, w.power_2_scale, g.dtype, g.amax_epsilon, g.power_2_scale,
                   need_dgrad, need_wgrad, spec.save_original_input, *fg._op_weight_parts(w_parts))
        else:
            y = fg._Float8GraphLinear.apply(x, layer.weight, layer.bias, spec, need_dgrad, need_wgrad, parts, w_parts)
    if refill is not None:
        refill()
    node = None if y.grad_fn is None else y.grad_fn.name()
    if y.requires_grad:
        y.backward(gy)
    bias_grad = None if layer.bias is None else layer.bias.grad
    return [y.detach(), x.grad, layer.weight.grad, bias_grad], node, packed


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if (a is None) != (b is None):
        return False
    if a is not None and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # (saved FP8 data: its bytes)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a is None or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                         and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


def check(op, case, spec_q, save_original_input, x_grad, w_grad, bias, dtype, shared, hooks, gathered,
          non_finite=False) -> None:
    torch.manual_seed(0)
    recipe = hq.CustomRecipe(lambda role: spec_q[role.tensor_type](), name=case)
    layer = hq.Linear(256, 128, bias=bias, recipe=recipe, dtype=dtype, save_original_input=save_original_input)
    layer.weight.requires_grad_(w_grad)
    g = torch.Generator().manual_seed(1)
    x0, gy = torch.randn(2, 64, 256, generator=g).to(dtype), torch.randn(2, 64, 128, generator=g).to(dtype)
    if non_finite:
        x0.view(-1)[3] = float("inf")
        gy.view(-1)[100] = float("nan")
        layer.weight.data.view(-1)[257] = float("-inf")
    what = (f"{case}, save_original_input={save_original_input}, x grad {x_grad}, weight grad {w_grad}, bias {bias}, "
            f"{dtype}, x handed over {shared}, saved-tensor hooks {hooks}, gathered weight {gathered}, "
            f"non-finite {non_finite}")
    spec = layer._float8_graph_spec
    got, node, packed = step(op, spec, layer, x0, gy, x_grad, shared, hooks, gathered, True)
    want, want_node, want_packed = step(op, spec, layer, x0, gy, x_grad, shared, hooks, gathered, False)
    if x_grad or w_grad or bias:
        assert (node, want_node) == (ONE_OP, PYTHON), f"{what}: nodes {node}, {want_node}"
    for name, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert same(a, b), f"{what}: {name} differs from the Python node's"
    assert packed == want_packed, f"{what}: saved tensors {packed}, the Python node's {want_packed}"


def phase_step(spec, cfg, wq: QuantizedTensor, x, bias, dy, need_dgrad, need_wgrad, cpp: bool):
    """[y, saved tensors..., dx, dW, db] of one gathered call (`gathered_forward`, then `gathered_grads` on what it
    kept), with the C++ phase ops or the Python phases, and how often the Python phases ran."""
    calls = {"_fprop": 0, "_grads": 0}
    real = {n: getattr(fg, n) for n in calls}

    def counted(name):
        def f(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return f

    was = fg._block_phase_op
    fg._block_phase_op = lambda t, fast: cpp  # (on the CPU `_cpp_phase` says no: the host ops stand in for CUDA's)
    fg._fprop, fg._grads = counted("_fprop"), counted("_grads")
    try:
        y, x_saved, xcs, fast = fg.gathered_forward(x, wq, bias, spec, cfg, need_dgrad, need_wgrad)
        saved = [] if x_saved is None or xcs is None else [x_saved, xcs]
        if need_wgrad and spec.save_original_input:
            x_saved = x.reshape(-1, x.shape[-1])
        grads = fg.gathered_grads(spec, dy, x_saved, xcs, wq.part(fg.COLUMNWISE) if need_dgrad else None, need_dgrad,
                                  need_wgrad, bias is not None, list(x.shape), x.dtype, x.dtype, fast)
    finally:
        fg._block_phase_op = was
        fg._fprop, fg._grads = real["_fprop"], real["_grads"]
    return [y, *saved, *grads], calls


def check_phases(case, spec_q, save_original_input, need_dgrad, need_wgrad, bias, dtype, non_finite=False) -> None:
    torch.manual_seed(0)
    recipe = hq.CustomRecipe(lambda role: spec_q[role.tensor_type](), name=case)
    layer = hq.Linear(256, 128, bias=bias, recipe=recipe, dtype=dtype, save_original_input=save_original_input)
    key = layer._configuration_key
    spec, cfg = compiled_linear._fast_spec(key, None), compiled_linear._config(key, None)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(2, 64, 256, generator=g).to(dtype), torch.randn(2, 64, 128, generator=g).to(dtype)
    w = torch.randn(128, 256, generator=g).to(dtype)
    b = torch.randn(128, generator=g).to(dtype) if bias else None
    if non_finite:
        x.view(-1)[3] = float("inf")
        dy.view(-1)[100] = float("nan")
        w.view(-1)[257] = float("-inf")
    wq = compiled_linear._LAYERS[key][1]["weight"].quantize(w, rowwise=True, columnwise=True, name="fc.weight")
    what = (f"phases: {case}, save_original_input={save_original_input}, dgrad {need_dgrad}, wgrad {need_wgrad}, "
            f"bias {bias}, {dtype}, non-finite {non_finite}")
    got, calls = phase_step(spec, cfg, wq, x, b, dy, need_dgrad, need_wgrad, True)
    assert calls == {"_fprop": 0, "_grads": 0}, f"{what}: the C++ phases were not taken ({calls})"
    want, calls = phase_step(spec, cfg, wq, x, b, dy, need_dgrad, need_wgrad, False)
    assert calls == {"_fprop": 1, "_grads": 1}, f"{what}: the Python phases were not taken ({calls})"
    assert len(got) == len(want), f"{what}: {len(got)} results, the Python phases' {len(want)}"
    for i, (a, b_) in enumerate(zip(got, want)):
        assert same(a, b_) and a.stride() == b_.stride(), \
            f"{what}: result {i} differs from the Python phases' ({a.shape} {a.dtype} vs {b_.shape} {b_.dtype})"


def check_grads_refusals() -> int:
    """The gradient phase op's argument checks (linear_node.h's check_grads_phase, shared with fp8_linear_grads) on
    the host build: each inconsistent call raises naming the op and the rule, before any work; the number checked."""
    e4, m, k, n = torch.float8_e4m3fn, 128, 256, 128
    x = torch.randn(m, k, dtype=torch.bfloat16)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    w_row, w_rs, w_col, w_cs = torch.ops.hybridq.fp8_block_quantize(torch.randn(n, k, dtype=torch.bfloat16), e4, 2,
                                                                    0.0, True, True, True)
    _, _, x_col, x_s = torch.ops.hybridq.fp8_block_quantize(x, e4, 1, 0.0, True, False, True)

    def grads(x_saved, xs, wc, ws, dy=dy, need_dgrad=True, w_block_dim=2):
        return torch.ops.hybridq.fp8_block_linear_grads(dy, x_saved, xs, wc, ws, e4, 0.0, True, e4, 0.0, True,
                                                        w_block_dim, False, need_dgrad, True, True, [m, k],
                                                        torch.bfloat16, torch.bfloat16)

    bad = {
        r"grad_output of shape \[\] and input shape \[128, 256\] are not a Linear's":
            (x_col, x_s, w_col, w_cs, dy[0, 0]),
        r"dgrad needs the weight's columnwise part \(w_col and w_col_scale_inv\)": (x_col, x_s, None, w_cs),
        r"wgrad needs what the forward kept of x \(x_saved, and x_col_scale_inv unless save_original_input\)":
            (x_col, None, w_col, w_cs),
        r"w_col of shape \[128, 256\] is not the columnwise part \[in_features, out_features\] = \[256, 128\]":
            (x_col, x_s, w_row, w_rs),
    }
    for message, args in bad.items():
        try:
            grads(*args)
        except RuntimeError as e:
            assert re.search(f"hybridq::fp8_block_linear_grads: {message}", str(e)), f"{message!r}: raised {e}"
        else:
            raise AssertionError(f"fp8_block_linear_grads accepted a call that breaks: {message}")
    grads(x_col, x_s, None, None, need_dgrad=False)  # no dgrad: the weight's columnwise part not needed
    return len(bad) + check_create_graph_refused()


def check_create_graph_refused() -> int:
    """The node's backward under create_graph=True raises NotImplementedError naming the op, as the Python node's
    does ([Note: no double backward through quantized GEMMs]): before, it returned gradients with no graph, and a
    second backward got None for the layer's weight silently. The number checked (1)."""
    layer = hq.Linear(256, 128, recipe="fp8_block", dtype=torch.bfloat16)
    s = layer._float8_graph_spec
    xi, w, g = s.input, s.weight, s.grad_output
    x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    y = torch.ops.hybridq.fp8_block_linear.default(
        x, layer.weight, layer.bias, None, None, None, None, xi.dtype, xi.amax_epsilon, xi.power_2_scale, w.dtype,
        w.block_dim, w.amax_epsilon, w.power_2_scale, g.dtype, g.amax_epsilon, g.power_2_scale, True, True, False)
    for out, cpp in ((y, True), (fg._Float8GraphLinear.apply(x, layer.weight, layer.bias, s, True, True), False)):
        try:
            torch.autograd.grad(out.float().square().sum(), [x, layer.weight], create_graph=True)
        except NotImplementedError as e:
            name = "hybridq::fp8_block_linear" if cpp else "an FP8 Linear"
            assert name in str(e) and "create_graph=True" in str(e), f"create_graph=True raised {e}"
        else:
            raise AssertionError(f"the {'C++' if cpp else 'Python'} node ran its backward under create_graph=True")
    return 1


def main(build_dir: str) -> None:
    lib = define_ops()  # noqa: F841 (kept alive: a Library's registrations die with it)
    load(name="hybridq_block_linear_host", sources=[CSRC], is_python_module=False, build_directory=build_dir)
    op = torch.ops.hybridq.fp8_block_linear.default
    # (float8_graph reaches the phase ops through cuda_fp8_block, which asks the built extension: here the host build)
    cuda_fp8_block.linear_op = lambda name="fp8_block_linear": getattr(torch.ops.hybridq, name).default
    n = 0
    for (case, spec_q), *flags in itertools.product(SPECS.items(), (False, True), (True, False), (True, False),
                                                    (True, False), (torch.bfloat16, torch.float32), (False, True),
                                                    (False, True), (False, True)):
        check(op, case, spec_q, *flags)
        n += 1
    for case, spec_q in SPECS.items():
        for gathered in (False, True):
            check(op, case, spec_q, False, True, True, True, torch.bfloat16, False, False, gathered, non_finite=True)
            n += 1
    with torch.inference_mode():  # (the CPU backend kernel: the forward alone, nothing saved)
        layer = hq.Linear(256, 128, recipe="fp8_block", dtype=torch.bfloat16)
        x = torch.randn(128, 256, dtype=torch.bfloat16)
        s = layer._float8_graph_spec
        xi, w, g = s.input, s.weight, s.grad_output
        y = op(x, layer.weight, layer.bias, None, None, None, None, xi.dtype, xi.amax_epsilon, xi.power_2_scale,
               w.dtype, w.block_dim, w.amax_epsilon, w.power_2_scale, g.dtype, g.amax_epsilon, g.power_2_scale, False,
               False, False)
        want = fg._Float8GraphLinear.apply(x, layer.weight, layer.bias, s, False, False, None, None)
        assert same(y, want), "inference mode: the output differs from the Python node's"
        n += 1
    phases = 0
    for (case, spec_q), soi, (dgrad, wgrad), bias, dtype in itertools.product(
            SPECS.items(), (False, True), ((True, True), (True, False), (False, True)), (True, False),
            (torch.bfloat16, torch.float32)):
        check_phases(case, spec_q, soi, dgrad, wgrad, bias, dtype)
        phases += 1
    for case, spec_q in SPECS.items():
        check_phases(case, spec_q, False, True, True, True, torch.bfloat16, non_finite=True)
        phases += 1
    refusals = check_grads_refusals()
    print(f"bitwise: {n} variants, {phases} phase variants; {refusals} refusals")


if __name__ == "__main__":
    main(sys.argv[1])
