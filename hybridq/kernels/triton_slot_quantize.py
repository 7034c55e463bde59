"""The grouped quantize of GroupedLinear's packed block path in Triton: the routed token rows (tokens sorted by expert)
quantized straight into the zero-padded expert slots the grouped GEMMs read, one launch per tensor for all experts,
rowwise and columnwise forms from the same load -- instead of a packing copy (`TokenLayout.pack`: a zeroed `[S, K]`
buffer and an `index_copy_`) followed by the format's quantize kernel on it.

`slot_quantize(x, src_rows, ...)`: slot row r of the result quantizes token row `src_rows[r]` of `x`, or a zero row
where `src_rows[r] < 0` (the padding), exactly as the CUDA tile kernel quantizes the packed buffer (csrc/tile/
policy_fp8_block.cuh, policy_mxfp8.cuh):

  - FP8 blocks (`MODE_FP8_BLOCK`): 1x128 rowwise blocks (a partial last block along K), 128x1 columnwise blocks along
    the slot rows; scale = fp8_max / amax (eps floor, inf -> FLT_MAX, optional power of two, 1 for an amax of 0 / inf /
    NaN), stored as its correctly rounded reciprocal (fp32 scale_inv);
  - MXFP8 (`MODE_MXFP8`): 1x32 / 32x1 blocks, E8M0 = e8m0_round_up(amax * fp32(1 / fp8_max)), elements times
    2^(127 - E8M0) (NaN for a NaN block: every byte of it is the positive NaN byte, as the CUDA kernel writes it);

elements: x * mult rounded once to fp32, clamped to +-fp8_max and rounded to nearest even (the hardware's satfinite
conversion); a NaN keeps its sign (from the input's bits: a NaN through a multiply may lose it), +-inf becomes E5M2's
+-inf or E4M3's NaN with that sign. Divisions are `div.rn.f32` (inline PTX: libdevice's flushes subnormals under
Triton's FTZ reflection, and 1 / 2^127 is one); under TRITON_INTERPRET the same IEEE operations of numpy run.

Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

MODE_FP8_BLOCK, MODE_MXFP8 = 0, 1
# (slot rows per chunk, columns per program, num_warps). A program covers one columnwise block of slot rows (128 / 32)
# and 128 columns (whole rowwise blocks). Compiled for sm_90 (Triton 3.6, ptxas 13.0): the whole 128x128 FP8 tile at
# once used 255 registers and spilled with 8 warps (measured on an H200 at ~0.93 TB/s of token reads + fp8 writes,
# BENCHMARKS.md); in chunks of 32 rows with 8 warps it uses 128 (MXFP8: 64) and spills nothing (not timed yet).
CONFIGS = {MODE_FP8_BLOCK: (32, 128, 8), MODE_MXFP8: (32, 128, 8)}
_BLOCKS = {MODE_FP8_BLOCK: 128, MODE_MXFP8: 32}  # elements per scale in either direction
_FP8 = {torch.float8_e4m3fn: False, torch.float8_e5m2: True}  # -> E5M2
_IN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def available() -> bool:
    """True when Triton imports (the device checks are the caller's)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:
    @triton.jit
    def _div_rn(a, b, USE_ASM: tl.constexpr):
        """a / b correctly rounded, subnormals kept (a: a scalar or b's shape)."""
        a = a + tl.zeros_like(b)
        if USE_ASM:
            return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return a / b

    @triton.jit
    def _multiplier(amax_bits, fp8_max, rcp_max, eps, MODE: tl.constexpr, POW2: tl.constexpr,
                    USE_ASM: tl.constexpr):
        """(what each element of a block is multiplied by, the block's stored scale) from its amax bits."""
        amax = amax_bits.to(tl.float32, bitcast=True)
        if MODE == 0:  # FP8 blocks: scale_from_amax, stored as 1 / scale
            amax = tl.where((eps > 0) & (amax < eps), eps, amax)
            scale = _div_rn(fp8_max, amax, USE_ASM)
            scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
            if POW2:
                scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
            degenerate = (amax == 0) | (amax == float("inf")) | (amax != amax)
            scale = tl.where(degenerate, 1.0, scale)
            return scale, _div_rn(1.0, scale, USE_ASM)
        else:  # MXFP8: e8m0_round_up(amax * rcp_max); multiplier 2^(127 - e), NaN for e == 255
            v = amax * rcp_max
            bits = v.to(tl.int32, bitcast=True)
            exp = (bits >> 23) & 0xFF
            man = bits & 0x7FFFFF
            bump = (man != 0) & (exp != 254) & ~((exp == 0) & (man <= 0x400000))
            e = exp + bump.to(tl.int32)
            e = tl.where(v == float("inf"), 254, e)
            e = tl.where(v != v, 255, e)
            e = tl.where(v == 0, 0, e)
            mbits = tl.where(e == 254, 0x00400000, (254 - e) << 23)
            mult = mbits.to(tl.float32, bitcast=True)
            mult = tl.where(e == 255, float("nan"), mult)
            return mult, e.to(tl.uint8)

    @triton.jit
    def _rne_shift(a, s):
        """a >> s rounded to nearest even (a >= 0, 1 <= s <= 31)."""
        return (a + ((1 << (s - 1)) - 1) + ((a >> s) & 1)) >> s

    @triton.jit
    def _fp8_rne_bits(v, E5M2: tl.constexpr):
        """The fp8 byte of finite v (|v| <= the format's max) rounded to nearest even, in integer arithmetic: the
        interpreter's float conversion rounds otherwise (no carry into the exponent)."""
        if E5M2:
            MB: tl.constexpr = 2
            BIAS: tl.constexpr = 15
        else:
            MB: tl.constexpr = 3
            BIAS: tl.constexpr = 7
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        e = (mag >> 23) - 127  # (unbiased; fp32 subnormals: -127, which round to 0 below)
        normal = _rne_shift(mag, 23 - MB) - ((127 - BIAS) << MB)
        shift = tl.minimum((23 - MB) + (1 - BIAS) - e, 31)  # below the smallest normal: a subnormal code
        sub = _rne_shift((mag & 0x7FFFFF) | 0x800000, tl.maximum(shift, 1))
        code = tl.where(e >= 1 - BIAS, normal, sub)
        return (code | tl.where(bits < 0, 0x80, 0)).to(tl.uint8)

    @triton.jit
    def _encode(xf, neg, mult, fp8_max, E5M2: tl.constexpr, HW_CVT: tl.constexpr):
        """fp8 bytes (uint8) of xf * mult (module docstring: satfinite, RNE, the non-finite rules)."""
        v = xf * mult
        vb = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        vc = tl.minimum(tl.maximum(v, -fp8_max), fp8_max)
        if HW_CVT:  # (cvt.rn.satfinite, the CUDA kernel's conversion)
            if E5M2:
                q = vc.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                q = vc.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = _fp8_rne_bits(vc, E5M2)
        nan_mult = mult != mult  # (MXFP8's NaN block: the multiplier's positive NaN wins)
        sign = tl.where(neg & ~nan_mult, 0x80, 0)
        if E5M2:
            low = tl.where(vb > 0x7F800000, 0x7F, 0x7C)
        else:
            low = 0x7F
        special = (sign | low).to(tl.uint8)
        return tl.where(vb >= 0x7F800000, special, q)

    @triton.jit
    def _load_rows(x_ptr, src_ptr, rows, cols, S, K, stride_x, IN_KIND: tl.constexpr):
        """(values as fp32, sign bits) of slot rows `rows` x `cols`: token rows through `src_ptr`, zeros for padding
        rows and outside the tensor."""
        src = tl.load(src_ptr + rows, mask=rows < S, other=-1)
        x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                    mask=(src >= 0)[:, None] & (cols < K)[None, :], other=0.0)
        if IN_KIND == 1:  # bf16: its bits are fp32's top half (exact, NaN sign kept, under the interpreter too)
            xf = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            neg = xf.to(tl.int32, bitcast=True) < 0
        elif IN_KIND == 2:  # fp16
            neg = x.to(tl.int16, bitcast=True) < 0
            xf = x.to(tl.float32)
        else:
            neg = x.to(tl.int32, bitcast=True) < 0
            xf = x
        return xf, neg

    @triton.jit
    def _abs_bits(xf):
        return xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # (max of |x| bits: a NaN block's is above inf's)

    @triton.jit
    def _rowwise(xf, neg, rows, cols, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, CH: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLK: tl.constexpr, MODE: tl.constexpr, POW2: tl.constexpr,
                 E5M2: tl.constexpr, USE_ASM: tl.constexpr):
        """The rowwise form of CH slot rows: blocks of BLK columns."""
        NB: tl.constexpr = BLOCK_C // BLK
        am = tl.max(tl.reshape(_abs_bits(xf), (CH, NB, BLK)), axis=2)
        mult, stored = _multiplier(am, fp8_max, rcp_max, eps, MODE, POW2, USE_ASM)
        m_el = tl.reshape(tl.broadcast_to(mult[:, :, None], (CH, NB, BLK)), (CH, BLOCK_C))
        q = _encode(xf, neg, m_el, fp8_max, E5M2, USE_ASM)
        row_in = rows < S
        tl.store(rq_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=row_in[:, None] & (cols < K)[None, :])
        sc = tl.program_id(1) * NB + tl.arange(0, NB)
        tl.store(rs_ptr + rows.to(tl.int64)[:, None] * rs_cols + sc[None, :], stored,
                 mask=row_in[:, None] & (sc < rs_cols)[None, :])

    @triton.jit
    def _columnwise(xf, neg, mult, rows, cols, cq_ptr, S, K, fp8_max, E5M2: tl.constexpr, USE_ASM: tl.constexpr):
        """CH slot rows of the columnwise form (stored transposed, `[K, S]`) with their column block's multipliers."""
        q = tl.trans(_encode(xf, neg, mult[None, :], fp8_max, E5M2, USE_ASM))
        tl.store(cq_ptr + cols.to(tl.int64)[:, None] * S + rows[None, :], q,
                 mask=(cols < K)[:, None] & (rows < S)[None, :])

    @triton.jit
    def _slot_quantize_kernel(x_ptr, src_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, S, K, stride_x, rs_cols, cs_cols,
                              fp8_max, rcp_max, eps,
                              CH: tl.constexpr, BLOCK_C: tl.constexpr, BLK: tl.constexpr, MODE: tl.constexpr,
                              POW2: tl.constexpr, E5M2: tl.constexpr, IN_KIND: tl.constexpr, ROWWISE: tl.constexpr,
                              COLUMNWISE: tl.constexpr, USE_ASM: tl.constexpr):
        """One program: one columnwise block (BLK slot rows) x BLOCK_C columns, in chunks of CH rows (few registers
        per thread). Rowwise blocks are whole in every chunk; the columnwise blocks' amaxes build up over the chunks,
        which are then read again (from L2) to encode the columnwise form -- unless one chunk is the whole block."""
        r0 = tl.program_id(0) * BLK
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        NCH: tl.constexpr = BLK // CH
        if NCH == 1:
            rows = r0 + tl.arange(0, CH)
            xf, neg = _load_rows(x_ptr, src_ptr, rows, cols, S, K, stride_x, IN_KIND)
            if ROWWISE:
                _rowwise(xf, neg, rows, cols, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, CH, BLOCK_C, BLK,
                         MODE, POW2, E5M2, USE_ASM)
            if COLUMNWISE:
                mult, stored = _multiplier(tl.max(_abs_bits(xf), axis=0), fp8_max, rcp_max, eps, MODE, POW2,
                                           USE_ASM)
                _columnwise(xf, neg, mult, rows, cols, cq_ptr, S, K, fp8_max, E5M2, USE_ASM)
                tl.store(cs_ptr + cols.to(tl.int64) * cs_cols + tl.program_id(0), stored, mask=cols < K)
        else:
            cam = tl.zeros([BLOCK_C], dtype=tl.int32)
            for i in tl.static_range(NCH):
                rows = r0 + i * CH + tl.arange(0, CH)
                xf, neg = _load_rows(x_ptr, src_ptr, rows, cols, S, K, stride_x, IN_KIND)
                if ROWWISE:
                    _rowwise(xf, neg, rows, cols, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, CH, BLOCK_C,
                             BLK, MODE, POW2, E5M2, USE_ASM)
                if COLUMNWISE:
                    cam = tl.maximum(cam, tl.max(_abs_bits(xf), axis=0))
            if COLUMNWISE:
                mult, stored = _multiplier(cam, fp8_max, rcp_max, eps, MODE, POW2, USE_ASM)
                for i in tl.static_range(NCH):
                    rows = r0 + i * CH + tl.arange(0, CH)
                    xf, neg = _load_rows(x_ptr, src_ptr, rows, cols, S, K, stride_x, IN_KIND)
                    _columnwise(xf, neg, mult, rows, cols, cq_ptr, S, K, fp8_max, E5M2, USE_ASM)
                tl.store(cs_ptr + cols.to(tl.int64) * cs_cols + tl.program_id(0), stored, mask=cols < K)


