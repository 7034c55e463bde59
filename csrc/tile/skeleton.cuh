// The one quantization kernel of every block format, parameterised by a format policy (policy_*.cuh). A CTA loads
// a 128x128 tile of the [M, K] input into shared memory once, then writes the rowwise part ([M, K], blocks along
// K) and the columnwise part ([K, M], the transpose, blocks along M) from it. The CTAs are persistent and keep the
// next tile's loads in flight while they process the current one (TileCfg). 16-bit tiles are stored with the
// 16-byte chunks of each row XOR-swizzled (swz), which makes the 64-byte row reads, the 32-bit column reads and
// the cp.async writes all free of bank conflicts.
//
//   row phase:    a task is 32 consecutive elements of one tile row (4 lanes per row); the policy turns them into
//                 32 fp8 bytes / 16 fp4 bytes and writes their scales.
//   column phase: a task is 32 consecutive rows of one tile column (lane = column, conflict-free); a block
//                 along M of <= 32 elements is inside one task; longer ones (kColChunkAmax) get a pre-pass that
//                 leaves each 32-row chunk's amax in shared memory. Output is staged and written as row segments.
//   2-D tiles:    a pre-phase reduces each S x S tile's amax into shared memory (atomicMax on |x| bits).
//   one scale for both directions (kColFromRow), both requested: the row phase also keeps its fp8 bytes in shared
//                 memory and the column phase writes their byte transpose (4 columns x 16 rows per task) instead
//                 of converting the tile a second time.
//   row map:      (Cfg::ROW_MAP) the kernel tiles an [M, K] whose row m is input row a.src_rows[m], or a zero
//                 row where that is < 0. RowMap::kLoads (any policy): the outputs are that [M, K]'s, bitwise the
//                 quantization of the buffer it stands for, never materialized -- e.g. the routed tokens straight
//                 into zero-padded expert slots. RowMap::kLoadsAndRows (per-tensor policies): the rowwise part goes
//                 to the input's rows (none for a zero row), the columnwise part spans all M -- e.g. row groups
//                 placed at 16-aligned columns of the transpose with zeros between them, the layout a grouped GEMM
//                 reads.
//
// The skeleton has no format branches: it asks the policy only compile-time traits (if constexpr) and calls its
// row / column functions, which are force-inlined, so each instantiation compiles to the same straight-line code
// as a kernel written for that one format.
//
// Policy interface (see policy_fp8_tensor.cuh for the simplest one):
//   traits   kBlock (elements per block along a direction; 1 = one per-tensor scale), kTwoD (kBlock x kBlock
//            tiles, one scale per tile), kStochastic, kElemsPerByte (1: fp8, 2: packed fp4), kColFromRow,
//            kColChunkAmax, kColScalesInTranspose, kColScalesStaged, kRecordsAmax
//   types    Args (the kernel's argument: TileArgs, csrc/hybridq.h, plus the format's own fields; with
//            kRecordsAmax a `uint32_t* amax_out`), Shared (the policy's shared memory), Ctx (per-CTA values)
//   init(a, sh, tid, nt) -> Ctx; tile_scales(ctx, a, tile_amax, pos) (after the 2-D pre-phase, thread 0);
//   row<T>(...) and col<T>(...) (one task -> packed words, scales written; with kColScalesStaged col() leaves its
//   scale bytes in its Shared and store_col_scales(ctx, sh, a, pos, c) writes a tile column's after the column
//   phase: one wide store per output row instead of a byte per block into 32 different rows per warp store);
//   transposed_col_scale(...);
//   the skeleton reduces ctx.my_amax into a.amax_out when kRecordsAmax.
// The same policy dequantizes (csrc/tile/dequantize.cuh: DequantArgs, dequant_init, dequant16).
//
// A new format with a kernel touches: csrc/tile/policy_<format>.cuh (new: numerics of one task, quantize and
// dequantize) and csrc/quantize_<format>.cu (new: instantiations, argument checks, allocation, launches, and its
// ops' schemas and registration); on the Python side hybridq/kernels/cuda_<format>.py (new: the calls, the fake
// implementations and the dispatch registrations). setup.py compiles every csrc/*.cu; hybridq/kernels/cuda.py
// finds every cuda_<format>.py.
#pragma once

