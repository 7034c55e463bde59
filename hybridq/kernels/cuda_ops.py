"""Fake (meta) implementations of the `torch.ops.hybridq.*` CUDA ops, so that they trace under FakeTensorMode
and torch.compile. Imported by `_ext.load()` once the extension has registered the ops.

Op reference (all inputs 2-D and contiguous; a direction not asked for returns an empty `[0]` tensor):
- fp8_tensor_quantize(x, dtype, scale?, amax?, eps, pow2, rowwise, columnwise, want_amax)
    -> (rowwise [M, K] fp8, columnwise [K, M] fp8, scale_inv [1], amax [1] | [0])
- fp8_tensor_quantize_delayed(x, dtype, scale, amax_history, eps, pow2, rowwise, columnwise): delayed scaling's cast,
  max|x| max-combined into amax_history[0] in place -> (rowwise, columnwise, scale_inv [1])
- fp8_tensor_quantize_grouped(x, dtype, row_group, n_groups, eps, pow2, columnwise, col_pitch=0): row r quantized
  with the scale of group row_group[r] (int32 [M]), each group's scale from its own max|x|; the columnwise rows
  col_pitch (>= M; 0: M) elements apart
    -> (rowwise [M, K] fp8, columnwise [K, M] fp8 (strides (col_pitch, 1)) | [0], scale_inv [n_groups],
        amax [n_groups])
- fp8_block_quantize(x, dtype, block_dim, eps, pow2, rowwise, columnwise)
    -> (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv)
- mxfp8_quantize(x, dtype, block_2d, rowwise, columnwise, swizzle) -> (rowwise, E8M0 scales, columnwise, scales)
- nvfp4_quantize(x, block_2d, rht, stochastic_rounding, generator?, rowwise, columnwise, amax?, amax_col?)
    (amax / amax_col: given global amaxes, e.g. of the whole tensor when x is a row shard of it)
    -> (row data [M, K/2], row scales [M, K/16] e4m3, row amax [1], col data [K, M/2], col scales, col amax)
- nvfp4_quantize_grouped(x, block_2d, rht, stochastic_rounding, generator?, rowwise, columnwise, sizes, draw_rank,
  n_draws): row group g (the next sizes[g] rows) quantized as nvfp4_quantize quantizes it alone, its draws those of
  the draw_rank[g]-th of n_draws launches -> as nvfp4_quantize with amaxes [G]
- rms_norm_forward(x, weight?, eps) -> (y like x, rstd [M] fp32, max|y| [1] fp32);
  rms_norm_backward(dy, x, weight?, rstd, weight_grad) -> (dx like x, dweight like weight | [0] fp32)
- amax(x) -> [1]; transpose_bytes(x) -> x.t().contiguous() for 1-byte elements; dequantize_fp8(data, scale, mode, out_dtype); dequantize_nvfp4(data, scale, amax, rht_inverse,
  apply_global, out_dtype)
- fp8_delayed_update(histories, scales, fp8_maxes, divisors, most_recent) -> None: Float8Quantizer.update() of many
  quantizers, in place (see delayed.py)
"""

from __future__ import annotations

import torch
from torch.library import register_fake

_F32 = torch.float32


def _or0(x, shape, dtype, on):
    return x.new_empty(shape if on else (0,), dtype=dtype)


