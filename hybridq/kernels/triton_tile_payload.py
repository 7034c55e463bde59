"""FSDP2's stacked payload of FP8 128x128-tile experts in one Triton launch (distributed/grouped_blocks_payload.py,
[Note: stacked block payload]): the experts a rank holds -- its `[held*N, K]` shard -- cast to the gather dtype and
quantized in 128x128 tiles straight into their payload slots, each expert's rowwise bytes at the payload's data offset
of its slot and its tile scales (the replicated scale_inv the slot carries) at the replica's offset. Instead of the
cast (a copy of the shard), the format's tile quantize into fresh tensors and one copy per tensor kind into the slots.

`tile_payload(x, payload, n, slot, data_offset, scale_offset, ...)`: expert g = rows [g*n, (g+1)*n) of `x`, written
into `payload[g]` (`[held, slot]` bytes). Numerics (bitwise the CUDA tile kernel on `x.to(gather dtype)`,
csrc/tile/policy_fp8_block.cuh, as triton_slot_quantize's FP8 blocks): each element first rounded to the gather dtype
(on CUDA an fp32 shard gathered as bf16 is cast in the kernel by `cvt.rn.bf16.f32`, the instruction torch's CUDA cast
runs -- a NaN's sign, the one bit of it the FP8 byte keeps, included; elsewhere `Tensor.to` first), the tile's amax
of |x|, scale = fp8_max / amax (eps floor, inf -> FLT_MAX, optional power of two, 1 for an amax of 0 / inf / NaN)
stored as its correctly rounded reciprocal, elements x * scale rounded once to fp32 then saturated and rounded to
nearest even, NaN / inf by triton_slot_quantize's rules (its jit functions). `n` must be a multiple of 128 (no tile
spans two experts).

Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import os

import torch

from ..formats import Float8BlockQuantizer
from ..switches import Switch
from .triton_launch import kept_plan, launch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

ENABLED = Switch("HYBRIDQ_TILE_PAYLOAD_KERNEL")
TILE = 128
WARPS = 8
_FP8 = {torch.float8_e4m3fn: False, torch.float8_e5m2: True}  # -> E5M2
_IN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def available() -> bool:
    """True when Triton imports (the device checks are the caller's)."""
    return triton is not None


def takes(q) -> bool:
    """Whether the kernel implements quantizer `q`: FP8 128x128 tiles (`Float8BlockQuantizer(block_dim=2)`, E4M3 or
    E5M2, its power-of-two and epsilon options; a subclass may add options the kernel would ignore)."""
    return type(q) is Float8BlockQuantizer and q.block_dim == 2 and q.dtype in _FP8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:
    from .triton_slot_quantize import _abs_bits, _multiplier, _quantize, _widen

    # (the sizes and offsets are a weight's constants: specialized on their divisibility -- vector loads and stores --,
    # a handful of variants per model)
    @triton.jit
    def _tile_payload_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, n, slot, data_offset, scale_offset, scale_cols,
                             fp8_max, eps, CAST_BF16: tl.constexpr, IN_KIND: tl.constexpr, POW2: tl.constexpr,
                             E5M2: tl.constexpr, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr):
        """One 128x128 tile per program (grid: tile rows of all experts x tile columns): loaded, cast, its amax,
        scale and bytes computed, the bytes stored at the expert's data offset in its slot (`out_ptr`: the payload's
        bytes) and the scale at its place in the expert's tile-scale grid (`scale_cols` tiles per row) at the
        replica's offset (`scale_ptr`: the payload as fp32; `slot`, `scale_offset` in bytes)."""
        tr, tc = tl.program_id(0), tl.program_id(1)
        rows = tr * 128 + tl.arange(0, 128)
        cols = tc * 128 + tl.arange(0, 128)
        xp = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        if EVEN_K:
            x = tl.load(xp)
        else:
            x = tl.load(xp, mask=(cols < K)[None, :], other=0.0)
        if CAST_BF16:  # (fp32 -> bf16 by the hardware's cvt.rn.bf16.f32, the instruction of torch's CUDA cast)
            x = x.to(tl.bfloat16)
        xf = _widen(x, 1 if CAST_BF16 else IN_KIND)
        am = tl.max(tl.max(_abs_bits(xf), axis=1), axis=0)
        finite = am < 0x7F800000
        mult, stored = _multiplier(am, fp8_max, 0.0, eps, 0, POW2, USE_ASM)
        mult = tl.zeros_like(xf) + mult  # (every element's: the encoding's rules take the multiplier elementwise)
        q = _quantize(x, xf, mult, finite, fp8_max, 1 if CAST_BF16 else IN_KIND, E5M2, USE_ASM)
        g = (tr * 128) // n
        first = tr * 128 - g * n  # (the tile's first row inside expert g)
        r = first + tl.arange(0, 128)
        qp = out_ptr + g.to(tl.int64) * slot + data_offset + r.to(tl.int64)[:, None] * K + cols[None, :]
        if EVEN_K:
            tl.store(qp, q)
        else:
            tl.store(qp, q, mask=(cols < K)[None, :])
        sp = scale_ptr + (g.to(tl.int64) * slot + scale_offset) // 4 + (first // 128) * scale_cols + tc
        tl.store(sp, stored)


