// Bit-level numerics of docs/numerics.md, shared by every hybridq kernel.
//
// Every function here is __host__ __device__ so it can be unit-tested on the host against the pure-PyTorch
// references (hybridq/formats/_numerics.py), which are the oracle. Build WITHOUT --use_fast_math (IEEE
// division and no flush-to-zero are part of the contract) and with --fmad=false (no contraction of a
// multiply into an add).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "hybridq.h"

#define HQ_HD __host__ __device__ __forceinline__

namespace hybridq {

constexpr float kFltMax = 3.402823466e+38f;
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;

HQ_HD uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

HQ_HD float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

HQ_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
HQ_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

HQ_HD bool is_nan(float f) { return (f2u(f) & kAbsMask) > 0x7F800000u; }
HQ_HD bool is_inf(float f) { return (f2u(f) & kAbsMask) == 0x7F800000u; }

// |x| as ordered bits: max over these integers is a max|x| that propagates NaN (NaN bits sort above inf),
// like torch's amax.
HQ_HD uint32_t abs_bits(float f) { return f2u(f) & kAbsMask; }

// fp32 product with the NaN rules of the CPU reference (x86 SSE/AVX): a NaN operand propagates with its
// sign; an invalid product (inf * 0) is the default NaN, which is negative. When both operands are NaN
// (only MXFP8: a NaN element in a NaN block, `x * mult`), torch's vectorized CPU multiply returns the second
// operand's NaN (its compiler swaps the commutative operands; the scalar tail loop would return the first,
// but MXFP8 rows have K % 32 == 0, so every element is in the vector body). GPUs return a canonical positive
// NaN instead; the sign reaches the fp8 byte, so we follow the CPU.
HQ_HD float mul_ref(float a, float b) {
  float r = a * b;
  if (is_nan(r)) {
    if (is_nan(b)) return u2f(f2u(b) | 0x00400000u);
    if (is_nan(a)) return u2f(f2u(a) | 0x00400000u);
    return u2f(0xFFC00000u);
  }
  return r;
}

// ---- input conversion -------------------------------------------------------------------------------
HQ_HD float to_f32(float v) { return v; }
HQ_HD float to_f32(__nv_bfloat16 v) {
  __nv_bfloat16_raw r = v;
  return u2f(static_cast<uint32_t>(r.x) << 16);  // exact, NaN sign and payload kept (like torch)
}
HQ_HD float to_f32(__half v) {
  __half_raw r = v;
  const uint32_t h = r.x;
  if ((h & 0x7FFFu) > 0x7C00u) {  // NaN: keep sign and payload (like torch's CPU conversion)
    return u2f(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
  }
  return __half2float(v);
}

// fp32 -> bf16 -> fp32, round to nearest even (torch's .to(torch.bfloat16); NaN -> canonical NaN)
HQ_HD float round_bf16(float v) {
  if (is_nan(v)) return u2f(0x7FC00000u);
  uint32_t u = f2u(v);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return u2f(u & 0xFFFF0000u);
}
template <typename T>
HQ_HD float to_bf16_f32(T v) {
  return round_bf16(to_f32(v));
}
template <>
HQ_HD float to_bf16_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return to_f32(v);
}

// ---- FP8 --------------------------------------------------------------------------------------------
// satfinite(v) with the non-finite rule (docs/numerics.md "Non-finite values": a non-finite value never comes out
// finite): finite v is clamped to +-max, then rounded to nearest even; NaN keeps its sign (0x7F | sign); +-inf is
// +-inf in E5M2 (0x7C | sign) and NaN with inf's sign in E4M3, which has no infinity (0x7F | sign).
HQ_HD uint8_t fp8_satfinite(float v, bool e5m2) {
  const uint8_t sign = static_cast<uint8_t>((f2u(v) >> 24) & 0x80u);
  if (is_nan(v)) return static_cast<uint8_t>(sign | 0x7Fu);
  if (is_inf(v)) return static_cast<uint8_t>(sign | (e5m2 ? 0x7Cu : 0x7Fu));
  const float m = e5m2 ? 57344.0f : 448.0f;
  v = v > m ? m : (v < -m ? -m : v);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3));
}

