// One fused quantization kernel for every block format: a CTA loads a 128x128 tile of the [M, K] input into
// shared memory once, then writes the rowwise part ([M, K], blocks along K) and the columnwise part
// ([K, M], the transpose, blocks along M) from it. The CTAs are persistent and keep the next tile's loads in
// flight while they process the current one (TileCfg). 16-bit tiles are stored with the 16-byte chunks of each
// row XOR-swizzled (swz), which makes the 64-byte row reads, the 32-bit column reads and the cp.async writes
// all free of bank conflicts.
//
//   row phase:    a task is 32 consecutive elements of one tile row (4 lanes per row): one MX block, two NVFP4
//                 blocks, a quarter of a 1x128 block (2 warp shuffles); 32 fp8 bytes / 16 fp4 bytes per store.
//   column phase: a task is 32 consecutive rows of one tile column (lane = column, conflict-free); a block
//                 along M of <= 32 elements is inside one task (FP8 128x1 blocks: 4 tasks, via shared
//                 memory); 32 fp8 bytes / 16 fp4 bytes per store.
//   2-D tiles:    a pre-phase reduces each S x S tile's amax into shared memory (atomicMax on |x| bits).
//   one scale for both directions (per-tensor FP8, 2-D FP8 128x128 and MXFP8 32x32 tiles), both requested: the
//                 row phase also keeps its fp8 bytes in shared memory and the column phase writes their byte
//                 transpose (4 columns x 16 rows per task) instead of converting the tile a second time.
#pragma once

#include <type_traits>

#include "numerics.cuh"

