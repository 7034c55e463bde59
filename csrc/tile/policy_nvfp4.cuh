// NVFP4 (docs/numerics.md "NVFP4"): blocks of 16 E2M1 values with an E4M3 scale byte each, under a per-tensor
// global scale from the rowwise / columnwise amax; 1x16 rowwise and 16x1 columnwise blocks (the columnwise input
// optionally through the 16-point random Hadamard transform), or 16x16 tiles (one scale per tile for both
// directions, one global amax); round to nearest or stochastic rounding from a Philox stream.
#pragma once

#include "skeleton.cuh"

namespace hybridq {

__device__ __forceinline__ void philox_unpack(const PhiloxArgs& p, uint64_t& seed, uint64_t& offset) {
  if (p.captured) {
    seed = static_cast<uint64_t>(*p.seed_ptr);
    offset = static_cast<uint64_t>(*p.offset_ptr) + p.offset_intragraph;
  } else {
    seed = p.seed;
    offset = p.offset;
  }
}

template <bool TWO_D, bool SR>
struct Nvfp4Policy {
  static constexpr int kBlock = 16;
  static constexpr bool kTwoD = TWO_D;
  static constexpr bool kStochastic = SR;
  static constexpr int kElemsPerByte = 2;
  static constexpr bool kColFromRow = false;  // the transpose of packed nibbles is not a byte transpose
  static constexpr bool kColChunkAmax = false;
  static constexpr bool kColScalesInTranspose = false;
  static constexpr bool kRecordsAmax = false;

  struct Shared {
    // the element multiplier of every E4M3 scale byte under the rowwise [0] / columnwise [1] global scale,
    // computed once per CTA with nvfp4_elem_mult: a table lookup instead of two IEEE divisions per block
    float enc_tab[2][256];
  };
  struct Ctx {
    float s_enc_row, s_enc_col;
    uint64_t seed, offset;
  };

  static __device__ __forceinline__ Ctx init(const QuantArgs& a, Shared& sh, int tid, int nt) {
    Ctx c{1.0f, 1.0f, 0, 0};
    if (a.amax_row != nullptr) c.s_enc_row = nvfp4_global_encode(*a.amax_row);
    if (a.amax_col != nullptr) c.s_enc_col = nvfp4_global_encode(*a.amax_col);
    if constexpr (SR) philox_unpack(a.philox, c.seed, c.offset);
    for (int i = tid; i < 256; i += nt) {
      sh.enc_tab[0][i] = nvfp4_elem_mult(static_cast<uint8_t>(i), c.s_enc_row);
      sh.enc_tab[1][i] = nvfp4_elem_mult(static_cast<uint8_t>(i), c.s_enc_col);
    }
    return c;
  }

  static __device__ __forceinline__ void tile_scales(const Ctx&, const QuantArgs&, const uint32_t*, const TilePos&) {}

  // two blocks of 16
  template <typename T>
  static __device__ __forceinline__ void row(Ctx& c, const Shared& sh, const QuantArgs& a, const uint32_t* tile_amax,
                                             const TilePos& p, const float (&xv)[tile::VR], int r, int v, int64_t gm,
                                             int64_t gk, int nvalid, bool, uint32_t (&w)[tile::VR / 8]) {
    using tile::TK;
    const int64_t K = p.K;
#pragma unroll
    for (int q = 0; q < 4; ++q) w[q] = 0u;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float g[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
      uint32_t tam;
      if constexpr (TWO_D) tam = tile_amax[(r / 16) * (TK / 16) + 2 * v + b];
      else tam = absmax_n(g);
      const uint8_t sc = nvfp4_block_scale(u2f(tam), c.s_enc_row);
      const float enc = sh.enc_tab[0][sc];
      if (16 * b < nvalid) static_cast<uint8_t*>(a.row_s)[gm * (K / 16) + gk / 16 + b] = sc;
      float u[16];
      if constexpr (SR) {
        const uint64_t idx = static_cast<uint64_t>(gm * K + gk + 16 * b);  // K % 16 == 0: idx % 16 == 0
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float u4[4];
          philox_uniform4(c.seed, c.offset, 0, idx / 4 + q, u4);
#pragma unroll
          for (int j = 0; j < 4; ++j) u[4 * q + j] = u4[j];
        }
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float y = g[j] * enc;
        uint32_t code;
        if constexpr (SR) code = e2m1_code_sr(y, u[j]);
        else code = e2m1_code(y);
        w[2 * b + j / 8] |= code << (4 * (j % 8));
      }
    }
  }

  // two blocks of 16 rows of one column; 1-D: through the RHT when a.rht
  template <typename T>
  static __device__ __forceinline__ void col(Ctx& c, const Shared& sh, const QuantArgs& a, const uint32_t* tile_amax,
                                             const uint32_t*, const TilePos& p, const float (&xv)[tile::CV], int col,
                                             int ch, int64_t gk, int64_t gm0, int nvalid,
                                             uint32_t (&w)[tile::CV / 8]) {
    using tile::CV;
    using tile::TK;
    const int64_t M = p.M, K = p.K;
#pragma unroll
    for (int q = 0; q < 4; ++q) w[q] = 0u;
#pragma unroll
    for (int b = 0; b < CV / 16; ++b) {
      float g[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
      uint32_t bam;
      float s_enc;
      int tab;
      if constexpr (TWO_D) {
        bam = tile_amax[((ch * CV + 16 * b) / 16) * (TK / 16) + col / 16];
        s_enc = c.s_enc_row;  // one global amax for both directions
        tab = 0;
      } else {
        if (a.rht) {
          if constexpr (!std::is_same<T, __nv_bfloat16>::value) {
#pragma unroll
            for (int i = 0; i < 16; ++i) g[i] = round_bf16(g[i]);
          }
          rht16_forward(g);
        }
        bam = absmax_n(g);
        s_enc = c.s_enc_col;
        tab = 1;
      }
      const uint8_t s = nvfp4_block_scale(u2f(bam), s_enc);
      const float enc = sh.enc_tab[tab][s];
      if (16 * b < nvalid) static_cast<uint8_t*>(a.col_s)[gk * (M / 16) + gm0 / 16 + b] = s;
      float u[16];
      if constexpr (SR) {
        if constexpr (TWO_D) {  // the same draw as the rowwise element (m, k): columnwise = transpose
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const uint64_t idx = static_cast<uint64_t>((gm0 + 16 * b + i) * K + gk);
            float u4[4];
            philox_uniform4(c.seed, c.offset, 0, idx / 4, u4);
            const int sel = static_cast<int>(idx % 4);
            u[i] = sel == 0 ? u4[0] : (sel == 1 ? u4[1] : (sel == 2 ? u4[2] : u4[3]));
          }
        } else {
          const uint64_t idx = static_cast<uint64_t>(gk * M + gm0 + 16 * b);  // M % 16 == 0
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float u4[4];
            philox_uniform4(c.seed, c.offset, 1, idx / 4 + q, u4);
#pragma unroll
            for (int j = 0; j < 4; ++j) u[4 * q + j] = u4[j];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float y = g[i] * enc;
        uint32_t code;
        if constexpr (SR) code = e2m1_code_sr(y, u[i]);
        else code = e2m1_code(y);
        w[(16 * b + i) / 8] |= code << (4 * (i % 8));
      }
    }
  }

  static __device__ __forceinline__ void transposed_col_scale(const Ctx&, const QuantArgs&, const uint32_t*,
                                                              const TilePos&, int, int, int64_t, int64_t) {}
};

}  // namespace hybridq