// fp8 byte -> fp32 (exact; NaN stays NaN)
HQ_HD float fp8_to_f32(uint8_t b, bool e5m2) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), e5m2 ? __NV_E5M2 : __NV_E4M3);
  if ((h.x & 0x7FFFu) > 0x7C00u) return u2f(((h.x & 0x8000u) << 16) | 0x7FC00000u);
  return __half2float(__half(h));
}

// FP8 current-scaling rule (scale_from_amax in _numerics.py)
HQ_HD float scale_from_amax(float amax, float fp8_max, float eps, bool pow2) {
  if (eps > 0.0f && amax < eps) amax = eps;
  float scale = fp8_max / amax;
  if (is_inf(scale)) scale = kFltMax;
  if (pow2) scale = u2f(f2u(scale) & 0xFF800000u);
  const bool degenerate = amax == 0.0f || is_inf(amax) || is_nan(amax);
  return degenerate ? 1.0f : scale;
}

// ---- E8M0 (MXFP8 scales) ----------------------------------------------------------------------------
HQ_HD uint8_t e8m0_round_up(float v) {
  if (is_nan(v)) return 255;
  if (is_inf(v)) return 254;
  if (v == 0.0f) return 0;
  const uint32_t b = f2u(v);
  const uint32_t e = (b >> 23) & 0xFFu, man = b & 0x7FFFFFu;
  const bool bump = man != 0 && e != 254 && !(e == 0 && man <= 0x400000u);
  return static_cast<uint8_t>(e + (bump ? 1u : 0u));
}

// 2^(e-127) (negate: 2^(127-e)); exact including 2^-127; 255 -> NaN
HQ_HD float e8m0_pow2(uint8_t e, bool negate) {
  if (e == 255) return u2f(0x7FC00000u);
  const int p = negate ? 127 - static_cast<int>(e) : static_cast<int>(e) - 127;
  if (p == -127) return u2f(0x00400000u);  // 2^-127, subnormal
  return u2f(static_cast<uint32_t>(p + 127) << 23);
}

// ---- E2M1 (NVFP4 values) ----------------------------------------------------------------------------
// nearest, ties to even, saturating at 6; NaN -> +6 (code 7); bit 3 = sign (NaN gets none)
HQ_HD uint8_t e2m1_code(float v) {
  const float a = u2f(f2u(v) & kAbsMask);
  if (is_nan(a)) return 7;
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f);
  return static_cast<uint8_t>(code | ((f2u(v) >> 28) & 8u));
}

HQ_HD float e2m1_value(uint32_t code) {
  // magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; negative zero for code 8
  const uint32_t c = code & 7u;
  float mag = c < 4 ? 0.5f * static_cast<float>(c) : (c == 4 ? 2.0f : (c == 5 ? 3.0f : (c == 6 ? 4.0f : 6.0f)));
  return (code & 8u) ? -mag : mag;
}

// stochastic rounding: up with probability equal to the position between the two neighbours; u in [0, 1)
HQ_HD uint8_t e2m1_code_sr(float v, float u) {
  if (is_nan(v)) return 7;
  float a = u2f(f2u(v) & kAbsMask);
  a = a > 6.0f ? 6.0f : a;
  // largest code whose value is <= a
  const uint32_t lo = (a >= 0.5f) + (a >= 1.0f) + (a >= 1.5f) + (a >= 2.0f) + (a >= 3.0f) + (a >= 4.0f) + (a >= 6.0f);
  const uint32_t hi = lo < 7 ? lo + 1 : 7;
  const float lv = e2m1_value(lo), hv = e2m1_value(hi);
  const float frac = hv > lv ? (a - lv) / (hv - lv) : 0.0f;
  const uint32_t code = u < frac ? hi : lo;
  return static_cast<uint8_t>(code | ((f2u(v) >> 28) & 8u));
}

