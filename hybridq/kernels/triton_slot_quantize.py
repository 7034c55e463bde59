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
from typing import NamedTuple

import torch

from .triton_launch import kept_plan, launch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

MODE_FP8_BLOCK, MODE_MXFP8 = 0, 1


class SlotConfig(NamedTuple):
    """A launch configuration of the kernel (see _slot_quantize_kernel): tiles of one columnwise block of slot rows x
    `cols` columns (whole rowwise blocks); `warps` per program; `maxnreg` caps the registers per thread (0: none;
    ptxas otherwise takes what the launch bounds allow, which may leave fewer programs resident); `stages` 0: one
    tile per program, else persistent programs, `per_sm` per SM, with `stages` tiles' loads in flight."""
    cols: int
    warps: int
    maxnreg: int = 0
    stages: int = 0
    per_sm: int = 0


# Fixed per mode, not autotuned (the slot row count changes with the routing every step). Measured on an H200
# (.devrun/sq/bench_slot.py, 2026-11-27 22:50 UTC, bench_grouped's configs, bf16 tokens; bytes read + written):
# FP8 blocks 1.30-1.38 TB/s at 8 warps per 128 x 128 tile (the previous kernel: 0.87-0.92), MXFP8 1.56-1.67 at 4
# warps per 32 x 128 tile (0.97-1.01); a bf16 copy of the same bytes runs at 4.2.
CONFIGS = {MODE_FP8_BLOCK: SlotConfig(128, 8), MODE_MXFP8: SlotConfig(128, 4)}
_BLOCKS = {MODE_FP8_BLOCK: 128, MODE_MXFP8: 32}  # elements per scale in either direction
_FP8 = {torch.float8_e4m3fn: False, torch.float8_e5m2: True}  # -> E5M2
_IN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SMS: dict = {}  # device -> multiprocessor count


def _check_config(mode: int, c: SlotConfig) -> None:
    """A config the kernel implements, else ValueError naming the rule."""
    blk = _BLOCKS[mode]
    # (16 warps and more: compiled for an H200 by Triton 3.6 they wrote other rowwise bytes than the CUDA kernel --
    # FP8 blocks at K = 200 / 232 / 264, MXFP8 at every K --, which the interpreter does not show)
    if not (all(v > 0 and v & (v - 1) == 0 for v in (c.cols, c.warps)) and c.cols % blk == 0 and c.warps <= 8
            and 0 <= c.maxnreg <= 255 and c.stages >= 0 and (c.per_sm > 0) == (c.stages > 0)):
        raise ValueError(f"slot quantize config {c} for {blk}-element blocks: needs whole power-of-two rowwise blocks "
                         f"per tile, a power of two up to 8 warps, a register cap within 0..255, and programs per SM "
                         f"exactly where stages > 0")


