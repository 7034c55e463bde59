"""hybridq.nn.RMSNorm: RMSNorm over the last dimension in one CUDA kernel per pass, which also computes max|y| of
its output so that the per-tensor scaled cast of that output by the Linear layers reading it (q/k/v, w1/w3) skips
its own max|y| pass (Transformer Engine's LayerNormLinear idea, without merging the modules).

`convert_linears` / `apply_hybrid_fsdp` swap in this module for `torch.nn.RMSNorm` and for modules that follow the
RMSNorm protocol (a class named `*RMSNorm` with a 1-D `weight` and a float `eps` whose forward is
`x * rsqrt(mean(x^2) + eps) * weight`, checked on a probe input before anything changes), sharing the weight.
Numerics (docs/numerics.md "RMSNorm"): torch's rms_norm with its fp32 computation and one rounding to the input
dtype; the kernel's row sums run in another order than torch's, so y may differ in the last bit from the eager
module, and max|y| is exact (of the rounded y). On the CPU and for DTensors the same math runs as PyTorch
operations. Under torch.compile the kernels run as custom ops (compiled_norms.py; the CPU: the reference inside
them), bitwise eager.

The norm also writes the rowwise block-format input of the Linear layers reading y once they registered their
quantizer ([Note: pre-quantized norm outputs], fused_input.py); `normalize` is the forward of both hybridq norms."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn

from ..formats.base import is_dtensor
from .compiled_norms import compiled_norm, norm_kernel_grads, norm_kernels, op_takes
from .first_order import first_order_only
from .fused_input import NormReaders, produce
from .norm_reference import rms_norm_reference


def _eps_for(x: torch.Tensor, eps: float | None) -> float:
    """torch.nn.RMSNorm's default: the machine epsilon of the computation dtype (fp32 for 16-bit inputs)."""
    if eps is not None:
        return float(eps)
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