// ---- E2M1, the fast forms (the quantize kernels' hot loop) -------------------------------------------
// Bit-equal to e2m1_code / e2m1_code_sr for every non-NaN value (tests/test_cuda_numerics_host.py sweeps them),
// in a few fp32 operations instead of seven compare-and-adds: the E2M1 grid is 0.5-spaced up to 2, 1-spaced up to
// 4, 2-spaced up to 6, so the code is min(rnd(2a), rnd(a) + 2, rnd(a / 2) + 4) (a = min(|v|, 6)) -- each term one
// fma / add onto 2^23, whose sum rounds to an integer by the hardware's own rounding (to nearest even for
// rounding, toward zero for the stochastic floor), and the minimum of positive floats is the minimum of their
// bits. The result is that integer plus kE2m1Bias (the bits of 2^23), which packing subtracts once per word.
constexpr uint32_t kE2m1Bias = 0x4B000000u;

#ifndef __CUDA_ARCH__
// the host's toward-zero sum s * a + c (tests): exact in double for the operands used here (|a| <= 6, c < 2^24)
inline float hq_host_fma_rz(float a, float s, float c) {
  const double d = static_cast<double>(a) * s + c;
  float f = static_cast<float>(d);
  if (static_cast<double>(f) > d) f = nextafterf(f, 0.0f);  // (d > 0 here)
  return f;
}
#endif

// a * s + c rounded once: to nearest even, or (RZ) toward zero
template <bool RZ>
HQ_HD float fma_round(float a, float s, float c) {
#ifdef __CUDA_ARCH__
  return RZ ? __fmaf_rz(a, s, c) : __fmaf_rn(a, s, c);
#else
  return RZ ? hq_host_fma_rz(a, s, c) : fmaf(a, s, c);
#endif
}
HQ_HD uint32_t min3_u32(uint32_t a, uint32_t b, uint32_t c) {
  const uint32_t m = a < b ? a : b;
  return m < c ? m : c;
}

// kE2m1Bias + the magnitude code (0..7) of v rounded to nearest even, saturating at 6 (NaN: 7). CLAMP = false
// drops the clamp a = min(|v|, 6), exact for |v| < kE2m1NoClampBelow only: there the third term rnd(a / 2) + 4 is
// at most 7 (a / 2 < 3.5), so the minimum saturates by itself; the kernels take this form for a block whose largest
// product is below it (one test per block instead of one clamp per value).
constexpr float kE2m1NoClampBelow = 7.0f;
template <bool CLAMP = true>
HQ_HD uint32_t e2m1_mag_biased(float v) {
  const float a = CLAMP ? fminf(fabsf(v), 6.0f) : fabsf(v);  // (fminf: NaN -> 6)
  return min3_u32(f2u(fma_round<false>(a, 2.0f, 8388608.0f)), f2u(fma_round<false>(a, 1.0f, 8388610.0f)),
                  f2u(fma_round<false>(a, 0.5f, 8388612.0f)));
}

// the magnitude code (0..7) of v stochastically rounded with the uniform u in [0, 1): the largest code at or below
// a = min(|v|, 6), plus one when u * (step to the next code) < a - (its value). Codes as values: the fp32 whose bits
// are code << 22 is value(code) * 2^-126 (E2M1 and fp32 share the subnormal layout), so * 2^126 is exact; a - lo and
// u * step are exact (Sterbenz; the steps are powers of two), so the comparison is e2m1_code_sr's u < frac.
HQ_HD uint32_t e2m1_mag_sr(float v, float u) {
  const float a = fminf(fabsf(v), 6.0f);
  const uint32_t lo = min3_u32(f2u(fma_round<true>(a, 2.0f, 8388608.0f)), f2u(fma_round<true>(a, 1.0f, 8388610.0f)),
                               f2u(fma_round<true>(a, 0.5f, 8388612.0f))) - kE2m1Bias;
  const float lv = u2f(lo << 22) * 0x1p126f, hv = u2f((lo + 1u) << 22) * 0x1p126f;
  return lo + (u * (hv - lv) < a - lv ? 1u : 0u);
}

// The device's byte permute (prmt, selector nibbles 0..7) and funnel shift (shf.l.wrap), with host stand-ins for
// the tests
HQ_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  const uint64_t x = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((x >> (8 * ((s >> (4 * i)) & 7))) & 0xFFu) << (8 * i);
  return r;