def _cdiv(a, b):
    return -(-a // b)


@register_fake("hybridq::fp8_tensor_quantize")
def _fp8_tensor_quantize(x, dtype, scale, amax, eps, pow2, rowwise, columnwise, want_amax):
    m, k = x.shape
    return (_or0(x, (m, k), dtype, rowwise), _or0(x, (k, m), dtype, columnwise), x.new_empty((1,), dtype=_F32),
            _or0(x, (1,), _F32, scale is None or want_amax))


@register_fake("hybridq::fp8_tensor_quantize_delayed")
def _fp8_tensor_quantize_delayed(x, dtype, scale, amax_history, eps, pow2, rowwise, columnwise):
    return _fp8_tensor_quantize(x, dtype, scale, None, eps, pow2, rowwise, columnwise, False)[:3]


@register_fake("hybridq::fp8_tensor_quantize_grouped")
def _fp8_tensor_quantize_grouped(x, dtype, row_group, n_groups, eps, pow2, columnwise, col_pitch=0):
    m, k = x.shape
    col = (x.new_empty_strided((k, m), (col_pitch or m, 1), dtype=dtype) if columnwise
           else x.new_empty((0,), dtype=dtype))
    return (x.new_empty((m, k), dtype=dtype), col, x.new_empty((n_groups,), dtype=_F32),
            x.new_empty((n_groups,), dtype=_F32))


@register_fake("hybridq::fp8_block_quantize")
def _fp8_block_quantize(x, dtype, block_dim, eps, pow2, rowwise, columnwise):
    m, k = x.shape
    bm, bk = _cdiv(m, 128), _cdiv(k, 128)
    rs, cs = ((m, bk), (k, bm)) if block_dim == 1 else ((bm, bk), (bk, bm))
    return (_or0(x, (m, k), dtype, rowwise), _or0(x, rs, _F32, rowwise), _or0(x, (k, m), dtype, columnwise),
            _or0(x, cs, _F32, columnwise))


@register_fake("hybridq::mxfp8_quantize")
def _mxfp8_quantize(x, dtype, block_2d, rowwise, columnwise, swizzle):
    m, k = x.shape
    if swizzle:
        rs = (_cdiv(m, 128) * 128 * _cdiv(k // 32, 4) * 4,)
        cs = (_cdiv(k, 128) * 128 * _cdiv(m // 32, 4) * 4,)
    else:
        rs, cs = (m, k // 32), (k, m // 32)
    return (_or0(x, (m, k), dtype, rowwise), _or0(x, rs, torch.uint8, rowwise), _or0(x, (k, m), dtype, columnwise),
            _or0(x, cs, torch.uint8, columnwise))


@register_fake("hybridq::nvfp4_quantize")
def _nvfp4_quantize(x, block_2d, rht, stochastic_rounding, generator, rowwise, columnwise, amax=None, amax_col=None):
    m, k = x.shape
    e4 = torch.float8_e4m3fn
    return (_or0(x, (m, k // 2), torch.uint8, rowwise), _or0(x, (m, k // 16), e4, rowwise), _or0(x, (1,), _F32, rowwise),
            _or0(x, (k, m // 2), torch.uint8, columnwise), _or0(x, (k, m // 16), e4, columnwise),
            _or0(x, (1,), _F32, columnwise))


@register_fake("hybridq::nvfp4_quantize_grouped")
def _nvfp4_quantize_grouped(x, block_2d, rht, stochastic_rounding, generator, rowwise, columnwise, sizes, draw_rank,
                            n_draws):
    m, k = x.shape
    g = len(sizes)
    e4 = torch.float8_e4m3fn
    return (_or0(x, (m, k // 2), torch.uint8, rowwise), _or0(x, (m, k // 16), e4, rowwise), _or0(x, (g,), _F32, rowwise),
            _or0(x, (k, m // 2), torch.uint8, columnwise), _or0(x, (k, m // 16), e4, columnwise),
            _or0(x, (g,), _F32, columnwise))


@register_fake("hybridq::rms_norm_forward")
def _rms_norm_forward(x, weight, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=_F32), x.new_empty((1,), dtype=_F32)


@register_fake("hybridq::rms_norm_backward")
def _rms_norm_backward(dy, x, weight, rstd, weight_grad):
    on = weight_grad and weight is not None
    return torch.empty_like(x), (weight.new_empty(weight.shape) if on else x.new_empty((0,), dtype=_F32))


@register_fake("hybridq::amax")
def _amax(x):
    return x.new_empty((1,), dtype=_F32)


@register_fake("hybridq::transpose_bytes")
def _transpose_bytes(x):
    return x.new_empty((x.shape[1], x.shape[0]))


@register_fake("hybridq::dequantize_fp8")
def _dequantize_fp8(data, scale, mode, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@register_fake("hybridq::dequantize_nvfp4")
def _dequantize_nvfp4(data, scale, amax, rht_inverse, apply_global, out_dtype):
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=out_dtype)


@register_fake("hybridq::fp8_delayed_update")
def _fp8_delayed_update(histories, scales, fp8_maxes, divisors, most_recent):
    return None
