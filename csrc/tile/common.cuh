// Tile machinery shared by every block format's quantization kernel (csrc/tile/skeleton.cuh): the tile geometry,
// shared-memory loads of a 16-byte-chunk XOR-swizzled tile, the cp.async pipeline and its launch configurations,
// the persistent tile order, warp reductions, FP8 encoders and byte stores. Nothing here knows a format.
#pragma once

#include <type_traits>

#include "../numerics.cuh"

namespace hybridq {

constexpr int kTileGroupDefault = 1;  // tile rows per group of the persistent tile order (1: row-major)

namespace tile {
constexpr int TM = 128;  // tile rows (along M)
constexpr int TK = 128;  // tile columns (along K)
constexpr int VR = 32;   // elements per row-phase task
constexpr int CV = 32;   // rows per column-phase task
constexpr int LANES_PER_ROW = TK / VR;
constexpr int ROW_TASKS = TM * TK / VR;
}  // namespace tile

template <int L>
__device__ __forceinline__ uint32_t group_max(uint32_t v) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <typename T>
__device__ __forceinline__ float half_bits_to_f32(uint32_t b);
template <>
__device__ __forceinline__ float half_bits_to_f32<__nv_bfloat16>(uint32_t b) {
  return u2f((b & 0xFFFFu) << 16);
}
template <>
__device__ __forceinline__ float half_bits_to_f32<__half>(uint32_t b) {
  __half_raw r;
  r.x = static_cast<unsigned short>(b & 0xFFFFu);
  return to_f32(__half(r));
}

template <typename T>
__device__ __forceinline__ T zero_of() {
  if constexpr (sizeof(T) == 4) {
    return 0.0f;
  } else {
    typename std::conditional<std::is_same<T, __half>::value, __half_raw, __nv_bfloat16_raw>::type r;
    r.x = 0;
    return T(r);
  }
}

// 8 consecutive elements from shared memory (16-byte aligned), as fp32
template <typename T>
__device__ __forceinline__ void smem_load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = half_bits_to_f32<T>(w[i]);
      v[2 * i + 1] = half_bits_to_f32<T>(w[i] >> 16);
    }
  }
}

// Physical 16-byte chunk of logical chunk c (0..15) of tile row r, for 16-bit tiles (fp32 tiles: unswizzled).
template <typename T>
__device__ __forceinline__ int swz(int r, int c) {
  if constexpr (sizeof(T) == 2) {
    return c ^ ((c >> 3) << 1) ^ (r & 1);
  } else {
    return c;
  }
}

// Element offset of (row r, column col) in the tile
template <typename T>
__device__ __forceinline__ int tile_off(int r, int col) {
  if constexpr (sizeof(T) == 2) {
    return r * tile::TK + swz<T>(r, col >> 3) * 8 + (col & 7);
  } else {
    return r * tile::TK + col;
  }
}

// The 32 elements of tile row r from column 32 v, as fp32
template <typename T>
__device__ __forceinline__ void smem_load_row32(const T* ts, int r, int v, float (&x)[32]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float q[8];
    if constexpr (sizeof(T) == 2) {
      smem_load8(ts + r * tile::TK + swz<T>(r, 4 * v + j) * 8, q);
    } else {
      smem_load8(ts + r * tile::TK + 32 * v + 8 * j, q);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) x[8 * j + i] = q[i];
  }
}

// The 32 elements of tile row r from column 32 v as 16 packed words (16-bit tiles; element 2i in word i's low half)
template <typename T>
__device__ __forceinline__ void smem_load_row32_words(const T* ts, int r, int v, uint32_t (&w)[16]) {
  static_assert(sizeof(T) == 2, "packed words of 16-bit tiles");
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 q = *reinterpret_cast<const uint4*>(ts + r * tile::TK + swz<T>(r, 4 * v + j) * 8);
    w[4 * j] = q.x;
    w[4 * j + 1] = q.y;
    w[4 * j + 2] = q.z;
    w[4 * j + 3] = q.w;
  }
}