def tile_payload(x: torch.Tensor, payload: torch.Tensor, n: int, slot: int, data_offset: int, scale_offset: int,
                 fp8: torch.dtype, gather_dtype: torch.dtype, *, fp8_max: float, eps: float = 0.0,
                 pow2: bool = False) -> None:
    """Quantize `x` `[held*n, K]` (unit stride along K; fp32 -- cast to bf16 in the kernel where `gather_dtype` is
    bf16 --, bf16 or fp16 of the gather dtype) in 128x128 tiles into `payload` `[held, slot]` uint8: expert g's
    rowwise bytes `[n, K]` at `payload[g, data_offset:]`, its fp32 tile scale_inv `[n/128, ceil(K/128)]` at
    `payload[g, scale_offset:]` (a multiple of 4). Nothing else of the payload is written."""
    m, k = x.shape
    held = payload.shape[0]
    if (n % TILE or m != held * n or x.stride(1) != 1 or payload.dtype != torch.uint8 or not payload.is_contiguous()
            or payload.shape[1] != slot or slot % 4 or scale_offset % 4 or data_offset + n * k > slot
            or scale_offset + (n // TILE) * -(-k // TILE) * 4 > slot):
        raise ValueError(f"tile payload: x {tuple(x.shape)} (stride {tuple(x.stride())}) into a payload "
                         f"{tuple(payload.shape)} {payload.dtype} of {held} experts of {n} rows, slot {slot}, data at "
                         f"{data_offset}, scales at {scale_offset}: needs n a multiple of {TILE}, x held*n rows with "
                         f"unit stride along K, a contiguous uint8 payload of that slot, both tensors inside it and "
                         f"4-byte aligned scales")
    if m == 0 or k == 0:
        return
    if x.dtype not in _IN_KINDS or gather_dtype not in _IN_KINDS:
        raise ValueError(f"tile payload: x {x.dtype} gathered as {gather_dtype}: float32, bfloat16 or float16 only")
    # fp32 -> bf16 in the kernel on CUDA (the same conversion instruction as torch's cast there); elsewhere (Triton's
    # interpreter) and for other casts by `Tensor.to` first
    cast = x.dtype == torch.float32 and gather_dtype == torch.bfloat16 and x.is_cuda and not _interpreting()
    if x.dtype != gather_dtype and not cast:
        x = x.to(gather_dtype)
    grid, head, kw = kept_plan(_PLANS, (k, x.dtype, fp8, cast, float(fp8_max), float(eps), bool(pow2), m,
                                        _interpreting()), _make_plan, k, x.dtype, fp8, cast, float(fp8_max),
                               float(eps), bool(pow2), m)
    launch(_tile_payload_kernel, grid, x, payload, payload.view(torch.float32), k, x.stride(0), n, slot, data_offset,
           scale_offset, *head, **kw)


def _make_plan(k: int, x_dtype: torch.dtype, fp8: torch.dtype, cast: bool, fp8_max: float, eps: float, pow2: bool,
               m: int) -> tuple:
    """(grid, the arguments after `scale_offset`, the constexprs and options) of one launch, per distinct arguments
    (triton_launch's [Note: launch plans])."""
    cols = -(-k // TILE)
    kw = dict(CAST_BF16=cast, IN_KIND=_IN_KINDS[x_dtype], POW2=pow2, E5M2=_FP8[fp8], USE_ASM=not _interpreting(),
              EVEN_K=k % TILE == 0, num_warps=WARPS)
    return (m // TILE, cols), (cols, fp8_max, eps), kw


_PLANS: dict = {}