#include <atomic>
#include <cstdint>

#include "common.cuh"

namespace hybridq {

// Policies with kRawWords = true take 16-bit inputs as the tile's packed words (row_raw, col_pair_amax, col_raw)
template <class P, class = void>
struct RawWords : std::false_type {};
template <class P>
struct RawWords<P, std::void_t<decltype(P::kRawWords)>> : std::integral_constant<bool, P::kRawWords> {};

// Where the current tile is, for the policies' scale indexing and bounds
struct TilePos {
  int64_t M, K;
  int64_t m0, k0;            // first element
  int64_t tm, tk;            // tile row, tile column
  int64_t tiles_m, tiles_k;  // tiles along M, K
  bool full;                 // the whole tile is inside the tensor (no bounds checks)
};

// ROW_MAP: this thread's rows' map entries of tile t (t < ntiles; else unchanged)
template <typename T, int NT>
__device__ __forceinline__ void map_rows_of_tile(const TileArgs& a, int64_t t, int64_t ntiles, int64_t tiles_m,
                                                 int64_t tiles_k, int tid, int32_t (&rows)[RowMapLoads<T, NT>::NP]) {
  if (t >= ntiles) return;
  int64_t lm, lk;
  tile_coords(t, tiles_m, tiles_k, a.tile_group, lm, lk);
  map_rows<T, NT>(a.src_rows, a.M, lm * tile::TM, tid, rows);
}

// `a` is __grid_constant__: read from the parameter space where it is used, as the compiler read the one argument
// struct of every format before; copied into registers up front (what it makes of a policy's smaller Args by
// default) the tile loop compiles differently: 12% slower for MXFP8 on an H200.
template <typename T, class P, class Cfg>
__global__ void __launch_bounds__(Cfg::NT, Cfg::MINB) quantize_tile_kernel(const __grid_constant__ typename P::Args a) {
  using namespace tile;
  constexpr int NT = Cfg::NT;
  constexpr int STAGES = Cfg::STAGES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const stages = reinterpret_cast<T*>(smem_raw);  // [STAGES][TM][TK]

  constexpr int S = P::kBlock;
  constexpr bool TWO_D = P::kTwoD;
  constexpr int EPB = P::kElemsPerByte;
  constexpr int NTILE2D = TWO_D ? (TM / S) * (TK / S) : 1;
  constexpr int ROW_WORDS = VR / 4 / EPB;  // packed output words of one row task
  constexpr int COL_WORDS = CV / 4 / EPB;  // ... of one column task
  constexpr int NPAIR = TK / 2;            // column-phase tasks: column pairs x chunks
  constexpr int COL_PAIR_TASKS = NPAIR * (TM / CV);
  static_assert(!P::kColFromRow || EPB == 1, "the byte-transpose column phase needs one element per byte");
  // (a per-tensor policy reads and writes nothing for a row outside the input, row_in false: a zero row's too)
  static_assert(!Cfg::MAP_ROWS || (S == 1 && P::kColFromRow), "rows written by a map only with per-tensor policies");
  // ROW_MAP: each stage's tile rows' map entries (input rows, < 0: zero rows), for the row phase; and this thread's
  // rows' entries of the next tile to load, fetched a tile ahead (load_tile_mapped)
  __shared__ int32_t s_rows[Cfg::ROW_MAP ? STAGES : 1][Cfg::ROW_MAP ? TM : 1];
  int32_t next_rows[RowMapLoads<T, NT>::NP];
  __shared__ uint32_t s_tile_amax[NTILE2D];
  // [chunk][column] amax (kColChunkAmax)
  __shared__ __align__(16) uint32_t s_part[P::kColChunkAmax ? (TM / CV) * TK : 1];
  __shared__ uint32_t s_red[NT / 32];
  __shared__ typename P::Shared s_pol;

  // columnwise output staged in shared memory ([TK] rows of the transposed tile), then written as
  // contiguous row segments: direct 16-byte stores at an M-byte stride serialize on the memory partitions
  constexpr int CB = TM / EPB;  // bytes per staged row (chunks placed by stage_chunk)
  uint8_t* const so = smem_raw + static_cast<size_t>(STAGES) * TM * TK * sizeof(T);

  const int tid = threadIdx.x;
  const int64_t M = a.M, K = a.K;
  const int64_t tiles_k = (K + TK - 1) / TK;
  const int64_t tiles_m = (M + TM - 1) / TM;
  const int64_t ntiles = tiles_m * tiles_k;
  const T* x = static_cast<const T*>(a.x);
  const bool vec = (K % (16 / static_cast<int>(sizeof(T))) == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  // rowwise / columnwise output rows start 16-byte aligned (the full-tile fast paths store 16 bytes at a time)
  // (the columnwise rows may be longer than M: a.col_pitch elements, e.g. 16-byte aligned rows for a GEMM)
  const int64_t row_bytes = K / EPB, col_bytes = M / EPB, col_pitch = (a.col_pitch > 0 ? a.col_pitch : M) / EPB;
  const bool row_vec16 = a.row_q != nullptr && row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(a.row_q) & 15) == 0;
  const bool col_vec16 = a.col_q != nullptr && col_pitch % 16 == 0 && (reinterpret_cast<uintptr_t>(a.col_q) & 15) == 0;
  const bool transpose_cols = P::kColFromRow && a.rowwise && a.columnwise;
  constexpr bool RAW = RawWords<P>::value && sizeof(T) == 2;
  uint32_t* const byte_tile = reinterpret_cast<uint32_t*>(so);  // [TM][TK / 4] words, byte_tile_word (fits in so)

  // per-CTA values of the format (visible to other threads after the first barrier of the tile loop)
  typename P::Ctx ctx = P::init(a, s_pol, tid, NT);

  // ---- pipeline prologue: the first STAGES-1 tiles of this CTA ----------------------------------------
  int64_t tile = blockIdx.x;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int64_t t = tile + static_cast<int64_t>(s) * gridDim.x;
    if (t < ntiles) {
      int64_t lm, lk;
      tile_coords(t, tiles_m, tiles_k, a.tile_group, lm, lk);
      T* const ts = stages + static_cast<size_t>(s) * TM * TK;
      if constexpr (Cfg::ROW_MAP) {
        map_rows<T, NT>(a.src_rows, M, lm * TM, tid, next_rows);
        load_tile_mapped<T, NT>(ts, s_rows[s], x, a.src_rows, M, K, lm * TM, lk * TK, vec, tid, next_rows);
      } else {
        load_tile<T, NT>(ts, x, M, K, lm * TM, lk * TK, vec, tid);
      }
    }
    cp_async_commit();
  }
  if constexpr (Cfg::ROW_MAP) {
    map_rows_of_tile<T, NT>(a, tile + static_cast<int64_t>(STAGES - 1) * gridDim.x, ntiles, tiles_m, tiles_k, tid,
                            next_rows);
  }

