"""Bit-level numerics shared by the format references (docs/numerics.md, "Terms").

Everything here is fp32 arithmetic on CPU or GPU tensors, written so that a CUDA kernel can reproduce it
bit for bit. Format-specific rules (block sizes, which amax feeds which scale) stay in the format modules.
"""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_NAMES = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2"}
FP8_BY_NAME = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_dtype(fmt: str | torch.dtype) -> torch.dtype:
    """Accept "e4m3"/"e5m2" (any case) or the torch dtype itself."""
    if isinstance(fmt, torch.dtype):
        if fmt not in FP8_MAX:
            raise ValueError(f"unsupported FP8 dtype {fmt}; use torch.float8_e4m3fn or torch.float8_e5m2")
        return fmt
    try:
        return FP8_BY_NAME[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}; use 'e4m3' or 'e5m2'") from None


def satfinite_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 element conversion (docs/numerics.md, "Terms" and "Non-finite values").

    Finite values: clamp to +-max finite, then round to nearest even (torch's cast is RNE once in range).
    NaN -> the format's NaN byte with the input's sign; +-inf -> +-inf in E5M2, +-NaN in E4M3. The non-finite
    bytes are written explicitly rather than left to torch's cast, which saturates inf on some builds.
    """
    m = FP8_MAX[dtype]
    v = x.float()
    out = v.clamp(-m, m).to(dtype).view(torch.uint8)
    # the top byte of a non-finite fp32 is 0x7F or 0xFF (sign, all-ones exponent): E4M3's NaN bytes; E5M2 keeps
    # the two low bits (NaN) only for NaN, clearing them for inf. (few ops: the FSDP shard paths run this on GPU)
    special = (v.view(torch.int32) >> 24).to(torch.uint8)
    if dtype == torch.float8_e5m2:
        special = torch.where(torch.isnan(v), special, special & 0xFC)
    return torch.where(torch.isfinite(v), out, special).view(dtype)


def clear_mantissa(x: torch.Tensor) -> torch.Tensor:
    """Power-of-two rounding down of a positive fp32: keep sign and exponent bits only."""
    return (x.float().view(torch.int32) & -0x800000).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, fp8_max: float, eps: float = 0.0, pow2: bool = False) -> torch.Tensor:
    """FP8 current-scaling rule shared by per-tensor and block formats.

    amax < eps -> eps; amax 0 / inf / NaN -> scale 1; else fp8_max / amax with inf -> FLT_MAX;
    optional power-of-two (mantissa cleared, i.e. rounded down).
    """
    amax = amax.float()
    if eps > 0:
        amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    if pow2:
        scale = clear_mantissa(scale)
    degenerate = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(degenerate, torch.ones_like(scale), scale)


def rcp(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 reciprocal (IEEE division)."""
    return torch.ones_like(x, dtype=torch.float32) / x.float()


def block_amax(x2d: torch.Tensor, block: int) -> torch.Tensor:
    """max|x| over 1 x `block` groups along the last dim; the last group may be partial. NaN propagates."""
    m, k = x2d.shape
    nb = -(-k // block)
    pad = nb * block - k
    a = x2d.float().abs()
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    return a.view(m, nb, block).amax(dim=-1)


def tile_amax(x2d: torch.Tensor, tile: int) -> torch.Tensor:
    """max|x| over `tile` x `tile` tiles; edge tiles may be partial. Shape [ceil(M/t), ceil(K/t)]."""
    m, k = x2d.shape
    mb, kb = -(-m // tile), -(-k // tile)
    a = torch.nn.functional.pad(x2d.float().abs(), (0, kb * tile - k, 0, mb * tile - m))
    return a.view(mb, tile, kb, tile).amax(dim=(1, 3))


def expand_blocks(s: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Repeat per-block values along the last dim and cut to length k."""
    return s.repeat_interleave(block, dim=-1)[..., :k]


def expand_tiles(s: torch.Tensor, tile: int, m: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(tile, dim=0)[:m].repeat_interleave(tile, dim=1)[:, :k]


# ---- E8M0 (MX scales) --------------------------------------------------------------------------

def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """docs/numerics.md "MXFP8" e8m0_round_up: NaN -> 255, inf -> 254, 0 -> 0, else exponent rounded up. uint8 result."""
    bits = v.float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    bump = (man != 0) & (exp != 254) & ~((exp == 0) & (man <= 0x400000))
    e = exp + bump.to(torch.int32)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 255), e)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    return e.to(torch.uint8)


def e8m0_to_pow2(e: torch.Tensor, negate: bool = False) -> torch.Tensor:
    """fp32 2^(e-127) (or 2^(127-e) with negate); exact, including the subnormal 2^-127; 255 -> NaN."""
    e = e.to(torch.int32)
    p = (127 - e) if negate else (e - 127)  # the power, in [-127, 127] for e in [0, 254]
    normal = ((p + 127) << 23).view(torch.float32)
    sub = torch.full_like(normal, 2.0 ** -127)  # only p == -127 is below the normal range
    out = torch.where(p == -127, sub, normal)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


# ---- E2M1 (NVFP4 values) ---------------------------------------------------------------------------

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 8 E2M1 magnitudes (codes 0-7) as fp32 on `device`, built per call rather than held in a module-level
    tensor, which fake-tensor tracing (torch.compile) cannot read."""
    return torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)


# Midpoints between neighbours; at a tie the even code wins (codes 0, 2, 4, 6 are even).
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to E2M1 (nearest, ties to even, saturating at +-6); 4-bit codes (bit 3 = sign) as uint8.

    NaN maps to +6 (code 7): E2M1 has no NaN. A NaN input makes its direction's global amax NaN, so the
    whole dequantized direction reads NaN.
    """
    a = v.float().abs()
    code = torch.zeros_like(a, dtype=torch.int32)
    for i, mid in enumerate(_E2M1_MIDS):
        # ties go to the even code: strict '>' above an even code, '>=' above an odd one
        code += (a > mid).to(torch.int32) if i % 2 == 0 else (a >= mid).to(torch.int32)
    code = torch.where(torch.isnan(a), torch.full_like(code, 7), code)
    sign = (torch.signbit(v) & ~torch.isnan(v)).to(torch.int32) << 3
    return (code | sign).to(torch.uint8)


def e2m1_codes_stochastic(v: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding: round |v| up with probability equal to its position between the two neighbours.

    `rand` holds uniform [0, 1) fp32 draws of v's shape. Saturates at 6; NaN -> +6 as in e2m1_codes.
    """
    vals = e2m1_values(v.device)
    a = v.float().abs().clamp(max=6.0).contiguous()
    lo_code = (torch.searchsorted(vals, a, right=True) - 1).clamp(0, 7)
    hi_code = (lo_code + 1).clamp(max=7)
    lo, hi = vals[lo_code], vals[hi_code]
    frac = torch.where(hi > lo, (a - lo) / (hi - lo), torch.zeros_like(a))
    code = torch.where(rand < frac, hi_code, lo_code).to(torch.int32)
    code = torch.where(torch.isnan(v), torch.full_like(code, 7), code)
    sign = (torch.signbit(v) & ~torch.isnan(v)).to(torch.int32) << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    vals = e2m1_values(codes.device)
    c = codes.to(torch.int64)
    mag = vals[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Element 2i in the low nibble, 2i+1 in the high nibble, along the last dim."""
    c = codes.to(torch.uint8)
    # contiguous whatever the codes' layout (e.g. a transpose): the kernels reading packed data take no strides
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ---- 16-point random Hadamard transform (NVFP4 columnwise) ----------------------------------------

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _fwht16(g: torch.Tensor) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard over the last dim (16), fp32 butterflies with stride 1, 2, 4, 8."""
    h = 1
    while h < 16:
        g = g.view(*g.shape[:-1], 16 // (2 * h), 2, h)
        a, b = g[..., 0, :], g[..., 1, :]
        g = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return g


# A group whose largest |value| reaches this takes the butterflies pre-scaled by 2^-4 (their sums of 16 values
# would overflow fp32 near FLT_MAX / 16 = 2^124): a rule on the inputs, so the CUDA kernels decide it the same way.
RHT_PRESCALE_FROM = 2.0 ** 123


def _rht_butterflies(g: torch.Tensor) -> torch.Tensor:
    """`_fwht16(g) * 0.25`, or, for groups with max|g| >= RHT_PRESCALE_FROM, `_fwht16(g * 2^-4) * 4` (the same
    value: scaling values that large by a power of two is exact, and it keeps the fp32 sums finite)."""
    big = (g.abs() >= RHT_PRESCALE_FROM).any(-1, keepdim=True)  # NaN compares false, inf true
    return torch.where(big, _fwht16(g * 0.0625) * 4.0, _fwht16(g) * 0.25)


def rht16(x: torch.Tensor) -> torch.Tensor:
    """Each group of 16 along the last dim times diag(s) * H16 / 4 (docs/numerics.md, "NVFP4"): inputs rounded
    to bf16 first, butterflies in fp32 in the order stride 1, 2, 4, 8, result * 0.25 rounded to bf16 (returned
    as fp32). Groups with max|x| >= 2^123 run the butterflies pre-scaled by 2^-4 (see `_rht_butterflies`), so a
    finite result is never lost to an fp32 overflow inside the sums; a result beyond bf16's range (|x| above
    about 2^125) is +-inf: out of the format's range, never finite.
    """
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device)
    lead = x.shape[:-1]
    g = x.to(torch.bfloat16).float().reshape(*lead, x.shape[-1] // 16, 16) * signs
    return _rht_butterflies(g).to(torch.bfloat16).float().reshape(x.shape)


def rht16_inverse(y: torch.Tensor) -> torch.Tensor:
    """(diag(s) H16 / 4)^-1 = H16 diag(s) / 4, in fp32 (used only to dequantize; not part of the encode path),
    with the same pre-scaling of large groups as `rht16`."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=y.device)
    lead = y.shape[:-1]
    g = y.float().reshape(*lead, y.shape[-1] // 16, 16)
    return (_rht_butterflies(g) * signs).reshape(y.shape)
