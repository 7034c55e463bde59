"""Hardware GEMMs for pairs of quantized parts on CUDA, selected by what the parts declare
(`QuantizedPart.gemm_kind`: scale layout, block shape, scale dtype; `hybridq.dispatch.register_layout_gemm`), so
this module names no format: a new format whose parts declare a kind below gets its GEMMs. The kinds (`KINDS`) and
the formats that declare them today:

- TENSOR fp32 x TENSOR fp32 (per-tensor FP8), sm_89+: `torch._scaled_mm` (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3).
  Both parts are stored `[rows, K]` row-major, so `b.data.t()` is the column-major operand cuBLAS wants.
  The forward GEMM (rowwise x rowwise) uses fast accumulation (`FAST_ACCUM_FPROP`), the backward ones do not.
- ROW x ROW, any blocks (one scale per row: rowwise FP8), E4M3 x E4M3 on sm_90: `torch._scaled_mm`'s rowwise kernel
  (scale_a `[M, 1]`, scale_b `[1, N]` fp32, bf16 result); fast accumulation for the forward GEMM as above
  (torchao's rowwise recipe does the same).
- BLOCK 1x128 fp32 x BLOCK 128x128 / 1x128 fp32 (FP8 blocks), sm_90: the extension's `hybridq::fp8_block_mm` (one
  op: the scales relaid in one kernel, cuBLASLt with a cached plan; [Note: the dense block GEMM op]), bitwise
  `torch.nn.functional.scaled_mm` with BlockWise1x128 / BlockWise128x128 scales (1x128 scales outer-dim-major, K
  blocks padded to 4: `block_scale_operands`), which runs where the op does not (HYBRIDQ_BLOCK_GEMM_OP=0).
- BLOCK 1x32 E8M0 (MXFP8) x the same, BLOCK 1x16 E4M3 with a global decode scale (NVFP4) x the same, on sm_100+:
  `torch.nn.functional.scaled_mm` with BlockWise1x32 / BlockWise1x16 (+ TensorWise global) scales in the swizzled
  128x4-tile layout, self-checked against the emulation on first use.
- 1x32 E8M0 x 1x32 E8M0 on sm_90 (cuBLAS refuses MXFP8 there), opt-in with HYBRIDQ_TRITON_MXFP8=1: a Triton kernel
  (`triton_mxfp8`) on the FP8 tensor cores that reads the fp8 bytes and E8M0 scales as stored and applies the
  32-element K-block scales in its main loop (fp32 accumulation). Off by default: it is correct but, as measured,
  slower than the bf16 emulation below (BENCHMARKS.md "MXFP8 GEMM on sm_90 in Triton").
- 1x32 E8M0 / 1x16 E4M3 on sm_90, any pairing (MXFP8 x MXFP8, NVFP4 x NVFP4, MXFP8 x NVFP4, NVFP4 x MXFP8), opt-in with
  HYBRIDQ_TRITON_DEQUANT_GEMM=1: a Triton kernel (`triton_dequant_gemm`) that reads codes and scales as stored,
  dequantizes each K tile to bf16 in registers exactly as the emulation below does, and multiplies in bf16 with
  fp32 accumulation (the same math as the emulation without its bf16 copies in HBM). Off until it is measured
  faster than the emulation. With both switches on, MXFP8 x MXFP8 takes the HYBRIDQ_TRITON_MXFP8 kernel.
- Otherwise MXFP8 / NVFP4 on sm_90 have no hardware GEMM: they are emulated, and on CUDA
  the emulation multiplies in bf16 (fp32 accumulation) where the operands dequantize exactly to bf16
  (MXFP8; NVFP4 codes times their block scale, the global scales applied to the fp32 product; bf16 identity
  parts, NONE x NONE), else in fp32 like the CPU path. See `exact_bf16_operand`.
Shapes the hardware cannot take fall back to the emulated GEMM with a one-time warning naming the operands. A user's
GEMM registered for a pair of part types (`hybridq.register_native_gemm`) is tried before these.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..formats.base import OperandKind, ScaleLayout, transposed_copy
from ..formats import swizzle_mx_scales
from ..dispatch import current_gemm_name, register_grouped_gemm, register_layout_gemm
from ..switches import Switch, Turned
from . import _ext

log = logging.getLogger("hybridq")

FAST_ACCUM_FPROP = True
# every GEMM here, or none: HYBRIDQ_NATIVE_GEMMS=0 / `disabled()` leave all to the generic emulated path (tests, A/B)
_NATIVE = Switch("HYBRIDQ_NATIVE_GEMMS")
_warned: set = set()
_failed: set = set()

# The operand kinds the GEMMs here are registered for (see the module docstring)
TENSOR = OperandKind(ScaleLayout.TENSOR, None, torch.float32)
BLOCK_1X128 = OperandKind(ScaleLayout.BLOCK, (1, 128), torch.float32)
TILE_128X128 = OperandKind(ScaleLayout.BLOCK, (128, 128), torch.float32)
E8M0_1X32 = OperandKind(ScaleLayout.BLOCK, (1, 32), torch.float8_e8m0fnu)
E4M3_1X16 = OperandKind(ScaleLayout.BLOCK, (1, 16), torch.float8_e4m3fn)  # with a global decode scale
NO_SCALE = OperandKind(ScaleLayout.NONE)
MICROSCALED = (E8M0_1X32, E4M3_1X16)  # cuBLAS's block-scaled GEMMs on sm_100; the bf16 emulation on sm_90


def disabled() -> Turned:
    """Within this `with` block every GEMM registered here declines, so the generic emulated path runs (tests;
    HYBRIDQ_NATIVE_GEMMS=0 does it for a whole process)."""
    return _NATIVE.turned(False)


def _warn_once(key, msg: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


_CAPS: dict = {}


def _cap(t: torch.Tensor) -> tuple[int, int]:
    idx = t.device.index
    cap = _CAPS.get(idx)
    if cap is None:
        cap = _CAPS[idx] = torch.cuda.get_device_capability(t.device)
    return cap


def _shapes(a, b) -> str:
    """The operands, and the layer's GEMM when the caller named it (e.g. "dgrad of layers.0.fc1")."""
    name = current_gemm_name()
    return f"[{a.rows}, {a.cols}] x [{b.rows}, {b.cols}]^T" + (f" ({name})" if name else "")


