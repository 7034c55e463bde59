// Float8 block scaling (docs/numerics.md "Float8 block scaling"): 1x128 rowwise / 128x1 columnwise blocks, or
// 128x128 tiles (one scale per tile for both directions: the columnwise form is the byte transpose). Scales are
// fp32 scale_inv: [M, ceil(K/128)] and [K, ceil(M/128)], or [ceil(M/128), ceil(K/128)] and its transpose.
#pragma once

#include "skeleton.cuh"

namespace hybridq {

// The tile kernel's arguments (csrc/tile/skeleton.cuh) of FP8 block scaling
struct Fp8BlockArgs : TileArgs {
  Fp8Encoding fp8;
};

// The dequantize kernel's arguments (csrc/tile/dequantize.cuh) of a FP8 block scaling part
struct Fp8BlockDequantArgs : DequantTile {
  const float* scale_inv;  // [rows, ceil(cols/128)] (1x128 blocks) or [ceil(rows/128), ceil(cols/128)] (tiles)
  bool e5m2;
};

template <bool TWO_D>
struct Fp8BlockPolicy {
  static constexpr int kBlock = 128;
  static constexpr bool kTwoD = TWO_D;
  static constexpr bool kStochastic = false;
  static constexpr int kElemsPerByte = 1;
  static constexpr bool kColFromRow = TWO_D;
  static constexpr bool kColChunkAmax = !TWO_D;  // a 128-row column block spans the tile's 4 column chunks
  static constexpr bool kColScalesInTranspose = false;  // the tile's scale is written once (tile_scales)
  static constexpr bool kColScalesStaged = false;
  static constexpr bool kRecordsAmax = false;

  using Args = Fp8BlockArgs;
  struct Shared {};
  struct Ctx {
    float fp8_max, eps;
    bool pow2, e5m2;
  };

  static __device__ __forceinline__ Ctx init(const Args& a, Shared&, int, int) {
    return Ctx{a.fp8.max, a.fp8.eps, a.fp8.pow2, a.fp8.e5m2};
  }

  static __device__ __forceinline__ void tile_scales(const Ctx& c, const Args& a, const uint32_t* tile_amax,
                                                     const TilePos& p) {
    const float sc = scale_from_amax(u2f(tile_amax[0]), c.fp8_max, c.eps, c.pow2);
    if (a.rowwise) static_cast<float*>(a.row_s)[p.tm * p.tiles_k + p.tk] = 1.0f / sc;
    if (a.columnwise) static_cast<float*>(a.col_s)[p.tk * p.tiles_m + p.tm] = 1.0f / sc;
  }

  // a quarter of a 1x128 block: the 4 lanes of one tile row reduce the block amax with 2 warp shuffles
  template <typename T>
  static __device__ __forceinline__ void row(Ctx& c, const Shared&, const Args& a, const uint32_t* tile_amax,
                                             const TilePos& p, const float (&xv)[tile::VR], int, int v, int64_t gm,
                                             int64_t, int, bool row_in, uint32_t (&w)[tile::VR / 4]) {
    const uint32_t am = absmax_n(xv);
    uint32_t bam;
    if constexpr (TWO_D) bam = tile_amax[0];
    else bam = group_max<tile::LANES_PER_ROW>(am);
    const float mult = scale_from_amax(u2f(bam), c.fp8_max, c.eps, c.pow2);
    if (!TWO_D && v == 0 && row_in) static_cast<float*>(a.row_s)[gm * p.tiles_k + p.tk] = 1.0f / mult;
    encode_fp8(xv, mult, c.e5m2, scaled_nonfinite(am, mult), w);
  }

  // 1-D blocks only (2-D: the byte transpose, or the tile's scale when only the columnwise part is requested)
  template <typename T>
  static __device__ __forceinline__ void col(Ctx& c, const Shared&, const Args& a, const uint32_t* tile_amax,
                                             const uint32_t* chunk_amax, const TilePos& p,
                                             const float (&xv)[tile::CV], int col, int ch, int64_t gk, int64_t, int,
                                             uint32_t (&w)[tile::CV / 4]) {
    using tile::TK;
    const uint32_t am = absmax_n(xv);
    uint32_t bam;
    if constexpr (TWO_D) {
      bam = tile_amax[0];
    } else {
      bam = max(max(chunk_amax[col], chunk_amax[TK + col]), max(chunk_amax[2 * TK + col], chunk_amax[3 * TK + col]));
    }
    const float mult = scale_from_amax(u2f(bam), c.fp8_max, c.eps, c.pow2);
    if (!TWO_D && ch == 0 && gk < p.K) static_cast<float*>(a.col_s)[gk * p.tiles_m + p.tm] = 1.0f / mult;
    encode_fp8(xv, mult, c.e5m2, scaled_nonfinite(am, mult), w);
  }

  static __device__ __forceinline__ void transposed_col_scale(const Ctx&, const Args&, const uint32_t*,
                                                              const TilePos&, int, int, int64_t, int64_t) {}

  // ---- dequantize (csrc/tile/dequantize.cuh): each element times its block's (tile's) scale_inv ------------
  using DequantArgs = Fp8BlockDequantArgs;
  static constexpr bool kDequantWholeChunks = false;
  struct DequantCtx {
    int64_t nbc;  // scale columns
  };
  static __device__ __forceinline__ DequantCtx dequant_init(const DequantArgs& a) { return {(a.cols + 127) / 128}; }
  static __device__ __forceinline__ void dequant16(const DequantCtx& c, const DequantArgs& a, int64_t r, int64_t c0,
                                                   const uint32_t (&w)[4], float (&o)[16]) {
    const int64_t sr = TWO_D ? r / 128 : r;
    decode_fp8_16(w, a.e5m2, __ldg(a.scale_inv + sr * c.nbc + c0 / 128), o);
  }
};

}  // namespace hybridq