class _NormFunction(torch.autograd.Function):
    """The CUDA kernels of RMSNorm (bias None, not centered) and LayerNorm (centered) in eager mode: forward saves x
    and the per-row statistics (not the normalized fp32 copies eager autograd keeps); with `blocks` (RowBlocks) the
    kernel also writes the rowwise part of y in that block format (hybridq/nn/fused_input.py). Under torch.compile
    the same kernels run as custom ops (compiled_norms.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                centered: bool, blocks):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        y, mean, rstd, amax, data, scale = norm_kernels(x2d, weight, bias, eps, centered, blocks)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.shape = x.shape
        ctx.centered = centered
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(amax, data, scale)
        return y.view(x.shape), amax, data, scale

    @staticmethod
    @first_order_only(lambda ctx: f"hybridq's {'LayerNorm' if ctx.centered else 'RMSNorm'} kernel")
    def backward(ctx, dy: torch.Tensor, *_):
        x2d, w, mean, rstd = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape).contiguous()
        dx, dw, db = norm_kernel_grads(dy2d, x2d, w, mean, rstd, ctx.centered, ctx.needs_input_grad[1],
                                       ctx.needs_input_grad[2], ctx.b_dtype)
        return dx.view(ctx.shape), dw, db, None, None, None


def _kernel_takes(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    return x.is_cuda and op_takes(x, *params)


def normalize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, centered: bool,
              reference: Callable[[], torch.Tensor], readers: NormReaders | None, name: str) -> torch.Tensor:
    """y of RMSNorm / LayerNorm (`centered`): on CUDA by the kernels, elsewhere by `reference()`; under
    torch.compile as the custom ops of compiled_norms.py (on the CPU the reference inside them), the reference's
    ops where those do not take the call (a DTensor). In eager mode it records max|y| (known_amax) and, for the
    quantizer its `readers` registered, that format's rowwise part of y (fused_input)."""
    if torch.compiler.is_compiling():
        return compiled_norm(x, weight, bias, eps, centered)[0] if op_takes(x, weight, bias) else reference()
    kernel = None
    if _kernel_takes(x, weight, bias):
        kernel = lambda blocks: _NormFunction.apply(x, weight, bias, eps, centered, blocks)  # noqa: E731
    return produce(x, (x,), kernel, reference, readers, name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = None,
             name: str = "RMSNorm", readers: NormReaders | None = None) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension (see the module docstring); records max|y| for the layers that
    quantize y (hybridq.nn.known_amax) and, with `readers`, their rowwise quantized input (hybridq.nn.fused_input).
    `eps=None`: torch.nn.RMSNorm's default."""
    if weight is not None and (weight.dim() != 1 or x.shape[-1:] != weight.shape):
        raise ValueError(f"{name}: its weight of shape {tuple(weight.shape)} normalizes a last dimension of that "
                         f"size, got an input of shape {tuple(x.shape)}")
    eps = _eps_for(x, eps)
    return normalize(x, weight, None, eps, False, lambda: rms_norm_reference(x, weight, eps), readers, name)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (torch.nn.RMSNorm's math and parameters, 1-D `normalized_shape`), run by
    hybridq's kernel on CUDA; see the module docstring."""

    def __init__(self, normalized_shape: int | tuple[int], eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, name: str = "RMSNorm"):
        super().__init__()
        dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(dims) != 1:
            raise ValueError(f"hybridq.nn.RMSNorm normalizes the last dimension only, got normalized_shape {dims}")
        self.normalized_shape = dims
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.name = name
        self._readers = NormReaders()  # the quantizer of the Linear layers reading y (fused_input.py)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dims, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, name=self.name, readers=self._readers)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

    @classmethod
    def from_module(cls, module: nn.Module, name: str = "RMSNorm") -> "RMSNorm":
        """A hybridq RMSNorm sharing `module`'s weight (the same Parameter object: optimizer state, state_dict keys
        and FSDP2 sharding are unchanged). Raises ValueError naming the module if it is not a plain RMSNorm
        (`rms_norm_mismatch`)."""
        why = rms_norm_mismatch(module)
        if why is not None:
            raise ValueError(f"{name} cannot run as hybridq.nn.RMSNorm: {why}")
        return adopt(cls, module, name, ("weight",), None if module.eps is None else float(module.eps))


def adopt(cls: type, module: nn.Module, name: str, params: tuple[str, ...], eps: float | None) -> nn.Module:
    """A new `cls` norm (not set up by its __init__) with `module`'s parameters `params` (the same objects, or None),
    its normalized width, `eps` and training flag."""
    weight = module.weight
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.normalized_shape = (weight.shape[0],) if weight is not None else tuple(module.normalized_shape)
    new.eps = eps
    new.elementwise_affine = weight is not None
    new.name = name
    new._readers = NormReaders()
    for pname in params:
        p = getattr(module, pname, None)
        if p is not None:
            setattr(new, pname, p)
        else:
            new.register_parameter(pname, None)
    new.train(module.training)
    return new


def is_rms_norm_candidate(module: nn.Module) -> bool:
    """torch.nn.RMSNorm, or a module following the RMSNorm protocol by name and attributes (a class named
    `*RMSNorm` with a 1-D `weight` parameter and a float `eps`); `rms_norm_mismatch` then checks its math."""
    return is_candidate(module, RMSNorm, nn.RMSNorm, "RMSNorm")


def is_candidate(module: nn.Module, ours: type, torch_type: type, suffix: str) -> bool:
    """`module` is of `torch_type`, or named `*<suffix>` with a 1-D `weight` parameter and a float `eps` (not
    already `ours`)."""
    if isinstance(module, ours):
        return False
    if isinstance(module, torch_type):
        return True
    w = getattr(module, "weight", None)
    return (type(module).__name__.endswith(suffix) and isinstance(w, nn.Parameter) and w.dim() == 1
            and isinstance(getattr(module, "eps", None), float))


def rms_norm_mismatch(module: nn.Module) -> str | None:
    """Why `module` cannot be replaced by hybridq.nn.RMSNorm with its weight and eps (None if it can): see
    `protocol_mismatch`; the probe's reference is `rms_norm_reference`."""
    eps = getattr(module, "eps", None)
    return protocol_mismatch(module, nn.RMSNorm, "x * rsqrt(mean(x^2) + eps) * weight",
                             lambda x, p: rms_norm_reference(x, p.weight, _eps_for(x, eps)))


def protocol_mismatch(module: nn.Module, torch_type: type, math: str,
                      reference: Callable[[torch.Tensor, nn.Module], torch.Tensor]) -> str | None:
    """Why `module` -- an instance of `torch_type` (torch.nn.RMSNorm / LayerNorm) or a module following that norm's
    protocol -- cannot be replaced by hybridq's norm with its parameters and eps (None if it can): the attributes
    (a 1-D `weight` parameter, an optional `bias` parameter of its shape, a float `eps`), hooks (e.g. a parallel
    style's), a parameter that is already sharded, and its output on a probe input (fp32, random parameters)
    against `reference(x, probe)` (`math` names it in the reason)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if isinstance(module, torch_type):
        if len(module.normalized_shape) != 1:
            return f"it normalizes {len(module.normalized_shape)} dimensions {tuple(module.normalized_shape)}"
    elif not (isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(getattr(module, "eps", None), float)):
        return "it has no 1-D weight parameter and float eps"
    elif bias is not None and not (isinstance(bias, nn.Parameter) and bias.shape == weight.shape):
        return f"its bias is not a parameter of the weight's shape {tuple(weight.shape)}"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return "it has hooks (e.g. a tensor-parallel style or FSDP2): swap norms before parallelizing or sharding"
    for pname, param in (("weight", weight), ("bias", bias)):
        if param is not None and is_dtensor(param):
            return f"its {pname} is already a DTensor: swap norms before parallelizing or sharding"
    dim = weight.shape[0] if weight is not None else module.normalized_shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, dim, generator=g) * 3
    try:
        probe = copy.deepcopy(module)
        if weight is not None or bias is not None:
            if (weight if weight is not None else bias).device.type == "meta":
                probe = probe.to_empty(device="cpu")
            probe = probe.to(device="cpu", dtype=torch.float32)
            with torch.no_grad():
                if weight is not None:
                    probe.weight.copy_(torch.rand(dim, generator=g) + 0.5)
                if bias is not None:
                    probe.bias.copy_(torch.randn(dim, generator=g))
        with torch.no_grad():
            got = probe(x)
    except Exception as e:  # noqa: BLE001 (any failure means: not the protocol)
        return f"its forward failed on a probe input: {type(e).__name__}: {e}"
    with torch.no_grad():
        want = reference(x, probe)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return "its output on a probe input is not a tensor of the input's shape and dtype"
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return f"its output differs from {math} on a probe input (max |diff| {(got - want).abs().max().item():.3g})"
    return None
