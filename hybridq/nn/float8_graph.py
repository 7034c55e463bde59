"""A per-tensor FP8 Linear inside torch.compile's graph as the individual ops it is made of.

compiled_linear.py puts any hybridq Linear into a compiled graph as two opaque custom ops whose bodies run the eager
Python: exact for every format, but each call still pays that Python (~0.25 ms forward, ~0.23 ms backward on the
host), and Inductor sees nothing inside. A layer whose three quantizers are per-tensor FP8 with current scaling needs
none of that machinery: each cast is one call of the extension's `hybridq::fp8_tensor_quantize` op (C++, with a
fake), each GEMM one `torch._scaled_mm`. Here that layer is an autograd.Function dynamo traces through, so the graph
holds those ops themselves: no Python runs per call, and AOTAutograd's common-subexpression pass merges the casts of
one tensor read by several layers (q/k/v, w1/w3) into one, as the eager path's input sharing does.

The results are bitwise those of the eager layer: the same kernels (or, on the CPU, the same reference ops) with the
same arguments, the same GEMM calls (fast accumulation in forward only), the same saved directions. Where the eager
layer would take another path -- no extension or no FP8 tensor cores on the device, a dimension the FP8 GEMM cannot
take (not a multiple of 16: the eager layer warns and emulates), an input dtype the kernels do not read --
`takes` says no and the layer runs as compiled_linear's ops, which run the eager code. On the CPU the casts are the
pure-PyTorch reference and the GEMMs the fp32 emulation (dequantize, multiply), as in eager.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..enums import Scaling
from ..formats.float8 import Float8Quantizer, float8_current_scaling
from ..kernels import _ext, native_gemm
from ..kernels.cuda import FP8_TENSOR_OPTIONS, IN_DTYPES

__all__ = ["Float8Cast", "Float8GraphSpec", "graph_spec", "takes", "float8_graph_linear"]


class Float8Cast(NamedTuple):
    """What one per-tensor FP8 cast with current scaling depends on."""

    dtype: torch.dtype
    amax_epsilon: float
    power_2_scale: bool


class Float8GraphSpec(NamedTuple):
    """A layer's configuration as the traced code reads it (plain constants: dynamo guards on them)."""

    input: Float8Cast
    weight: Float8Cast
    grad_output: Float8Cast
    save_original_input: bool


def graph_spec(quantizers: dict, save_original_input: bool) -> Float8GraphSpec | None:
    """The spec of a layer whose input, weight and grad_output quantizers are all per-tensor FP8 with current
    scaling (exactly `Float8Quantizer`, with no option this path does not implement), else None."""
    casts = []
    for role in ("input", "weight", "grad_output"):
        q = quantizers[role]
        if type(q) is not Float8Quantizer or q.scaling != Scaling.CURRENT:
            return None
        if {f.name for f in dataclasses.fields(q)} - FP8_TENSOR_OPTIONS:
            return None  # an option added later is never silently ignored here
        casts.append(Float8Cast(q.dtype, float(q.amax_epsilon), bool(q.power_2_scale)))
    return Float8GraphSpec(*casts, bool(save_original_input))


@torch.compiler.assume_constant_result
def _cuda_fp8_ready(index: int) -> bool:
    """The extension's kernels and the FP8 tensor cores (sm_89+) are there on CUDA device `index` (a fact of the
    machine: compiled code reads it as a constant)."""
    device = torch.device("cuda", index)
    return _ext.available_for(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def takes(spec: Float8GraphSpec | None, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call runs as the ops of this module: the eager layer would run exactly these kernels and GEMMs
    (see the module docstring). Traced by dynamo."""
    if spec is None or x.device != weight.device:
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or x.dtype not in IN_DTYPES or weight.dtype not in IN_DTYPES:
        return False
    if not native_gemm.native_enabled() or not _cuda_fp8_ready(x.device.index or 0):
        return False
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    pairs = ((spec.input.dtype, spec.weight.dtype), (spec.grad_output.dtype, spec.weight.dtype),
             (spec.grad_output.dtype, spec.input.dtype))
    return (m > 0 and m % 16 == 0 and k % 16 == 0 and n % 16 == 0
            and all(native_gemm.fp8_tensor_pair_supported(a, b) for a, b in pairs))


def _quantize(x2d: torch.Tensor, cast: Float8Cast, rowwise: bool, columnwise: bool
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(rowwise fp8 `[M, K]`, columnwise fp8 `[K, M]`, scale_inv `[1]`); a direction not asked for is None."""
    if x2d.is_cuda:
        row, col, scale_inv, _ = torch.ops.hybridq.fp8_tensor_quantize(
            x2d.contiguous(), cast.dtype, None, None, cast.amax_epsilon, cast.power_2_scale, rowwise, columnwise,
            False)
        return (row if rowwise else None), (col if columnwise else None), scale_inv
    data, scale_inv = float8_current_scaling(x2d, cast.dtype, cast.amax_epsilon, cast.power_2_scale)
    return (data if rowwise else None), (data.t().contiguous() if columnwise else None), scale_inv


def _mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
        out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """`a @ b^T` of two per-tensor FP8 operands in GEMM orientation: the FP8 GEMM on CUDA, the emulation on CPU."""
    if a.is_cuda:
        return native_gemm.fp8_tensor_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, fast_accum)
    return native_gemm.fp8_tensor_emulated_mm(a, a_scale_inv, b, b_scale_inv, out_dtype)


class _Float8GraphLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8GraphSpec,
                need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        keep_x = need_wgrad and spec.save_original_input  # wgrad quantizes the original input in backward
        xr, xc, x_si = _quantize(x2d, spec.input, True, need_wgrad and not keep_x)
        wr, wc, w_si = _quantize(weight, spec.weight, True, need_dgrad)
        y = _mm(xr, x_si, wr, w_si, x.dtype, native_gemm.FAST_ACCUM_FPROP)
        if bias is not None:
            y = y + bias.to(x.dtype)
        ctx.save_for_backward(x2d if keep_x else xc, wc, x_si, w_si)
        ctx.spec, ctx.need_dgrad, ctx.need_wgrad = spec, need_dgrad, need_wgrad
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        # (a tensor of its own, not a view: see linear_function._output)
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_saved, wc, x_si, w_si = ctx.saved_tensors
        spec, need_dgrad, need_wgrad = ctx.spec, ctx.need_dgrad, ctx.need_wgrad
        dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw = db = None
        if need_dgrad or need_wgrad:
            gr, gc, g_si = _quantize(dy2d, spec.grad_output, need_dgrad, need_wgrad)
            if need_dgrad:
                dx = _mm(gr, g_si, wc, w_si, dy.dtype, False).reshape(ctx.x_shape)
            if need_wgrad:
                xc = x_saved
                if spec.save_original_input:
                    _, xc, x_si = _quantize(x_saved, spec.input, False, True)
                dw = _mm(gc, g_si, xc, x_si, dy.dtype, False).to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None


def float8_graph_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        spec: Float8GraphSpec) -> torch.Tensor:
    """`x W^T + b` of a per-tensor FP8 layer as traceable ops (call only where `takes` says yes)."""
    grad = torch.is_grad_enabled()
    need_dgrad = grad and x.requires_grad
    need_wgrad = grad and weight.requires_grad
    if not (need_dgrad or need_wgrad or (grad and bias is not None and bias.requires_grad)):
        need_dgrad = need_wgrad = False  # forward only: rowwise forms, nothing saved
    return _Float8GraphLinear.apply(x, weight, bias, spec, need_dgrad, need_wgrad)
