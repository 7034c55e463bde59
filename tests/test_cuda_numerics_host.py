"""The kernels' element numerics (csrc/numerics.cuh), compiled for the host with nvcc and run on the CPU: the FP8
conversion under the non-finite rule and NVFP4 dequantize's global factor at large amaxes (docs/numerics.md
"Non-finite values", "NVFP4"), and the 16-point Hadamard transform against the reference. Skipped where nvcc is
not installed; no GPU needed."""

from __future__ import annotations

import struct
import subprocess

import pytest
import torch

from _nvcc_host import NVCC, build_host_driver

pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (host compile of csrc/numerics.cuh)")

DRIVER = r"""
#include <cstdio>
#include "numerics.cuh"
using namespace hybridq;
int main() {
  char op;
  unsigned a, b;
  while (scanf(" %c %x", &op, &a) == 2) {
    if (op == 's') {
      printf("%u %u\n", fp8_satfinite(u2f(a), false), fp8_satfinite(u2f(a), true));
    } else if (op == 'g' && scanf(" %x", &b) == 1) {
      printf("%u\n", f2u(nvfp4_apply_global(u2f(a), u2f(b))));
    } else if (op == 'e' || op == 'f' || op == 'q' || op == 'd') {  // sweeps of the fast forms: bits a, a + b, ...
      // below end. e: e2m1_pack8 (nearest) vs e2m1_code; f: the same without the clamp, for |v| < kE2m1NoClampBelow
      // (the other seven values folded into that range); q: e2m1_pack8 (stochastic) vs e2m1_code_sr at 67
      // uniforms each (0, 1 - 2^-24 and the fractions between); d: nvfp4_div2688 vs x / 2688 where
      // nvfp4_div2688_ok allows it
      unsigned long long n = 0, bad = 0, first = 0, end = 0;
      if (scanf(" %x %llx", &b, &end) != 2) return 1;
      for (unsigned long long x = a; x < end; x += b) {
        const float v = u2f(static_cast<uint32_t>(x));
        if (is_nan(v) || (op == 'f' && !(fabsf(v) < kE2m1NoClampBelow))) continue;
        bool ok = true;
        // e, q: v in the word's first place, seven other values of the sweep (scaled) after it: the word's layout
        float y[8] = {v};
        for (int j = 1; j < 8; ++j) {
          y[j] = u2f(static_cast<uint32_t>(x + 0x9E3779B9ull * j));
          if (is_nan(y[j])) y[j] = 0.0f;
          if (op == 'f') y[j] = fmodf(y[j], kE2m1NoClampBelow);  // (exact; |y| < 7, the sign kept)
        }
        if (op == 'e') {
          uint32_t want = 0;
          for (int j = 0; j < 8; ++j) want |= static_cast<uint32_t>(e2m1_code(y[j])) << (4 * j);
          ok = e2m1_pack8<false>(y, nullptr) == want;
        } else if (op == 'f') {
          uint32_t want = 0;
          for (int j = 0; j < 8; ++j) want |= static_cast<uint32_t>(e2m1_code(y[j])) << (4 * j);
          ok = e2m1_pack8<false, false>(y, nullptr) == want;
        } else if (op == 'q') {
          for (uint32_t k = 0; k < (1u << 24) && ok; k += (k == (1u << 24) - 1) ? 1 : ((1u << 24) / 64 + 7)) {
            float uu[8];
            uint32_t want = 0;
            for (int j = 0; j < 8; ++j) {
              uu[j] = static_cast<float>((k + 0x3C6EF3u * j) & 0xFFFFFFu) * (1.0f / 16777216.0f);
              want |= static_cast<uint32_t>(e2m1_code_sr(y[j], uu[j])) << (4 * j);
            }
            ok = e2m1_pack8<true>(y, uu) == want;
            if (k + 1 == (1u << 24)) break;
          }
        } else {
          const float ax = fabsf(v);
          if (ax != 0.0f && (ax < 0x1p-70f || ax > 2688.0f * 0x1p100f)) continue;  // outside qs * amax
          ok = f2u(nvfp4_div2688(v)) == f2u(v / 2688.0f);
        }
        ++n;
        if (!ok && bad++ == 0) first = x;
      }
      printf("%llu %llu %llx\n", n, bad, first);
    } else if (op == 'u') {  // philox_uniform4's floats vs (counter >> 8) * 2^-24 by integer-to-float conversion
      unsigned long long bad = 0;
      for (uint64_t g = 0; g < 200000; ++g) {
        const uint64_t seed = 0x9E3779B97F4A7C15ull * (a + 1), offset = 4 * g;
        float u[4];
        philox_uniform4(seed, offset, static_cast<uint32_t>(g & 1), g * 977, u);
        uint32_t c[4] = {static_cast<uint32_t>(g * 977), static_cast<uint32_t>((g * 977) >> 32),
                         static_cast<uint32_t>(offset) + static_cast<uint32_t>(g & 1),
                         static_cast<uint32_t>(offset >> 32)};
        philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
        for (int i = 0; i < 4; ++i)
          bad += f2u(u[i]) != f2u(static_cast<float>(c[i] >> 8) * (1.0f / 16777216.0f));
      }
      printf("%llu\n", bad);
    } else if (op == 'k') {  // philox4x32_10 of the counter a, b1, b2, b3 under the key b4, b5 (with precomputed keys)
      uint32_t w[5];
      for (int j = 0; j < 5; ++j)
        if (scanf(" %x", &w[j]) != 1) return 1;
      uint32_t c[4] = {a, w[0], w[1], w[2]};
      philox4x32_10(c, philox_round_keys(static_cast<uint64_t>(w[3]) | (static_cast<uint64_t>(w[4]) << 32)));
      printf("%x %x %x %x\n", c[0], c[1], c[2], c[3]);
    } else if (op == 'v') {  // e2m1_value_fast vs e2m1_value, the 16 codes
      for (uint32_t c = 0; c < 16; ++c) printf("%u%c", f2u(e2m1_value_fast(c)) == f2u(e2m1_value(c)) ? 1 : 0, c == 15 ? '\n' : ' ');
    } else if (op == 'r' || op == 'i') {  // a 16-point transform of the group a, b1..b15 (fp32 bits)
      float g[16];
      g[0] = u2f(a);
      for (int j = 1; j < 16; ++j) {
        if (scanf(" %x", &b) != 1) return 1;
        g[j] = u2f(b);
      }
      if (op == 'r') rht16_forward(g); else rht16_inverse(g);
      for (int j = 0; j < 16; ++j) printf("%u%c", f2u(g[j]), j == 15 ? '\n' : ' ');
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def numerics_bin(tmp_path_factory) -> str:
    return build_host_driver(tmp_path_factory.mktemp("numerics_host"), DRIVER, "numerics.cuh", ("--fmad=false",))


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def _run(exe: str, lines: list[str]) -> list[str]:
    r = subprocess.run([exe], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return r.stdout.split("\n")[:len(lines)]


NEG_NAN = 0xFFC00000
SPECIALS = {  # fp32 bits -> (E4M3 byte, E5M2 byte)
    _bits(float("inf")): (0x7F, 0x7C),
    _bits(float("-inf")): (0xFF, 0xFC),
    _bits(float("nan")): (0x7F, 0x7F),
    NEG_NAN: (0xFF, 0xFF),
}


@pytest.mark.parametrize("bits", list(SPECIALS), ids=["+inf", "-inf", "+nan", "-nan"])
def test_fp8_conversion_of_non_finite_values(numerics_bin, bits):
    want = SPECIALS[bits]
    got = tuple(int(t) for t in _run(numerics_bin, [f"s {bits:x}"])[0].split())
    assert got == want, (f"fp8_satfinite({_float(bits)!r}, bits {bits:#x}): got E4M3/E5M2 bytes "
                         f"{[hex(g) for g in got]}, want {[hex(w) for w in want]}")


def test_fp8_conversion_of_finite_values_clamps_then_rounds(numerics_bin):
    vals = [0.0, -0.0, 1.0, -2.5, 447.9, 448.0, 449.0, 460.0, 1e6, -1e6, 57344.0, 61440.0, 1e30, -3.4e38, 2.0 ** -9,
            2.0 ** -17, 2.0 ** -20, 1e-30]
    got = [tuple(int(t) for t in line.split()) for line in _run(numerics_bin, [f"s {_bits(v):x}" for v in vals])]
    x = torch.tensor(vals, dtype=torch.float32)
    want4 = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    want5 = x.clamp(-57344.0, 57344.0).to(torch.float8_e5m2).view(torch.uint8).tolist()
    for v, g, w4, w5 in zip(vals, got, want4, want5):
        assert g == (w4, w5), f"fp8_satfinite({v!r}): got {[hex(b) for b in g]}, want {[hex(w4), hex(w5)]}"


def _rule(qs: float, amax: float) -> int:
    """q*s * A / 2688 in fp32: division first when A > FLT_MAX / 2688 (the threshold itself in fp32)."""
    q, a = torch.tensor(qs, dtype=torch.float32), torch.tensor(amax, dtype=torch.float32)
    thr = torch.tensor(torch.finfo(torch.float32).max, dtype=torch.float32) / 2688.0
    r = q * (a / 2688.0) if bool(a > thr) else (q * a) / 2688.0
    return _bits(float(r))


@pytest.mark.parametrize("amax", [1.0, 448.0 * 6, 1e35, 1.2659e35, 1.2660e35, 1e36, 3e38])
def test_nvfp4_global_factor_is_finite_for_every_finite_amax(numerics_bin, amax):
    qss = [0.0, 0.5, -6.0 * 448.0, 6.0 * 448.0, 3.0 * 0.015625, 6.0 * 2.0 ** -9]
    out = _run(numerics_bin, [f"g {_bits(q):x} {_bits(amax):x}" for q in qss])
    for q, line in zip(qss, out):
        got = int(line)
        assert got == _rule(q, amax), (f"nvfp4_apply_global({q!r}, {amax!r}) = {_float(got)!r}, want "
                                       f"{_float(_rule(q, amax))!r}")
        assert abs(_float(got)) != float("inf"), f"nvfp4_apply_global({q!r}, {amax!r}) overflowed to inf"


def _rht_groups() -> torch.Tensor:
    """Groups of 16 (bf16 values as fp32) from ordinary sizes up to bf16's top, NaN/inf included."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for e in (0, 60, 119, 122, 123, 124, 125, 126, 127):
        g = torch.randn(6, 16, generator=gen) * 2.0 ** e
        g[0, 3] = 2.0 ** e * 1.5  # one large element among smaller ones
        rows.append(g)
    special = torch.randn(4, 16, generator=gen)
    special[0, 0], special[1, 5], special[2, 7], special[3, 2] = float("inf"), float("nan"), -float("inf"), 2.0 ** 124
    special[3, 9] = float("nan")
    rows.append(special)
    return torch.cat(rows).to(torch.bfloat16).float()


