// Per-tensor FP8 (docs/numerics.md "Per-tensor FP8"): one scale for the whole tensor, from a given scale (delayed
// scaling) or from the amax (current scaling); the columnwise form is the byte transpose of the rowwise one.
#pragma once

#include "skeleton.cuh"

namespace hybridq {

// The tile kernel's arguments (csrc/tile/skeleton.cuh) of per-tensor FP8
struct Fp8TensorArgs : TileArgs {
  Fp8Encoding fp8;
  // scale_in (delayed scaling) or amax_in (current scaling) gives the scale
  const float* scale_in;
  const float* amax_in;
  float* scale_inv_out;
  uint32_t* amax_out;  // |x| max as fp32 bits (atomicMax), when not null
  // row groups (the experts of a grouped linear): row r takes the scale of group row_group[r] from
  // amax_in[group]; scale_inv_out gets one value per group. Null: one scale for the whole tensor.
  const int32_t* row_group;
  int n_groups;
};

// The dequantize kernel's arguments (csrc/tile/dequantize.cuh) of a per-tensor FP8 part
struct Fp8TensorDequantArgs : DequantTile {
  const float* scale_inv;  // [1]
  bool e5m2;
};

struct Fp8TensorPolicy {
  static constexpr int kBlock = 1;
  static constexpr bool kTwoD = false;
  static constexpr bool kStochastic = false;
  static constexpr int kElemsPerByte = 1;
  static constexpr bool kColFromRow = true;  // one scale for both directions
  static constexpr bool kColChunkAmax = false;
  static constexpr bool kColScalesInTranspose = false;
  static constexpr bool kColScalesStaged = false;
  static constexpr bool kRecordsAmax = true;  // max|x| of the cast for delayed scaling (a.amax_out)

  using Args = Fp8TensorArgs;
  struct Shared {};
  struct Ctx {
    float mult;        // the scale
    bool e5m2;
    uint32_t my_amax;  // this thread's max|x|, as bits
  };

  static __device__ __forceinline__ Ctx init(const Args& a, Shared&, int tid, int nt) {
    Ctx c;
    if (a.row_group != nullptr) {  // row groups: a scale per row, from its group's amax (see row())
      c.mult = 1.0f;
      if (blockIdx.x == 0 && a.scale_inv_out != nullptr) {
        for (int g = tid; g < a.n_groups; g += nt)
          a.scale_inv_out[g] = 1.0f / scale_from_amax(a.amax_in[g], a.fp8.max, a.fp8.eps, a.fp8.pow2);
      }
    } else {
      c.mult = a.scale_in != nullptr ? *a.scale_in : scale_from_amax(*a.amax_in, a.fp8.max, a.fp8.eps, a.fp8.pow2);
      if (blockIdx.x == 0 && tid == 0 && a.scale_inv_out != nullptr) *a.scale_inv_out = 1.0f / c.mult;
    }
    c.e5m2 = a.fp8.e5m2;
    c.my_amax = 0;
    return c;
  }

  static __device__ __forceinline__ void tile_scales(const Ctx&, const Args&, const uint32_t*, const TilePos&) {}

  template <typename T>
  static __device__ __forceinline__ void row(Ctx& c, const Shared&, const Args& a, const uint32_t*, const TilePos&,
                                             const float (&xv)[tile::VR], int, int, int64_t gm, int64_t, int,
                                             bool row_in, uint32_t (&w)[tile::VR / 4]) {
    const uint32_t am = absmax_n(xv);
    c.my_amax = max(c.my_amax, am);
    const float mult = a.row_group == nullptr ? c.mult
                       : row_in ? scale_from_amax(a.amax_in[a.row_group[gm]], a.fp8.max, a.fp8.eps, a.fp8.pow2)
                                : 1.0f;
    encode_fp8(xv, mult, c.e5m2, scaled_nonfinite(am, mult), w);
  }

  // only when the rowwise part is not requested (else the columnwise part is the rowwise bytes' transpose);
  // never with row groups (the op asks for the rowwise part then)
  template <typename T>
  static __device__ __forceinline__ void col(Ctx& c, const Shared&, const Args&, const uint32_t*, const uint32_t*,
                                             const TilePos&, const float (&xv)[tile::CV], int, int, int64_t, int64_t,
                                             int, uint32_t (&w)[tile::CV / 4]) {
    const uint32_t am = absmax_n(xv);
    c.my_amax = max(c.my_amax, am);
    encode_fp8(xv, c.mult, c.e5m2, scaled_nonfinite(am, c.mult), w);
  }

  static __device__ __forceinline__ void transposed_col_scale(const Ctx&, const Args&, const uint32_t*,
                                                              const TilePos&, int, int, int64_t, int64_t) {}

  // ---- dequantize (csrc/tile/dequantize.cuh): every element times the one scale_inv ----------------------
  using DequantArgs = Fp8TensorDequantArgs;
  static constexpr bool kDequantWholeChunks = false;
  struct DequantCtx {
    float s;
  };
  static __device__ __forceinline__ DequantCtx dequant_init(const DequantArgs& a) { return {__ldg(a.scale_inv)}; }
  static __device__ __forceinline__ void dequant16(const DequantCtx& c, const DequantArgs& a, int64_t, int64_t,
                                                   const uint32_t (&w)[4], float (&o)[16]) {
    decode_fp8_16(w, a.e5m2, c.s, o);
  }
};

}  // namespace hybridq
