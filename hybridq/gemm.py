"""Scaled GEMM dispatch over quantized parts.

Every GEMM of a Linear is `out = A @ B^T` with both operands in GEMM orientation (scaling blocks along the
contracted dim), which is how parts are stored:
    fprop  y  = x.rowwise          @ W.rowwise^T      ([M,K] x [N,K])
    dgrad  dx = dy.rowwise         @ W.columnwise^T   ([M,N] x [K,N])
    wgrad  dW = dy.columnwise      @ x.columnwise^T   ([N,M] x [K,M])
A native kernel registered for what the two parts declare (`QuantizedPart.gemm_kind`: scale layout, block shape,
scale dtype; or a user's kernel for the pair of part types, tried first: `hybridq.dispatch.gemm_candidates`) runs
when it accepts the operands (device, capability, element dtypes, shapes); otherwise the GEMM is emulated:
dequantize both parts to fp32 and multiply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .dispatch import (NativeGemm, current_gemm_name, find_native_gemm, grouped_gemm_kernel, register_native_gemm,
                       reset_gemm_name, set_gemm_name)
from .formats.base import OperandKind, ScaleLayout

if TYPE_CHECKING:
    from .formats.base import QuantizedPart

__all__ = ["gemm", "emulated_gemm", "register_native_gemm", "find_native_gemm", "current_gemm_name", "NativeGemm",
           "native_row_multiple", "grouped_gemm_fp8", "grouped_fp8_gemm_kernel", "JaggedFP8", "JaggedFP8Kernels",
           "jagged_fp8_kernels"]

# every group of `grouped_gemm_fp8`'s operands: FP8 with one fp32 scale for the group's tensor
PER_GROUP_TENSOR = OperandKind(ScaleLayout.TENSOR, None, torch.float32)


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
    if a.cols == 0 or a.rows == 0 or b.rows == 0:
        # an empty product (e.g. the wgrad of 0 tokens): zeros, a sum over no terms, as the emulated GEMM gives;
        # the native kernels refuse zero-size operands, and that refusal must not turn one off for later calls
        return torch.zeros(a.rows, b.rows, dtype=out_dtype, device=a.device)
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


def grouped_fp8_gemm_kernel(device_type: str):
    """The grouped GEMM `grouped_gemm_fp8` runs on `device_type` (registered for `PER_GROUP_TENSOR` operands), or
    None."""
    return grouped_gemm_kernel(PER_GROUP_TENSOR, device_type)


# ---- per-tensor FP8 experts on the jagged token layout -----------------------------------------------------------

class JaggedFP8:
    """Per-tensor FP8 of E row groups of one tensor, each group quantized as its own tensor (its amax, its scale):
    `row` fp8 `[M, K]` (rowwise), `col` the columnwise form of every group or None, `scale_inv` fp32 `[E]`. `col` is
    in the layout of the kernels that made it, which only their `wgrad` reads: the reference's is the byte transpose
    `[K, M]` (group g's columns at its rows' positions); the CUDA kernels' starts every group at a multiple of 16
    columns, zero-padded (hybridq/kernels/grouped_fp8.py)."""

    __slots__ = ("row", "col", "scale_inv")

    def __init__(self, row: torch.Tensor, col: torch.Tensor | None, scale_inv: torch.Tensor):
        self.row, self.col, self.scale_inv = row, col, scale_inv


class JaggedFP8Kernels:
    """The operations of per-tensor FP8 experts on the jagged token layout (`hybridq.nn.grouped_jagged`): every
    expert's tokens are consecutive rows, `groups` (a `TokenGroups`) gives their bounds. This class is the reference
    (any device, one quantization and one `gemm` per group, host token counts: bitwise the per-expert path on the
    CPU); a device registers faster ones with `hybridq.dispatch.register_jagged_fp8` (the CUDA ones take the bounds
    from the device, without a host sync).

    - `quantize(q, x2d, groups, columnwise, name)` -> JaggedFP8: each group as `q.quantize` quantizes it alone;
    - `mm(a, a_scale_inv, b, b_group_stride, b_row_stride, n, b_scale_inv, groups, out_dtype, precise)` -> `[M, n]`:
      group g's rows of `a` (fp8 `[M, K]`) times `b_g^T`, `b_g[j, :]` starting at element `g * b_group_stride +
      j * b_row_stride` of `b` (contiguous along K); `precise`: the GEMM of a columnwise form (no fast accumulation);
    - `wgrad(a_t, a_scale_inv, b_t, b_scale_inv, groups, out_dtype)` -> `[E, M, N]`: `a_t [M, T]` and `b_t [N, T]`
      (columnwise forms) contracted over each group's tokens (zero for a group without tokens)."""

    name = "reference"

    def supports(self, device: torch.device, in_features: int, out_features: int, quantizers: dict) -> bool:
        return device.type == "cpu"

    def prefers_per_expert_path(self, sizes: list[int], in_features: int, out_features: int) -> bool:
        """Whether GroupedLinear's per-expert path is measured faster than these kernels at these token counts."""
        return False

    def columnwise_width(self, groups) -> int:
        """The columns of the buffer that holds the columnwise form `quantize` makes for token `groups` (here the
        byte transpose: one per token), from what the host knows without a sync (the compiled op's fake: nn/
        compiled_grouped.py)."""
        return groups.tokens

    def columnwise_form(self, buffer: torch.Tensor, groups) -> torch.Tensor:
        """The columnwise form `quantize` returned, from the whole buffer that holds it (`columnwise_width` columns)."""
        return buffer

    def quantize(self, q, x2d: torch.Tensor, groups, columnwise: bool, name: str) -> JaggedFP8:
        from .formats.base import transposed_copy
        g = q.quantize_row_groups(x2d, groups.host_sizes(), name=name)
        return JaggedFP8(g.data, transposed_copy(g.data) if columnwise else None, g.scale_inv)

    def mm(self, a, a_scale_inv, b, b_group_stride: int, b_row_stride: int, n: int, b_scale_inv, groups,
           out_dtype: torch.dtype, precise: bool, name: str = "grouped GEMM") -> torch.Tensor:
        from .formats.float8 import Float8TensorPart, aligned_scales
        k = a.shape[1]
        out = a.new_empty(a.shape[0], n, dtype=out_dtype)
        sa, sb = aligned_scales(a_scale_inv), aligned_scales(b_scale_inv)
        o = 0
        for g, m in enumerate(groups.host_sizes()):
            if m:
                bg = b.as_strided((n, k), (b_row_stride, 1), b.storage_offset() + g * b_group_stride).contiguous()
                ap = Float8TensorPart(rows=m, cols=k, columnwise=False, data=a[o:o + m], scale_inv=sa[g, :1])
                bp = Float8TensorPart(rows=n, cols=k, columnwise=precise, data=bg, scale_inv=sb[g, :1])
                out[o:o + m] = gemm(ap, bp, out_dtype, f"{name} (expert {g})")
            o += m
        return out

    def wgrad(self, a_t, a_scale_inv, b_t, b_scale_inv, groups, out_dtype: torch.dtype,
              name: str = "grouped wgrad") -> torch.Tensor:
        from .formats.float8 import Float8TensorPart, aligned_scales
        sizes = groups.host_sizes()
        out = a_t.new_empty(len(sizes), a_t.shape[0], b_t.shape[0], dtype=out_dtype)
        sa, sb = aligned_scales(a_scale_inv), aligned_scales(b_scale_inv)
        o = 0
        for g, m in enumerate(sizes):
            if m:
                ap = Float8TensorPart(rows=a_t.shape[0], cols=m, columnwise=True, data=a_t[:, o:o + m].contiguous(),
                                      scale_inv=sa[g, :1])
                bp = Float8TensorPart(rows=b_t.shape[0], cols=m, columnwise=True, data=b_t[:, o:o + m].contiguous(),
                                      scale_inv=sb[g, :1])
                out[g] = gemm(ap, bp, out_dtype, f"{name} (expert {g})")
            else:
                out[g].zero_()
            o += m
        return out


REFERENCE_JAGGED_FP8 = JaggedFP8Kernels()


def jagged_fp8_kernels(device: torch.device, in_features: int, out_features: int,
                       quantizers: dict) -> JaggedFP8Kernels | None:
    """The kernels for per-tensor FP8 experts of these shapes and quantizers on `device`: the device's registered
    ones where they take the call, the reference on the CPU, else None (the caller takes another path)."""
    from .dispatch import jagged_fp8_kernels as registered
    k = registered(device.type)
    if k is not None and k.supports(device, in_features, out_features, quantizers):
        return k
    return REFERENCE_JAGGED_FP8 if REFERENCE_JAGGED_FP8.supports(device, in_features, out_features, quantizers) \
        else None