#endif
}
// (hi << 4) | (lo >> 28): lo's top nibble shifted in below hi's
HQ_HD uint32_t funnel_in4(uint32_t lo, uint32_t hi) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, 4);
#else
  return (hi << 4) | (lo >> 28);
#endif
}

// 8 magnitude codes c[j] (0..7 in bits 0..2, bits 3..7 zero, the bits above anything: kE2m1Bias drops out) and the
// signs of y[j] -> one word of 8 E2M1 codes (value j in bits 4j .. 4j + 3, the sign in bit 4j + 3). Two codes per
// multiply-add (a pair's byte), three byte permutes for the word, and the signs shifted in a nibble at a time from
// the top of each y (16 instructions per 8 values instead of 25 for a shift-and-add per field).
HQ_HD uint32_t e2m1_pack8_codes(const uint32_t (&c)[8], const float* y) {
  uint32_t b[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) b[p] = c[2 * p + 1] * 16u + c[2 * p];  // byte 0: the pair (kE2m1Bias * 17: low byte 0)
  const uint32_t mag = byte_perm(byte_perm(b[0], b[1], 0x0040u), byte_perm(b[2], b[3], 0x0040u), 0x5410u);
  uint32_t s = f2u(y[7]) >> 28;
#pragma unroll
  for (int j = 6; j >= 0; --j) s = funnel_in4(f2u(y[j]), s);
  return mag | (s & 0x88888888u);
}

// 8 values -> one word of 8 E2M1 codes, rounded to nearest (SR: stochastically with u); equal to e2m1_code /
// e2m1_code_sr of each value when none is NaN (and, CLAMP = false, every |y| < kE2m1NoClampBelow)
template <bool SR, bool CLAMP = true>
HQ_HD uint32_t e2m1_pack8(const float* y, const float* u) {
  uint32_t c[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (SR) {
      c[j] = e2m1_mag_sr(y[j], u[j]);
    } else {
      c[j] = e2m1_mag_biased<CLAMP>(y[j]);
    }
  }
  return e2m1_pack8_codes(c, y);
}

// value(code) for a 4-bit E2M1 code: the fp32 bits (code & 7) << 22 with the sign, times 2^126 (exact; see above)
HQ_HD float e2m1_value_fast(uint32_t code) {
  return u2f(((code & 7u) << 22) | ((code & 8u) << 28)) * 0x1p126f;
}

// ---- NVFP4 scales -----------------------------------------------------------------------------------
HQ_HD float fmin_ref(float a, float b) {  // torch.fmin: a NaN operand yields the other
  if (is_nan(a)) return b;
  if (is_nan(b)) return a;
  return a < b ? a : b;
}

// S_enc = (448 * 6) / A clamped to FLT_MAX (NaN -> FLT_MAX); 1 when A == 0 or S_enc == 0
HQ_HD float nvfp4_global_encode(float amax) {
  float s = fmin_ref(2688.0f / amax, kFltMax);
  if (amax == 0.0f || s == 0.0f) s = 1.0f;
  return s;
}

// s = e4m3_satfinite(min(block_amax * (S_enc * (1/6)), FLT_MAX)), as a byte
HQ_HD uint8_t nvfp4_block_scale(float blk_amax, float s_enc) {
  const float sixth = static_cast<float>(1.0 / 6.0);
  const float v = blk_amax * (s_enc * sixth);
  return fp8_satfinite(fmin_ref(v, kFltMax), false);
}

// The scale bytes of two blocks (s0 in bits 0..7, s1 in 8..15), each nvfp4_block_scale(amax_i, s_enc_i); on the
// device one paired conversion: fminf is fmin_ref here (v >= 0; a NaN v -> FLT_MAX) and the satfinite conversion of a
// finite value is fp8_satfinite's clamp-then-round (as fp8x2 in tile/common.cuh)
HQ_HD uint32_t nvfp4_block_scale2(float amax0, float s_enc0, float amax1, float s_enc1) {
  const float sixth = static_cast<float>(1.0 / 6.0);
#ifdef __CUDA_ARCH__
  const float v0 = fminf(amax0 * (s_enc0 * sixth), kFltMax), v1 = fminf(amax1 * (s_enc1 * sixth), kFltMax);
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3));
#else
  (void)sixth;
  return nvfp4_block_scale(amax0, s_enc0) | (static_cast<uint32_t>(nvfp4_block_scale(amax1, s_enc1)) << 8);