namespace hybridq {

enum class Fmt : int { kFp8Tensor = 0, kFp8Block = 1, kMxfp8 = 2, kNvfp4 = 3 };

constexpr int kTileGroupDefault = 1;  // tile rows per group of the persistent tile order (1: row-major)

namespace tile {
constexpr int TM = 128;  // tile rows (along M)
constexpr int TK = 128;  // tile columns (along K)
constexpr int NT = 256;  // threads per CTA
constexpr int VR = 32;   // elements per row-phase task
constexpr int CV = 32;   // rows per column-phase task
constexpr int LANES_PER_ROW = TK / VR;
constexpr int ROW_TASKS = TM * TK / VR;
constexpr int COL_TASKS = TK * (TM / CV);
}  // namespace tile

template <Fmt F>
__host__ __device__ constexpr int block_len() {
  return F == Fmt::kFp8Block ? 128 : (F == Fmt::kMxfp8 ? 32 : (F == Fmt::kNvfp4 ? 16 : 1));
}

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

// MXFP8 scale byte at (r, c) of a [rows, cols] scale matrix, compact or GEMM-swizzled (FORMATS.md)
__device__ __forceinline__ void write_mx_scale(void* s, int64_t r, int64_t c, int64_t cols, bool swizzle,
                                               int64_t cols_pad, uint8_t e) {
  uint8_t* p = static_cast<uint8_t*>(s);
  if (swizzle) {
    p[((r >> 7) * (cols_pad >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3)] = e;
  } else {
    p[r * cols + c] = e;
  }
}

__device__ __forceinline__ void philox_unpack(const PhiloxArgs& p, uint64_t& seed, uint64_t& offset) {
  if (p.captured) {
    seed = static_cast<uint64_t>(*p.seed_ptr);
    offset = static_cast<uint64_t>(*p.offset_ptr) + p.offset_intragraph;
  } else {
    seed = p.seed;
    offset = p.offset;
  }
}

// ---- fast encoders --------------------------------------------------------------------------------------
// Two fp32 -> two fp8 (satfinite, RNE) in one instruction: equal to satfinite() for every non-NaN input
// (the instruction clamps +-inf and out-of-range values to +-max like the clamp-then-cast of the contract).
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

// N values (N % 4 == 0) times mult, to fp8 bytes packed in words. `slow`: the block holds a NaN (or mult is
// NaN): exact per-element NaN-sign rules of the reference.
template <int N>
__device__ __forceinline__ void encode_fp8(const float (&x)[N], float mult, bool e5m2, bool slow,
                                           uint32_t (&w)[N / 4]) {
  if (!slow) {
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
  } else {  // exact per-element NaN rules (inline: an out-of-line call would put x and w in local memory)
#pragma unroll
    for (int q = 0; q < N / 4; ++q) w[q] = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i)
      w[i / 4] |= static_cast<uint32_t>(fp8_satfinite(mul_ref(x[i], mult), e5m2)) << (8 * (i % 4));
  }
}

template <int N>
__device__ __forceinline__ uint32_t absmax_n(const float (&x)[N]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, abs_bits(x[i]));
  return m;
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
// (one scale for both directions). Word q (4 bytes) of tile row r sits at word q ^ (4 * ((r >> 4) & 7)) of that
// row: the column phase's reads (a warp = 8 strips of 16 rows x 4 word columns) then hit 32 distinct banks, and
// the row phase's 16-byte groups of 4 words stay contiguous.
__device__ __forceinline__ int byte_tile_word(int r, int q) {
  return r * (tile::TK / 4) + (q ^ (((r >> 4) & 7) << 2));
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
// one, so loads stay in flight while it computes and stores.
template <int NT_, int STAGES_, int MINB_>
struct TileCfg {
  static constexpr int NT = NT_;
  static constexpr int STAGES = STAGES_;
  static constexpr int MINB = MINB_;
};
using CfgOneShot = TileCfg<256, 1, 2>;  // the original kernel (one tile per CTA, 128 registers)
using CfgPipe2 = TileCfg<256, 2, 2>;    // default: 2 CTAs/SM, each double-buffered (4 tiles of smem per SM)
using CfgPipe3W = TileCfg<512, 3, 1>;   // 1 CTA/SM of 16 warps, 3 stages

// Issue the loads of one TM x TK tile into `ts` (zero-filled outside the tensor): 16-byte cp.async when rows are
// 16-byte aligned, else plain loads (synchronous; ordered by the caller's barriers like the async ones).
template <typename T, int NT>
__device__ __forceinline__ void load_tile(T* ts, const T* x, int64_t M, int64_t K, int64_t m0, int64_t k0, bool vec,
                                          int tid) {
  using namespace tile;
  constexpr int CH = 16 / static_cast<int>(sizeof(T));
  if (vec) {
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

template <typename T, Fmt F, bool TWO_D, bool SR, class Cfg>
__global__ void __launch_bounds__(Cfg::NT, Cfg::MINB) quantize_tile_kernel(const QuantArgs a) {
  using namespace tile;
  constexpr int NT = Cfg::NT;
  constexpr int STAGES = Cfg::STAGES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const stages = reinterpret_cast<T*>(smem_raw);  // [STAGES][TM][TK]

  constexpr int S = block_len<F>();
  constexpr int NTILE2D = TWO_D ? (TM / S) * (TK / S) : 1;
  constexpr bool COL_SPLIT = (F == Fmt::kFp8Block) && !TWO_D;  // 128-row column blocks span 4 tasks
  // one scale for both directions: the columnwise part is the byte transpose of the rowwise part (when both are
  // requested), done from the row phase's output in shared memory instead of converting the tile again
  constexpr bool COL_FROM_ROW = F == Fmt::kFp8Tensor || (TWO_D && (F == Fmt::kFp8Block || F == Fmt::kMxfp8));
  constexpr int NPAIR = TK / 2;                                 // column-phase tasks: column pairs x chunks
  constexpr int COL_PAIR_TASKS = NPAIR * (TM / CV);
  __shared__ uint32_t s_tile_amax[NTILE2D];
  __shared__ uint32_t s_part[COL_SPLIT ? (TM / CV) * TK : 1];
  __shared__ uint32_t s_red[NT / 32];
  // NVFP4: the element multiplier of every E4M3 scale byte (rowwise / columnwise global scale), computed once per
  // CTA with the same function as before: a table lookup instead of two IEEE divisions per 16-block
  __shared__ float s_enc_tab[F == Fmt::kNvfp4 ? 2 : 1][F == Fmt::kNvfp4 ? 256 : 1];

  // columnwise output staged in shared memory ([TK] rows of the transposed tile), then written as
  // contiguous row segments: direct 16-byte stores at an M-byte stride serialize on the memory partitions
  constexpr int CB = (F == Fmt::kNvfp4) ? TM / 2 : TM;  // bytes per staged row
  constexpr int SO_STRIDE = CB + 16;                    // padded: fewer bank conflicts
  uint8_t* const so = smem_raw + static_cast<size_t>(STAGES) * TM * TK * sizeof(T);

  const int tid = threadIdx.x;
  const int64_t M = a.M, K = a.K;
  const int64_t tiles_k = (K + TK - 1) / TK;
  const int64_t tiles_m = (M + TM - 1) / TM;
  const int64_t ntiles = tiles_m * tiles_k;
  const T* x = static_cast<const T*>(a.x);
  const bool vec = (K % (16 / static_cast<int>(sizeof(T))) == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  // rowwise / columnwise output rows start 16-byte aligned (the full-tile fast paths store 16 bytes at a time)
  const int64_t row_bytes = F == Fmt::kNvfp4 ? K / 2 : K, col_bytes = F == Fmt::kNvfp4 ? M / 2 : M;
  const bool row_vec16 = a.row_q != nullptr && row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(a.row_q) & 15) == 0;
  const bool col_vec16 = a.col_q != nullptr && col_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(a.col_q) & 15) == 0;
  const bool transpose_cols = COL_FROM_ROW && a.rowwise && a.columnwise;
  uint32_t* const byte_tile = reinterpret_cast<uint32_t*>(so);  // [TM][TK / 4] words, byte_tile_word (fits in so)

  // ---- per-tensor values ------------------------------------------------------------------------------
  float pt_mult = 1.0f;
  if constexpr (F == Fmt::kFp8Tensor) {
    pt_mult = a.scale_in != nullptr ? *a.scale_in : scale_from_amax(*a.amax_in, a.fp8_max, a.eps, a.pow2);
    if (blockIdx.x == 0 && tid == 0 && a.scale_inv_out != nullptr) *a.scale_inv_out = 1.0f / pt_mult;
  }
  float s_enc_row = 1.0f, s_enc_col = 1.0f;
  uint64_t seed = 0, offset = 0;
  if constexpr (F == Fmt::kNvfp4) {
    if (a.amax_row != nullptr) s_enc_row = nvfp4_global_encode(*a.amax_row);
    if (a.amax_col != nullptr) s_enc_col = nvfp4_global_encode(*a.amax_col);
    if constexpr (SR) philox_unpack(a.philox, seed, offset);
    for (int i = tid; i < 256; i += NT) {  // visible after the first barrier of the tile loop
      s_enc_tab[0][i] = nvfp4_elem_mult(static_cast<uint8_t>(i), s_enc_row);
      s_enc_tab[1][i] = nvfp4_elem_mult(static_cast<uint8_t>(i), s_enc_col);
    }
  }
  const float rcp_max = 1.0f / a.fp8_max;  // MXFP8: multiply by the rounded reciprocal, not a division
  const bool e5m2 = a.e5m2;

  uint32_t my_amax = 0;  // per-tensor |x| max (delayed scaling records it)

  // ---- pipeline prologue: the first STAGES-1 tiles of this CTA ----------------------------------------
  int64_t tile = blockIdx.x;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int64_t t = tile + static_cast<int64_t>(s) * gridDim.x;
    if (t < ntiles) {
      int64_t lm, lk;
      tile_coords(t, tiles_m, tiles_k, a.tile_group, lm, lk);
      load_tile<T, NT>(stages + static_cast<size_t>(s) * TM * TK, x, M, K, lm * TM, lk * TK, vec, tid);
    }
    cp_async_commit();
  }

  for (int it = 0; tile < ntiles; ++it, tile += gridDim.x) {
    // issue the tile STAGES-1 ahead into the stage the previous iteration consumed (STAGES == 1: this tile)
    {
      const int64_t t = tile + static_cast<int64_t>(STAGES - 1) * gridDim.x;
      if (t < ntiles) {
        int64_t lm, lk;
        tile_coords(t, tiles_m, tiles_k, a.tile_group, lm, lk);
        load_tile<T, NT>(stages + static_cast<size_t>((it + STAGES - 1) % STAGES) * TM * TK, x, M, K, lm * TM,
                         lk * TK, vec, tid);
      }
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();  // this thread's copies of the current tile have landed
    if constexpr (TWO_D) {
      for (int i = tid; i < NTILE2D; i += NT) s_tile_amax[i] = 0u;
    }
    __syncthreads();  // everyone's copies are visible

    const T* ts = stages + static_cast<size_t>(it % STAGES) * TM * TK;  // [TM][TK], swizzled (tile_off)
    int64_t tm, tk;
    tile_coords(tile, tiles_m, tiles_k, a.tile_group, tm, tk);
    const int64_t m0 = tm * TM, k0 = tk * TK;
    const bool full = m0 + TM <= M && k0 + TK <= K;  // no bounds checks inside this tile

    // ---- 2-D tiles: amax of each S x S tile -----------------------------------------------------------
    // a warp's 32 tasks are 8 consecutive rows (aligned to 8, so inside one S-row block) x 4 quarters
    if constexpr (TWO_D) {
      for (int task = tid; task < ROW_TASKS; task += NT) {
        const int r = task / LANES_PER_ROW, v = task % LANES_PER_ROW;
        float xv[VR];
        smem_load_row32(ts, r, v, xv);
        uint32_t am0, am1 = 0;
        if constexpr (S == 16) {
          float h[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) h[i] = xv[i];
          am0 = absmax_n(h);
#pragma unroll
          for (int i = 0; i < 16; ++i) h[i] = xv[16 + i];
          am1 = absmax_n(h);
        } else {
          am0 = absmax_n(xv);
        }
#pragma unroll
        for (int o = 4; o < 32; o *= 2) {  // over the warp's 8 rows (lanes with the same quarter v)
          am0 = max(am0, __shfl_xor_sync(0xffffffffu, am0, o));
          if constexpr (S == 16) am1 = max(am1, __shfl_xor_sync(0xffffffffu, am1, o));
        }
        if constexpr (S == 128) am0 = group_max<4>(am0);  // and over the 4 quarters
        if ((tid & 31) < 4) {
          if constexpr (S == 128) {
            if ((tid & 31) == 0) atomicMax(&s_tile_amax[0], am0);
          } else if constexpr (S == 32) {
            atomicMax(&s_tile_amax[(r / 32) * (TK / 32) + v], am0);
          } else {
            atomicMax(&s_tile_amax[(r / 16) * (TK / 16) + 2 * v], am0);
            atomicMax(&s_tile_amax[(r / 16) * (TK / 16) + 2 * v + 1], am1);
          }
        }
      }
      __syncthreads();
      if constexpr (F == Fmt::kFp8Block) {
        if (tid == 0) {
          const float sc = scale_from_amax(u2f(s_tile_amax[0]), a.fp8_max, a.eps, a.pow2);
          if (a.rowwise) static_cast<float*>(a.row_s)[tm * tiles_k + tk] = 1.0f / sc;
          if (a.columnwise) static_cast<float*>(a.col_s)[tk * tiles_m + tm] = 1.0f / sc;
        }
      }
    }

    // ---- rowwise part: each task is 32 consecutive elements of one row ----------------------------------
    if (a.rowwise) {
      for (int task = tid; task < ROW_TASKS; task += NT) {
        const int r = task / LANES_PER_ROW, v = task % LANES_PER_ROW;
        const int64_t gm = m0 + r, gk = k0 + v * VR;
        const bool row_in = full || gm < M;
        int nvalid = VR;  // elements of this task inside the tensor
        if (!full) nvalid = row_in ? static_cast<int>(min64(VR, max64(0, K - gk))) : 0;
        float xv[VR];
        smem_load_row32(ts, r, v, xv);

        if constexpr (F == Fmt::kNvfp4) {
          uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            float g[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
            uint32_t tam;
            if constexpr (TWO_D) tam = s_tile_amax[(r / 16) * (TK / 16) + 2 * v + b];
            else tam = absmax_n(g);
            const uint8_t sc = nvfp4_block_scale(u2f(tam), s_enc_row);
            const float enc = s_enc_tab[0][sc];
            if (16 * b < nvalid) static_cast<uint8_t*>(a.row_s)[gm * (K / 16) + gk / 16 + b] = sc;
            float u[16];
            if constexpr (SR) {
              const uint64_t idx = static_cast<uint64_t>(gm * K + gk + 16 * b);  // K % 16 == 0: idx % 16 == 0
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                float u4[4];
                philox_uniform4(seed, offset, 0, idx / 4 + q, u4);
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
          uint8_t* dst = a.row_q + gm * (K / 2) + gk / 2;
          if (full && row_vec16) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
          } else if (nvalid > 0) {
            store_bytes(dst, w, nvalid / 2);
          }
        } else {
          const uint32_t am = absmax_n(xv);
          float mult;
          uint32_t nan_probe = am;
          if constexpr (F == Fmt::kFp8Tensor) {
            mult = pt_mult;
            my_amax = max(my_amax, am);
          } else if constexpr (F == Fmt::kFp8Block) {
            uint32_t bam;
            if constexpr (TWO_D) bam = s_tile_amax[0];
            else bam = group_max<LANES_PER_ROW>(am);
            mult = scale_from_amax(u2f(bam), a.fp8_max, a.eps, a.pow2);
            if (!TWO_D && v == 0 && row_in) static_cast<float*>(a.row_s)[gm * tiles_k + tk] = 1.0f / mult;
          } else {  // MXFP8: the task is one block
            uint32_t bam;
            if constexpr (TWO_D) bam = s_tile_amax[(r / 32) * (TK / 32) + v];
            else bam = am;
            const uint8_t e = e8m0_round_up(u2f(bam) * rcp_max);
            mult = e8m0_pow2(e, true);
            nan_probe = bam;  // a NaN block has a NaN multiplier
            if (nvalid > 0) write_mx_scale(a.row_s, gm, gk / 32, K / 32, a.swizzle, a.row_s_cols_pad, e);
          }
          uint32_t w[VR / 4];
          encode_fp8(xv, mult, e5m2, nan_probe > 0x7F800000u, w);
          if (transpose_cols) {
            reinterpret_cast<uint4*>(byte_tile)[byte_tile_word(r, 8 * v) / 4] = make_uint4(w[0], w[1], w[2], w[3]);
            reinterpret_cast<uint4*>(byte_tile)[byte_tile_word(r, 8 * v + 4) / 4] = make_uint4(w[4], w[5], w[6], w[7]);
          }
          uint8_t* dst = a.row_q + gm * K + gk;
          if (full && row_vec16) {
            reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
            reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
          } else if (nvalid > 0) {
            store_bytes(dst, w, nvalid);
          }
        }
      }
    }

    // ---- columnwise part as the transpose of the rowwise bytes: a task is 4 columns x 16 rows ------------------
    if (transpose_cols) {
      __syncthreads();  // the byte tile is complete
      for (int task = tid; task < (TM / 16) * (TK / 4); task += NT) {
        const int j = task % (TM / 16), q = task / (TM / 16);  // rows 16 j .. 16 j + 15, columns 4 q .. 4 q + 3
        uint32_t rw[16];
#pragma unroll
        for (int t = 0; t < 16; ++t) rw[t] = byte_tile[byte_tile_word(16 * j + t, q)];
        uint32_t cw[4][4];  // [column][word]: 16 bytes of one output row
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          uint32_t o[4];
          transpose4x4_bytes(rw[4 * u], rw[4 * u + 1], rw[4 * u + 2], rw[4 * u + 3], o);
#pragma unroll
          for (int i = 0; i < 4; ++i) cw[i][u] = o[i];
        }
        const int64_t gm = m0 + 16 * j;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t gk = k0 + 4 * q + i;
          uint8_t* dst = a.col_q + gk * M + gm;
          if (full && col_vec16) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(cw[i][0], cw[i][1], cw[i][2], cw[i][3]);
          } else if (gk < K && gm < M) {
            store_bytes(dst, cw[i], static_cast<int>(min64(16, M - gm)));
          }
          if constexpr (F == Fmt::kMxfp8) {  // 32x32 tiles: the tile's scale byte, once per 32-row block
            if (j % 2 == 0 && gk < K && gm < M) {
              const uint8_t e = e8m0_round_up(u2f(s_tile_amax[(j / 2) * (TK / 32) + (4 * q + i) / 32]) * rcp_max);
              write_mx_scale(a.col_s, gk, gm / 32, M / 32, a.swizzle, a.col_s_cols_pad, e);
            }
          }
        }
      }
    } else if (a.columnwise) {
      // ---- columnwise part: each task is two adjacent columns x CV rows -----------------------------------
      if constexpr (COL_SPLIT) {
        for (int task = tid; task < COL_PAIR_TASKS; task += NT) {
          const int c = 2 * (task % NPAIR), ch = task / NPAIR;
          float xa[CV], xb[CV];
          smem_load_col_pair(ts, ch * CV, c, xa, xb);
          s_part[ch * TK + c] = absmax_n(xa);
          s_part[ch * TK + c + 1] = absmax_n(xb);
        }
        __syncthreads();
      }
      for (int task = tid; task < COL_PAIR_TASKS; task += NT) {
        const int c0 = 2 * (task % NPAIR), ch = task / NPAIR;
        const int64_t gm0 = m0 + ch * CV;
        uint32_t wr[sizeof(T) == 4 ? 1 : CV];  // 16-bit inputs: the pair's words, one per row
        if constexpr (sizeof(T) != 4) {
          const int off0 = tile_off<T>(ch * CV, c0), off1 = tile_off<T>(ch * CV + 1, c0) - TK;  // even / odd rows
#pragma unroll
          for (int i = 0; i < CV; ++i)
            wr[i] = *reinterpret_cast<const uint32_t*>(ts + i * TK + ((i & 1) ? off1 : off0));
        }
#pragma unroll 1
        for (int t = 0; t < 2; ++t) {
          const int c = c0 + t;
          const int64_t gk = k0 + c;
          const int nvalid = full ? CV : (gk < K ? static_cast<int>(min64(CV, max64(0, M - gm0))) : 0);
          float xv[CV];
          if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int i = 0; i < CV; ++i) xv[i] = to_f32(ts[tile_off<T>(ch * CV + i, c)]);
          } else {
#pragma unroll
            for (int i = 0; i < CV; ++i) xv[i] = half_bits_to_f32<T>(t ? (wr[i] >> 16) : wr[i]);
          }

          if constexpr (F == Fmt::kNvfp4) {
            uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int b = 0; b < CV / 16; ++b) {
              float g[16];
#pragma unroll
              for (int i = 0; i < 16; ++i) g[i] = xv[16 * b + i];
              uint32_t bam;
              float s_enc;
              int tab;
              if constexpr (TWO_D) {
                bam = s_tile_amax[((ch * CV + 16 * b) / 16) * (TK / 16) + c / 16];
                s_enc = s_enc_row;  // one global amax for both directions
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
                s_enc = s_enc_col;
                tab = 1;
              }
              const uint8_t s = nvfp4_block_scale(u2f(bam), s_enc);
              const float enc = s_enc_tab[tab][s];
              if (16 * b < nvalid) static_cast<uint8_t*>(a.col_s)[gk * (M / 16) + gm0 / 16 + b] = s;
              float u[16];
              if constexpr (SR) {
                if constexpr (TWO_D) {  // the same draw as the rowwise element (m, k): columnwise = transpose
#pragma unroll
                  for (int i = 0; i < 16; ++i) {
                    const uint64_t idx = static_cast<uint64_t>((gm0 + 16 * b + i) * K + gk);
                    float u4[4];
                    philox_uniform4(seed, offset, 0, idx / 4, u4);
                    const int sel = static_cast<int>(idx % 4);
                    u[i] = sel == 0 ? u4[0] : (sel == 1 ? u4[1] : (sel == 2 ? u4[2] : u4[3]));
                  }
                } else {
                  const uint64_t idx = static_cast<uint64_t>(gk * M + gm0 + 16 * b);  // M % 16 == 0
#pragma unroll
                  for (int q = 0; q < 4; ++q) {
                    float u4[4];
                    philox_uniform4(seed, offset, 1, idx / 4 + q, u4);
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
            *reinterpret_cast<uint4*>(so + c * SO_STRIDE + ch * (CV / 2)) = make_uint4(w[0], w[1], w[2], w[3]);
          } else {
            float mult;
            const uint32_t am = absmax_n(xv);
            uint32_t nan_probe = am;
            if constexpr (F == Fmt::kFp8Tensor) {
              mult = pt_mult;
              if (!a.rowwise) my_amax = max(my_amax, am);
            } else if constexpr (F == Fmt::kFp8Block) {
              uint32_t bam;
              if constexpr (TWO_D) {
                bam = s_tile_amax[0];
              } else {
                bam = max(max(s_part[c], s_part[TK + c]), max(s_part[2 * TK + c], s_part[3 * TK + c]));
              }
              mult = scale_from_amax(u2f(bam), a.fp8_max, a.eps, a.pow2);
              if (!TWO_D && ch == 0 && gk < K) static_cast<float*>(a.col_s)[gk * tiles_m + tm] = 1.0f / mult;
            } else {  // MXFP8
              uint32_t bam;
              if constexpr (TWO_D) bam = s_tile_amax[ch * (TK / 32) + c / 32];
              else bam = am;
              const uint8_t e = e8m0_round_up(u2f(bam) * rcp_max);
              mult = e8m0_pow2(e, true);
              nan_probe = bam;
              if (nvalid > 0) write_mx_scale(a.col_s, gk, gm0 / 32, M / 32, a.swizzle, a.col_s_cols_pad, e);
            }
            uint32_t w[CV / 4];
            encode_fp8(xv, mult, e5m2, nan_probe > 0x7F800000u, w);
            uint4* dst = reinterpret_cast<uint4*>(so + c * SO_STRIDE + ch * CV);
            dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
            dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
          }
        }
      }
      __syncthreads();
      // the staged [TK][CB] bytes: each output row gets one contiguous segment of up to CB bytes
      const int64_t row_len = (F == Fmt::kNvfp4) ? M / 2 : M;
      const int64_t seg0 = (F == Fmt::kNvfp4) ? m0 / 2 : m0;
      for (int i = tid; i < TK * (CB / 16); i += NT) {
        const int c = i / (CB / 16), j = i % (CB / 16);
        const int64_t gk = k0 + c, off = seg0 + j * 16;
        const uint4 v = *reinterpret_cast<const uint4*>(so + c * SO_STRIDE + j * 16);
        if (full && col_vec16) {
          *reinterpret_cast<uint4*>(a.col_q + gk * row_len + off) = v;
          continue;
        }
        if (gk >= K || off >= row_len) continue;
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        store_bytes(a.col_q + gk * row_len + off, w, static_cast<int>(min64(16, row_len - off)));
      }
    }
    __syncthreads();  // the stage, the staging buffer and the 2-D amaxes are free for the next tile
  }
  cp_async_wait<0>();  // nothing may be in flight when the CTA exits (only empty groups are left)

  // ---- per-tensor amax (delayed scaling) --------------------------------------------------------------
  if constexpr (F == Fmt::kFp8Tensor) {
    if (a.amax_out != nullptr) {
      const uint32_t wm = warp_max(my_amax);
      if ((tid & 31) == 0) s_red[tid >> 5] = wm;
      __syncthreads();
      if (tid == 0) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < NT / 32; ++i) m = max(m, s_red[i]);
        atomicMax(a.amax_out, m);
      }
    }
  }
}

