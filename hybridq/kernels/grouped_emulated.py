"""Grouped MXFP8 GEMMs of GroupedLinear's packed path (`hybridq.nn.grouped_packed_blocks`) on CUDA sm_90, which has
no MXFP8 tensor-core GEMM: the same exact emulation as the per-expert path (`native_gemm._bf16_run`: each operand
dequantized to bf16, which holds every MXFP8 value exactly, then a bf16 GEMM with fp32 accumulation and one rounding
to bf16), with ONE dequantize per packed operand and ONE `torch._grouped_mm` per phase instead of one of each per
expert.

  - fprop / dgrad (`mm`): the tokens' rows of the packed token operand (its fp8 bytes and scales gathered in token
    order: one byte per element, where gathering the bf16 output rows moved four per output element) against the
    whole packed weight (rowwise `[E*n, K]`, or columnwise `[K, E*n]` read as `[E, n, K]` through strides: no copy),
    grouped by the tokens' ends;
  - wgrad (`wgrad`): the columnwise forms `[M, S]`, `[N, S]` contracted over each slot (an empty slot: zeros).

Numerics: the bf16 operands are bitwise those of the per-expert emulation (the dequantize is element by element), the
products exact in fp32; only the accumulation order of the GEMM kernel differs (cuBLAS per expert vs CUTLASS grouped):
within 1e-2 of each expert's largest magnitude after the bf16 rounding (tests/test_grouped_blocks_gemm.py).

Taken where every piece runs: CUDA sm_90 (sm_100 has native MXFP8 GEMMs), `torch._grouped_mm`, the built extension,
native GEMMs enabled, untransformed 1x32 E8M0 parts on both sides, and `HYBRIDQ_GROUPED_EMULATED_GEMM` not "0"
(`ENABLED.on`). A failure inside torch turns it off for the process with one warning (`grouped_blocks.run_or_none`);
the per-expert GEMMs (same numerics class) run instead.
"""

from __future__ import annotations


import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..switches import Switch
from . import _ext, native_gemm

ENABLED = Switch("HYBRIDQ_GROUPED_EMULATED_GEMM")
ALIGN = 8  # bf16 elements in 16 bytes: every group's base and every stride of `torch._grouped_mm`'s operands


def supports(a, b) -> bool:
    """Whether the grouped emulation takes token operand part `a` against `b` (the weight, or a token operand for
    wgrad)."""
    if not (ENABLED.on and native_gemm.native_enabled() and a.data.is_cuda and not isinstance(a.data, FakeTensor)
            and b.data.device == a.data.device and hasattr(torch, "_grouped_mm")):
        return False
    if a.gemm_kind != native_gemm.E8M0_1X32 or b.gemm_kind != native_gemm.E8M0_1X32:
        return False
    if a.transform is not None or b.transform is not None or native_gemm._cap(a.data) != (9, 0):
        return False
    return a.cols % 16 == 0 and _ext.available_for(a.data.device)


def weight_supported(b, experts: int) -> bool:
    """Whether each expert's rows of the whole packed weight part `b` start 16-byte aligned."""
    return ((b.cols if b.columnwise else b.rows) // experts) % ALIGN == 0 and b.rows % ALIGN == 0


def bf16(p) -> torch.Tensor:
    """The part's values as bf16 `[rows, cols]` (exact for MXFP8): the extension's dequantize on CUDA
    (`native_gemm.exact_bf16_operand`), the reference elsewhere."""
    if p.data.is_cuda:
        out = native_gemm.exact_bf16_operand(p, False)
        if out is not None and out[1] is None:
            return out[0]
    return p.dequantize_2d().to(torch.bfloat16)


def mm(a, b, experts: int, slot_ends: torch.Tensor, token_rows: torch.Tensor | None,
       out_dtype: torch.dtype, token_ends: torch.Tensor | None = None) -> torch.Tensor:
    """fprop / dgrad of every expert: `a` the packed rowwise token part `[S, K]`, `b` the whole packed weight part
    (rowwise `[E*n, K]` for fprop, columnwise `[K, E*n]` for dgrad), `slot_ends` int32 `[E]` (cumulative slot sizes,
    on the device), `token_rows` the packed row of each token (None: the slots are the tokens). Result `[tokens, n]`
    in token order. With `token_ends` (int32 `[E]`, cumulative token counts) the tokens' rows of `a` (fp8 bytes and
    their scales, 1x32 blocks lie in one row) are gathered before the dequantize and the GEMM runs on them alone:
    no bf16 output rows of padding to drop afterwards (a row's products and sums do not depend on the other rows)."""
    if token_rows is not None and token_ends is not None and not a.columnwise:
        rows = token_rows.shape[0]
        a = a._sliced(rows, a.cols, a.data.view(torch.uint8).index_select(0, token_rows).view(a.data.dtype),
                      a.scales.index_select(0, token_rows), {})
        slot_ends, token_rows = token_ends, None
    ma, mb = bf16(a), bf16(b)
    if b.columnwise:  # expert g: columns [g*n, (g+1)*n) of [K_out, E*n], as [n, K_out] with unit stride along n
        n_out = b.rows
        mat_b = mb.view(n_out, experts, b.cols // experts).permute(1, 2, 0)
    else:
        n = b.rows // experts
        mat_b = mb.view(experts, n, b.cols).transpose(1, 2)
    y = torch._grouped_mm(ma, mat_b, offs=slot_ends)
    if token_rows is not None:
        y = y.index_select(0, token_rows)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def wgrad(a_t, b_t, slot_ends: torch.Tensor, empty: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """dW of every expert, `[E, M, N]`: the columnwise token parts `a_t [M, S]`, `b_t [N, S]` contracted over each
    slot; `empty`: the experts without tokens (a zero product)."""
    out = torch._grouped_mm(bf16(a_t), bf16(b_t).t(), offs=slot_ends)
    if empty:
        out[empty] = 0
    return out if out.dtype == out_dtype else out.to(out_dtype)
