"""hybridq's norms and SwiGLU inside torch.compile's graph: their CUDA kernels as custom ops with fakes.

torch 2.11's dynamo fails an assertion (handle_saved_tensors_wiring) tracing the kernels' autograd.Function
(norm.py, swiglu.py), so under torch.compile the kernels run as custom ops (nn/plain_ops.py) whose autograd
is registered with `register_autograd` instead: `hybridq::compiled_norm_forward` / `compiled_norm_backward` (RMSNorm,
and LayerNorm with `centered`) and `hybridq::compiled_swiglu_forward` / `compiled_swiglu_backward`. Dynamo puts
each in the graph as one node; Inductor fuses the element-wise work around them.

On CUDA the ops call the same extension kernels, with the same arguments, as the eager modules (`norm_kernels`,
`swiglu_kernels`): the compiled results are bitwise eager. On the CPU they run the reference (the contract's
PyTorch ops; backward: their vjp, the gradients eager autograd computes), so that CPU tests exercise the ops, their
fakes and their autograd as a GPU run does, bitwise the eager CPU module. (One exception: an fp32 RMSNorm input
that also feeds another op, e.g. a residual: eager autograd adds that op's gradient of x between the two gradients
the reference's ops give x, the op after their sum, so that dx may differ in the last bit. 16-bit inputs, whose
cast in the reference sums the two first, and CUDA are bitwise.)

Each forward also returns max|y| (the kernels compute it in passing), as the eager kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.base import is_dtensor
from ..kernels import _ext
from .norm_reference import layer_norm_reference, rms_norm_reference
from .plain_ops import plain_op

__all__ = ["KERNEL_DTYPES", "compiled_norm", "compiled_swiglu", "norm_kernel_grads", "norm_kernels", "op_takes",
           "swiglu_kernels"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32 = torch.float32


def op_takes(*tensors: torch.Tensor | None) -> bool:
    """Whether a producer's inputs run as the ops here (under torch.compile): the CPU (the reference inside the op)
    or CUDA where the extension's kernels read them -- no DTensor (its sharding rules are the reference's), inputs
    and parameters of one device, kernel dtypes and one dtype among the parameters. Traced by dynamo."""
    ts = [t for t in tensors if t is not None]
    x = ts[0]
    if any(is_dtensor(t) or t.device != x.device for t in ts) or x.dim() < 1:
        return False
    if x.device.type == "cpu":
        return True
    return (x.is_cuda and all(t.dtype in KERNEL_DTYPES for t in ts)
            and len({t.dtype for t in ts[1:]}) <= 1 and _kernels_ready(x.device.index or 0))


@torch.compiler.assume_constant_result
def _kernels_ready(index: int) -> bool:
    """The extension's kernels run on CUDA device `index` (a fact of the machine: compiled code reads it as a
    constant)."""
    return _ext.available_for(torch.device("cuda", index))


# ---- the kernels (shared with the eager autograd.Functions of norm.py / swiglu.py) --------------------------------

def norm_kernels(x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                 centered: bool, blocks) -> tuple:
    """(y, mean or None, rstd, max|y|, rowwise data, scales) of the CUDA kernels on `[M, K]` contiguous `x2d`;
    with `blocks` (RowBlocks) the kernel also writes y's rowwise part in that block format (else empty data /
    scales)."""
    w = None if weight is None else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    hq = torch.ops.hybridq
    if blocks is not None:
        y, mean, rstd, amax, data, scale = hq.norm_quantize_forward(x2d, w, b, eps, centered, blocks.block,
                                                                    blocks.dtype, blocks.amax_eps, blocks.pow2)
        return y, mean if centered else None, rstd, amax, data, scale
    data = scale = x2d.new_empty((0,), dtype=torch.uint8)
    if centered:
        y, mean, rstd, amax = hq.layer_norm_forward(x2d, w, b, eps)
    else:
        (y, rstd, amax), mean = hq.rms_norm_forward(x2d, w, eps), None
    return y, mean, rstd, amax, data, scale


def norm_kernel_grads(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None, mean, rstd,
                      centered: bool, want_w: bool, want_b: bool, b_dtype: torch.dtype | None) -> tuple:
    """(dx, dw or None, db or None) of the CUDA kernels (`[M, K]` contiguous dy and x)."""
    w = None if weight is None else weight.contiguous()
    if centered:
        dx, dw, db = torch.ops.hybridq.layer_norm_backward(dy2d, x2d, w, mean, rstd, want_w, want_b)
    else:
        (dx, dw), db = torch.ops.hybridq.rms_norm_backward(dy2d, x2d, w, rstd, want_w), None
    return dx, dw if want_w else None, db.to(b_dtype) if want_b else None


def swiglu_kernels(a2d: torch.Tensor, b2d: torch.Tensor, blocks) -> tuple:
    """(y, max|y|, rowwise data, scales) of the CUDA kernel on `[M, K]` contiguous a and b; with `blocks` it also
    writes y's rowwise part in that block format."""
    return torch.ops.hybridq.swiglu_forward(
        a2d, b2d, 0 if blocks is None else blocks.block, torch.float8_e4m3fn if blocks is None else blocks.dtype,
        0.0 if blocks is None else blocks.amax_eps, blocks is not None and blocks.pow2)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _amax(y: torch.Tensor) -> torch.Tensor:
    """max|y| as the kernels give it (`[1]` fp32; 0 for an empty y)."""
    return (y.float().abs().amax() if y.numel() else y.new_zeros((), dtype=_F32)).reshape(1)


