// One warp per row: the helpers of the row kernels whose output a Linear reads (csrc/rms_norm.cu: RMSNorm, LayerNorm;
// csrc/swiglu.cu: silu(a) * b) -- 16-byte vector loads and stores, warp reductions, the block-wide max|y|, and the
// rowwise part of a block format along K written from the output in the same pass (RowQuant, quantize_chunk).
#pragma once

#include <initializer_list>

#include "numerics.cuh"
#include "tile/policy_mxfp8.cuh"  // (block_nonfinite; the tile machinery's encoders)

namespace hybridq {
namespace rows {

constexpr int kWarps = 8;  // rows per CTA (one warp per row)

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// V consecutive elements as fp32 (V > 1: one 16-byte load; the caller checks alignment and K % V == 0)
template <int V, typename T>
__device__ __forceinline__ void load_f32(const T* p, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = to_f32(p[0]);
  } else {
    static_assert(V * sizeof(T) == 16, "one 16-byte vector");
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_f32(e[i]);
  }
}

template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const T (&v)[V]) {
  if constexpr (V == 1) {
    p[0] = v[0];
  } else {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
  }
}

// The fused rowwise quantization of a row kernel's output (norm_quantize_forward, swiglu_forward): the rowwise part of
// a block format along K, bitwise what that format's tile kernel makes of y (the same per-block steps as
// policy_fp8_block.cuh's and policy_mxfp8.cuh's row tasks, on the same rounded values of y)
struct RowQuant {
  uint8_t* q;  // [M, K] fp8 bytes
  void* s;     // QB 128 (FP8 block 1x128): fp32 scale_inv [M, K/128]; QB 32 (MXFP8 1x32): E8M0 bytes [M, K/32]
  Fp8Encoding fp8;
};

// one lane's V values of y (k: their first column; `in`: inside the row) -> fp8 bytes and the block's scale; every
// lane of the warp calls it (the block max is a shuffle over the QB / V lanes of one block)
template <int QB, int V>
__device__ __forceinline__ void quantize_chunk(const RowQuant& nq, const float (&yv)[V], int64_t r, int64_t k,
                                               int64_t K, bool in, int lane) {
  constexpr int L = QB / V;  // lanes per block
  static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0 && V % 4 == 0, "whole blocks of whole vectors per warp");
  const uint32_t own = absmax_n(yv);
  const uint32_t bam = group_max<L>(own);
  uint32_t wq[V / 4];
  if constexpr (QB == 128) {
    const float mult = scale_from_amax(u2f(bam), nq.fp8.max, nq.fp8.eps, nq.fp8.pow2);
    encode_fp8(yv, mult, nq.fp8.e5m2, scaled_nonfinite(own, mult), wq);
    if (in && lane % L == 0) static_cast<float*>(nq.s)[r * (K / 128) + k / 128] = 1.0f / mult;
  } else {
    static_assert(QB == 32, "MXFP8 1x32 or FP8 block 1x128");
    const uint8_t e = e8m0_round_up(u2f(bam) * (1.0f / nq.fp8.max));
    const float mult = e8m0_pow2(e, true);  // NaN for a NaN block
    encode_fp8(yv, mult, nq.fp8.e5m2, block_nonfinite(bam), wq);
    if (in && lane % L == 0) static_cast<uint8_t*>(nq.s)[r * (K / 32) + k / 32] = e;
  }
  if (in) {
    uint8_t* dst = nq.q + r * K + k;
    if constexpr (V == 8) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(wq[0], wq[1]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = wq[0];
    }
  }
}

// max|y| of the CTA's rows (m: this thread's) into *amax (NaN sorts above inf); every thread of the CTA calls it
__device__ __forceinline__ void reduce_amax(uint32_t m, uint32_t* amax) {
  m = warp_max(m);
  __shared__ uint32_t red[kWarps];
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t bm = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) bm = max(bm, red[i]);
    atomicMax(amax, bm);
  }
}

// 16-byte vectors: every row starts on a vector boundary and every pointer is 16-byte aligned
inline bool vectorizable(int64_t K, int V, std::initializer_list<const void*> ptrs) {
  if (K % V != 0) return false;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

}  // namespace rows
}  // namespace hybridq