def _grid(c: SlotConfig, tiles: int, dev: torch.device) -> int:
    if c.stages == 0:
        return tiles
    if dev.type != "cuda":  # (the interpreter: a few programs, each looping over several tiles)
        return min(tiles, 3)
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return min(tiles, c.per_sm * _SMS[dev])


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
    def _to_fp8(v, fp8_max, E5M2: tl.constexpr, HW_CVT: tl.constexpr):
        """fp8 bytes of finite v rounded to nearest even, saturating at +-fp8_max (the format's largest value)."""
        if HW_CVT:  # (cvt.rn.satfinite, the CUDA kernel's conversion: it saturates by itself)
            if E5M2:
                return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return _fp8_rne_bits(tl.minimum(tl.maximum(v, -fp8_max), fp8_max), E5M2)

    @triton.jit
    def _encode(xf, neg, mult, fp8_max, E5M2: tl.constexpr, HW_CVT: tl.constexpr):
        """fp8 bytes (uint8) of xf * mult (module docstring: satfinite, RNE, the non-finite rules)."""
        v = xf * mult
        vb = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        q = _to_fp8(v, fp8_max, E5M2, HW_CVT)  # (the non-finite ones replaced below)
        nan_mult = mult != mult  # (MXFP8's NaN block: the multiplier's positive NaN wins)
        sign = tl.where(neg & ~nan_mult, 0x80, 0)
        if E5M2:
            low = tl.where(vb > 0x7F800000, 0x7F, 0x7C)
        else:
            low = 0x7F
        special = (sign | low).to(tl.uint8)
        return tl.where(vb >= 0x7F800000, special, q)

    @triton.jit
    def _quantize(x, xf, mult, finite, fp8_max, IN_KIND: tl.constexpr, E5M2: tl.constexpr, HW_CVT: tl.constexpr):
        """fp8 bytes of xf * mult. `finite` (the program's values are all finite, so are the multipliers, and the
        scales keep |xf * mult| within rounding of fp8_max): the conversion alone; else `_encode`'s rules for inf,
        NaN and NaN blocks."""
        if finite:
            q = _to_fp8(xf * mult, fp8_max, E5M2, HW_CVT)
        else:
            q = _encode(xf, _negative(x, xf, IN_KIND), mult, fp8_max, E5M2, HW_CVT)
        return q

    @triton.jit
    def _load_raw(x_ptr, src_ptr, rows, cols, S, K, stride_x, EVEN: tl.constexpr):
        """The raw values of slot rows `rows` x `cols`: token rows through `src_ptr`, zeros for padding rows and
        outside the tensor (EVEN: the program is inside it)."""
        if EVEN:
            src = tl.load(src_ptr + rows)
            mask = (src >= 0)[:, None]
        else:
            src = tl.load(src_ptr + rows, mask=rows < S, other=-1)
            mask = (src >= 0)[:, None] & (cols < K)[None, :]
        return tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _widen(x, IN_KIND: tl.constexpr):
        """Raw values as fp32 (bf16: its bits are fp32's top half: exact, NaN sign kept, under the interpreter too)."""
        if IN_KIND == 1:
            return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _negative(x, xf, IN_KIND: tl.constexpr):
        """The sign bits of the raw values (a NaN's too, which a conversion or multiply may drop)."""
        if IN_KIND == 1:
            return xf.to(tl.int32, bitcast=True) < 0
        elif IN_KIND == 2:
            return x.to(tl.int16, bitcast=True) < 0
        else:
            return x.to(tl.int32, bitcast=True) < 0

    @triton.jit
    def _abs_bits(xf):
        return xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # (max of |x| bits: a NaN block's is above inf's)

    @triton.jit
    def _rowwise(x, xf, finite, rows, cols, cb, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps,
                 R: tl.constexpr, BLOCK_C: tl.constexpr, BLK: tl.constexpr, MODE: tl.constexpr, POW2: tl.constexpr,
                 E5M2: tl.constexpr, IN_KIND: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr):
        """The rowwise form of R slot rows: blocks of BLK columns."""
        NB: tl.constexpr = BLOCK_C // BLK
        if NB == 1:
            mult, stored = _multiplier(tl.max(_abs_bits(xf), axis=1), fp8_max, rcp_max, eps, MODE, POW2, USE_ASM)
            q = _quantize(x, xf, mult[:, None], finite, fp8_max, IN_KIND, E5M2, USE_ASM)
        else:
            am = tl.max(tl.reshape(_abs_bits(xf), (R, NB, BLK)), axis=2)
            mult, stored = _multiplier(am, fp8_max, rcp_max, eps, MODE, POW2, USE_ASM)
            m_el = tl.reshape(tl.broadcast_to(mult[:, :, None], (R, NB, BLK)), (R, BLOCK_C))
            q = _quantize(x, xf, m_el, finite, fp8_max, IN_KIND, E5M2, USE_ASM)
        qp = rq_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
        if EVEN:
            tl.store(qp, q)
        else:
            tl.store(qp, q, mask=(rows < S)[:, None] & (cols < K)[None, :])
        if NB == 1:
            sp = rs_ptr + rows.to(tl.int64) * rs_cols + cb
            if EVEN:
                tl.store(sp, stored)
            else:
                tl.store(sp, stored, mask=(rows < S) & (cb < rs_cols))
        else:
            sc = cb * NB + tl.arange(0, NB)
            tl.store(rs_ptr + rows.to(tl.int64)[:, None] * rs_cols + sc[None, :], stored,
                     mask=(rows < S)[:, None] & (sc < rs_cols)[None, :])

    @triton.jit
    def _pack4(q0, q1, q2, q3):
        """Four byte tensors as the little-endian bytes of int32 words."""
        return (q0.to(tl.int32) | (q1.to(tl.int32) << 8) | (q2.to(tl.int32) << 16) | (q3.to(tl.int32) << 24))

    @triton.jit
    def _cvt4(v0, v1, v2, v3, E5M2: tl.constexpr):
        """The satfinite fp8 bytes of v0..v3 as one word each (the conversion of the CUDA kernel and of Triton's own
        cast, paired along the words' rows instead of along the columns: no bytes to unpack and repack)."""
        if E5M2:
            asm: tl.constexpr = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
                                 "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
        else:
            asm: tl.constexpr = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                                 "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
        return tl.inline_asm_elementwise(asm, "=r,f,f,f,f", [v0, v1, v2, v3], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _col_words(x0, xf0, x1, xf1, x2, xf2, x3, xf3, mult, finite, fp8_max, IN_KIND: tl.constexpr,
                   E5M2: tl.constexpr, USE_ASM: tl.constexpr):
        """The columnwise fp8 bytes of four row groups (column multipliers `mult`) as words (group g: byte g)."""
        m = mult[None, :]
        if finite:
            if USE_ASM:
                w = _cvt4(xf0 * m, xf1 * m, xf2 * m, xf3 * m, E5M2)
            else:
                w = _pack4(_to_fp8(xf0 * m, fp8_max, E5M2, USE_ASM), _to_fp8(xf1 * m, fp8_max, E5M2, USE_ASM),
                           _to_fp8(xf2 * m, fp8_max, E5M2, USE_ASM), _to_fp8(xf3 * m, fp8_max, E5M2, USE_ASM))
        else:
            w = _pack4(_encode(xf0, _negative(x0, xf0, IN_KIND), m, fp8_max, E5M2, USE_ASM),
                       _encode(xf1, _negative(x1, xf1, IN_KIND), m, fp8_max, E5M2, USE_ASM),
                       _encode(xf2, _negative(x2, xf2, IN_KIND), m, fp8_max, E5M2, USE_ASM),
                       _encode(xf3, _negative(x3, xf3, IN_KIND), m, fp8_max, E5M2, USE_ASM))
        return w

    @triton.jit
    def _tile(rb, cb, x_ptr, src_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, S, K, stride_x, rs_cols, cs_cols, fp8_max,
              rcp_max, eps, BLOCK_C: tl.constexpr, BLK: tl.constexpr, MODE: tl.constexpr, POW2: tl.constexpr,
              E5M2: tl.constexpr, IN_KIND: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
              USE_ASM: tl.constexpr, EVEN: tl.constexpr):
        """Columnwise block rb of slot rows x column block cb (the kernel's docstring)."""
        R: tl.constexpr = BLK // 4
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        rows = rb * BLK + 4 * tl.arange(0, R)  # (group g: slot rows rows + g)
        x0 = _load_raw(x_ptr, src_ptr, rows, cols, S, K, stride_x, EVEN)
        x1 = _load_raw(x_ptr, src_ptr, rows + 1, cols, S, K, stride_x, EVEN)
        x2 = _load_raw(x_ptr, src_ptr, rows + 2, cols, S, K, stride_x, EVEN)
        x3 = _load_raw(x_ptr, src_ptr, rows + 3, cols, S, K, stride_x, EVEN)
        xf0 = _widen(x0, IN_KIND)
        xf1 = _widen(x1, IN_KIND)
        xf2 = _widen(x2, IN_KIND)
        xf3 = _widen(x3, IN_KIND)
        cam = tl.max(tl.maximum(tl.maximum(_abs_bits(xf0), _abs_bits(xf1)), tl.maximum(_abs_bits(xf2), _abs_bits(xf3))),
                     axis=0)  # (one reduction across the threads, not four)
        finite = tl.max(cam, axis=0) < 0x7F800000
        if ROWWISE:
            _rowwise(x0, xf0, finite, rows, cols, cb, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, R,
                     BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, USE_ASM, EVEN)
            _rowwise(x1, xf1, finite, rows + 1, cols, cb, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, R,
                     BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, USE_ASM, EVEN)
            _rowwise(x2, xf2, finite, rows + 2, cols, cb, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, R,
                     BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, USE_ASM, EVEN)
            _rowwise(x3, xf3, finite, rows + 3, cols, cb, rq_ptr, rs_ptr, S, K, rs_cols, fp8_max, rcp_max, eps, R,
                     BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, USE_ASM, EVEN)
        if COLUMNWISE:
            mult, stored = _multiplier(cam, fp8_max, rcp_max, eps, MODE, POW2, USE_ASM)
            # the four rows of a word are held by one thread: little-endian bytes, no byte shuffles to transpose
            w = _col_words(x0, xf0, x1, xf1, x2, xf2, x3, xf3, mult, finite, fp8_max, IN_KIND, E5M2, USE_ASM)
            wp = cq_ptr + cols.to(tl.int64)[None, :] * (S // 4) + (rb * R + tl.arange(0, R))[:, None]
            sp = cs_ptr + cols.to(tl.int64) * cs_cols + rb
            if EVEN:
                tl.store(wp, w)
                tl.store(sp, stored)
            else:
                tl.store(wp, w, mask=(cols < K)[None, :] & (rows < S)[:, None])
                tl.store(sp, stored, mask=cols < K)

    # (the scale row lengths and tile counts only index: specializing on their divisibility would compile new
    # variants as the routing changes the slot count)
    @triton.jit(do_not_specialize=["rs_cols", "cs_cols", "n_tiles", "n_cb", "n_programs"])
    def _slot_quantize_kernel(x_ptr, src_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, S, K, stride_x, rs_cols, cs_cols,
                              n_tiles, n_cb, n_programs, fp8_max, rcp_max, eps,
                              BLOCK_C: tl.constexpr, BLK: tl.constexpr, MODE: tl.constexpr, POW2: tl.constexpr,
                              E5M2: tl.constexpr, IN_KIND: tl.constexpr, ROWWISE: tl.constexpr,
                              COLUMNWISE: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr,
                              STAGES: tl.constexpr, INTERP_ITERS: tl.constexpr):
        """A tile is one columnwise block (BLK slot rows) x BLOCK_C columns (whole rowwise blocks), held as four
        groups of BLK / 4 rows, group g the slot rows 4 j + g: every element of a group sits in the same thread as
        the same element of the others (the tensors share one layout), so the columnwise bytes of 4 consecutive slot
        rows pack into one int32 word inside a thread and the transposed `[K, S]` form is written as words (Triton
        moves a transposed byte tensor through shared memory one byte per store: the L1 bound of the first kernel).
        All four groups' loads are issued before anything is stored (a store may alias the input: the compiler
        cannot move a load above one, and loads between stores wait one memory latency each). Where the tile's
        values are all finite, the elements are encoded by the conversion alone (the inf / NaN rules cost more
        instructions than the rest of the encoding). EVEN: every tile is inside the tensor (no bounds masks).
        STAGES 0: one tile per program (grid: row blocks x column blocks); else persistent programs (a 1-D grid of
        n_programs) looping over the n_tiles tiles (n_cb along K) with the next tiles' loads in flight (Triton's
        software pipeline, STAGES deep, through shared memory). `cq_ptr`: the columnwise bytes as int32 words."""
        if STAGES == 0:
            _tile(tl.program_id(0), tl.program_id(1), x_ptr, src_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, S, K, stride_x,
                  rs_cols, cs_cols, fp8_max, rcp_max, eps, BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, ROWWISE,
                  COLUMNWISE, USE_ASM, EVEN)
        elif USE_ASM:
            for t in tl.range(tl.program_id(0), n_tiles, n_programs, num_stages=STAGES):
                _tile(t // n_cb, t % n_cb, x_ptr, src_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, S, K, stride_x, rs_cols,
                      cs_cols, fp8_max, rcp_max, eps, BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, ROWWISE, COLUMNWISE,
                      USE_ASM, EVEN)
        else:  # (the same tiles under the interpreter, whose range takes no runtime bound: a constexpr count)
            for i in range(0, INTERP_ITERS):
                t = tl.program_id(0) + i * n_programs
                if t < n_tiles:
                    _tile(t // n_cb, t % n_cb, x_ptr, src_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, S, K, stride_x,
                          rs_cols, cs_cols, fp8_max, rcp_max, eps, BLOCK_C, BLK, MODE, POW2, E5M2, IN_KIND, ROWWISE,
                          COLUMNWISE, USE_ASM, EVEN)


def slot_quantize(x: torch.Tensor, src_rows: torch.Tensor, mode: int, fp8: torch.dtype, rowwise: bool,
                  columnwise: bool, *, fp8_max: float, eps: float = 0.0, pow2: bool = False, config=None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(rowwise fp8 `[S, K]`, its scales, columnwise fp8 `[K, S]`, its scales) of the `S = len(src_rows)` slot rows
    (module docstring), None for a direction not asked for. `x` `[T, K]` (unit stride along K; bf16, fp16 or fp32),
    `src_rows` int32 `[S]` on x's device. Scales: FP8 blocks fp32 `[S, ceil(K/128)]`, `[K, ceil(S/128)]`; MXFP8 E8M0
    bytes `[S, K/32]`, `[K, S/32]` (K and S multiples of 32). The columnwise form needs S a multiple of 4 (its bytes
    are written 4 slot rows to a word). `config`: a SlotConfig (default CONFIGS[mode])."""
    s, k = src_rows.shape[0], x.shape[1]
    if columnwise and s % 4:
        raise ValueError(f"slot quantize: the columnwise form of {s} slot rows: the slot count must be a multiple of 4")
    dev = x.device
    (rs_cols, cs_cols, s_dtype), grid, head, kw = _plan(mode, fp8, rowwise, columnwise, s, k, x.dtype, float(fp8_max),
                                                        float(eps), bool(pow2), dev,
                                                        None if config is None else tuple(config))
    rq = torch.empty(s, k, device=dev, dtype=fp8) if rowwise else None
    rs = torch.empty(s, rs_cols, device=dev, dtype=s_dtype) if rowwise else None
    cq = torch.empty(k, s, device=dev, dtype=fp8) if columnwise else None
    cs = torch.empty(k, cs_cols, device=dev, dtype=s_dtype) if columnwise else None
    if s == 0 or k == 0 or not (rowwise or columnwise):
        return rq, rs, cq, cs
    # (a direction not asked for: its pointers are never read; one int32 placeholder)
    dummy = None if rowwise and columnwise else torch.empty(1, device=dev, dtype=torch.int32)
    launch(_slot_quantize_kernel, grid, x, src_rows, rq.view(torch.uint8) if rowwise else dummy,
           rs if rowwise else dummy, cq.view(torch.int32) if columnwise else dummy, cs if columnwise else dummy, s, k,
           x.stride(0), *head, **kw)
    return rq, rs, cq, cs


def _plan(mode: int, fp8: torch.dtype, rowwise: bool, columnwise: bool, s: int, k: int, x_dtype: torch.dtype,
          fp8_max: float, eps: float, pow2: bool, dev: torch.device, config: tuple | None) -> tuple:
    """((scale columns rowwise, columnwise, scale dtype), grid, the arguments after `stride_x`, the constexprs and
    options) of one launch, made once per distinct arguments ([Note: slot quantize launch plans])."""
    args = (mode, fp8, rowwise, columnwise, s, k, x_dtype, fp8_max, eps, pow2, dev, config, _interpreting())
    return kept_plan(_PLANS, args, _make_plan, *args)


def _make_plan(mode: int, fp8: torch.dtype, rowwise: bool, columnwise: bool, s: int, k: int, x_dtype: torch.dtype,
               fp8_max: float, eps: float, pow2: bool, dev: torch.device, config: tuple | None, interp: bool) -> tuple:
    c = SlotConfig(*config) if config is not None else CONFIGS[mode]
    _check_config(mode, c)
    blk = _BLOCKS[mode]
    if mode == MODE_FP8_BLOCK:
        scales = (-(-k // blk), -(-s // blk), torch.float32)
    else:
        scales = (k // blk, s // blk, torch.uint8)
    cap = {"maxnreg": c.maxnreg} if c.maxnreg and not interp else {}
    rcp_max = float(torch.tensor(1.0) / torch.tensor(fp8_max, dtype=torch.float32))  # fp32(1 / fp8_max)
    n_cb = -(-k // c.cols)
    tiles = -(-s // blk) * n_cb
    grid = _grid(c, tiles, dev)
    head = (scales[0], scales[1], tiles, n_cb, grid, fp8_max, rcp_max, eps)
    kw = dict(BLOCK_C=c.cols, BLK=blk, MODE=mode, POW2=pow2, E5M2=_FP8[fp8], IN_KIND=_IN_KINDS[x_dtype],
              ROWWISE=rowwise, COLUMNWISE=columnwise, USE_ASM=not interp, EVEN=s % blk == 0 and k % c.cols == 0,
              STAGES=c.stages, INTERP_ITERS=-(-tiles // grid) if interp and c.stages else 0, num_warps=c.warps, **cap)
    return scales, (grid,) if c.stages else (-(-s // blk), n_cb), head, kw


# [Note: slot quantize launch plans]
# Everything a launch passes besides the tensors and x's row stride -- the scale shapes, the grid, the tile counts,
# fp32(1 / fp8_max) (three CPU tensor ops), the constexprs and options -- depends only on the mode, the formats, the
# directions, the slot and column counts, the input dtype, the scaling options, the device (its SM count), the
# config and whether Triton interprets: kept per those (`_PLANS`, triton_launch's [Note: launch plans]), the launch
# itself through the launcher cached per specialization (`triton_launch.launch`; Triton's `kernel[grid]` costs ~50-100
# us of host per call).
_PLANS: dict = {}