  for (int it = 0; tile < ntiles; ++it, tile += gridDim.x) {
    // issue the tile STAGES-1 ahead into the stage the previous iteration consumed (STAGES == 1: this tile)
    {
      const int64_t t = tile + static_cast<int64_t>(STAGES - 1) * gridDim.x;
      if (t < ntiles) {
        int64_t lm, lk;
        tile_coords(t, tiles_m, tiles_k, a.tile_group, lm, lk);
        const int st = (it + STAGES - 1) % STAGES;
        if constexpr (Cfg::ROW_MAP) {
          load_tile_mapped<T, NT>(stages + static_cast<size_t>(st) * TM * TK, s_rows[st], x, a.src_rows, M, K,
                                  lm * TM, lk * TK, vec, tid, next_rows);
        } else {
          load_tile<T, NT>(stages + static_cast<size_t>(st) * TM * TK, x, M, K, lm * TM, lk * TK, vec, tid);
        }
      }
      cp_async_commit();
      if constexpr (Cfg::ROW_MAP) {  // (the next iteration's loads read them)
        map_rows_of_tile<T, NT>(a, t + gridDim.x, ntiles, tiles_m, tiles_k, tid, next_rows);
      }
    }
    cp_async_wait<STAGES - 1>();  // this thread's copies of the current tile have landed
    if constexpr (TWO_D) {
      for (int i = tid; i < NTILE2D; i += NT) s_tile_amax[i] = 0u;
    }
    __syncthreads();  // everyone's copies are visible

    const T* ts = stages + static_cast<size_t>(it % STAGES) * TM * TK;  // [TM][TK], swizzled (tile_off)
    TilePos pos;
    tile_coords(tile, tiles_m, tiles_k, a.tile_group, pos.tm, pos.tk);
    pos.M = M;
    pos.K = K;
    pos.tiles_m = tiles_m;
    pos.tiles_k = tiles_k;
    pos.m0 = pos.tm * TM;
    pos.k0 = pos.tk * TK;
    pos.full = pos.m0 + TM <= M && pos.k0 + TK <= K;  // no bounds checks inside this tile
    const int64_t m0 = pos.m0, k0 = pos.k0;
    const bool full = pos.full;

    // ---- 2-D tiles: amax of each S x S tile -----------------------------------------------------------
    // a warp's 32 tasks are 8 consecutive rows (aligned to 8, so inside one S-row block) x 4 quarters
    if constexpr (TWO_D) {
      static_assert(S == 16 || S == 32 || S == 128, "2-D tiles of 16, 32 or 128");
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
      if (tid == 0) P::tile_scales(ctx, a, s_tile_amax, pos);
    }

    // ---- rowwise part: each task is 32 consecutive elements of one row ----------------------------------
    if (a.rowwise) {
      for (int task = tid; task < ROW_TASKS; task += NT) {
        const int r = task / LANES_PER_ROW, v = task % LANES_PER_ROW;
        // gm: the input row (a row map's entry: < 0 for a zero row, which has no rowwise output)
        const int64_t gk = k0 + v * VR;
        int64_t gm = m0 + r;
        if constexpr (Cfg::MAP_ROWS) gm = s_rows[it % STAGES][r];
        const bool row_in = Cfg::MAP_ROWS ? gm >= 0 : full || gm < M;
        int nvalid = VR;  // elements of this task inside the tensor
        if (!full || !row_in) nvalid = row_in ? static_cast<int>(min64(VR, max64(0, K - gk))) : 0;
        uint32_t w[ROW_WORDS];
        if constexpr (RAW) {
          uint32_t xw[VR / 2];
          smem_load_row32_words(ts, r, v, xw);
          P::template row_raw<T>(ctx, s_pol, a, s_tile_amax, pos, xw, r, v, gm, gk, nvalid, row_in, w);
        } else {
          float xv[VR];
          smem_load_row32(ts, r, v, xv);
          P::template row<T>(ctx, s_pol, a, s_tile_amax, pos, xv, r, v, gm, gk, nvalid, row_in, w);
        }
        if constexpr (P::kColFromRow) {
          if (transpose_cols) {
#pragma unroll
            for (int q = 0; q < ROW_WORDS / 4; ++q)
              reinterpret_cast<uint4*>(byte_tile)[byte_tile_word(r, 8 * v + 4 * q) / 4] =
                  make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
          }
        }
        uint8_t* dst = a.row_q + gm * row_bytes + gk / EPB;
        if (full && row_vec16 && row_in) {
#pragma unroll
          for (int q = 0; q < ROW_WORDS / 4; ++q)
            reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        } else if (nvalid > 0) {
          store_bytes(dst, w, nvalid / EPB);
        }
      }
    }

    // ---- columnwise part as the transpose of the rowwise bytes: a task is 4 columns x 16 rows ------------------
    if (transpose_cols) {
      if constexpr (P::kColFromRow) {
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
            uint8_t* dst = a.col_q + gk * col_pitch + gm;
            if (full && col_vec16) {
              *reinterpret_cast<uint4*>(dst) = make_uint4(cw[i][0], cw[i][1], cw[i][2], cw[i][3]);
            } else if (gk < K && gm < M) {
              store_bytes(dst, cw[i], static_cast<int>(min64(16, M - gm)));
            }
            if constexpr (P::kColScalesInTranspose) {  // one scale per block of S rows of the output row
              if ((16 * j) % S == 0 && gk < K && gm < M)
                P::transposed_col_scale(ctx, a, s_tile_amax, pos, 16 * j, 4 * q + i, gk, gm);
            }
          }
        }
      }
    } else if (a.columnwise) {
      // ---- columnwise part: each task is two adjacent columns x CV rows -----------------------------------
      // kColChunkAmax: each task leaves its two columns' chunk amaxes in s_part, and after one barrier every task
      // has its whole block's; one task per thread (a loop over tasks could not hold a barrier), so the values stay
      // in registers across it instead of being read from the tile twice
      static_assert(!P::kColChunkAmax || COL_PAIR_TASKS <= NT, "the chunk-amax exchange needs one task per thread");
      for (int task0 = 0; task0 < COL_PAIR_TASKS; task0 += NT) {
        const int task = task0 + tid;
        const bool has_task = COL_PAIR_TASKS % NT == 0 || task < COL_PAIR_TASKS;
        const int c0 = 2 * (task % NPAIR), ch = task / NPAIR;
        const int64_t gm0 = m0 + ch * CV;
        uint32_t wr[sizeof(T) == 4 ? 1 : CV];  // 16-bit inputs: the pair's words, one per row
        if constexpr (sizeof(T) != 4) {
          if (has_task) {
            const int off0 = tile_off<T>(ch * CV, c0), off1 = tile_off<T>(ch * CV + 1, c0) - TK;  // even / odd rows
#pragma unroll
            for (int i = 0; i < CV; ++i)
              wr[i] = *reinterpret_cast<const uint32_t*>(ts + i * TK + ((i & 1) ? off1 : off0));
          }
        }
        if constexpr (P::kColChunkAmax) {
          if (has_task) {
            uint32_t am0 = 0, am1 = 0;
            if constexpr (sizeof(T) == 4) {
              float xa[CV], xb[CV];
              smem_load_col_pair(ts, ch * CV, c0, xa, xb);
              am0 = absmax_n(xa);
              am1 = absmax_n(xb);
            } else {
#pragma unroll
              for (int i = 0; i < CV; ++i) {
                am0 = max(am0, abs_bits(half_bits_to_f32<T>(wr[i])));
                am1 = max(am1, abs_bits(half_bits_to_f32<T>(wr[i] >> 16)));
              }
            }
            // one 8-byte store per pair: consecutive lanes, consecutive words (no bank conflicts)
            *reinterpret_cast<uint2*>(&s_part[ch * TK + c0]) = make_uint2(am0, am1);
          }
          __syncthreads();  // every chunk amax of the tile is in s_part
        }
        if (!has_task) continue;
        uint32_t pm[CV / 16];  // RAW: the pair's packed block amaxes
        if constexpr (RAW) P::template col_pair_amax<T>(a, wr, pm);
#pragma unroll 1
        for (int t = 0; t < 2; ++t) {
          const int c = c0 + t;
          const int64_t gk = k0 + c;
          uint32_t w[COL_WORDS];
          if constexpr (RAW) {
            P::template col_raw<T>(ctx, s_pol, a, s_tile_amax, pos, wr, t, pm, c, ch, gk, gm0, w);
          } else {
            const int nvalid = full ? CV : (gk < K ? static_cast<int>(min64(CV, max64(0, M - gm0))) : 0);
            float xv[CV];
            if constexpr (sizeof(T) == 4) {
#pragma unroll
              for (int i = 0; i < CV; ++i) xv[i] = to_f32(ts[tile_off<T>(ch * CV + i, c)]);
            } else {
#pragma unroll
              for (int i = 0; i < CV; ++i) xv[i] = half_bits_to_f32<T>(t ? (wr[i] >> 16) : wr[i]);
            }
            P::template col<T>(ctx, s_pol, a, s_tile_amax, s_part, pos, xv, c, ch, gk, gm0, nvalid, w);
          }
          uint4* dst = reinterpret_cast<uint4*>(so);
#pragma unroll
          for (int q = 0; q < COL_WORDS / 4; ++q)
            dst[stage_chunk<CB>(c, ch * (COL_WORDS / 4) + q)] =
                make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        }
      }
      __syncthreads();
      if constexpr (P::kColScalesStaged) {
        for (int c = tid; c < TK; c += NT) P::store_col_scales(ctx, s_pol, a, pos, c);
      }
      // the staged [TK][CB] bytes: each output row gets one contiguous segment of up to CB bytes
      const int64_t seg0 = m0 / EPB;
      for (int i = tid; i < TK * (CB / 16); i += NT) {
        const int c = i / (CB / 16), j = i % (CB / 16);
        const int64_t gk = k0 + c, off = seg0 + j * 16;
        const uint4 v = reinterpret_cast<const uint4*>(so)[stage_chunk<CB>(c, j)];
        if (full && col_vec16) {
          *reinterpret_cast<uint4*>(a.col_q + gk * col_pitch + off) = v;
          continue;
        }
        if (gk >= K || off >= col_bytes) continue;
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        store_bytes(a.col_q + gk * col_pitch + off, w, static_cast<int>(min64(16, col_bytes - off)));
      }
    }
    __syncthreads();  // the stage, the staging buffer and the 2-D amaxes are free for the next tile
  }
  cp_async_wait<0>();  // nothing may be in flight when the CTA exits (only empty groups are left)

  // ---- per-tensor amax (delayed scaling) --------------------------------------------------------------
  if constexpr (P::kRecordsAmax) {
    if (a.amax_out != nullptr) {
      const uint32_t wm = warp_max(ctx.my_amax);
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

template <typename T, class P, class Cfg>
cudaError_t launch_tile_cfg(const typename P::Args& a, cudaStream_t stream) {
  using namespace tile;
  const int64_t tiles = ((a.M + TM - 1) / TM) * ((a.K + TK - 1) / TK);
  if (tiles == 0) return cudaSuccess;
  constexpr int CB = TM / P::kElemsPerByte;
  const size_t smem = static_cast<size_t>(Cfg::STAGES) * TM * TK * sizeof(T) + static_cast<size_t>(TK) * CB;
  auto kern = quantize_tile_kernel<T, P, Cfg>;
  if (smem > 48 * 1024) {
    // once per device and instantiation (a driver call per launch otherwise)
    static std::atomic<uint64_t> smem_set{0};
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const uint64_t bit = uint64_t{1} << (dev & 63);
    if (!(smem_set.load(std::memory_order_relaxed) & bit)) {
      err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (err != cudaSuccess) return err;
      smem_set.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  static int per_sm = 0;  // resident CTAs per SM of this instantiation (the same on every GPU of one kind)
  if (per_sm == 0) {
    int n = 0;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, Cfg::NT, smem);
    if (err != cudaSuccess) return err;
    per_sm = n > 0 ? n : 1;
  }
  const int64_t grid = Cfg::STAGES == 1 ? tiles : min64(tiles, static_cast<int64_t>(per_sm) * tile_num_sms());
  typename P::Args b = a;
  b.tile_group = tile_group_default();
  kern<<<static_cast<unsigned int>(grid), Cfg::NT, smem, stream>>>(b);
  return cudaGetLastError();
}

// The launch of one (input type, policy) instantiation with the default configuration (HQ_TILE_VARIANTS builds:
// the benchmark variants of HYBRIDQ_TILE_CFG for bf16 inputs without stochastic rounding).
template <typename T, class P>
cudaError_t launch_tile(const typename P::Args& a, cudaStream_t stream) {
#ifdef HQ_TILE_VARIANTS
  if constexpr (std::is_same<T, __nv_bfloat16>::value && !P::kStochastic) {
    switch (tile_cfg_override()) {
      case 0: return launch_tile_cfg<T, P, CfgOneShot>(a, stream);
      case 2: return launch_tile_cfg<T, P, CfgPipe3W>(a, stream);
      default: break;
    }
  }
#endif
  return launch_tile_cfg<T, P, CfgPipe2>(a, stream);
}

// The launches of the row-map instantiations (a.src_rows set; see "row map" above), in the default configuration:
// rowwise output to the input's rows (per-tensor policies), or the mapped [M, K]'s outputs (launch_tile_slots).
template <typename T, class P>
cudaError_t launch_tile_row_map(const typename P::Args& a, cudaStream_t stream) {
  return launch_tile_cfg<T, P, CfgPipe2RowMap>(a, stream);
}

template <typename T, class P>
cudaError_t launch_tile_slots(const typename P::Args& a, cudaStream_t stream) {
  return launch_tile_cfg<T, P, CfgPipe2Slots>(a, stream);
}

}  // namespace hybridq
