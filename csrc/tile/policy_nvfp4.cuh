// NVFP4 (docs/numerics.md "NVFP4"): blocks of 16 E2M1 values with an E4M3 scale byte each, under a per-tensor
// global scale from the rowwise / columnwise amax; 1x16 rowwise and 16x1 columnwise blocks (the columnwise input
// optionally through the 16-point random Hadamard transform), or 16x16 tiles (one scale per tile for both
// directions, one global amax); round to nearest or stochastic rounding from a Philox stream.
//
// Row groups (a.row_group != null: the experts of a grouped linear, one launch for all): every row takes the global
// encode scale of its group's amax, and its stochastic-rounding draws are the ones the group's own launch would
// make (that launch's Philox offset, element indices relative to the group), so each group's bytes are bitwise
// those of quantizing it alone. Groups are whole 16-row groups wherever a block or tile runs along M, so every
// block lies in one group.
#pragma once

#include "skeleton.cuh"

namespace hybridq {

// Stochastic-rounding stream: torch's PhiloxCudaState, flattened (seed/offset by value, or by pointer while a
// CUDA graph is captured).
struct PhiloxArgs {
  uint64_t seed;
  uint64_t offset;
  const int64_t* seed_ptr;
  const int64_t* offset_ptr;
  uint64_t offset_intragraph;
  bool captured;
};

__device__ __forceinline__ void philox_unpack(const PhiloxArgs& p, uint64_t& seed, uint64_t& offset) {
  if (p.captured) {
    seed = static_cast<uint64_t>(*p.seed_ptr);
    offset = static_cast<uint64_t>(*p.offset_ptr) + p.offset_intragraph;
  } else {
    seed = p.seed;
    offset = p.offset;
  }
}

// The tile kernel's arguments (csrc/tile/skeleton.cuh) of NVFP4
struct Nvfp4Args : TileArgs {
  // global amaxes (fp32 [1]) of the rowwise input and of the (transformed) columnwise input
  const float* amax_row;
  const float* amax_col;
  bool rht;
  bool sr;  // (picks the SR instantiation at launch)
  PhiloxArgs philox;
  // row groups (row_group != null, each a whole number of 16-row groups when a block or tile runs along M):
  // amax_row / amax_col hold one global amax per group, group g's rows start at group_start[g] (int64
  // [n_groups + 1]), and its stochastic-rounding draws are those of the draw_rank[g]-th per-group launch (Philox
  // offset + 4 * draw_rank[g], element indices relative to the group)
  const int32_t* row_group;
  const int64_t* group_start;
  const int32_t* draw_rank;
};

// What a block needs of its row group: the global encode scale, the Philox offset of the group's launch and the
// block's first row and element count (rows of the tensor along M) relative to the group. Without row groups: the
// tensor's (the whole tensor is one group).
struct Nvfp4Group {
  float s_enc;
  uint64_t offset;
  int64_t row0;  // the group's first row
  int64_t rows;  // the group's rows
};

__device__ __forceinline__ Nvfp4Group nvfp4_group_of(const Nvfp4Args& a, const float* amax, int64_t row,
                                                     uint64_t offset) {
  // (row < M: the callers clamp rows outside the tensor, whose outputs are not stored)
  const int32_t g = a.row_group[row];
  return {nvfp4_global_encode(amax[g]), offset + 4u * static_cast<uint64_t>(a.draw_rank[g]), a.group_start[g],
          a.group_start[g + 1] - a.group_start[g]};
}

// The dequantize kernel's arguments (csrc/tile/dequantize.cuh) of an NVFP4 part
struct Nvfp4DequantArgs : DequantTile {
  const uint8_t* scale;  // E4M3 bytes [rows, cols/16]
  const float* amax;     // [1]
  bool rht_inverse;
  bool apply_global;
};

template <bool TWO_D, bool SR>
struct Nvfp4Policy {
  static constexpr int kBlock = 16;
  static constexpr bool kTwoD = TWO_D;
  static constexpr bool kStochastic = SR;
  static constexpr int kElemsPerByte = 2;
  static constexpr bool kColFromRow = false;  // the transpose of packed nibbles is not a byte transpose
  static constexpr bool kColChunkAmax = false;
  static constexpr bool kColScalesInTranspose = false;
  static constexpr bool kColScalesStaged = true;  // a tile column's 8 scale bytes: one 64-bit store
  static constexpr bool kRecordsAmax = false;