# ---- the norms -----------------------------------------------------------------------------------------------

def _norm_reference(x, weight, bias, eps: float, centered: bool) -> torch.Tensor:
    return layer_norm_reference(x, weight, bias, eps) if centered else rms_norm_reference(x, weight, eps)


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=_F32)


@plain_op("hybridq::compiled_norm_forward")
def _norm_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                  centered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean `[M]` (centered) or empty, rstd `[M]`, max|y| `[1]`) of RMSNorm / LayerNorm (`centered`) over x's
    last dimension."""
    if x.is_cuda:
        y, mean, rstd, amax, _, _ = norm_kernels(_rows(x), weight, bias, eps, centered, None)
        return y.view(x.shape), _empty(x) if mean is None else mean, rstd, amax
    # the CPU: the reference; the statistics as the kernels save them (backward recomputes from x)
    y = _norm_reference(x, weight, bias, eps, centered)
    xf = _rows(x).to(torch.float64 if x.dtype == torch.float64 else _F32)
    if centered:
        mean, var = xf.mean(-1), xf.var(-1, unbiased=False)
    else:
        mean, var = None, xf.pow(2).mean(-1)
    rstd = torch.rsqrt(var + eps).to(_F32)
    return y, _empty(x) if mean is None else mean.to(_F32), rstd, _amax(y)


@_norm_forward.register_fake
def _(x, weight, bias, eps, centered):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((m if centered else 0,), dtype=_F32),
            x.new_empty((m,), dtype=_F32), x.new_empty((1,), dtype=_F32))


@plain_op("hybridq::compiled_norm_backward")
def _norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   mean: torch.Tensor, rstd: torch.Tensor, eps: float, centered: bool, want_w: bool,
                   want_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of `compiled_norm_forward` (an empty tensor for a gradient not asked for)."""
    if x.is_cuda:
        dx, dw, db = norm_kernel_grads(_rows(dy), _rows(x), weight, mean, rstd, centered, want_w, want_b,
                                       None if bias is None else bias.dtype)
        dx = dx.view(x.shape)
    else:  # the vjp of the reference: the gradients eager autograd computes through its ops
        params = [p for p, want in ((weight, want_w), (bias, want_b)) if want]

        def f(x_, *ps):
            it = iter(ps)
            w = next(it) if want_w else weight
            b = next(it) if want_b else bias
            return _norm_reference(x_, w, b, eps, centered)

        _, vjp = torch.func.vjp(f, x, *params)
        dx, *grads = vjp(dy)
        dw = grads.pop(0) if want_w else None
        db = grads.pop(0) if want_b else None
    return dx, _empty(x) if dw is None else dw, _empty(x) if db is None else db


@_norm_backward.register_fake
def _(dy, x, weight, bias, mean, rstd, eps, centered, want_w, want_b):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight) if want_w else _empty(x), torch.empty_like(bias) if want_b else _empty(x))


def _norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, eps, centered = inputs
    _, mean, rstd, amax = output
    ctx.mark_non_differentiable(mean, rstd, amax)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps, ctx.centered = eps, centered


def _norm_autograd(ctx, dy, *_):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    want_w = weight is not None and ctx.needs_input_grad[1]
    want_b = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.hybridq.compiled_norm_backward(dy, x, weight, bias, mean, rstd, ctx.eps, ctx.centered,
                                                          want_w, want_b)
    return dx, dw if want_w else None, db if want_b else None, None, None


_norm_forward.register_autograd(_norm_autograd, setup_context=_norm_setup)


def compiled_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                  centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, max|y|) of the norm as the custom op (call where `op_takes(x, weight, bias)`)."""
    y, _, _, amax = torch.ops.hybridq.compiled_norm_forward(x, weight, bias, eps, centered)
    return y, amax


# ---- SwiGLU --------------------------------------------------------------------------------------------------

@plain_op("hybridq::compiled_swiglu_forward")
def _swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(a) * b, its max|y| `[1]`)."""
    if a.is_cuda:
        y, amax, _, _ = swiglu_kernels(_rows(a), _rows(b), None)
        return y.view(a.shape), amax
    y = F.silu(a) * b
    return y, _amax(y)


@_swiglu_forward.register_fake
def _(a, b):
    return torch.empty_like(a, memory_format=torch.contiguous_format), a.new_empty((1,), dtype=_F32)


@plain_op("hybridq::compiled_swiglu_backward")
def _swiglu_backward(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of `compiled_swiglu_forward`."""
    if a.is_cuda:
        da, db = torch.ops.hybridq.swiglu_backward(_rows(dy), _rows(a), _rows(b))
        return da.view(a.shape), db.view(a.shape)
    _, vjp = torch.func.vjp(lambda a_, b_: F.silu(a_) * b_, a, b)
    return vjp(dy)


@_swiglu_backward.register_fake
def _(dy, a, b):
    return (torch.empty_like(a, memory_format=torch.contiguous_format),
            torch.empty_like(b, memory_format=torch.contiguous_format))


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(*inputs)


def _swiglu_autograd(ctx, dy, _):
    a, b = ctx.saved_tensors
    return tuple(torch.ops.hybridq.compiled_swiglu_backward(dy, a, b))


_swiglu_forward.register_autograd(_swiglu_autograd, setup_context=_swiglu_setup)


def compiled_swiglu(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(a) * b, max|y|) as the custom op (call where `op_takes(a, b)` and a, b have one shape and dtype)."""
    y, amax = torch.ops.hybridq.compiled_swiglu_forward(a, b)
    return y, amax