def _on_cuda(a, b) -> bool:
    return _NATIVE.on and a.device.type == "cuda" and b.device.type == "cuda" and a.device == b.device


# ---- FP8 tensorwise ----------------------------------------------------------------------------------------

def native_enabled() -> bool:
    """False inside `disabled()` (every GEMM here declines)."""
    return _NATIVE.on


def fp8_tensor_pair_supported(a_dtype: torch.dtype, b_dtype: torch.dtype) -> bool:
    """Whether cuBLAS's FP8 GEMM takes operands of these element types (E4M3 / E5M2, not both E5M2)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return a_dtype in fp8 and b_dtype in fp8 and not (a_dtype == b_dtype == torch.float8_e5m2)


def fp8_tensor_shape_supported(m: int, k: int, n: int) -> bool:
    """Whether the FP8 tensor cores take an `[m, k] x [n, k]^T` GEMM (every dimension a multiple of 16)."""
    return m % 16 == 0 and k % 16 == 0 and n % 16 == 0


def _fp8_supports(a, b, min_cap: tuple[int, int], pair_ok, what: str) -> bool:
    """Whether an FP8 tensor-core GEMM takes parts `a`, `b` (fp8 `data`): one CUDA device of capability >= `min_cap`,
    element types `pair_ok(a_dtype, b_dtype)`, contiguous data, every dimension a multiple of 16 (else a one-time
    warning naming the operands: the emulated GEMM runs)."""
    if not _on_cuda(a, b) or _cap(a.data) < min_cap:
        return False
    if not pair_ok(a.data.dtype, b.data.dtype):
        return False
    if not fp8_tensor_shape_supported(a.rows, a.cols, b.rows):
        _warn_once((what, a.rows, a.cols, b.rows), f"hybridq: {what} GEMM {_shapes(a, b)}: dimensions not divisible "
                   f"by 16 (the FP8 tensor cores need them); using the emulated GEMM")
        return False
    return a.data.is_contiguous() and b.data.is_contiguous()


def _fp8_tensor_supports(a, b) -> bool:
    return _fp8_supports(a, b, (8, 9), fp8_tensor_pair_supported, "FP8")


def fp8_tensor_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                  out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """`a @ b^T` of per-tensor FP8 operands `a [m, k]`, `b [n, k]` (contiguous, dequantize = data * scale_inv) by
    `torch._scaled_mm` (a result dtype it cannot write is converted from fp32)."""
    od = out_dtype if out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    y = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv.reshape(()), scale_b=b_scale_inv.reshape(()),
                         out_dtype=od, use_fast_accum=fast_accum)
    return y if od == out_dtype else y.to(out_dtype)


def fp8_tensor_emulated_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """`gemm.emulated_gemm` of two per-tensor FP8 parts on plain tensors: dequantize to fp32, multiply."""
    return ((a.float() * a_scale_inv) @ (b.float() * b_scale_inv).t()).to(out_dtype)


def _fp8_tensor_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    fast = FAST_ACCUM_FPROP and not a.columnwise and not b.columnwise
    return fp8_tensor_mm(a.data, a.scales, b.data, b.scales, out_dtype, fast)


# ---- FP8 with one scale per row (ScaleLayout.ROW x ROW: the rowwise format, any part declaring that layout) ----

def _fp8_row_supports(a, b) -> bool:
    """`torch._scaled_mm` with per-row scales (CUTLASS, sm_90): E4M3 x E4M3, fp32 scales `[M, 1]` x `[1, N]`."""
    return _fp8_supports(a, b, (9, 0), lambda da, db: da == db == torch.float8_e4m3fn, "FP8 rowwise")


def fp8_row_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """`a @ b^T` of FP8 operands `a [m, k]`, `b [n, k]` with one scale per row (`[m, 1]`, `[n, 1]`; dequantize =
    data * scale_inv) by `torch._scaled_mm`'s rowwise kernel (bf16 result: the only one it writes)."""
    return torch._scaled_mm(a, b.t(), scale_a=a_scale_inv.float().reshape(-1, 1).contiguous(),
                            scale_b=b_scale_inv.float().reshape(1, -1).contiguous(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def _fp8_row_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype != torch.bfloat16:  # (rounding through bf16 would lose what an fp32 / fp16 result keeps)
        return _emulated_fp32(a, b, out_dtype)
    fast = FAST_ACCUM_FPROP and not a.columnwise and not b.columnwise
    return fp8_row_mm(a.data, a.scales, b.data, b.scales, out_dtype, fast)


# ---- FP8 block (1x128 x 128x128, 1x128 x 1x128) ------------------------------------------------------------

def _block_supports(a, b) -> bool:
    if not _on_cuda(a, b) or _cap(a.data) != (9, 0):
        return False
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    if a.block_shape != (1, 128) or a.data.dtype != torch.float8_e4m3fn or b.data.dtype != torch.float8_e4m3fn:
        return False
    key = ("block", a.rows, a.cols, b.rows, b.block_shape)
    if key in _failed:
        return False
    if a.cols % 128 or a.rows % 16 or b.rows % 16:
        _warn_once(key, f"hybridq: FP8 block GEMM {_shapes(a, b)}: needs K % 128 == 0 and M, N % 16 == 0; "
                   f"using the emulated GEMM")
        return False
    return a.data.is_contiguous() and b.data.is_contiguous()


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """[rows, kb] scales with stride (1, rows): the outer-dim-major layout cuBLAS wants for 1x128 scales."""
    return s.t().contiguous().t()


def block_scale_operands(a_scales: torch.Tensor, b_scales: torch.Tensor, b_tiles: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale operands `F.scaled_mm` takes for `a @ b^T` of FP8 block parts from their stored scales: a's 1x128
    scales `[M, K/128]` outer-dim-major; b's 128x128 tile scales `[ceil(N/128), K/128]` with the K blocks zero-padded
    to a multiple of 4 and transposed (`[round_up(K/128, 4), ceil(N/128)]`, strides (1, round_up(K/128, 4))), or
    b's 1x128 scales `[N, K/128]` outer-dim-major. What `hybridq::fp8_block_mm` writes in one kernel (csrc/
    block_gemm.cu, [Note: the dense block GEMM op]) and passes cuBLASLt by pointer."""
    sa = _outer_major(a_scales)
    if not b_tiles:
        return sa, _outer_major(b_scales)
    pad = -b_scales.shape[1] % 4
    sb = torch.nn.functional.pad(b_scales, (0, pad)) if pad else b_scales
    return sa, sb.t()


# [Note: the dense block GEMM op] (csrc/block_gemm.cu): the block GEMM of a CUDA part pair runs as one extension op
# (scales relaid in one kernel, the GEMM through cuBLASLt with a cached plan: bitwise F.scaled_mm, less host time);
# HYBRIDQ_BLOCK_GEMM_OP=0 or set_block_gemm_op(False) runs F.scaled_mm from Python as before
BLOCK_GEMM_OP = Switch("HYBRIDQ_BLOCK_GEMM_OP")


def set_block_gemm_op(on: bool) -> bool:
    """Turns the dense FP8 block GEMM op on or off (benchmarks compare the two paths in one process); returns the
    previous setting."""
    return BLOCK_GEMM_OP.set(on)


def block_op_takes_scales(a_scales: torch.Tensor, b_scales: torch.Tensor, m: int, k: int, n: int,
                          b_tiles: bool) -> bool:
    """Whether `hybridq::fp8_block_mm` takes these stored scales of `[m, k] x [n, k]^T` parts: contiguous fp32 of
    the shapes the quantize kernels write (a `[m, k/128]`; b `[ceil(n/128), k/128]` tiles or `[n, k/128]`). Any
    other (a strided view of the reference quantizer's) runs F.scaled_mm on `block_scale_operands`, as before."""
    kb = k // 128
    want_b = (-(-n // 128) if b_tiles else n, kb)
    return all(s.dtype == torch.float32 and s.dim() == 2 and s.is_contiguous() for s in (a_scales, b_scales)) \
        and tuple(a_scales.shape) == (m, kb) and tuple(b_scales.shape) == want_b


def _block_op_takes(a, b, b_tiles: bool) -> bool:
    return BLOCK_GEMM_OP.on and _ext.available_for(a.device) and \
        block_op_takes_scales(a.scales, b.scales, a.rows, a.cols, b.rows, b_tiles)


def _block_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    F = torch.nn.functional
    tiles = b.block_shape == (128, 128)
    try:
        if _block_op_takes(a, b, tiles):
            return torch.ops.hybridq.fp8_block_mm(a.data, a.scales, b.data, b.scales, tiles, out_dtype)
        sa, sb = block_scale_operands(a.scales, b.scales, tiles)
        rb = F.ScalingType.BlockWise128x128 if tiles else F.ScalingType.BlockWise1x128
        od = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
        y = F.scaled_mm(a.data, b.data.t(), sa, F.ScalingType.BlockWise1x128, sb, rb, output_dtype=od)
    except torch.OutOfMemoryError:
        raise  # (memory, not the kernel: the emulated GEMM needs more, and the shape must not lose its kernel)
    except RuntimeError as e:
        key = ("block", a.rows, a.cols, b.rows, b.block_shape)
        _failed.add(key)
        _warn_once(key, f"hybridq: FP8 block GEMM {_shapes(a, b)} failed in torch ({e}); using the emulated GEMM")
        return _emulated_fp32(a, b, out_dtype)
    return y if od == out_dtype else y.to(out_dtype)


def _emulated_fp32(a, b, out_dtype):
    return (a.dequantize_2d() @ b.dequantize_2d().t()).to(out_dtype)


# ---- 1x32 E8M0 (MXFP8) and 1x16 E4M3 (NVFP4) pairs on sm_100+ (cuBLAS block-scaled GEMMs) ----------------------
# Behind a compute-capability check: never tried below sm_100 (Hopper has no such GEMM). This path could not be
# run on sm_100 hardware here, so its first use on each device checks it against the emulated GEMM on a small
# problem and, if the two disagree (or torch refuses the call), turns it off for that device with one warning.

SELF_CHECK_TOL = 1e-3  # max |native - emulated| / max |emulated|: both are exact products summed in fp32
_blockscaled_ok: dict = {}  # (part type, device index) -> bool, set by the first use's self-check


def _blockscaled_operand(p):
    """(matrix, scales, scale recipes, swizzles) of one operand for torch.nn.functional.scaled_mm: the elements as
    their declared dtype (fp8; E2M1 pairs), the 1 x b block scales as their declared dtype (E8M0 1x32, E4M3 1x16) in
    the 128x4-tile layout of `swizzle_mx_scales`, then the global decode scale where the part has one (NVFP4:
    amax / (6 * 448))."""
    F = torch.nn.functional
    scales = [swizzle_mx_scales(p.scales).view(p.scale_dtype)]
    recipes = [getattr(F.ScalingType, f"BlockWise1x{p.block_shape[1]}")]
    swizzles = [F.SwizzleType.SWIZZLE_32_4_4]
    decode = p.global_decode_scale
    if decode is not None:
        scales.append(decode.float().reshape(()))
        recipes.append(F.ScalingType.TensorWise)
        swizzles.append(F.SwizzleType.NO_SWIZZLE)
    return p.data.view(p.element_dtype), scales, recipes, swizzles


def _blockscaled_mm(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    ma, sa, ra, wa = _blockscaled_operand(a)
    mb, sb, rb, wb = _blockscaled_operand(b)
    one = (lambda v: v[0] if len(v) == 1 else v)
    od = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
    y = torch.nn.functional.scaled_mm(ma, mb.t(), one(sa), one(ra), one(sb), one(rb), swizzle_a=one(wa),
                                      swizzle_b=one(wb), output_dtype=od)
    return y if od == out_dtype else y.to(out_dtype)


def _blockscaled_self_check(part_type: type, device: torch.device) -> bool:
    if part_type.quantizer_type is None:
        return False  # (nothing to make check operands with: the emulated GEMM runs)
    q = part_type.quantizer_type()
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (q.quantize_parts(torch.randn(m, 512, generator=g, device=device).to(torch.bfloat16), True, False)[0]
            for m in (256, 128))
    what = f"hybridq: native {q.describe()} GEMM on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}"
    try:
        got = _blockscaled_mm(a, b, torch.float32)
    except (RuntimeError, TypeError, ValueError) as e:
        _warn_once(("blockscaled", part_type, device.index), f"{what} failed in torch ({e}); using the emulated GEMM")
        return False
    want = _emulated_fp32(a, b, torch.float32)
    err = float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))
    if not err <= SELF_CHECK_TOL:
        _warn_once(("blockscaled", part_type, device.index), f"{what} disagrees with the emulated GEMM on its self-check "
                   f"(max relative error {err:.2e} > {SELF_CHECK_TOL:g}); using the emulated GEMM")
        return False
    log.info("%s passed its self-check (max relative error %.2e)", what, err)
    return True


def _blockscaled_supports(a, b) -> bool:
    F = torch.nn.functional
    if type(a) is not type(b) or not _on_cuda(a, b) or _cap(a.data) < (10, 0):
        return False  # (cuBLAS has no MXFP8 x NVFP4 product; the self-check is per part type)
    if not (hasattr(F, "scaled_mm") and hasattr(F, "SwizzleType") and hasattr(F.ScalingType, "BlockWise1x16")):
        return False
    if _blockscaled_ok.get((type(a), a.device.index)) is False:
        return False
    if a.transform != b.transform or a.element_dtype == torch.uint8:
        return False  # one operand Hadamard-rotated, the other not (the emulation undoes it); packed codes unnamed
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return False
    if a.cols % 32 or a.rows % 16 or b.rows % 16:
        _warn_once(("blockscaled", a.rows, a.cols, b.rows), f"hybridq: {a.format_name} GEMM {_shapes(a, b)}: the "
                   f"block-scaled tensor cores need K % 32 == 0 and M, N % 16 == 0; using the emulated GEMM")
        return False
    return all(t.is_contiguous() for t in (a.data, b.data, a.scales, b.scales))


def _blockscaled_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    key = (type(a), a.device.index)
    if key not in _blockscaled_ok:
        _blockscaled_ok[key] = _blockscaled_self_check(type(a), a.device)
    if not _blockscaled_ok[key]:
        return _bf16_run(a, b, out_dtype) if _bf16_supports(a, b) else _emulated_fp32(a, b, out_dtype)
    return _blockscaled_mm(a, b, out_dtype)


# ---- 1x32 E8M0 x 1x32 E8M0 (MXFP8) on sm_90: Triton kernel on the FP8 tensor cores -----------------------------

# opt-in until it is faster than the bf16 emulation (186 vs 773 TFLOP/s for torch.mm bf16 at 8192^3 on an H100)
TRITON_MXFP8 = Switch("HYBRIDQ_TRITON_MXFP8", default=False)


def _triton_mxfp8_module():
    """hybridq.kernels.triton_mxfp8 when Triton imports, else None (imported on first use: Triton is optional)."""
    from . import triton_mxfp8
    return triton_mxfp8 if triton_mxfp8.available() else None


def _triton_mxfp8_supports(a, b) -> bool:
    if not (TRITON_MXFP8.on and _on_cuda(a, b)) or _cap(a.data) != (9, 0):
        return False
    if ("triton-mxfp8", a.device.index) in _failed:
        return False
    tm = _triton_mxfp8_module()
    if tm is None:
        return False
    return tm.check_operands(a.data, a.scales, b.data, b.scales, contiguous=False) is None


def _triton_mxfp8_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    """The CUDA quantize kernels store every part row-major; a strided view (the reference quantizer's
    columnwise parts) is copied first, one byte per element (still less than the emulation's bf16 copy)."""
    return _triton_or_emulated("triton-mxfp8", "MXFP8", a, b, out_dtype, lambda: _triton_mxfp8_module().mxfp8_mm(
        a.data.contiguous(), a.scales, b.data.contiguous(), b.scales, out_dtype))


def _triton_or_emulated(name: str, what: str, a, b, out_dtype: torch.dtype, run) -> torch.Tensor:
    """`run()`, a Triton GEMM; a compile or launch failure turns that kernel off on the device (warned once) and
    this call takes the emulated GEMM."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 (a Triton compile or launch failure: fall back, once per device)
        key = (name, a.device.index)
        _failed.add(key)
        _warn_once(key, f"hybridq: Triton {what} GEMM {_shapes(a, b)} failed ({type(e).__name__}: {e}); "
                   f"using the emulated GEMM")
    return _bf16_run(a, b, out_dtype) if _bf16_supports(a, b) else _emulated_fp32(a, b, out_dtype)


# ---- 1x32 E8M0 / 1x16 E4M3 (any pairing) on sm_90: Triton kernel that dequantizes K tiles to bf16 in registers --

# opt-in until measured faster than the bf16 emulation (BENCHMARKS.md "MXFP8 / NVFP4 GEMMs on sm_90: dequantize in
# registers")
TRITON_DEQUANT_GEMM = Switch("HYBRIDQ_TRITON_DEQUANT_GEMM", default=False)


def _triton_dequant_module():
    """hybridq.kernels.triton_dequant_gemm when Triton imports, else None (imported on first use)."""
    from . import triton_dequant_gemm
    return triton_dequant_gemm if triton_dequant_gemm.available() else None


def _dequant_operand(tdg, p, contiguous: bool):
    """The kernel's view of a 1x32 E8M0 (MXFP8) / 1x16 E4M3 (NVFP4) part (`tdg.Operand`; the latter's global amax,
    from which the kernel takes amax / 2688 as the part's `global_decode_scale` does); `contiguous`: a strided fp8
    view (the reference quantizer's columnwise parts) is copied row-major, one byte per element."""
    if p.gemm_kind == E8M0_1X32:
        return tdg.mxfp8_operand(p.data.contiguous() if contiguous else p.data, p.scales)
    return tdg.nvfp4_operand(p.data.contiguous() if contiguous else p.data, p.scales, p.amax)


def _triton_dequant_supports(a, b) -> bool:
    if not (TRITON_DEQUANT_GEMM.on and _on_cuda(a, b)) or _cap(a.data) != (9, 0):
        return False
    if ("triton-dequant", a.device.index) in _failed or not _transforms_compatible(a, b):
        return False
    tdg = _triton_dequant_module()
    if tdg is None:
        return False
    return tdg.check_operands(_dequant_operand(tdg, a, False), _dequant_operand(tdg, b, False),
                              contiguous=False) is None


def _triton_dequant_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    def run():
        tdg = _triton_dequant_module()
        return tdg.dequant_mm(_dequant_operand(tdg, a, True), _dequant_operand(tdg, b, True), out_dtype)

    return _triton_or_emulated("triton-dequant", f"{a.format_name} x {b.format_name}", a, b, out_dtype, run)


# ---- emulation in bf16 where the operands are exactly bf16 ------------------------------------------------

def exact_bf16_operand(p, keep_transform: bool):
    """(bf16 matrix, fp32 post-scale or None) with matrix * post_scale == p.dequantize_2d(), or None.

    Exact: MXFP8 values are fp8 values times a power of two (bf16 holds them; only magnitudes below 2^-126,
    i.e. blocks whose amax is under ~2^-117, land in bf16 subnormals); NVFP4 codes times their E4M3 block
    scale have at most 6 significant bits, and the global factor amax/2688 is returned separately; identity
    parts holding bf16. Anything else (FP8 per-tensor / block scales, an inverse Hadamard transform) is not
    exactly bf16 and returns None. Which one a part is: its declared kind (1x32 E8M0, 1x16 E4M3, no scale).
    """
    ops = torch.ops.hybridq
    kind = p.gemm_kind
    if kind == E8M0_1X32:
        if p.scales.dtype != torch.uint8 or tuple(p.scales.shape) != (p.rows, p.cols // 32):
            return None
        return ops.mxfp8_dequantize(p.data, p.scales, torch.bfloat16), None
    if kind == E4M3_1X16:
        if p.transform is not None and not keep_transform:
            return None
        return ops.nvfp4_dequantize(p.data, p.scales, p.amax, False, False, torch.bfloat16), p.global_decode_scale
    if kind == NO_SCALE and p.data.dtype == torch.bfloat16 and p.data.dim() == 2:
        return (p.data.t() if p.columnwise else p.data), None
    return None


def _bf16_supports(a, b) -> bool:
    if not _on_cuda(a, b):
        return False
    if a.gemm_kind == NO_SCALE and b.gemm_kind == NO_SCALE:
        return a.data.dtype == torch.bfloat16 and b.data.dtype == torch.bfloat16
    if not _ext.available_for(a.device):
        return False
    return _transforms_compatible(a, b)


def _transforms_compatible(a, b) -> bool:
    """A part in a transformed domain (NVFP4's Hadamard rotation) is multiplied as stored only against a part with the
    same transform, since (A R)(B R)^T = A B^T; against any other part the transform must be undone (fp32
    emulation)."""
    same = a.transform is not None and a.transform == b.transform
    return same or (a.transform is None and b.transform is None)


def _bf16_run(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    same = a.transform is not None and a.transform == b.transform
    ea, eb = exact_bf16_operand(a, same), exact_bf16_operand(b, same)
    if ea is None or eb is None:
        return _emulated_fp32(a, b, out_dtype)
    (ma, sa), (mb, sb) = ea, eb
    if sa is None and sb is None:
        return torch.mm(ma, mb.t()).to(out_dtype)
    y = _mm_fp32_out(ma, mb.t())
    for s in (sa, sb):
        if s is not None:
            y = y * s
    return y.to(out_dtype)


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 with fp32 accumulation and an fp32 result (no rounding to bf16 before the post-scales)."""
    if _mm_out_dtype["ok"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            _mm_out_dtype["ok"] = False
    return torch.mm(a.float(), b.float())


_mm_out_dtype = {"ok": True}


# ---- per-tensor FP8 grouped GEMM (grouped linear) ----------------------------------------------------------

_GROUP_INDEX: dict = {}  # (sizes, device) -> (offsets, counts) on the device; a step's three GEMMs share them


def _group_index(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (tuple(sizes), device)
    hit = _GROUP_INDEX.get(key)
    if hit is None:
        if len(_GROUP_INDEX) >= 8:
            _GROUP_INDEX.clear()
        counts = torch.tensor(sizes, dtype=torch.int64)
        hit = _GROUP_INDEX[key] = (counts.cumsum(0).to(torch.int32).to(device, non_blocking=True),
                                   counts.to(device, non_blocking=True))
    return hit


def _grouped_fp8_run(a: torch.Tensor, a_scale_inv: torch.Tensor, sizes: list[int], b: torch.Tensor,
                     b_scale_inv: torch.Tensor, out_dtype: torch.dtype, columnwise: tuple[bool, bool]):
    """`torch._scaled_grouped_mm` (sm_90: E4M3 x E4M3, bf16 output, rowwise fp32 scales) with each group's
    per-tensor scale expanded over its rows / columns; None where it cannot run (see hybridq.gemm.grouped_gemm_fp8).
    """
    e4m3 = torch.float8_e4m3fn
    if not (_NATIVE.on and a.is_cuda and b.device == a.device and hasattr(torch, "_scaled_grouped_mm")
            and _cap(a) == (9, 0) and out_dtype == torch.bfloat16 and a.dtype == e4m3 and b.dtype == e4m3
            and a.is_contiguous() and b.is_contiguous() and not any(s % 16 for s in sizes)):
        return None
    offs, counts = _group_index(sizes, a.device)
    e = len(sizes)
    if b.dim() == 3:  # a [rows, K] x b [E, N, K]
        n, k = b.shape[1], b.shape[2]
        if n % 16 or k % 16:
            return None
        sa = torch.repeat_interleave(a_scale_inv, counts, output_size=a.shape[0])
        sb = b_scale_inv[:, None].expand(e, n).contiguous()
        fast = FAST_ACCUM_FPROP and not any(columnwise)
        return torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
    n, k = a.shape[1], b.shape[1]  # a [rows, N], b [rows, K]: contracted over each group's rows
    if n % 16 or k % 16:
        return None
    a_t, b_t = transposed_copy(a), transposed_copy(b)  # the columnwise forms, [N, rows] and [K, rows]
    sa = a_scale_inv[:, None].expand(e, n).reshape(-1).contiguous()
    sb = b_scale_inv[:, None].expand(e, k).reshape(-1).contiguous()
    out = torch._scaled_grouped_mm(a_t, b_t.t(), sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False)
    empty = [g for g, s in enumerate(sizes) if s == 0]
    if empty:  # a group with nothing to contract has a zero product
        out[empty] = 0
    return out


def register_all() -> None:
    register_layout_gemm(TENSOR, TENSOR, "cuda-scaled-mm-tensorwise", _fp8_tensor_run, _fp8_tensor_supports)
    for kb in (TILE_128X128, BLOCK_1X128):
        register_layout_gemm(BLOCK_1X128, kb, "cuda-scaled-mm-blockwise", _block_run, _block_supports)
    register_layout_gemm(ScaleLayout.ROW, ScaleLayout.ROW, "cuda-scaled-mm-rowwise", _fp8_row_run, _fp8_row_supports)
    for k in MICROSCALED:  # before the emulation of the same pairs: sm_100+ only
        register_layout_gemm(k, k, "cuda-scaled-mm-blockscaled", _blockscaled_run, _blockscaled_supports)
    register_layout_gemm(E8M0_1X32, E8M0_1X32, "triton-mxfp8-sm90", _triton_mxfp8_run, _triton_mxfp8_supports)
    for ka in MICROSCALED:
        for kb in MICROSCALED:
            register_layout_gemm(ka, kb, "triton-dequant-sm90", _triton_dequant_run, _triton_dequant_supports)
            register_layout_gemm(ka, kb, "cuda-emulated-bf16", _bf16_run, _bf16_supports)
    register_layout_gemm(NO_SCALE, NO_SCALE, "cuda-bf16", _bf16_run, _bf16_supports)
    register_grouped_gemm(TENSOR, "cuda", _grouped_fp8_run)  # (each group one per-tensor FP8 operand)
