"""hybridq.nn.LayerNorm: LayerNorm over the last dimension in one CUDA kernel per pass (csrc/rms_norm.cu), which also
computes max|y| for the per-tensor casts of the Linear layers reading y and can write their rowwise block-format
input in the same pass ([Note: pre-quantized norm outputs], fused_input.py) -- what hybridq.nn.RMSNorm does for
RMSNorm.

`convert_linears` / `apply_hybrid_fsdp` swap it in for `torch.nn.LayerNorm` and for modules following the LayerNorm
protocol: a class named `*LayerNorm` with a 1-D `weight` parameter, a `bias` parameter of its shape or None and a
float `eps`, whose forward is `(x - mean(x)) * rsqrt(var(x) + eps) * weight + bias` (biased variance), checked on a
probe input before anything changes; the parameters are shared. Numerics (docs/numerics.md "LayerNorm"): torch's
layer_norm, fp32 computation and one rounding to the input dtype; on the CPU and for DTensors `F.layer_norm` runs
itself (bitwise the torch module); the CUDA kernel's row sums run in another order than torch's, so y may differ
in the last bit, and max|y| is exact (of the rounded y). Under torch.compile the kernels run as custom ops
(compiled_norms.py), bitwise eager."""

from __future__ import annotations

import torch
import torch.nn as nn

from .fused_input import NormReaders
from .norm_reference import layer_norm_reference
from .norm import adopt, is_candidate, normalize, protocol_mismatch


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               name: str = "LayerNorm", readers: NormReaders | None = None) -> torch.Tensor:
    """LayerNorm of `x` over its last dimension (see the module docstring); records max|y| for the layers that
    quantize y (hybridq.nn.known_amax) and, with `readers`, their rowwise quantized input (hybridq.nn.fused_input)."""
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or x.shape[-1:] != p.shape):
            raise ValueError(f"{name}: its {pname} of shape {tuple(p.shape)} normalizes a last dimension of that "
                             f"size, got an input of shape {tuple(x.shape)}")
    if bias is not None and weight is not None and bias.dtype != weight.dtype:
        raise ValueError(f"{name}: its weight ({weight.dtype}) and bias ({bias.dtype}) must have one dtype")
    return normalize(x, weight, bias, float(eps), True, lambda: layer_norm_reference(x, weight, bias, float(eps)),
                     readers, name)


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (torch.nn.LayerNorm's math and parameters, 1-D `normalized_shape`), run by
    hybridq's kernel on CUDA; see the module docstring."""

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, *, name: str = "LayerNorm"):
        super().__init__()
        dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(dims) != 1:
            raise ValueError(f"hybridq.nn.LayerNorm normalizes the last dimension only, got normalized_shape {dims}")
        self.normalized_shape = dims
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        self.name = name
        self._readers = NormReaders()  # the quantizer of the Linear layers reading y (fused_input.py)
        on = {"weight": elementwise_affine, "bias": elementwise_affine and bias}
        for pname, init in (("weight", torch.ones), ("bias", torch.zeros)):
            self.register_parameter(pname, nn.Parameter(init(dims, device=device, dtype=dtype)) if on[pname] else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, name=self.name, readers=self._readers)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

    @classmethod
    def from_module(cls, module: nn.Module, name: str = "LayerNorm") -> "LayerNorm":
        """A hybridq LayerNorm sharing `module`'s weight and bias (the same Parameter objects: optimizer state,
        state_dict keys and FSDP2 sharding are unchanged). Raises ValueError naming the module if it is not a plain
        LayerNorm (`layer_norm_mismatch`)."""
        why = layer_norm_mismatch(module)
        if why is not None:
            raise ValueError(f"{name} cannot run as hybridq.nn.LayerNorm: {why}")
        return adopt(cls, module, name, ("weight", "bias"), float(module.eps))


def is_layer_norm_candidate(module: nn.Module) -> bool:
    """torch.nn.LayerNorm, or a module following the LayerNorm protocol by name and attributes (a class named
    `*LayerNorm` with a 1-D `weight` parameter and a float `eps`); `layer_norm_mismatch` then checks its math."""
    return is_candidate(module, LayerNorm, nn.LayerNorm, "LayerNorm")


def layer_norm_mismatch(module: nn.Module) -> str | None:
    """Why `module` cannot be replaced by hybridq.nn.LayerNorm with its weight, bias and eps (None if it can): see
    `protocol_mismatch`; the probe's reference is `layer_norm_reference`."""
    eps = getattr(module, "eps", None)
    return protocol_mismatch(module, nn.LayerNorm, "(x - mean(x)) * rsqrt(var(x) + eps) * weight + bias",
                             lambda x, p: layer_norm_reference(x, p.weight, getattr(p, "bias", None), float(eps)))