  using Args = Nvfp4Args;
  struct Shared {
    // the element multiplier of every E4M3 scale byte under the rowwise [0] / columnwise [1] global scale,
    // computed once per CTA with nvfp4_elem_mult: a table lookup instead of two IEEE divisions per block
    alignas(16) float enc_tab[2][256];
    alignas(16) uint8_t col_sc[tile::TK][tile::TM / 16];  // columnwise scale bytes of the tile (column phase)
  };
  struct Ctx {
    float s_enc_row, s_enc_col;
    uint64_t seed, offset;
    PhiloxKeys keys;  // (stochastic rounding) the seed's round keys, made once per CTA
  };

  static __device__ __forceinline__ Ctx init(const Args& a, Shared& sh, int tid, int nt) {
    Ctx c{1.0f, 1.0f, 0, 0, {}};
    if constexpr (SR) {
      philox_unpack(a.philox, c.seed, c.offset);
      c.keys = philox_round_keys(c.seed);
    }
    if (a.row_group != nullptr) return c;  // row groups: a global scale per group, computed per block
    if (a.amax_row != nullptr) c.s_enc_row = nvfp4_global_encode(*a.amax_row);
    if (a.amax_col != nullptr) c.s_enc_col = nvfp4_global_encode(*a.amax_col);
    for (int i = tid; i < 256; i += nt) {
      sh.enc_tab[0][i] = nvfp4_elem_mult(static_cast<uint8_t>(i), c.s_enc_row);
      sh.enc_tab[1][i] = nvfp4_elem_mult(static_cast<uint8_t>(i), c.s_enc_col);
    }
    return c;
  }

  static __device__ __forceinline__ void tile_scales(const Ctx&, const Args&, const uint32_t*, const TilePos&) {}

  // one block of 16 values times its element multiplier -> two words of E2M1 codes. Three forms, by the block's
  // largest product fl(amax * enc) (fl(|x| enc) is monotonic in |x|, so it bounds every |y|): below
  // kE2m1NoClampBelow (every ordinary block) the rounding without the per-value clamp; else, no NaN in the block
  // (its amax bits below inf's; enc is finite and positive, so no product is NaN), the clamped fast forms of
  // numerics.cuh; else the per-element rules, whose NaN code carries no sign. Stochastic rounding clamps always.
  static __device__ __forceinline__ void encode16(const float (&g)[16], float enc, const float (&u)[16],
                                                  uint32_t amax_bits, uint32_t& w0, uint32_t& w1) {
    float y[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) y[j] = g[j] * enc;
    if constexpr (!SR) {
      if (u2f(amax_bits) * enc < kE2m1NoClampBelow) {  // (false for a NaN amax)
        w0 = e2m1_pack8<false, false>(y, u);
        w1 = e2m1_pack8<false, false>(y + 8, u + 8);
        return;
      }
    }
    if (amax_bits <= 0x7F800000u) {
      w0 = e2m1_pack8<SR>(y, u);
      w1 = e2m1_pack8<SR>(y + 8, u + 8);
      return;
    }
    w0 = w1 = 0u;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      uint32_t code;
      if constexpr (SR) code = e2m1_code_sr(y[j], u[j]);
      else code = e2m1_code(y[j]);
      (j < 8 ? w0 : w1) |= code << (4 * (j % 8));
    }
  }

  // 16-bit inputs come to row_raw / col_raw as the tile's packed words (two values each): the block amaxes of the
  // plain 1-D blocks are packed maxes of magnitudes (absmax_words: one instruction per 4 values instead of 6)
  static constexpr bool kRawWords = !SR;