// Store NW*4 bytes (the first nvalid of them) with the widest aligned stores.
template <int NW>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint32_t (&w)[NW], int nvalid) {
  constexpr int NB = NW * 4;
  const uintptr_t p = reinterpret_cast<uintptr_t>(dst);
  if (nvalid >= NB) {
    if constexpr (NW % 4 == 0) {
      if ((p & 15) == 0) {
#pragma unroll
        for (int q = 0; q < NW / 4; ++q)
          reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        return;
      }
    }
    if constexpr (NW % 2 == 0) {
      if ((p & 7) == 0) {
#pragma unroll
        for (int q = 0; q < NW / 2; ++q) reinterpret_cast<uint2*>(dst)[q] = make_uint2(w[2 * q], w[2 * q + 1]);
        return;
      }
    }
    if ((p & 3) == 0) {
#pragma unroll
      for (int q = 0; q < NW; ++q) reinterpret_cast<uint32_t*>(dst)[q] = w[q];
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < NB; ++i)
    if (i < nvalid) dst[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
}

// ---- fast encoders --------------------------------------------------------------------------------------
// Two fp32 -> two fp8 (satfinite, RNE) in one instruction: equal to fp8_satfinite() for every finite input
// (the instruction clamps out-of-range values to +-max like the clamp-then-cast of the contract; it would also
// clamp +-inf, which the non-finite rule forbids: encode_fp8 routes those blocks to the exact path).
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

// Whether x * mult is non-finite for some x of a block whose max |x| has the bits `amax_bits` (mult > 0 or NaN):
// the product is monotonic in |x|, so the block's largest product decides (docs/numerics.md "Non-finite values").
__device__ __forceinline__ bool scaled_nonfinite(uint32_t amax_bits, float mult) {
  return abs_bits(u2f(amax_bits) * mult) >= 0x7F800000u;
}

// N values (N % 4 == 0) times mult, to fp8 bytes packed in words. `exact`: some product is non-finite (see
// scaled_nonfinite): the per-element rules of the reference (NaN signs, +-inf) instead of the paired instruction.
template <int N>
__device__ __forceinline__ void encode_fp8(const float (&x)[N], float mult, bool e5m2, bool exact,
                                           uint32_t (&w)[N / 4]) {
  if (!exact) {
    if (e5m2) {
#pragma unroll
      for (int q = 0; q < N / 4; ++q)
        w[q] = fp8x2<true>(x[4 * q] * mult, x[4 * q + 1] * mult) |
               (fp8x2<true>(x[4 * q + 2] * mult, x[4 * q + 3] * mult) << 16);
    } else {
#pragma unroll
      for (int q = 0; q < N / 4; ++q)
        w[q] = fp8x2<false>(x[4 * q] * mult, x[4 * q + 1] * mult) |
               (fp8x2<false>(x[4 * q + 2] * mult, x[4 * q + 3] * mult) << 16);
    }
  } else {  // exact per-element rules (inline: an out-of-line call would put x and w in local memory)
#pragma unroll
    for (int q = 0; q < N / 4; ++q) w[q] = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i)
      w[i / 4] |= static_cast<uint32_t>(fp8_satfinite(mul_ref(x[i], mult), e5m2)) << (8 * (i % 4));
  }
}

// 16 fp8 codes (4 words, little-endian bytes) times one scale, each product rounded as the reference rounds it
__device__ __forceinline__ void decode_fp8_16(const uint32_t (&w)[4], bool e5m2, float s, float (&o)[16]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j] = mul_ref(fp8_to_f32(static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4))), e5m2), s);
}

template <int N>
__device__ __forceinline__ uint32_t absmax_n(const float (&x)[N]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, abs_bits(x[i]));
  return m;
}

// ---- magnitudes of packed 16-bit pairs -------------------------------------------------------------------
// max(|a|, |b|) of each 16-bit half (bf16 / fp16 by T), one instruction; a NaN in either operand gives a NaN (the
// sign bit of a result is the xor of the operands' and means nothing: callers drop it)
template <typename T>
__device__ __forceinline__ uint32_t hmax_abs2(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  }
  return r;
}

// Each half's max |x| over N words (a tree of N - 1 packed maxes)
template <typename T, int N>
__device__ __forceinline__ uint32_t hmax_abs_words(const uint32_t* w) {
  static_assert(N >= 2 && (N & (N - 1)) == 0, "a power of two of words");
  uint32_t m[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) m[i] = hmax_abs2<T>(w[2 * i], w[2 * i + 1]);
#pragma unroll
  for (int n = N / 4; n >= 1; n /= 2) {
#pragma unroll
    for (int i = 0; i < n; ++i) m[i] = hmax_abs2<T>(m[2 * i], m[2 * i + 1]);
  }
  return m[0];
}

