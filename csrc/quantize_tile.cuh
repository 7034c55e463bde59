// One fused quantization kernel for every block format: a CTA loads a 128x128 tile of the [M, K] input into
// shared memory once, then writes the rowwise part ([M, K], blocks along K) and the columnwise part
// ([K, M], the transpose, blocks along M) from it. Both phases read shared memory row-contiguously, so
// neither has bank conflicts and no padding is needed.
//
//   row phase:    a task is 8 consecutive elements of one tile row (16 lanes per row); a 1-D block along K
//                 of B elements is B/8 adjacent lanes (warp shuffles); 8 fp8 bytes / 4 fp4 bytes per store.
//   column phase: a task is 32 consecutive rows of one tile column (lane = column, conflict-free); a block
//                 along M of <= 32 elements is inside one task (FP8 128x1 blocks: 4 tasks, via shared
//                 memory); 32 fp8 bytes / 16 fp4 bytes per store.
//   2-D tiles:    a pre-phase reduces each S x S tile's amax into shared memory (atomicMax on |x| bits).
#pragma once

#include <type_traits>

#include "numerics.cuh"

namespace hybridq {

enum class Fmt : int { kFp8Tensor = 0, kFp8Block = 1, kMxfp8 = 2, kNvfp4 = 3 };

namespace tile {
constexpr int TM = 128;  // tile rows (along M)
constexpr int TK = 128;  // tile columns (along K)
constexpr int NT = 256;  // threads per CTA
constexpr int VR = 8;    // elements per row-phase task
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
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

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

// Two adjacent columns of CV tile rows: values of column 0 and column 1 as fp32
template <typename T>
__device__ __forceinline__ void smem_load_col_pair(const T* p, float (&a)[tile::CV], float (&b)[tile::CV]) {
#pragma unroll
  for (int i = 0; i < tile::CV; ++i) {
    if constexpr (sizeof(T) == 4) {
      const float2 f = *reinterpret_cast<const float2*>(p + i * tile::TK);
      a[i] = f.x;
      b[i] = f.y;
    } else {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(p + i * tile::TK);
      a[i] = half_bits_to_f32<T>(w);
      b[i] = half_bits_to_f32<T>(w >> 16);
    }
  }
}

template <typename T, Fmt F, bool TWO_D>
__global__ void __launch_bounds__(tile::NT) quantize_tile_kernel(const QuantArgs a) {
  using namespace tile;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ts = reinterpret_cast<T*>(smem_raw);  // [TM][TK]

  constexpr int S = block_len<F>();
  constexpr int NTILE2D = TWO_D ? (TM / S) * (TK / S) : 1;
  constexpr bool COL_SPLIT = (F == Fmt::kFp8Block) && !TWO_D;  // 128-row column blocks span 4 tasks
  constexpr int NPAIR = TK / 2;                                 // column-phase tasks: column pairs x chunks
  constexpr int COL_PAIR_TASKS = NPAIR * (TM / CV);
  __shared__ uint32_t s_tile_amax[NTILE2D];
  __shared__ uint32_t s_part[COL_SPLIT ? (TM / CV) * TK : 1];
  __shared__ uint32_t s_red[NT / 32];

  // columnwise output staged in shared memory ([TK] rows of the transposed tile), then written as
  // contiguous row segments: direct 16-byte stores at an M-byte stride serialize on the memory partitions
  constexpr int CB = (F == Fmt::kNvfp4) ? TM / 2 : TM;  // bytes per staged row
  constexpr int SO_STRIDE = CB + 16;                    // padded: fewer bank conflicts
  uint8_t* so = smem_raw + static_cast<size_t>(TM) * TK * sizeof(T);

  const int tid = threadIdx.x;
  const int64_t M = a.M, K = a.K;
  const int64_t tiles_k = (K + TK - 1) / TK;
  const int64_t tiles_m = (M + TM - 1) / TM;
  const int64_t tm = blockIdx.x / tiles_k, tk = blockIdx.x % tiles_k;
  const int64_t m0 = tm * TM, k0 = tk * TK;
  const T* x = static_cast<const T*>(a.x);

  // ---- load the tile, zero-filled outside the tensor ------------------------------------------------
  {
    constexpr int CH = 16 / static_cast<int>(sizeof(T));
    const bool vec = (K % CH == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
    if (vec) {
#pragma unroll 4
      for (int i = tid; i < TM * TK / CH; i += NT) {
        const int r = i / (TK / CH), c = (i % (TK / CH)) * CH;
        const int64_t gm = m0 + r, gk = k0 + c;
        const bool in = gm < M && gk < K;
        cp_async16(ts + r * TK + c, in ? static_cast<const void*>(x + gm * K + gk) : static_cast<const void*>(x),
                   in ? 16 : 0);
      }
      cp_async_wait_all();
    } else {
      for (int i = tid; i < TM * TK; i += NT) {
        const int r = i / TK, c = i % TK;
        const int64_t gm = m0 + r, gk = k0 + c;
        ts[i] = (gm < M && gk < K) ? x[gm * K + gk] : zero_of<T>();
      }
    }
  }
  if constexpr (TWO_D) {
    for (int i = tid; i < NTILE2D; i += NT) s_tile_amax[i] = 0u;
  }
  __syncthreads();

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
    if (a.sr) philox_unpack(a.philox, seed, offset);
  }
  const float rcp_max = 1.0f / a.fp8_max;  // MXFP8: multiply by the rounded reciprocal, not a division
  const bool e5m2 = a.e5m2;

  // ---- 2-D tiles: amax of each S x S tile -------------------------------------------------------------
  if constexpr (TWO_D) {
    for (int task = tid; task < ROW_TASKS; task += NT) {
      const int r = task / LANES_PER_ROW, v = task % LANES_PER_ROW;
      float xv[VR];
      smem_load8(ts + r * TK + v * VR, xv);
      uint32_t am = group_max<S / VR>(absmax_n(xv));
      if (v % (S / VR) == 0) atomicMax(&s_tile_amax[(r / S) * (TK / S) + (v * VR) / S], am);
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

  uint32_t my_amax = 0;  // per-tensor |x| max (delayed scaling records it)

  // ---- rowwise part -----------------------------------------------------------------------------------
  if (a.rowwise) {
    for (int task = tid; task < ROW_TASKS; task += NT) {
      const int r = task / LANES_PER_ROW, v = task % LANES_PER_ROW;
      const int64_t gm = m0 + r, gk = k0 + v * VR;
      const bool row_in = gm < M;
      const int nvalid = row_in ? static_cast<int>(min64(VR, max64(0, K - gk))) : 0;
      float xv[VR];
      smem_load8(ts + r * TK + v * VR, xv);
      const uint32_t am = absmax_n(xv);

      if constexpr (F == Fmt::kNvfp4) {
        uint32_t tam;
        if constexpr (TWO_D) tam = s_tile_amax[(r / 16) * (TK / 16) + (v * VR) / 16];
        else tam = group_max<16 / VR>(am);
        const uint8_t s = nvfp4_block_scale(u2f(tam), s_enc_row);
        const float enc = nvfp4_elem_mult(s, s_enc_row);
        if (v % (16 / VR) == 0 && nvalid > 0) static_cast<uint8_t*>(a.row_s)[gm * (K / 16) + gk / 16] = s;
        float u[VR];
        if (a.sr) {
          const uint64_t idx = static_cast<uint64_t>(gm * K + gk);  // K % 16 == 0: idx % 8 == 0
          float u4[4];
          philox_uniform4(seed, offset, 0, idx / 4, u4);
#pragma unroll
          for (int j = 0; j < 4; ++j) u[j] = u4[j];
          philox_uniform4(seed, offset, 0, idx / 4 + 1, u4);
#pragma unroll
          for (int j = 0; j < 4; ++j) u[4 + j] = u4[j];
        }
        uint32_t w[1] = {0u};
#pragma unroll
        for (int j = 0; j < VR; ++j) {
          const float y = xv[j] * enc;
          const uint32_t code = a.sr ? e2m1_code_sr(y, u[j]) : e2m1_code(y);
          w[0] |= code << (4 * j);
        }
        if (nvalid > 0) store_bytes(a.row_q + gm * (K / 2) + gk / 2, w, nvalid / 2);
      } else {
        float mult;
        uint32_t nan_probe = am;
        if constexpr (F == Fmt::kFp8Tensor) {
          mult = pt_mult;
          my_amax = max(my_amax, am);
        } else if constexpr (F == Fmt::kFp8Block) {
          uint32_t bam;
          if constexpr (TWO_D) bam = s_tile_amax[0];
          else bam = group_max<128 / VR>(am);
          mult = scale_from_amax(u2f(bam), a.fp8_max, a.eps, a.pow2);
          if (!TWO_D && v == 0 && row_in) static_cast<float*>(a.row_s)[gm * tiles_k + tk] = 1.0f / mult;
        } else {  // MXFP8
          uint32_t bam;
          if constexpr (TWO_D) bam = s_tile_amax[(r / 32) * (TK / 32) + (v * VR) / 32];
          else bam = group_max<32 / VR>(am);
          const uint8_t e = e8m0_round_up(u2f(bam) * rcp_max);
          mult = e8m0_pow2(e, true);
          nan_probe = bam;  // a NaN block has a NaN multiplier
          if (v % (32 / VR) == 0 && nvalid > 0) write_mx_scale(a.row_s, gm, gk / 32, K / 32, a.swizzle, a.row_s_cols_pad, e);
        }
        uint32_t w[2];
        encode_fp8(xv, mult, e5m2, nan_probe > 0x7F800000u, w);
        if (nvalid > 0) store_bytes(a.row_q + gm * K + gk, w, nvalid);
      }
    }
  }

  // ---- columnwise part: each task is two adjacent columns x CV rows ------------------------------------
  if (a.columnwise) {
    if constexpr (COL_SPLIT) {
      for (int task = tid; task < COL_PAIR_TASKS; task += NT) {
        const int c = 2 * (task % NPAIR), ch = task / NPAIR;
        float xa[CV], xb[CV];
        smem_load_col_pair(ts + (ch * CV) * TK + c, xa, xb);
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
#pragma unroll
        for (int i = 0; i < CV; ++i) wr[i] = *reinterpret_cast<const uint32_t*>(ts + (ch * CV + i) * TK + c0);
      }
#pragma unroll 1
      for (int t = 0; t < 2; ++t) {
        const int c = c0 + t;
        const int64_t gk = k0 + c;
        const int nvalid = gk < K ? static_cast<int>(min64(CV, max64(0, M - gm0))) : 0;
        float xv[CV];
        if constexpr (sizeof(T) == 4) {
#pragma unroll
          for (int i = 0; i < CV; ++i) xv[i] = to_f32(ts[(ch * CV + i) * TK + c]);
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
            if constexpr (TWO_D) {
              bam = s_tile_amax[((ch * CV + 16 * b) / 16) * (TK / 16) + c / 16];
              s_enc = s_enc_row;  // one global amax for both directions
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
            }
            const uint8_t s = nvfp4_block_scale(u2f(bam), s_enc);
            const float enc = nvfp4_elem_mult(s, s_enc);
            if (16 * b < nvalid) static_cast<uint8_t*>(a.col_s)[gk * (M / 16) + gm0 / 16 + b] = s;
            float u[16];
            if (a.sr) {
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
              const uint32_t code = a.sr ? e2m1_code_sr(y, u[i]) : e2m1_code(y);
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
      if (gk >= K || off >= row_len) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(so + c * SO_STRIDE + j * 16);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      store_bytes(a.col_q + gk * row_len + off, w, static_cast<int>(min64(16, row_len - off)));
    }
  }

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

template <typename T, Fmt F, bool TWO_D>
cudaError_t launch_tile(const QuantArgs& a, cudaStream_t stream) {
  using namespace tile;
  const int64_t tiles = ((a.M + TM - 1) / TM) * ((a.K + TK - 1) / TK);
  if (tiles == 0) return cudaSuccess;
  constexpr int CB = (F == Fmt::kNvfp4) ? TM / 2 : TM;
  const size_t smem = static_cast<size_t>(TM) * TK * sizeof(T) + static_cast<size_t>(TK) * (CB + 16);
  auto kern = quantize_tile_kernel<T, F, TWO_D>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kern<<<static_cast<unsigned int>(tiles), NT, smem, stream>>>(a);
  return cudaGetLastError();
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
