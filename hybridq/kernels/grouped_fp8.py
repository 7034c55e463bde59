"""CUDA kernels of per-tensor FP8 experts on the jagged token layout (`hybridq.gemm.JaggedFP8Kernels`), registered
for device type "cuda": the grouped quantize of the extension (`hybridq::fp8_tensor_quantize_grouped`: one amax launch
and one cast launch for all groups, rowwise and columnwise in the same pass, the columnwise form in the padded
layout the wgrad GEMMs read: each group from a 16-aligned column, zeros between) and the Triton grouped GEMMs of
`triton_grouped_fp8` (sm_90), all reading the group bounds from the device: no host sync, no packing copies. Where
the host has the token counts and each expert's GEMM is long enough to hide a call's host cost, the GEMMs run as one
cuBLAS GEMM per expert instead, issued from C++ in one op call per phase (`hybridq::grouped_fp8_tensor_cublas_mm` /
`_wgrad`: ~1.0-1.4 PFLOP/s on an H200 where the Triton kernels with promoted accumulation run at ~0.45-0.85;
`per_expert_min_us`, `wgrad_per_expert_min_us`).

Taken where every piece runs: a CUDA sm_90 device, Triton, the built extension, FP8 GEMMs enabled
(`native_gemm.disabled()` turns them off), contracted sizes (in_features for fprop, out_features for dgrad) multiple
of 32, and quantizers whose every option the cast kernel implements (`cuda_fp8_tensor.OPTIONS`). Elsewhere the
caller takes another path (`hybridq.gemm.jagged_fp8_kernels`).
"""

from __future__ import annotations

import torch

from ..enums import Scaling
from ..formats import Float8Quantizer
from ..formats.base import option_names
from ..gemm import JaggedFP8, JaggedFP8Kernels
from . import _ext, native_gemm
from .cuda import IN_DTYPES
from .cuda_fp8_tensor import OPTIONS as FP8_TENSOR_OPTIONS
from .expert_streams import gemm_us, streams_for


_TRITON: list = []  # [triton_grouped_fp8 or None] once looked up (each GEMM and transpose asks: ~60 calls per step)


def _triton():
    """triton_grouped_fp8 when Triton imports, else None (imported on first use: Triton is optional)."""
    if not _TRITON:
        from . import triton_grouped_fp8
        _TRITON.append(triton_grouped_fp8 if triton_grouped_fp8.available() else None)
    return _TRITON[0]


def _quantizer_ok(q) -> bool:
    if type(q) is not Float8Quantizer or q.scaling != Scaling.CURRENT:
        return False
    return option_names(type(q)) <= FP8_TENSOR_OPTIONS