#endif
}

// Dequantize's global factor: (q * fp32(s)) * A / (6 * 448), where qs = q * fp32(s). Left to right,
// (qs * A) / 2688 overflows for A > FLT_MAX / 2688 although the value is representable; there the division comes
// first (docs/numerics.md "NVFP4"). The threshold is FLT_MAX / 2688 evaluated in fp32.
HQ_HD float nvfp4_apply_global(float qs, float amax) {
  constexpr float kDivFirst = kFltMax / 2688.0f;
  return amax > kDivFirst ? qs * (amax / 2688.0f) : (qs * amax) / 2688.0f;
}

// x / 2688 correctly rounded without a division (Markstein: q0 = x * RN(1/2688) is faithful, the remainder
// x - 2688 q0 is exact, one fma corrects q0 to RN(x / 2688); the sign is restored for x = -0): exact where no step
// under- or overflows, which nvfp4_div2688_ok guarantees for every x = qs * amax of a dequantize (|qs| in
// {0} U [2^-10, 2688], or NaN). tests/test_cuda_numerics_host.py compares it with the division.
constexpr float kRcp2688 = 1.0f / 2688.0f;
HQ_HD bool nvfp4_div2688_ok(float amax) { return amax >= 0x1p-60f && amax <= 0x1p100f; }
HQ_HD float nvfp4_div2688(float x) {
  const float q0 = x * kRcp2688;
  const float rem = fma_round<false>(-q0, 2688.0f, x);
  return u2f(f2u(fma_round<false>(rem, kRcp2688, q0)) | (f2u(x) & 0x80000000u));
}

// enc = min(1 / (fp32(s) * S_dec), FLT_MAX), S_dec = 1 / S_enc
HQ_HD float nvfp4_elem_mult(uint8_t s, float s_enc) {
  const float s_dec = 1.0f / s_enc;
  const float enc = 1.0f / (fp8_to_f32(s, false) * s_dec);
  return fmin_ref(enc, kFltMax);
}

// ---- 16-point Hadamard transform --------------------------------------------------------------------
// diag(signs) bits: bit i set = element i is negated. RHT_SIGNS = (1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1)
constexpr uint32_t kRhtNegMask = (1u << 3) | (1u << 5) | (1u << 6) | (1u << 7) | (1u << 8) | (1u << 9) |
                                 (1u << 10) | (1u << 12) | (1u << 14) | (1u << 15);

HQ_HD void fwht16(float (&g)[16]) {
#pragma unroll
  for (int h = 1; h < 16; h *= 2) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        const float a = g[i], b = g[i + h];
        g[i] = a + b;
        g[i + h] = a - b;
      }
    }
  }
}

// Groups with max|g| >= 2^123 run the butterflies pre-scaled by 2^-4 and scale back by 4 (instead of * 0.25): the
// sums of 16 values would overflow fp32 near 2^124 (docs/numerics.md "NVFP4", Random Hadamard transform). A rule on
// the inputs, as in the reference (hybridq/formats/_numerics.py RHT_PRESCALE_FROM).
constexpr float kRhtPrescaleFrom = 0x1p123f;

HQ_HD void rht16_butterflies(float (&g)[16]) {
  bool big = false;  // any |g| >= 2^123 (a NaN compares false, an inf true: as the reference decides)
#pragma unroll
  for (int i = 0; i < 16; ++i) big |= fabsf(g[i]) >= kRhtPrescaleFrom;
  if (big) {
#pragma unroll
    for (int i = 0; i < 16; ++i) g[i] = g[i] * 0.0625f;
    fwht16(g);
#pragma unroll
    for (int i = 0; i < 16; ++i) g[i] = g[i] * 4.0f;
  } else {
    fwht16(g);
#pragma unroll
    for (int i = 0; i < 16; ++i) g[i] = g[i] * 0.25f;
  }
}