@pytest.mark.parametrize("direction", ["forward", "inverse"])
def test_hadamard_transform_matches_the_reference_bitwise(numerics_bin, direction):
    from hybridq.formats._numerics import rht16, rht16_inverse

    groups = _rht_groups()
    ref = (rht16 if direction == "forward" else rht16_inverse)(groups)
    op = "r" if direction == "forward" else "i"
    lines = [op + " " + " ".join(f"{_bits(float(v)):x}" for v in row) for row in groups]
    got = torch.tensor([[_float(int(t)) for t in line.split()] for line in _run(numerics_bin, lines)])
    same = (got.view(torch.int32) == ref.view(torch.int32)) | (got.isnan() & ref.isnan())
    bad = (~same).nonzero()
    assert not len(bad), (f"{direction} transform: {len(bad)} values differ from the reference; first at group "
                          f"{int(bad[0, 0])} element {int(bad[0, 1])}: kernel {got[tuple(bad[0])].item()!r}, "
                          f"reference {ref[tuple(bad[0])].item()!r}")


# The hot loop's fast forms against the per-element rules they replace (every non-NaN input is in their domain: the
# kernels route blocks with a NaN to e2m1_code / e2m1_code_sr). A sweep: every `stride`-th fp32 bit pattern from
# `start` below `end` (odd strides: every low bit pattern and, over all of fp32, both signs come up).
ALL = 1 << 32
SWEEPS = {
    "e2m1 nearest, every 1021st fp32": ("e", 0, 1021, ALL),
    "e2m1 nearest, every 13th in [0.125, 8]": ("e", 0x3E000000, 13, 0x41000001),  # the grid and its ties
    # the form without the clamp (blocks whose largest product is below 7): every value of [0, 7) near the grid's ties
    # and over all of it, both signs
    "e2m1 nearest unclamped, every 7th in [0.125, 7)": ("f", 0x3E000000, 7, 0x40E00000),
    "e2m1 nearest unclamped, every 7th in [-7, -0.125]": ("f", 0xBE000000, 7, 0xC0E00000),
    "e2m1 nearest unclamped, every 1021st fp32": ("f", 0, 1021, ALL),
    "e2m1 stochastic, every 100003rd fp32": ("q", 3, 100003, ALL),
    "global factor's division by 2688, every 97th fp32": ("d", 1, 97, ALL),
}