// The 16-bit value in the low half of h (its sign ignored) as the fp32 bits of its magnitude: equal to abs_bits of
// the converted value for every non-NaN value, and above inf's bits for a NaN
template <typename T>
__device__ __forceinline__ uint32_t half_mag_bits(uint32_t h) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return (h & 0x7FFFu) << 16;
  } else {
    __half_raw r;
    r.x = static_cast<unsigned short>(h & 0x7FFFu);
    return f2u(__half2float(__half(r)));
  }
}

// max |x| over the 2N values of N words as fp32 bits (absmax_n of the converted values, up to which NaN)
template <typename T, int N>
__device__ __forceinline__ uint32_t absmax_words(const uint32_t* w) {
  const uint32_t m = hmax_abs_words<T, N>(w);
  return half_mag_bits<T>(hmax_abs2<T>(m, m >> 16));
}

// Columns c0, c0 + 1 (c0 even) of tile rows r0 .. r0 + CV - 1 (r0 even): values as fp32
template <typename T>
__device__ __forceinline__ void smem_load_col_pair(const T* ts, int r0, int c0, float (&a)[tile::CV],
                                                   float (&b)[tile::CV]) {
  const int off0 = tile_off<T>(r0, c0), off1 = tile_off<T>(r0 + 1, c0) - tile::TK;  // even / odd rows
#pragma unroll
  for (int i = 0; i < tile::CV; ++i) {
    const T* p = ts + i * tile::TK + ((i & 1) ? off1 : off0);
    if constexpr (sizeof(T) == 4) {
      const float2 f = *reinterpret_cast<const float2*>(p);
      a[i] = f.x;
      b[i] = f.y;
    } else {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
      a[i] = half_bits_to_f32<T>(w);
      b[i] = half_bits_to_f32<T>(w >> 16);
    }
  }
}

// FP8 byte tile: the row phase's fp8 output kept in shared memory when the columnwise part is its exact transpose
// (one scale for both directions). Word q (4 bytes) of tile row r sits at word q ^ (4 * (((r >> 4) ^ r) & 7)) of
// that row: the column phase's reads (a warp = 8 strips of 16 rows x 4 word columns) hit 32 distinct banks, the row
// phase's 16-byte groups of 4 words stay contiguous, and its 16-byte stores (8 lanes = 2 adjacent rows x 4 quarters)
// fill all 8 bank groups: the (r & 1) term separates the two rows (without it: 2-way conflicts, 8 wavefronts per
// warp store instead of 4, Nsight 2026-11-27).
__device__ __forceinline__ int byte_tile_word(int r, int q) {
  return r * (tile::TK / 4) + (q ^ ((((r >> 4) ^ r) & 7) << 2));
}

// Staged columnwise output: [TK] rows of CB bytes (rows of the transposed tile), as 16-byte chunks. Chunk j of row c
// sits at chunk index L ^ ((c >> 1) & 7) inside its 128-byte line (L = c * CB / 16 + j; a line holds 128 / CB whole
// rows, which share the XOR): the column phase's 16-byte stores (8 lanes = 8 columns 2 apart, one chunk each) fill
// all 8 bank groups, and the copy-out's reads (8 lanes = one 128-byte line) do too. (A row pitch of CB + 16 bytes
// left the stores 2-way conflicted, Nsight 2026-11-27.)
template <int CB>
__device__ __forceinline__ int stage_chunk(int c, int j) {
  static_assert(CB == 64 || CB == 128, "staged rows of 64 (fp4) or 128 (fp8) bytes");
  const int L = c * (CB / 16) + j;
  return (L & ~7) | ((L & 7) ^ ((c >> 1) & 7));
}