// forward: inputs already rounded to bf16 (as fp32); times signs; butterflies (* 0.25); rounded to bf16
HQ_HD void rht16_forward(float (&g)[16]) {
  // a group of finite values below the prescale threshold (the common case, one integer max): the sign flips are
  // negations (folded into the first butterflies' adds), no sum overflows, and the device's round to nearest even
  // bf16 conversion (two values per instruction) equals round_bf16 on finite values
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = abs_bits(g[i]) > m ? abs_bits(g[i]) : m;
  if (m < f2u(kRhtPrescaleFrom)) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (kRhtNegMask & (1u << i)) g[i] = -g[i];
    fwht16(g);
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
#ifdef __CUDA_ARCH__
      const __nv_bfloat162 h = __floats2bfloat162_rn(g[i] * 0.25f, g[i + 1] * 0.25f);
      g[i] = __low2float(h);
      g[i + 1] = __high2float(h);
#else
      g[i] = round_bf16(g[i] * 0.25f);
      g[i + 1] = round_bf16(g[i + 1] * 0.25f);
#endif
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (kRhtNegMask & (1u << i)) g[i] = mul_ref(g[i], -1.0f);
  rht16_butterflies(g);
#pragma unroll
  for (int i = 0; i < 16; ++i) g[i] = round_bf16(g[i]);
}

// inverse (dequantize only): butterflies (* 0.25), * signs, all fp32
HQ_HD void rht16_inverse(float (&g)[16]) {
  rht16_butterflies(g);
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (kRhtNegMask & (1u << i)) g[i] = mul_ref(g[i], -1.0f);
}

// ---- Philox4x32-10 (stochastic rounding) ------------------------------------------------------------
// The ten rounds' keys of a seed: (k0 + r * 0x9E3779B9, k1 + r * 0xBB67AE85). A kernel makes them once (its seed is
// the launch's): the compiler keeps them in uniform registers, and each round of every draw XORs one in instead of
// also adding the key increments (2 of the 6 instructions of a round).
struct PhiloxKeys {
  uint32_t k[2][10];
};

HQ_HD PhiloxKeys philox_round_keys(uint64_t seed) {
  PhiloxKeys p;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    p.k[0][r] = k0;
    p.k[1][r] = k1;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return p;
}

HQ_HD void philox4x32_10(uint32_t (&c)[4], const PhiloxKeys& key) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c[0] = hi1 ^ c[1] ^ key.k[0][r];
    c[1] = lo1;
    c[2] = hi0 ^ c[3] ^ key.k[1][r];
    c[3] = lo0;
  }
}

HQ_HD void philox4x32_10(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
  philox4x32_10(c, philox_round_keys(static_cast<uint64_t>(k0) | (static_cast<uint64_t>(k1) << 32)));
}

// four uniforms in [0, 1) for elements 4*group .. 4*group+3 of stream `stream` (keys: philox_round_keys(seed))
HQ_HD void philox_uniform4(const PhiloxKeys& keys, uint64_t offset, uint32_t stream, uint64_t group, float (&u)[4]) {
  uint32_t c[4] = {static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                   static_cast<uint32_t>(offset) + stream, static_cast<uint32_t>(offset >> 32)};
  philox4x32_10(c, keys);
#pragma unroll
  // (c >> 8) * 2^-24, exactly: the bits c >> 8 are that integer times 2^-149 (a subnormal), and * 2^125 is exact --
  // an integer-to-float conversion is a quarter-rate instruction
  for (int i = 0; i < 4; ++i) u[i] = u2f(c[i] >> 8) * 0x1p125f;
}

HQ_HD void philox_uniform4(uint64_t seed, uint64_t offset, uint32_t stream, uint64_t group, float (&u)[4]) {
  philox_uniform4(philox_round_keys(seed), offset, stream, group, u);
}

}  // namespace hybridq
