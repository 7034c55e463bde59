"""hybridq.nn.SwiGLU: a SwiGLU feed-forward, `w2(silu(w1 x) * w3 x)`, whose element-wise step silu(a) * b runs as one
CUDA kernel (csrc/swiglu.cu) that also computes max|y| for the per-tensor cast of w2's input and writes w2's rowwise
block-format input in the same pass ([Note: pre-quantized norm outputs], fused_input.py: w2 registers its input
quantizer on the first step) -- Transformer Engine's LayerNormMLP role, without merging the Linears.

`convert_linears` / `apply_hybrid_fsdp` (with `norms=True`) swap it in for modules following the SwiGLU feed-forward
protocol: a module whose only children are the Linear layers `w1`, `w2`, `w3` (no parameters, buffers or hooks of
its own) and whose forward is `w2(silu(w1 x) * w3 x)`, checked on a probe input before anything changes. The new
module holds the same three Linear modules (state_dict keys, FSDP2 units and tensor-parallel plans by name are
unchanged). Numerics (docs/numerics.md "SwiGLU"): torch's F.silu(a) * b, each op rounded to the input dtype; on the
CPU and for DTensors those ops run themselves (bitwise the original module); the kernel's exp may differ from
torch's in the last bit. Under torch.compile the kernel runs as a custom op (compiled_norms.py), bitwise eager."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..formats.base import is_dtensor
from .compiled_norms import compiled_swiglu, op_takes, swiglu_kernels
from .first_order import first_order_only
from .fused_input import NormReaders, produce
from .replaceable import _HOOKS
_CHILDREN = ("w1", "w2", "w3")
_ALLOWED_METHODS = frozenset({"forward"})  # (checked on the probe)


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The contract: torch's eager `F.silu(a) * b`."""
    return F.silu(a) * b