class CudaJaggedFP8(JaggedFP8Kernels):
    name = "cuda-triton-sm90"

    def supports(self, device: torch.device, in_features: int, out_features: int, quantizers: dict) -> bool:
        if device.type != "cuda" or not native_gemm.native_enabled():
            return False
        if in_features % 32 or out_features % 32 or not all(_quantizer_ok(q) for q in quantizers.values()):
            return False
        idx = device.index if device.index is not None else torch.cuda.current_device()
        cap = native_gemm._CAPS.get(idx)
        if cap is None:  # (asked once per device, not at every call)
            cap = native_gemm._CAPS[idx] = torch.cuda.get_device_capability(idx)
        if cap != (9, 0):
            return False
        return _triton() is not None and _ext.available_for(device)

    def quantize(self, q, x2d: torch.Tensor, groups, columnwise: bool, name: str) -> JaggedFP8:
        """The cast writes the columnwise form in the padded layout (each group's tokens from a 16-aligned column,
        zeros up to a multiple of 16 and to `columnwise_width`), which the wgrad GEMM reads without edge products
        (and cuBLAS takes per expert). Groups the host knows are 16-aligned (the experts' weights) have the plain
        transpose (the same layout), and so do groups of device counts whose average has more
        than `padded_max_tokens_per_expert` tokens (see `_plain`)."""
        if x2d.dtype not in IN_DTYPES:
            raise TypeError(f"{name}: the FP8 cast takes float32 / bfloat16 / float16, got {x2d.dtype}")
        x = x2d.contiguous()
        padded = columnwise and not self._plain(groups)
        pitch = self.columnwise_width(groups) if columnwise else 0
        row, col, scale_inv, _ = torch.ops.hybridq.fp8_tensor_quantize_grouped(
            x, q.dtype, groups.row_group, groups.n, q.amax_epsilon, q.power_2_scale, columnwise, pitch,
            groups.ends if padded else None, groups.padded_ends if padded else None)
        return JaggedFP8(row, col if columnwise else None, scale_inv)

    # fprop / dgrad as one cuBLAS GEMM per expert (`grouped_fp8_tensor_cublas_mm`, the GEMM torch._scaled_mm runs:
    # ~1.2-1.4 PFLOP/s on an H200 at the bench_grouped shapes, ~10 us of host per expert) when the host has the token
    # counts (a list m_splits) and the average expert's GEMM takes at least this long on the GPU (estimated at 1.1
    # PFLOP/s); else one Triton grouped launch (which wins for short experts: the MoE job's 16 x 2048 tokens, d 2048,
    # h 1024, ~8 us each). wgrad likewise (`grouped_fp8_tensor_cublas_wgrad` on the padded columnwise layout, which
    # host counts give: cuBLAS needs each expert's tokens 16-aligned).
    per_expert_min_us = 15.0
    wgrad_per_expert_min_us = 15.0
    # (GroupedLinear's whole per-expert path is never preferred: with the GEMMs above, the jagged path measured 1.61x
    # bf16 at 8 experts x 4096 tokens, d 4096, h 14336, where the per-expert path measured 1.31x; BENCHMARKS.md)

    # token groups get the padded columnwise layout (see quantize) where the average expert has at most this many
    # tokens, else the plain transpose (the Triton wgrad kernel then reads each expert's < 16 edge tokens per side with
    # two small masked products). inf (the default): always -- the padded Triton wgrad measured faster than the plain
    # one at every bench_grouped config (one H200, 2026-11-29 03:16 UTC: 6.00 / 2.75 / 3.00 ms against 6.82 / 3.12 /
    # 3.64 at 8 / 16 / 64 experts), and since the cast writes it the padded layout costs ~6% more cast time than the
    # plain one (06:36 UTC; before, a 0.4-0.5 ms re-layout, when the default was 2048). 0: never.
    padded_max_tokens_per_expert: float = float("inf")

    def _plain(self, groups) -> bool:
        """Whether these groups' columnwise form is the plain transpose (a `[K, T]` view), else the padded
        layout: always the padded one for host counts (not all 16-aligned) where the wgrad may run per expert on
        cuBLAS, which needs it."""
        if groups.aligned16():
            return True
        if groups.known_sizes() is not None and self.wgrad_per_expert_min_us != float("inf"):
            return False
        return groups.tokens > self.padded_max_tokens_per_expert * groups.n

    def columnwise_width(self, groups) -> int:
        """The columnwise forms' row pitch: the layout's width (the plain transpose's `ceil16(T)` or the padded
        layout's `groups.padded_width()`) rounded up to COLUMN_PITCH bytes (the padded layout's extra columns zeros,
        the plain one's outside its `[K, T]` view)."""
        width = -(-groups.tokens // 16) * 16 if self._plain(groups) else groups.padded_width()
        return -(-width // COLUMN_PITCH) * COLUMN_PITCH

    def columnwise_form(self, buffer: torch.Tensor, groups) -> torch.Tensor:
        return buffer[:, :groups.tokens] if self._plain(groups) else buffer

    @staticmethod
    def _per_expert(groups, k: int, n: int, min_us: float) -> bool:
        sizes = groups.known_sizes()
        return bool(sizes) and gemm_us(sizes, k, n) >= min_us

    def mm(self, a, a_scale_inv, b, b_group_stride: int, b_row_stride: int, n: int, b_scale_inv, groups,
           out_dtype: torch.dtype, precise: bool, name: str = "grouped GEMM") -> torch.Tensor:
        od = out_dtype if out_dtype in _MM_OUT else torch.float32
        if self._per_expert(groups, a.shape[1], n, self.per_expert_min_us):
            sizes = groups.known_sizes()
            out = torch.ops.hybridq.grouped_fp8_tensor_cublas_mm(a, a_scale_inv, b, b_group_stride, b_row_stride, n,
                                                                 b_scale_inv, sizes, od, not precise,
                                                                 streams_for(sizes, a.shape[1], n))
        else:
            out = _triton().jagged_mm(a, a_scale_inv, b, b_group_stride, b_row_stride, n, b_scale_inv, groups.ends,
                                      od, precise)
        return out if od == out_dtype else out.to(out_dtype)

    def wgrad(self, a_t, a_scale_inv, b_t, b_scale_inv, groups, out_dtype: torch.dtype,
              name: str = "grouped wgrad") -> torch.Tensor:
        od = out_dtype if out_dtype in _MM_OUT else torch.float32
        if a_t.shape[1] != b_t.shape[1]:  # (a layout setting changed between forward and backward)
            raise RuntimeError(f"{name}: the columnwise forms have {a_t.shape[1]} and {b_t.shape[1]} token columns: "
                               f"they were quantized in different layouts (padded_max_tokens_per_expert or "
                               f"wgrad_per_expert_min_us changed between forward and backward)")
        # the columnwise forms of `quantize`: the padded layout (every group's bounds multiples of 16) is wider than
        # the tokens, or all groups are 16-aligned (both layouts are one); else the plain transpose, edges and all
        padded = a_t.shape[1] != groups.tokens or groups.aligned16()
        if padded and self._per_expert(groups, a_t.shape[0], b_t.shape[0], self.wgrad_per_expert_min_us):
            offsets, rows = groups.padded_slots()
            out = torch.ops.hybridq.grouped_fp8_tensor_cublas_wgrad(a_t, a_scale_inv, b_t, b_scale_inv, offsets, rows,
                                                                    od, streams_for(rows, a_t.shape[0], b_t.shape[0]))
        else:
            out = _triton().jagged_wgrad(a_t, a_scale_inv, b_t, b_scale_inv,
                                         groups.padded_ends if padded else groups.ends, od, precise=True,
                                         aligned=padded)
        return out if od == out_dtype else out.to(out_dtype)


_MM_OUT = (torch.bfloat16, torch.float16, torch.float32)
# The columnwise forms' rows start on 128-byte boundaries (an L2 line): the cast stores each tile's transposed rows as
# 128-byte segments, which a pitch off that grid splits over two lines. One H200, 2026-11-29, the routed operands of
# bench_grouped's 64-expert config: the padded cast of x [131072, 2048] / dy [131072, 3072] 376 / 609 us at the
# padded width 131472 (a multiple of 16 only), 318 / 487 us at 131584 or 132096; the plain cast ~300 / ~450 us.
COLUMN_PITCH = 128
