"""Scaled GEMM dispatch over quantized parts.

Every GEMM of a Linear is `out = A @ B^T` with both operands in GEMM orientation (scaling blocks along the
contracted dim), which is how parts are stored:
    fprop  y  = x.rowwise          @ W.rowwise^T      ([M,K] x [N,K])
    dgrad  dx = dy.rowwise         @ W.columnwise^T   ([M,N] x [K,N])
    wgrad  dW = dy.columnwise      @ x.columnwise^T   ([N,M] x [K,M])
A native kernel registered for the pair of part types runs when it accepts the operands (device,
capability, shapes); otherwise the GEMM is emulated: dequantize both parts to fp32 and multiply.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from .formats.base import QuantizedPart

log = logging.getLogger("hybridq")

GemmFn = Callable[[QuantizedPart, QuantizedPart, torch.dtype], torch.Tensor]
SupportsFn = Callable[[QuantizedPart, QuantizedPart], bool]


@dataclasses.dataclass
class NativeGemm:
    name: str
    run: GemmFn
    supports: SupportsFn


_NATIVE: dict[tuple[type, type], list[NativeGemm]] = {}


def register_native_gemm(a_type: type, b_type: type, name: str, run: GemmFn, supports: SupportsFn) -> None:
    """Register a hardware GEMM for a pair of part types (e.g. FP8 tensorwise on sm_89+)."""
    _NATIVE.setdefault((a_type, b_type), []).append(NativeGemm(name, run, supports))


def find_native_gemm(a: QuantizedPart, b: QuantizedPart) -> NativeGemm | None:
    for g in _NATIVE.get((type(a), type(b)), ()):
        if g.supports(a, b):
            return g
    return None


def emulated_gemm(a: QuantizedPart, b: QuantizedPart, out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize and multiply in fp32. Operands carrying the same orthogonal transform along the contracted
    dim (e.g. both Hadamard-rotated) are multiplied in the rotated domain, since (A R)(B R)^T = A B^T."""
    same = a.transform is not None and a.transform == b.transform
    return (a.dequantize_2d(undo_transform=not same) @ b.dequantize_2d(undo_transform=not same).t()).to(out_dtype)


def gemm(a: QuantizedPart, b: QuantizedPart, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b^T` for parts `a: [m, k]`, `b: [n, k]`; result `[m, n]` in out_dtype."""
    if a.cols != b.cols:
        raise ValueError(f"gemm: contracted dims differ: {a!r} x {b!r}")
    native = find_native_gemm(a, b)
    if native is not None:
        return native.run(a, b, out_dtype)
    return emulated_gemm(a, b, out_dtype)