class _SwiGLUFunction(torch.autograd.Function):
    """The CUDA kernels in eager mode (under torch.compile: the custom ops of compiled_norms.py)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, blocks):
        a2d = a.reshape(-1, a.shape[-1]).contiguous()
        b2d = b.reshape(-1, b.shape[-1]).contiguous()
        y, amax, data, scale = swiglu_kernels(a2d, b2d, blocks)
        ctx.save_for_backward(a2d, b2d)
        ctx.shape = a.shape
        ctx.mark_non_differentiable(amax, data, scale)
        return y.view(a.shape), amax, data, scale

    @staticmethod
    @first_order_only(lambda ctx: "hybridq's SwiGLU kernel")
    def backward(ctx, dy: torch.Tensor, *_):
        a2d, b2d = ctx.saved_tensors
        da, db = torch.ops.hybridq.swiglu_backward(dy.reshape(a2d.shape).contiguous(), a2d, b2d)
        return da.view(ctx.shape), db.view(ctx.shape), None


def _op_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and op_takes(a, b)


def swiglu(a: torch.Tensor, b: torch.Tensor, readers: NormReaders | None = None, name: str = "SwiGLU") -> torch.Tensor:
    """silu(a) * b (see the module docstring); records max|y| for the layer that quantizes y (hybridq.nn.known_amax)
    and, with `readers`, its rowwise quantized input (hybridq.nn.fused_input). Under torch.compile the kernels run
    as custom ops (compiled_norms.py; on the CPU the reference inside them)."""
    if torch.compiler.is_compiling():
        return compiled_swiglu(a, b)[0] if _op_takes(a, b) else swiglu_reference(a, b)
    kernel = None
    if a.is_cuda and _op_takes(a, b):
        kernel = lambda blocks: _SwiGLUFunction.apply(a, b, blocks)  # noqa: E731
    return produce(a, (a, b), kernel, lambda: swiglu_reference(a, b), readers, name)


class SwiGLU(nn.Module):
    """`w2(silu(w1 x) * w3 x)` with the element-wise step as hybridq's kernel; see the module docstring."""

    def __init__(self, w1: nn.Module, w2: nn.Module, w3: nn.Module, *, name: str = "SwiGLU"):
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3
        self.name = name
        self._readers = NormReaders()  # w2's input quantizer (fused_input.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w1(x), self.w3(x)
        if torch.compiler.is_compiling():
            # (nothing per module is read: dynamo would guard on it -- a block's name -- and compile every block of a
            # model anew, up to its recompile limit, then run the rest eagerly)
            return self.w2(swiglu(a, b))
        return self.w2(swiglu(a, b, self._readers, f"{self.name} (silu(w1 x) * w3 x)"))

    @classmethod
    def from_module(cls, module: nn.Module, name: str = "SwiGLU") -> "SwiGLU":
        """A hybridq SwiGLU holding `module`'s w1, w2 and w3 (the same module objects, in its order). Raises ValueError naming the
        module if it does not follow the protocol (`swiglu_mismatch`)."""
        why = swiglu_mismatch(module)
        if why is not None:
            raise ValueError(f"{name} cannot run as hybridq.nn.SwiGLU: {why}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for n, child in module._modules.items():  # (in its order: parameters() and state_dict keep theirs)
            setattr(new, n, child)
        new.name = name
        new._readers = NormReaders()
        new.train(module.training)
        return new


def is_swiglu_candidate(module: nn.Module) -> bool:
    """A module whose children are exactly three Linear layers named w1, w2, w3 (`swiglu_mismatch` then checks the
    rest and its math)."""
    return (not isinstance(module, SwiGLU) and set(module._modules) == set(_CHILDREN)
            and all(isinstance(module._modules[n], nn.Linear) for n in _CHILDREN))


def swiglu_mismatch(module: nn.Module) -> str | None:
    """Why `module` cannot be replaced by hybridq.nn.SwiGLU (None if it can): its children, parameters, buffers,
    hooks, instance attributes and its output on a probe input (fp32) against `w2(silu(w1 x) * w3 x)`."""
    if not is_swiglu_candidate(module):
        return "its children are not exactly the Linear layers w1, w2, w3"
    if module._parameters or module._buffers:
        return f"it owns {', '.join([*module._parameters, *module._buffers])}, which hybridq.nn.SwiGLU would drop"
    hooks = [what for attr, what in _HOOKS.items() if getattr(module, attr, None)]
    if hooks:
        return f"it has {', '.join(hooks)}, which hybridq.nn.SwiGLU would not run"
    w1, w2, w3 = (module._modules[n] for n in _CHILDREN)
    if not (w1.in_features == w3.in_features and w1.out_features == w3.out_features == w2.in_features):
        return "its Linear shapes do not chain as w2(silu(w1 x) * w3 x)"
    if any(is_dtensor(p) for p in module.parameters()):
        return "its weights are already DTensors: swap feed-forwards before parallelizing or sharding"
    methods = sorted(n for c in type(module).__mro__ if c not in nn.Module.__mro__ for n, v in vars(c).items()
                     if callable(v) and not n.startswith("__") and n not in _ALLOWED_METHODS)
    if methods:
        return f"its class defines {', '.join(methods)}, which hybridq.nn.SwiGLU would not have"
    # the probe: the module's forward with plain fp32 Linears of random weights in place of its children (its own
    # may be quantized, with state or random draws that differ between two calls)
    g = torch.Generator().manual_seed(0)
    plain = {n: nn.Linear(m.in_features, m.out_features, bias=m.bias is not None) for n, m in
             ((n, module._modules[n]) for n in _CHILDREN)}
    with torch.no_grad():
        for p in (p for m in plain.values() for p in m.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    probe = copy.copy(module)
    probe.__dict__["_modules"] = dict(plain)
    x = torch.randn(4, w1.in_features, generator=g)
    try:
        with torch.no_grad():
            got = probe(x)
    except Exception as e:  # noqa: BLE001 (any failure means: not the protocol)
        return f"its forward failed on a probe input: {type(e).__name__}: {e}"
    with torch.no_grad():
        want = plain["w2"](swiglu_reference(plain["w1"](x), plain["w3"](x)))
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return "its output on a probe input is not a tensor of the expected shape and dtype"
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return f"its output differs from w2(silu(w1 x) * w3 x) on a probe input (max |diff| {(got - want).abs().max():.3g})"
    return None
