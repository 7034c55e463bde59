// Rowwise FP8 (docs/numerics.md "Rowwise FP8"): one fp32 scale per stored row of each part -- per row of x for the
// rowwise part [M, K], per column of x for the columnwise part [K, M] -- from the row's / column's max|x|, which a
// pre-pass (quantize_fp8_rowwise.cu) leaves in row_amax [M] / col_amax [K]. Scales are fp32 scale_inv: [M] and [K].
#pragma once

#include "skeleton.cuh"

namespace hybridq {

// The tile kernel's arguments (csrc/tile/skeleton.cuh) of rowwise FP8; row_s / col_s: float scale_inv [M] / [K]
struct Fp8RowwiseArgs : TileArgs {
  Fp8Encoding fp8;
  const float* row_amax;  // [M]: max|x| of each row (rowwise part)
  const float* col_amax;  // [K]: max|x| of each column (columnwise part)
};

struct Fp8RowwisePolicy {
  static constexpr int kBlock = 1;  // (no block: a scale spans a whole row of the part)
  static constexpr bool kTwoD = false;
  static constexpr bool kStochastic = false;
  static constexpr int kElemsPerByte = 1;
  static constexpr bool kColFromRow = false;  // each direction has its own scales
  static constexpr bool kColChunkAmax = false;
  static constexpr bool kColScalesInTranspose = false;
  static constexpr bool kColScalesStaged = false;
  static constexpr bool kRecordsAmax = false;

  using Args = Fp8RowwiseArgs;
  struct Shared {};
  struct Ctx {
    float fp8_max, eps;
    bool pow2, e5m2;
  };

  static __device__ __forceinline__ Ctx init(const Args& a, Shared&, int, int) {
    return Ctx{a.fp8.max, a.fp8.eps, a.fp8.pow2, a.fp8.e5m2};
  }

  static __device__ __forceinline__ void tile_scales(const Ctx&, const Args&, const uint32_t*, const TilePos&) {}

  // 32 elements of row gm: its scale from the row's amax; the row's first task (tile column 0, quarter 0) writes it
  template <typename T>
  static __device__ __forceinline__ void row(Ctx& c, const Shared&, const Args& a, const uint32_t*, const TilePos& p,
                                             const float (&xv)[tile::VR], int, int v, int64_t gm, int64_t, int,
                                             bool row_in, uint32_t (&w)[tile::VR / 4]) {
    const float mult = row_in ? scale_from_amax(__ldg(a.row_amax + gm), c.fp8_max, c.eps, c.pow2) : 1.0f;
    if (row_in && v == 0 && p.tk == 0) static_cast<float*>(a.row_s)[gm] = 1.0f / mult;
    encode_fp8(xv, mult, c.e5m2, scaled_nonfinite(absmax_n(xv), mult), w);
  }

  // 32 rows of column gk (a row of the columnwise part): its scale from the column's amax; the column's first task
  // (tile row 0, chunk 0) writes it
  template <typename T>
  static __device__ __forceinline__ void col(Ctx& c, const Shared&, const Args& a, const uint32_t*, const uint32_t*,
                                             const TilePos& p, const float (&xv)[tile::CV], int, int ch, int64_t gk,
                                             int64_t, int, uint32_t (&w)[tile::CV / 4]) {
    const bool col_in = gk < p.K;
    const float mult = col_in ? scale_from_amax(__ldg(a.col_amax + gk), c.fp8_max, c.eps, c.pow2) : 1.0f;
    if (col_in && ch == 0 && p.tm == 0) static_cast<float*>(a.col_s)[gk] = 1.0f / mult;
    encode_fp8(xv, mult, c.e5m2, scaled_nonfinite(absmax_n(xv), mult), w);
  }

  static __device__ __forceinline__ void transposed_col_scale(const Ctx&, const Args&, const uint32_t*,
                                                              const TilePos&, int, int, int64_t, int64_t) {}
};

}  // namespace hybridq