// Rows 4u .. 4u + 3 (one word each: 4 consecutive columns) -> columns 0 .. 3 (one word each: the 4 rows)
__device__ __forceinline__ void transpose4x4_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&o)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);  // a0 b0 a1 b1 / a2 b2 a3 b3
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  o[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  o[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  o[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  o[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// Launch configuration of the tile kernel: threads per CTA, shared-memory stages (tiles in flight per CTA), and
// the CTAs per SM the register budget is sized for (__launch_bounds__). STAGES == 1 with one CTA per tile is the
// original one-shot kernel (load, wait, compute); STAGES >= 2 makes the CTAs persistent: each loops over tiles
// (stride gridDim.x) and issues the cp.async loads of the tile STAGES-1 ahead before it processes the current
// one, so loads stay in flight while it computes and stores. A row map (RowMap, csrc/tile/skeleton.cuh): the kernel
// reads its rows through TileArgs::src_rows (separate instantiations, so the kernels without a map compile as before).
enum class RowMap : int {
  kNone,
  kLoads,          // the input's rows are read through the map; the outputs are the mapped [M, K]'s (block formats)
  kLoadsAndRows,   // ... and the rowwise part goes to the input's rows (per-tensor: the padded columnwise layout)
};
template <int NT_, int STAGES_, int MINB_, RowMap MAP_ = RowMap::kNone>
struct TileCfg {
  static constexpr int NT = NT_;
  static constexpr int STAGES = STAGES_;
  static constexpr int MINB = MINB_;
  static constexpr bool ROW_MAP = MAP_ != RowMap::kNone;          // loads through src_rows
  static constexpr bool MAP_ROWS = MAP_ == RowMap::kLoadsAndRows;  // rowwise output to the input's rows
};
using CfgOneShot = TileCfg<256, 1, 2>;  // the original kernel (one tile per CTA, 128 registers)
using CfgPipe2 = TileCfg<256, 2, 2>;    // default: 2 CTAs/SM, each double-buffered (4 tiles of smem per SM)
using CfgPipe3W = TileCfg<512, 3, 1>;   // 1 CTA/SM of 16 warps, 3 stages
using CfgPipe2RowMap = TileCfg<256, 2, 2, RowMap::kLoadsAndRows>;  // CfgPipe2 reading and writing rows by a map
using CfgPipe2Slots = TileCfg<256, 2, 2, RowMap::kLoads>;          // CfgPipe2 reading its rows through a map

// Issue the loads of one TM x TK tile into `ts` (zero-filled outside the tensor): 16-byte cp.async when rows are
// 16-byte aligned, else plain loads (synchronous; ordered by the caller's barriers like the async ones).
template <typename T, int NT>
__device__ __forceinline__ void load_tile(T* ts, const T* x, int64_t M, int64_t K, int64_t m0, int64_t k0, bool vec,
                                          int tid) {
  using namespace tile;
  constexpr int CH = 16 / static_cast<int>(sizeof(T));
  constexpr int CPR = TK / CH;     // 16-byte chunks per tile row
  constexpr int RSTEP = NT / CPR;  // tile rows per pass of the CTA
  if (vec && m0 + TM <= M && k0 + TK <= K) {
    // whole tile: a thread's chunks are RSTEP rows apart, so one source pointer and one tile offset advance by
    // constants (the general loop below spends ~30 instructions of 64-bit index math per 16-byte copy); RSTEP is
    // even, so the chunk's swizzle (row parity) is the same in every pass
    static_assert(NT % CPR == 0 && RSTEP % 2 == 0 && TM % RSTEP == 0, "whole passes of even row steps");
    const int r0 = tid / CPR, c = (tid % CPR) * CH;
    const T* src = x + (m0 + r0) * K + k0 + c;
    T* dst = ts + tile_off<T>(r0, c);
#pragma unroll
    for (int p = 0; p < TM / RSTEP; ++p) cp_async16(dst + p * RSTEP * TK, src + p * RSTEP * K, 16);
  } else if (vec) {
#pragma unroll 4
    for (int i = tid; i < TM * TK / CH; i += NT) {
      const int r = i / (TK / CH), c = (i % (TK / CH)) * CH;
      const int64_t gm = m0 + r, gk = k0 + c;
      const bool in = gm < M && gk < K;
      cp_async16(ts + tile_off<T>(r, c), in ? static_cast<const void*>(x + gm * K + gk) : static_cast<const void*>(x),
                 in ? 16 : 0);
    }
  } else {
    for (int i = tid; i < TM * TK; i += NT) {
      const int r = i / TK, c = i % TK;
      const int64_t gm = m0 + r, gk = k0 + c;
      ts[tile_off<T>(r, c)] = (gm < M && gk < K) ? x[gm * K + gk] : zero_of<T>();
    }
  }
}

// The row map's loads (Cfg::ROW_MAP, csrc/tile/skeleton.cuh): tile row r is input row src_rows[m0 + r] (< 0: a zero
// row). A thread's chunks are the rows r0 + p * RSTEP (r0 = tid / CPR) of every tile, as in load_tile's whole-tile
// path, so their map entries can be fetched a tile ahead (map_rows, into registers: the loads issue without waiting
// on them) and handed in as `src`; s_rows gets the tile's map for the row phase. Inputs that are not 16-byte
// vectorizable read the map entries here instead (element loads).
template <typename T, int NT>
struct RowMapLoads {
  static constexpr int CH = 16 / static_cast<int>(sizeof(T));
  static constexpr int CPR = tile::TK / CH;
  static constexpr int RSTEP = NT / CPR;
  static constexpr int NP = tile::TM / RSTEP;  // rows per thread
};

template <typename T, int NT>
__device__ __forceinline__ void map_rows(const int32_t* src_rows, int64_t M, int64_t m0, int tid,
                                         int32_t (&src)[RowMapLoads<T, NT>::NP]) {
  using L = RowMapLoads<T, NT>;
  const int r0 = tid / L::CPR;
#pragma unroll
  for (int p = 0; p < L::NP; ++p) {
    const int64_t m = m0 + r0 + p * L::RSTEP;
    src[p] = m < M ? __ldg(src_rows + m) : -1;
  }
}

template <typename T, int NT>
__device__ __forceinline__ void load_tile_mapped(T* ts, int32_t* s_rows, const T* x, const int32_t* src_rows,
                                                 int64_t M, int64_t K, int64_t m0, int64_t k0, bool vec, int tid,
                                                 const int32_t (&src)[RowMapLoads<T, NT>::NP]) {
  using namespace tile;
  using L = RowMapLoads<T, NT>;
  if (vec) {
    const int r0 = tid / L::CPR, c = (tid % L::CPR) * L::CH;
    const int64_t gk = k0 + c;
#pragma unroll
    for (int p = 0; p < L::NP; ++p) {
      const int r = r0 + p * L::RSTEP;
      const bool in = src[p] >= 0 && gk < K;
      const void* from = in ? static_cast<const void*>(x + src[p] * K + gk) : static_cast<const void*>(x);
      cp_async16(ts + tile_off<T>(r, c), from, in ? 16 : 0);
      if (c == 0) s_rows[r] = src[p];
    }
  } else {
    for (int i = tid; i < TM * TK; i += NT) {
      const int r = i / TK, c = i % TK;
      const int64_t m = m0 + r, gk = k0 + c;
      const int64_t sm = m < M ? src_rows[m] : -1;
      ts[tile_off<T>(r, c)] = (sm >= 0 && gk < K) ? x[sm * K + gk] : zero_of<T>();
      if (c == 0) s_rows[r] = static_cast<int32_t>(sm);
    }
  }
}

// Tile t of the launch order -> (tile row, tile column): groups of G tile rows, column-major inside a group, so that
// the tiles in flight at once share both input rows (rowwise side) and output rows (columnwise side)
__device__ __forceinline__ void tile_coords(int64_t t, int64_t tiles_m, int64_t tiles_k, int G, int64_t& tm,
                                            int64_t& tk) {
  if (G <= 1) {
    tm = t / tiles_k;
    tk = t % tiles_k;
    return;
  }
  const int64_t per_group = static_cast<int64_t>(G) * tiles_k;
  const int64_t g = t / per_group, in = t % per_group;
  const int64_t first = g * G, rows = min64(G, tiles_m - first);
  tm = first + in % rows;
  tk = in / rows;
}

int tile_num_sms();
int tile_cfg_override();   // HYBRIDQ_TILE_CFG (benchmarks): -1 default, 0 one-shot, 1 pipe2, 2 pipe3w
int tile_group_default();  // HYBRIDQ_TILE_GROUP (benchmarks), else the default tile order

// Runs the statement(s) with T bound to the C++ type of an InType.
#define HQ_DISPATCH_IN(t, ...)              \
  switch (t) {                              \
    case InType::kF32: {                    \
      using T = float;                      \
      __VA_ARGS__;                          \
    }                                       \
    case InType::kBF16: {                   \
      using T = __nv_bfloat16;              \
      __VA_ARGS__;                          \
    }                                       \
    case InType::kF16: {                    \
      using T = __half;                     \
      __VA_ARGS__;                          \
    }                                       \
    default:                                \
      return cudaErrorInvalidValue;         \
  }

}  // namespace hybridq
