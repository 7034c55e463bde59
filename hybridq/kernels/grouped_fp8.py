"""CUDA kernels of per-tensor FP8 experts on the jagged token layout (`hybridq.gemm.JaggedFP8Kernels`), registered
for device type "cuda": the grouped quantize of the extension (`hybridq::fp8_tensor_quantize_grouped`: one amax launch
and one cast launch for all groups, rowwise and columnwise in the same pass, the columnwise rows 16-byte aligned for
the wgrad GEMM) and the Triton grouped GEMMs of `triton_grouped_fp8` (sm_90), all reading the group bounds from the
device: no host sync, no padding or packing copies.

Taken where every piece runs: a CUDA sm_90 device, Triton, the built extension, FP8 GEMMs enabled
(`native_gemm.disabled()` turns them off), contracted sizes (in_features for fprop, out_features for dgrad) multiple
of 32, and quantizers whose every option the cast kernel implements (`cuda.FP8_TENSOR_OPTIONS`). Elsewhere the
caller takes another path (`hybridq.gemm.jagged_fp8_kernels`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..enums import Scaling
from ..formats import Float8Quantizer
from ..gemm import JaggedFP8, JaggedFP8Kernels
from . import _ext, native_gemm
from .cuda import FP8_TENSOR_OPTIONS, IN_DTYPES


def _triton():
    """triton_grouped_fp8 when Triton imports, else None (imported on first use: Triton is optional)."""
    from . import triton_grouped_fp8
    return triton_grouped_fp8 if triton_grouped_fp8.available() else None


def _quantizer_ok(q) -> bool:
    return (type(q) is Float8Quantizer and q.scaling == Scaling.CURRENT
            and {f.name for f in dataclasses.fields(q)} <= FP8_TENSOR_OPTIONS)


class CudaJaggedFP8(JaggedFP8Kernels):
    name = "cuda-triton-sm90"

    def supports(self, device: torch.device, in_features: int, out_features: int, quantizers: dict) -> bool:
        if device.type != "cuda" or not native_gemm.native_enabled():
            return False
        if in_features % 32 or out_features % 32 or not all(_quantizer_ok(q) for q in quantizers.values()):
            return False
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if native_gemm._CAPS.setdefault(idx, torch.cuda.get_device_capability(idx)) != (9, 0):
            return False
        return _triton() is not None and _ext.available_for(device)

    def quantize(self, q, x2d: torch.Tensor, groups, columnwise: bool, name: str) -> JaggedFP8:
        if x2d.dtype not in IN_DTYPES:
            raise TypeError(f"{name}: the FP8 cast takes float32 / bfloat16 / float16, got {x2d.dtype}")
        x = x2d.contiguous()
        m = x.shape[0]
        pitch = -(-m // 16) * 16 if columnwise else 0  # 16-byte aligned columnwise rows (the wgrad GEMM's reads)
        row, col, scale_inv, _ = torch.ops.hybridq.fp8_tensor_quantize_grouped(
            x, q.dtype, groups.row_group, groups.n, q.amax_epsilon, q.power_2_scale, columnwise, pitch)
        return JaggedFP8(row, col if columnwise else None, scale_inv)

    def mm(self, a, a_scale_inv, b, b_group_stride: int, b_row_stride: int, n: int, b_scale_inv, groups,
           out_dtype: torch.dtype, precise: bool, name: str = "grouped GEMM") -> torch.Tensor:
        od = out_dtype if out_dtype in IN_DTYPES else torch.float32
        out = _triton().jagged_mm(a, a_scale_inv, b, b_group_stride, b_row_stride, n, b_scale_inv, groups.ends, od,
                                  precise)
        return out if od == out_dtype else out.to(out_dtype)

    def wgrad(self, a_t, a_scale_inv, b_t, b_scale_inv, groups, out_dtype: torch.dtype,
              name: str = "grouped wgrad") -> torch.Tensor:
        od = out_dtype if out_dtype in IN_DTYPES else torch.float32
        out = _triton().jagged_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, groups.ends, od, precise=True)
        return out if od == out_dtype else out.to(out_dtype)