def slot_quantize(x: torch.Tensor, src_rows: torch.Tensor, mode: int, fp8: torch.dtype, rowwise: bool,
                  columnwise: bool, *, fp8_max: float, eps: float = 0.0, pow2: bool = False, config=None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(rowwise fp8 `[S, K]`, its scales, columnwise fp8 `[K, S]`, its scales) of the `S = len(src_rows)` slot rows
    (module docstring), None for a direction not asked for. `x` `[T, K]` (unit stride along K; bf16, fp16 or fp32),
    `src_rows` int32 `[S]` on x's device. Scales: FP8 blocks fp32 `[S, ceil(K/128)]`, `[K, ceil(S/128)]`; MXFP8 E8M0
    bytes `[S, K/32]`, `[K, S/32]` (K and S multiples of 32)."""
    s, k = src_rows.shape[0], x.shape[1]
    blk = _BLOCKS[mode]
    dev = x.device
    if mode == MODE_FP8_BLOCK:
        rs_cols, cs_cols, s_dtype = -(-k // blk), -(-s // blk), torch.float32
    else:
        rs_cols, cs_cols, s_dtype = k // blk, s // blk, torch.uint8
    rq = torch.empty(s, k, device=dev, dtype=fp8) if rowwise else None
    rs = torch.empty(s, rs_cols, device=dev, dtype=s_dtype) if rowwise else None
    cq = torch.empty(k, s, device=dev, dtype=fp8) if columnwise else None
    cs = torch.empty(k, cs_cols, device=dev, dtype=s_dtype) if columnwise else None
    if s == 0 or k == 0 or not (rowwise or columnwise):
        return rq, rs, cq, cs
    ch, bc, warps = config if config is not None else CONFIGS[mode]
    dummy = torch.empty(1, device=dev, dtype=torch.uint8)
    rcp_max = float(torch.tensor(1.0) / torch.tensor(fp8_max, dtype=torch.float32))  # fp32(1 / fp8_max)
    grid = (-(-s // blk), -(-k // bc))
    _slot_quantize_kernel[grid](
        x, src_rows, rq.view(torch.uint8) if rowwise else dummy, rs if rowwise else dummy,
        cq.view(torch.uint8) if columnwise else dummy, cs if columnwise else dummy, s, k, x.stride(0), rs_cols,
        cs_cols, float(fp8_max), rcp_max, float(eps), CH=ch, BLOCK_C=bc, BLK=blk, MODE=mode, POW2=bool(pow2),
        E5M2=_FP8[fp8], IN_KIND=_IN_KINDS[x.dtype], ROWWISE=rowwise, COLUMNWISE=columnwise,
        USE_ASM=not _interpreting(), num_warps=warps)
    return rq, rs, cq, cs
