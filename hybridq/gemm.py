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

from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .dispatch import (NativeGemm, grouped_fp8_gemm_kernel, current_gemm_name, find_native_gemm, register_native_gemm, reset_gemm_name,
                       set_gemm_name)

if TYPE_CHECKING:
    from .formats.base import QuantizedPart

__all__ = ["gemm", "emulated_gemm", "register_native_gemm", "find_native_gemm", "current_gemm_name", "NativeGemm",
           "native_row_multiple", "grouped_gemm_fp8"]


def native_row_multiple(device: torch.device) -> int:
    """Rows a GEMM operand should come in multiples of for the hardware GEMMs of `device` to take it: the
    tensor-core GEMMs (torch._scaled_mm, the block-scaled kernels) need M, N and K % 16 == 0; the CPU has none."""
    return 16 if device.type == "cuda" else 1


def emulated_gemm(a: QuantizedPart, b: QuantizedPart, out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize and multiply in fp32. Operands carrying the same orthogonal transform along the contracted
    dim (e.g. both Hadamard-rotated) are multiplied in the rotated domain, since (A R)(B R)^T = A B^T."""
    same = a.transform is not None and a.transform == b.transform
    da, db = a.dequantize_2d(undo_transform=not same), b.dequantize_2d(undo_transform=not same)
    wide = torch.promote_types(da.dtype, db.dtype)  # fp32, or fp64 with an fp64 identity operand
    return (da.to(wide) @ db.to(wide).t()).to(out_dtype)


def _is_fake(p: QuantizedPart) -> bool:
    t = next(t for t in p.tensors().values() if t is not None)
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def gemm(a: QuantizedPart, b: QuantizedPart, out_dtype: torch.dtype, name: str | None = None) -> torch.Tensor:
    """`a @ b^T` for parts `a: [m, k]`, `b: [n, k]`; result `[m, n]` in out_dtype. `name` says what the GEMM is
    for (e.g. "fprop of fc1"); native kernels name it when they warn or fall back."""
    if a.cols != b.cols:
        raise ValueError(f"gemm{f' ({name})' if name else ''}: contracted dims differ: {a!r} x {b!r}")
    if _is_fake(a):
        # tracing (torch.compile's fake tensors): only the result's shape and dtype matter, and a native kernel
        # probed here could fail where the real call would not and be turned off for the real calls
        return torch.empty(a.rows, b.rows, dtype=out_dtype, device=a.device)
    token = set_gemm_name(name)
    try:
        native = find_native_gemm(a, b)
        if native is not None:
            return native.run(a, b, out_dtype)
        return emulated_gemm(a, b, out_dtype)
    finally:
        reset_gemm_name(token)


def grouped_gemm_fp8(a: torch.Tensor, a_scale_inv: torch.Tensor, sizes: list[int], b: torch.Tensor,
                     b_scale_inv: torch.Tensor, out_dtype: torch.dtype, columnwise: tuple[bool, bool]
                     ) -> torch.Tensor | None:
    """Per-tensor FP8 GEMMs of E groups in one call, by the device's registered grouped GEMM, or None where it has
    none or declines (the caller then runs one `gemm` per group). Group g has its own scales `a_scale_inv[g]`,
    `b_scale_inv[g]`. Two layouts:
      - `b` 3-D `[E, N, K]`: `a [rows, K]` holds the groups' rows (`sizes`); result `[rows, N]`, group g's rows
        `a_g b[g]^T` (fprop, dgrad);
      - `b` 2-D `[rows, K]`: `a [rows, N]` and `b` hold the groups' rows (`sizes`), contracted per group;
        result `[E, N, K]`, `a_g^T b_g` (wgrad, on the columnwise forms: the transposes of these rows).
    `columnwise` says which operands are columnwise forms (the forward GEMM of two rowwise forms may use fast
    accumulation, as `gemm` does)."""
    run = grouped_fp8_gemm_kernel(a.device.type)
    return None if run is None else run(a, a_scale_inv, sizes, b, b_scale_inv, out_dtype, columnwise)
