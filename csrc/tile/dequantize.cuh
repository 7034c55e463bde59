// The one dequantization kernel of every format, parameterised by the format's policy (policy_*.cuh: the same
// struct that quantizes). A thread takes 16 consecutive elements of one row of a [rows, cols] part: the skeleton
// loads their codes (16 fp8 bytes or 8 bytes of packed fp4) and stores the values as fp32 or bf16; the policy
// decodes them (its scale layout and element type, and any step after the scale: a global factor, an inverse
// transform).
//
// Policy interface: kElemsPerByte (as for quantizing); kDequantWholeChunks (every part's cols is a multiple of 16,
// which its op checks: no partial-chunk path is compiled); DequantArgs (the kernel's argument: DequantTile,
// csrc/hybridq.h, plus the format's scales); DequantCtx dequant_init(a) (per-thread values, before the loop);
// dequant16(ctx, a, r, c0, codes, out[16]) (elements c0 .. c0 + 15 of row r; codes: 16 / kElemsPerByte bytes as
// words).
#pragma once

#include "common.cuh"

namespace hybridq {

// 16 values to out[0 .. nvalid) as fp32 or bf16 (vec: 16-byte aligned full chunks)
template <typename OutT>
__device__ __forceinline__ void store16(OutT* dst, const float (&o)[16], int nvalid, bool vec) {
  if constexpr (std::is_same<OutT, float>::value) {
    if (vec) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        reinterpret_cast<float4*>(dst)[q] = make_float4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
      return;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (j < nvalid) dst[j] = o[j];
  } else {
    uint32_t w[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const __nv_bfloat16 lo = __float2bfloat16_rn(o[2 * q]), hi = __float2bfloat16_rn(o[2 * q + 1]);
      w[q] = static_cast<uint32_t>(__nv_bfloat16_raw(lo).x) | (static_cast<uint32_t>(__nv_bfloat16_raw(hi).x) << 16);
    }
    if (vec) {
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
      return;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (j < nvalid) reinterpret_cast<uint16_t*>(dst)[j] = static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2)));
  }
}

// The NB = 16 / EPB code bytes of 16 elements as words: one 16- or 8-byte load (vec), else the first nbytes bytes
// one by one (the rest zero)
template <int EPB>
__device__ __forceinline__ void load_codes(const uint8_t* src, int nbytes, bool vec, uint32_t (&w)[4 / EPB]) {
  constexpr int NW = 4 / EPB;
  if (vec) {
    if constexpr (NW == 4) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
      w[0] = raw.x; w[1] = raw.y; w[2] = raw.z; w[3] = raw.w;
    } else {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(src));
      w[0] = raw.x; w[1] = raw.y;
    }
    return;
  }
#pragma unroll
  for (int q = 0; q < NW; ++q) w[q] = 0;
#pragma unroll
  for (int j = 0; j < 4 * NW; ++j)
    if (j < nbytes) w[j / 4] |= static_cast<uint32_t>(src[j]) << (8 * (j % 4));
}

template <class P, typename OutT>
__global__ void __launch_bounds__(256) dequantize_kernel(const typename P::DequantArgs a, OutT* __restrict__ out) {
  constexpr int EPB = P::kElemsPerByte;
  const int64_t rows = a.rows, cols = a.cols;
  const int64_t cchunks = (cols + 15) / 16, total = rows * cchunks;
  const bool vec = P::kDequantWholeChunks || cols % 16 == 0;
  const typename P::DequantCtx ctx = P::dequant_init(a);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / cchunks, c0 = (idx % cchunks) * 16;
    const int nvalid = static_cast<int>(min64(16, cols - c0));
    uint32_t w[4 / EPB];
    load_codes<EPB>(a.q + r * (cols / EPB) + c0 / EPB, (nvalid + EPB - 1) / EPB, vec, w);
    float o[16];
    P::dequant16(ctx, a, r, c0, w, o);
    store16(out + r * cols + c0, o, nvalid, vec);
  }
}

// Dequantize a part to fp32 (out_bf16: to bf16) with the policy P's dequantize step
template <class P>
cudaError_t launch_dequantize(const typename P::DequantArgs& a, bool out_bf16, void* out, cudaStream_t stream) {
  const int64_t work = a.rows * ((a.cols + 15) / 16);
  if (work == 0) return cudaSuccess;
  const int blocks = static_cast<int>(max64(1, min64((work + 255) / 256, static_cast<int64_t>(tile_num_sms()) * 16)));
  if (out_bf16)
    dequantize_kernel<P, __nv_bfloat16><<<blocks, 256, 0, stream>>>(a, static_cast<__nv_bfloat16*>(out));
  else
    dequantize_kernel<P, float><<<blocks, 256, 0, stream>>>(a, static_cast<float*>(out));
  return cudaGetLastError();
}

}  // namespace hybridq