@pytest.mark.parametrize("case", list(SWEEPS))
def test_fast_element_forms_equal_the_per_element_rules(numerics_bin, case):
    op, start, stride, end = SWEEPS[case]
    n, bad, first = _run(numerics_bin, [f"{op} {start:x} {stride:x} {end:x}"])[0].split()
    assert int(n) > 1000, f"{case}: the sweep checked only {n} values"
    assert int(bad) == 0, f"{case}: {bad} of {n} values differ, first at fp32 bits {first}"


def test_fast_e2m1_value_equals_the_table(numerics_bin):
    same = _run(numerics_bin, ["v 0"])[0].split()
    assert same == ["1"] * 16, f"e2m1_value_fast differs from e2m1_value for codes {[i for i, s in enumerate(same) if s != '1']}"


# Random123's known-answer vectors for Philox4x32-10 (counter words, key words -> output words)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("kat", range(len(PHILOX_KAT)))
def test_philox_with_precomputed_round_keys_matches_the_known_answers(numerics_bin, kat):
    ctr, key, want = PHILOX_KAT[kat]
    line = "k " + " ".join(f"{v:x}" for v in ctr + key)
    got = tuple(int(t, 16) for t in _run(numerics_bin, [line])[0].split())
    assert got == want, f"philox4x32_10({ctr}, key {key}) = {[hex(g) for g in got]}, want {[hex(w) for w in want]}"


def test_stochastic_rounding_uniforms_are_the_counters_top_24_bits(numerics_bin):
    bad = int(_run(numerics_bin, ["u 3"])[0])
    assert bad == 0, f"philox_uniform4: {bad} of 800000 uniforms differ from (counter >> 8) * 2^-24"