  // a 16-bit value (the low half of h) as fp32: exact; a NaN stays a NaN (which one does not matter here: NaN
  // blocks take the per-element rules, whose NaN code has no sign, and the transform rounds a NaN to bf16's)
  template <typename T>
  static __device__ __forceinline__ float raw_f32(uint32_t h) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      return u2f(h << 16);
    } else {
      __half_raw r;
      r.x = static_cast<unsigned short>(h & 0xFFFFu);
      return __half2float(__half(r));
    }
  }

  // a row task's two blocks of 16 (1-D: am = their amaxes; 2-D: the tiles')
  static __device__ __forceinline__ void row_blocks(Ctx& c, const Shared& sh, const Args& a, const TilePos& p,
                                                    const float (&xv)[tile::VR], const uint32_t (&am)[2], int64_t gm,
                                                    int64_t gk, int nvalid, bool row_in, uint32_t (&w)[tile::VR / 8]) {
    const int64_t K = p.K;
    const bool grouped = a.row_group != nullptr;
    Nvfp4Group grp{c.s_enc_row, c.offset, 0, p.M};
    if (grouped) grp = nvfp4_group_of(a, a.amax_row, row_in ? gm : 0, c.offset);
    const uint32_t sc2 = nvfp4_block_scale2(u2f(am[0]), grp.s_enc, u2f(am[1]), grp.s_enc);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float g[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
      const uint32_t sc = (sc2 >> (8 * b)) & 0xFFu;
      const float enc = grouped ? nvfp4_elem_mult(static_cast<uint8_t>(sc), grp.s_enc) : sh.enc_tab[0][sc];
      float u[16];
      if constexpr (SR) {
        // K % 16 == 0: idx % 16 == 0
        const uint64_t idx = static_cast<uint64_t>((gm - grp.row0) * K + gk + 16 * b);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float u4[4];
          philox_uniform4(c.keys, grp.offset, 0, idx / 4 + q, u4);
#pragma unroll
          for (int j = 0; j < 4; ++j) u[4 * q + j] = u4[j];
        }
      }
      encode16(g, enc, u, am[b], w[2 * b], w[2 * b + 1]);
    }
    // the two scale bytes: one 16-bit store where aligned (K % 32 == 0: gk / 16 is even)
    uint8_t* rs = static_cast<uint8_t*>(a.row_s) + gm * (K / 16) + gk / 16;
    if (nvalid >= 32 && (reinterpret_cast<uintptr_t>(rs) & 1) == 0) {
      *reinterpret_cast<uint16_t*>(rs) = static_cast<uint16_t>(sc2);
    } else {
      if (nvalid > 0) rs[0] = static_cast<uint8_t>(sc2);
      if (nvalid > 16) rs[1] = static_cast<uint8_t>(sc2 >> 8);
    }
  }

  // two blocks of 16 (fp32 input)
  template <typename T>
  static __device__ __forceinline__ void row(Ctx& c, const Shared& sh, const Args& a, const uint32_t* tile_amax,
                                             const TilePos& p, const float (&xv)[tile::VR], int r, int v, int64_t gm,
                                             int64_t gk, int nvalid, bool row_in, uint32_t (&w)[tile::VR / 8]) {
    uint32_t am[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if constexpr (TWO_D) {
        am[b] = tile_amax[(r / 16) * (tile::TK / 16) + 2 * v + b];
      } else {
        float g[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
        am[b] = absmax_n(g);
      }
    }
    row_blocks(c, sh, a, p, xv, am, gm, gk, nvalid, row_in, w);
  }

  // two blocks of 16 from 16 packed words (16-bit input)
  template <typename T>
  static __device__ __forceinline__ void row_raw(Ctx& c, const Shared& sh, const Args& a, const uint32_t* tile_amax,
                                                 const TilePos& p, const uint32_t (&xw)[tile::VR / 2], int r, int v,
                                                 int64_t gm, int64_t gk, int nvalid, bool row_in,
                                                 uint32_t (&w)[tile::VR / 8]) {
    uint32_t am[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if constexpr (TWO_D) am[b] = tile_amax[(r / 16) * (tile::TK / 16) + 2 * v + b];
      else am[b] = absmax_words<T, 8>(xw + 8 * b);
    }
    float xv[tile::VR];
#pragma unroll
    for (int i = 0; i < tile::VR / 2; ++i) {
      xv[2 * i] = raw_f32<T>(xw[i]);
      xv[2 * i + 1] = raw_f32<T>(xw[i] >> 16);
    }
    row_blocks(c, sh, a, p, xv, am, gm, gk, nvalid, row_in, w);
  }

  // two blocks of 16 rows of one column (have_am: am holds their amaxes; else 1-D, through the RHT when a.rht, and
  // the amaxes of the (transformed) values). The scale bytes are staged (store_col_scales writes them).
  template <typename T>
  static __device__ __forceinline__ void col_blocks(Ctx& c, Shared& sh, const Args& a, const TilePos& p,
                                                    float (&xv)[tile::CV], bool have_am, uint32_t (&am)[2], int col,
                                                    int ch, int64_t gk, int64_t gm0, uint32_t (&w)[tile::CV / 8]) {
    static_assert(tile::CV == 32, "two blocks of 16 rows per column task");
    const int64_t M = p.M, K = p.K;
    const bool grouped = a.row_group != nullptr;
    // 16x16 tiles: one global amax for both directions (amax_row; amax_col without row groups is the same)
    const float* const g_amax = TWO_D ? a.amax_row : a.amax_col;
    const Nvfp4Group base{TWO_D ? c.s_enc_row : c.s_enc_col, c.offset, 0, M};
    // block b's row group (a block lies in one; its first row gm0 + 16 b, clamped: rows outside are not stored)
    auto group = [&](int b) {
      const int64_t gm = gm0 + 16 * b;
      return grouped ? nvfp4_group_of(a, g_amax, gm < M ? gm : 0, c.offset) : base;
    };
    if constexpr (!TWO_D) {
      if (!have_am) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          float g[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
          if (a.rht) {
            if constexpr (!std::is_same<T, __nv_bfloat16>::value) {
#pragma unroll
              for (int i = 0; i < 16; ++i) g[i] = round_bf16(g[i]);
            }
            rht16_forward(g);
#pragma unroll
            for (int i = 0; i < 16; ++i) xv[16 * b + i] = g[i];
          }
          am[b] = absmax_n(g);
        }
      }
    }
    // both scale bytes by one paired conversion (stochastic rounding: per block, which keeps its registers down)
    uint32_t sc2 = 0;
    if constexpr (!SR) {
      sc2 = nvfp4_block_scale2(u2f(am[0]), group(0).s_enc, u2f(am[1]), group(1).s_enc);
      *reinterpret_cast<uint16_t*>(&sh.col_sc[col][2 * ch]) = static_cast<uint16_t>(sc2);
    }
    constexpr int tab = TWO_D ? 0 : 1;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float g[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
      const int64_t gm = gm0 + 16 * b;
      const Nvfp4Group grp = group(b);
      uint32_t s;
      if constexpr (SR) {
        s = nvfp4_block_scale(u2f(am[b]), grp.s_enc);
        sh.col_sc[col][2 * ch + b] = static_cast<uint8_t>(s);
      } else {
        s = (sc2 >> (8 * b)) & 0xFFu;
      }
      const float enc = grouped ? nvfp4_elem_mult(static_cast<uint8_t>(s), grp.s_enc) : sh.enc_tab[tab][s];
      float u[16];
      if constexpr (SR) {
        if constexpr (TWO_D) {  // the same draw as the rowwise element (m, k): columnwise = transpose
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const uint64_t idx = static_cast<uint64_t>((gm - grp.row0 + i) * K + gk);
            float u4[4];
            philox_uniform4(c.keys, grp.offset, 0, idx / 4, u4);
            const int sel = static_cast<int>(idx % 4);
            u[i] = sel == 0 ? u4[0] : (sel == 1 ? u4[1] : (sel == 2 ? u4[2] : u4[3]));
          }
        } else {
          // the group's [K, rows] columnwise tensor; rows % 16 == 0
          const uint64_t idx = static_cast<uint64_t>(gk * grp.rows + (gm - grp.row0));
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float u4[4];
            philox_uniform4(c.keys, grp.offset, 1, idx / 4 + q, u4);
#pragma unroll
            for (int j = 0; j < 4; ++j) u[4 * q + j] = u4[j];
          }
        }
      }
      encode16(g, enc, u, am[b], w[2 * b], w[2 * b + 1]);
    }
  }

  // one column of the task (fp32 input)
  template <typename T>
  static __device__ __forceinline__ void col(Ctx& c, Shared& sh, const Args& a, const uint32_t* tile_amax,
                                             const uint32_t*, const TilePos& p, const float (&xv)[tile::CV], int col,
                                             int ch, int64_t gk, int64_t gm0, int,
                                             uint32_t (&w)[tile::CV / 8]) {
    float x[tile::CV];
#pragma unroll
    for (int i = 0; i < tile::CV; ++i) x[i] = xv[i];
    uint32_t am[2] = {0u, 0u};
    if constexpr (TWO_D) {
#pragma unroll
      for (int b = 0; b < 2; ++b) am[b] = tile_amax[((ch * tile::CV + 16 * b) / 16) * (tile::TK / 16) + col / 16];
    }
    col_blocks<T>(c, sh, a, p, x, TWO_D, am, col, ch, gk, gm0, w);
  }

  // 16-bit input: before a task's two columns, each half of pm[b] = that column's max |x| over the rows of block b
  // (1-D without the transform; else unused)
  template <typename T>
  static __device__ __forceinline__ void col_pair_amax(const Args& a, const uint32_t (&wr)[tile::CV],
                                                       uint32_t (&pm)[tile::CV / 16]) {
#pragma unroll
    for (int b = 0; b < tile::CV / 16; ++b) pm[b] = 0u;
    if constexpr (!TWO_D) {
      if (!a.rht) {
#pragma unroll
        for (int b = 0; b < tile::CV / 16; ++b) pm[b] = hmax_abs_words<T, 16>(wr + 16 * b);
      }
    }
  }

  // column t (0: the low halves of wr, 1: the high halves) of the task's pair
  template <typename T>
  static __device__ __forceinline__ void col_raw(Ctx& c, Shared& sh, const Args& a, const uint32_t* tile_amax,
                                                 const TilePos& p, const uint32_t (&wr)[tile::CV], int t,
                                                 const uint32_t (&pm)[tile::CV / 16], int col, int ch, int64_t gk,
                                                 int64_t gm0, uint32_t (&w)[tile::CV / 8]) {
    float x[tile::CV];
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      const uint32_t sel = t ? 0x3244u : 0x1044u;  // the half to the top, zeros below: its fp32 bits
#pragma unroll
      for (int i = 0; i < tile::CV; ++i) x[i] = u2f(byte_perm(wr[i], 0u, sel));
    } else {
      const uint32_t sel = t ? 0x4432u : 0x4410u;
#pragma unroll
      for (int i = 0; i < tile::CV; ++i) x[i] = raw_f32<T>(byte_perm(wr[i], 0u, sel));
    }
    uint32_t am[2];
    bool have_am = true;
    if constexpr (TWO_D) {
#pragma unroll
      for (int b = 0; b < 2; ++b) am[b] = tile_amax[((ch * tile::CV + 16 * b) / 16) * (tile::TK / 16) + col / 16];
    } else {
      have_am = !a.rht;
#pragma unroll
      for (int b = 0; b < 2; ++b) am[b] = half_mag_bits<T>(t ? pm[b] >> 16 : pm[b]);
    }
    col_blocks<T>(c, sh, a, p, x, have_am, am, col, ch, gk, gm0, w);
  }

  // the staged scale bytes of tile column col (blocks of rows m0 + 16 j, those inside the tensor; M % 16 == 0)
  static __device__ __forceinline__ void store_col_scales(const Ctx&, const Shared& sh, const Args& a, const TilePos& p,
                                                          int col) {
    constexpr int NB = tile::TM / 16;
    const int64_t gk = p.k0 + col;
    if (gk >= p.K) return;
    const int nb = static_cast<int>(min64(NB, (p.M - p.m0) / 16));
    uint8_t* dst = static_cast<uint8_t*>(a.col_s) + gk * (p.M / 16) + p.m0 / 16;
    if (nb == NB && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {  // (M % 128 == 0)
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(sh.col_sc[col]);
      return;
    }
    for (int j = 0; j < nb; ++j) dst[j] = sh.col_sc[col][j];
  }

  static __device__ __forceinline__ void transposed_col_scale(const Ctx&, const Args&, const uint32_t*,
                                                              const TilePos&, int, int, int64_t, int64_t) {}

  // ---- dequantize (csrc/tile/dequantize.cuh): each E2M1 value times its block's E4M3 scale, then (apply_global)
  // the global factor amax / 2688 (nvfp4_apply_global), then (rht_inverse) the inverse RHT of the block ----------
  using DequantArgs = Nvfp4DequantArgs;
  static constexpr bool kDequantWholeChunks = true;  // blocks of 16 along cols
  struct DequantCtx {
    float amax;
    bool fast_div;  // the global factor's division by 2688 as nvfp4_div2688 (amax in its exact range)
  };
  static __device__ __forceinline__ DequantCtx dequant_init(const DequantArgs& a) {
    const float amax = a.apply_global ? __ldg(a.amax) : 1.0f;
    return {amax, nvfp4_div2688_ok(amax)};
  }
  static __device__ __forceinline__ void dequant16(const DequantCtx& c, const DequantArgs& a, int64_t r, int64_t c0,
                                                   const uint32_t (&w)[2], float (&o)[16]) {
    const float sf = fp8_to_f32(__ldg(a.scale + r * (a.cols / 16) + c0 / 16), false);
#pragma unroll
    for (int j = 0; j < 16; ++j) o[j] = e2m1_value_fast(w[j / 8] >> (4 * (j % 8))) * sf;
    if (a.apply_global) {
      if (c.fast_div) {
#pragma unroll
        for (int j = 0; j < 16; ++j) o[j] = nvfp4_div2688(o[j] * c.amax);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) o[j] = nvfp4_apply_global(o[j], c.amax);
      }
    }
    if (a.rht_inverse) rht16_inverse(o);
  }
};

}  // namespace hybridq