int tile_num_sms();
int tile_cfg_override();  // HYBRIDQ_TILE_CFG (benchmarks): -1 default, 0 one-shot, 1 pipe2, 2 pipe3w
int tile_group_default();  // HYBRIDQ_TILE_GROUP (benchmarks), else the default tile order

template <typename T, Fmt F, bool TWO_D, bool SR, class Cfg>
cudaError_t launch_tile_cfg(const QuantArgs& a, cudaStream_t stream) {
  using namespace tile;
  const int64_t tiles = ((a.M + TM - 1) / TM) * ((a.K + TK - 1) / TK);
  if (tiles == 0) return cudaSuccess;
  constexpr int CB = (F == Fmt::kNvfp4) ? TM / 2 : TM;
  const size_t smem =
      static_cast<size_t>(Cfg::STAGES) * TM * TK * sizeof(T) + static_cast<size_t>(TK) * (CB + 16);
  auto kern = quantize_tile_kernel<T, F, TWO_D, SR, Cfg>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  static int per_sm = 0;  // resident CTAs per SM of this instantiation (the same on every GPU of one kind)
  if (per_sm == 0) {
    int n = 0;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, Cfg::NT, smem);
    if (err != cudaSuccess) return err;
    per_sm = n > 0 ? n : 1;
  }
  const int64_t grid = Cfg::STAGES == 1 ? tiles : min64(tiles, static_cast<int64_t>(per_sm) * tile_num_sms());
  QuantArgs b = a;
  b.tile_group = tile_group_default();
  kern<<<static_cast<unsigned int>(grid), Cfg::NT, smem, stream>>>(b);
  return cudaGetLastError();
}

template <typename T, Fmt F, bool TWO_D, bool SR>
cudaError_t launch_tile(const QuantArgs& a, cudaStream_t stream) {
#ifdef HQ_TILE_VARIANTS
  if constexpr (std::is_same<T, __nv_bfloat16>::value && !SR) {  // benchmark variants (bf16 inputs)
    switch (tile_cfg_override()) {
      case 0: return launch_tile_cfg<T, F, TWO_D, SR, CfgOneShot>(a, stream);
      case 2: return launch_tile_cfg<T, F, TWO_D, SR, CfgPipe3W>(a, stream);
      default: break;
    }
  }
#endif
  return launch_tile_cfg<T, F, TWO_D, SR, CfgPipe2>(a, stream);
}

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
