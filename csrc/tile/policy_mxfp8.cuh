// MXFP8 (docs/numerics.md "MXFP8"): 1x32 rowwise and 32x1 columnwise blocks from the input, or 32x32 tiles (one
// scale per tile for both directions: the columnwise form is the byte transpose); E8M0 scale bytes, compact
// [rows, cols/32] or GEMM-swizzled.
#pragma once

#include "skeleton.cuh"

namespace hybridq {

// Address of the MXFP8 scale byte at (r, c) of a [rows, cols] scale matrix, compact or GEMM-swizzled (128x4 tiles:
// bytes c .. c + 3 of row r are adjacent there when c % 4 == 0)
__device__ __forceinline__ uint8_t* mx_scale_ptr(void* s, int64_t r, int64_t c, int64_t cols, bool swizzle,
                                                 int64_t cols_pad) {
  uint8_t* p = static_cast<uint8_t*>(s);
  if (swizzle)
    return p + ((r >> 7) * (cols_pad >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3);
  return p + r * cols + c;
}

__device__ __forceinline__ void write_mx_scale(void* s, int64_t r, int64_t c, int64_t cols, bool swizzle,
                                               int64_t cols_pad, uint8_t e) {
  *mx_scale_ptr(s, r, c, cols, swizzle, cols_pad) = e;
}

// Whether a block (or 32x32 tile: a task inside it then takes the exact path, which is right for every element)
// has a non-finite product x * 2^(127-e): exactly when its amax is inf or NaN, since the exponent e is chosen from
// the amax so that a finite amax scales to at most about fp8_max.
__device__ __forceinline__ bool block_nonfinite(uint32_t amax_bits) { return amax_bits >= 0x7F800000u; }

// The tile kernel's arguments (csrc/tile/skeleton.cuh) of MXFP8
struct Mxfp8Args : TileArgs {
  Fp8Encoding fp8;
  // GEMM-ready swizzled scales (128x4 tiles, see write_mx_scale) instead of compact [rows, cols/32]
  bool swizzle;
  int64_t row_s_cols_pad, col_s_cols_pad;
};

// The dequantize kernel's arguments (csrc/tile/dequantize.cuh) of an MXFP8 part
struct Mxfp8DequantArgs : DequantTile {
  const uint8_t* scale;  // E8M0 bytes, compact [rows, cols/32]
  bool e5m2;
};

template <bool TWO_D>
struct Mxfp8Policy {
  static constexpr int kBlock = 32;
  static constexpr bool kTwoD = TWO_D;
  static constexpr bool kStochastic = false;
  static constexpr int kElemsPerByte = 1;
  static constexpr bool kColFromRow = TWO_D;
  static constexpr bool kColChunkAmax = false;  // a 32x1 block is one column task
  static constexpr bool kColScalesInTranspose = TWO_D;
  static constexpr bool kColScalesStaged = true;  // a tile column's 4 scale bytes: one 32-bit store
  static constexpr bool kRecordsAmax = false;

  using Args = Mxfp8Args;
  struct Shared {
    alignas(16) uint8_t col_sc[tile::TK][tile::TM / 32];  // columnwise scale bytes of the tile (column phase)
  };
  struct Ctx {
    float rcp_max;  // multiply by the rounded reciprocal of fp8_max, not a division
    bool e5m2;
  };

  static __device__ __forceinline__ Ctx init(const Args& a, Shared&, int, int) {
    return Ctx{1.0f / a.fp8.max, a.fp8.e5m2};
  }

  static __device__ __forceinline__ void tile_scales(const Ctx&, const Args&, const uint32_t*, const TilePos&) {}

  // the task is one block
  template <typename T>
  static __device__ __forceinline__ void row(Ctx& c, const Shared&, const Args& a, const uint32_t* tile_amax,
                                             const TilePos& p, const float (&xv)[tile::VR], int r, int v, int64_t gm,
                                             int64_t gk, int nvalid, bool, uint32_t (&w)[tile::VR / 4]) {
    uint32_t bam;
    if constexpr (TWO_D) bam = tile_amax[(r / 32) * (tile::TK / 32) + v];
    else bam = absmax_n(xv);
    const uint8_t e = e8m0_round_up(u2f(bam) * c.rcp_max);
    const float mult = e8m0_pow2(e, true);  // NaN for a NaN block
    if (nvalid > 0) write_mx_scale(a.row_s, gm, gk / 32, p.K / 32, a.swizzle, a.row_s_cols_pad, e);
    encode_fp8(xv, mult, c.e5m2, block_nonfinite(bam), w);
  }

  // the block's scale byte is staged (store_col_scales writes it)
  template <typename T>
  static __device__ __forceinline__ void col(Ctx& c, Shared& sh, const Args&, const uint32_t* tile_amax,
                                             const uint32_t*, const TilePos&, const float (&xv)[tile::CV], int col,
                                             int ch, int64_t, int64_t, int, uint32_t (&w)[tile::CV / 4]) {
    uint32_t bam;
    if constexpr (TWO_D) bam = tile_amax[ch * (tile::TK / 32) + col / 32];
    else bam = absmax_n(xv);
    const uint8_t e = e8m0_round_up(u2f(bam) * c.rcp_max);
    const float mult = e8m0_pow2(e, true);
    sh.col_sc[col][ch] = e;
    encode_fp8(xv, mult, c.e5m2, block_nonfinite(bam), w);
  }

  // the staged scale bytes of tile column col (blocks of rows m0 + 32 j, those inside the tensor)
  static __device__ __forceinline__ void store_col_scales(const Ctx&, const Shared& sh, const Args& a, const TilePos& p,
                                                          int col) {
    constexpr int NB = tile::TM / 32;
    const int64_t gk = p.k0 + col;
    if (gk >= p.K) return;
    const int nb = static_cast<int>(min64(NB, (p.M - p.m0 + 31) / 32));
    uint8_t* dst = mx_scale_ptr(a.col_s, gk, p.m0 / 32, p.M / 32, a.swizzle, a.col_s_cols_pad);
    if (nb == NB && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {  // (swizzled: always; compact: M % 128 == 0)
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(sh.col_sc[col]);
      return;
    }
    for (int j = 0; j < nb; ++j)
      write_mx_scale(a.col_s, gk, p.m0 / 32 + j, p.M / 32, a.swizzle, a.col_s_cols_pad, sh.col_sc[col][j]);
  }

  // 32x32 tiles, byte-transpose path: the scale of the block of tile rows r .. r + 31 of tile column col
  static __device__ __forceinline__ void transposed_col_scale(const Ctx& c, const Args& a,
                                                              const uint32_t* tile_amax, const TilePos& p, int r,
                                                              int col, int64_t gk, int64_t gm) {
    const uint8_t e = e8m0_round_up(u2f(tile_amax[(r / 32) * (tile::TK / 32) + col / 32]) * c.rcp_max);
    write_mx_scale(a.col_s, gk, gm / 32, p.M / 32, a.swizzle, a.col_s_cols_pad, e);
  }

  // ---- dequantize (csrc/tile/dequantize.cuh): each element times 2^(e - 127) of its 1x32 block -------------
  // (both block kinds: a 32x32 tile's scale is stored for each of its rows)
  using DequantArgs = Mxfp8DequantArgs;
  static constexpr bool kDequantWholeChunks = false;
  struct DequantCtx {};
  static __device__ __forceinline__ DequantCtx dequant_init(const DequantArgs&) { return {}; }
  static __device__ __forceinline__ void dequant16(const DequantCtx&, const DequantArgs& a, int64_t r, int64_t c0,
                                                   const uint32_t (&w)[4], float (&o)[16]) {
    decode_fp8_16(w, a.e5m2, e8m0_pow2(__ldg(a.scale + r * (a.cols / 32) + c0 / 32), false), o);
  }
};

}  // namespace hybridq
