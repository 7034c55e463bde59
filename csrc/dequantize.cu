// Dequantization of every format to fp32 (or bf16, for the emulated GEMMs where that is exact).
#include "binding_checks.h"
#include "ops.h"
#include "tile/common.cuh"

namespace hybridq {

namespace {

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

template <DequantMode MODE, typename OutT>
__global__ void __launch_bounds__(256) dequant_fp8_kernel(const uint8_t* __restrict__ q, const void* __restrict__ scale,
                                                          int64_t rows, int64_t cols, bool e5m2, OutT* __restrict__ out) {
  const int64_t cchunks = (cols + 15) / 16, total = rows * cchunks;
  const int64_t nbc = (cols + 127) / 128;
  const bool vec = cols % 16 == 0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / cchunks, c0 = (idx % cchunks) * 16;
    float s;
    if constexpr (MODE == DequantMode::kTensor) s = static_cast<const float*>(scale)[0];
    else if constexpr (MODE == DequantMode::kBlock1x128) s = static_cast<const float*>(scale)[r * nbc + c0 / 128];
    else if constexpr (MODE == DequantMode::kTile128) s = static_cast<const float*>(scale)[(r / 128) * nbc + c0 / 128];
    else s = e8m0_pow2(static_cast<const uint8_t*>(scale)[r * (cols / 32) + c0 / 32], false);
    const uint8_t* src = q + r * cols + c0;
    const int nvalid = static_cast<int>(min64(16, cols - c0));
    uint32_t w[4];
    if (vec) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
      w[0] = raw.x; w[1] = raw.y; w[2] = raw.z; w[3] = raw.w;
    } else {
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) w[qq] = 0;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j < nvalid) w[j / 4] |= static_cast<uint32_t>(src[j]) << (8 * (j % 4));
    }
    float o[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) o[j] = mul_ref(fp8_to_f32(static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4))), e5m2), s);
    store16(out + r * cols + c0, o, nvalid, vec);
  }
}

template <typename OutT>
__global__ void __launch_bounds__(256) dequant_nvfp4_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                                            const float* __restrict__ amax, int64_t rows, int64_t cols,
                                                            bool rht_inverse, bool apply_global, OutT* __restrict__ out) {
  const int64_t nb = cols / 16, total = rows * nb;
  const float A = apply_global ? *amax : 1.0f;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / nb, b = idx % nb;
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(q + r * (cols / 2) + b * 8));
    const float sf = fp8_to_f32(s[r * nb + b], false);
    float g[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t word = j < 8 ? raw.x : raw.y;
      g[j] = e2m1_value((word >> (4 * (j % 8))) & 0xFu) * sf;
      if (apply_global) g[j] = nvfp4_apply_global(g[j], A);
    }
    if (rht_inverse) rht16_inverse(g);
    store16(out + r * cols + b * 16, g, 16, true);
  }
}

int grid_for(int64_t work) {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (sms <= 0) sms = 132;
  }
  return static_cast<int>(max64(1, min64((work + 255) / 256, static_cast<int64_t>(sms) * 16)));
}

}  // namespace

cudaError_t launch_dequant_fp8(DequantMode mode, const uint8_t* q, const void* scale, int64_t rows, int64_t cols, bool e5m2,
                               bool out_bf16, void* out, cudaStream_t stream) {
  const int64_t work = rows * ((cols + 15) / 16);
  if (work == 0) return cudaSuccess;
  const int blocks = grid_for(work);
#define HQ_DQ(MODE)                                                                                              \
  if (out_bf16)                                                                                                 \
    dequant_fp8_kernel<MODE, __nv_bfloat16><<<blocks, 256, 0, stream>>>(q, scale, rows, cols, e5m2,             \
                                                                        static_cast<__nv_bfloat16*>(out));      \
  else                                                                                                          \
    dequant_fp8_kernel<MODE, float><<<blocks, 256, 0, stream>>>(q, scale, rows, cols, e5m2, static_cast<float*>(out));
  switch (mode) {
    case DequantMode::kTensor: HQ_DQ(DequantMode::kTensor); break;
    case DequantMode::kBlock1x128: HQ_DQ(DequantMode::kBlock1x128); break;
    case DequantMode::kTile128: HQ_DQ(DequantMode::kTile128); break;
    case DequantMode::kMx1x32: HQ_DQ(DequantMode::kMx1x32); break;
    default: return cudaErrorInvalidValue;
  }
#undef HQ_DQ
  return cudaGetLastError();
}

cudaError_t launch_dequant_nvfp4(const uint8_t* q, const uint8_t* s, const float* amax, int64_t rows, int64_t cols,
                                 bool rht_inverse, bool apply_global, bool out_bf16, void* out, cudaStream_t stream) {
  const int64_t work = rows * (cols / 16);
  if (work == 0) return cudaSuccess;
  const int blocks = grid_for(work);
  if (out_bf16)
    dequant_nvfp4_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(q, s, amax, rows, cols, rht_inverse, apply_global,
                                                                    static_cast<__nv_bfloat16*>(out));
  else
    dequant_nvfp4_kernel<float><<<blocks, 256, 0, stream>>>(q, s, amax, rows, cols, rht_inverse, apply_global,
                                                            static_cast<float*>(out));
  return cudaGetLastError();
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

Tensor dequantize_fp8(const Tensor& data, const Tensor& scale, int64_t mode, at::ScalarType out_dtype) {
  constexpr const char* op = "dequantize_fp8";
  check_input(data, op, "data");
  TORCH_CHECK(mode >= 0 && mode <= 3, "hybridq::", op,
              ": mode must be 0 (per-tensor), 1 (1x128 blocks), 2 (128x128 tiles) or 3 (MX 1x32), got ", mode);
  const auto dm = static_cast<hybridq::DequantMode>(mode);
  TORCH_CHECK(scale.is_cuda() && scale.is_contiguous(), "hybridq::", op, ": scale must be a contiguous CUDA tensor");
  check_same_device(scale, data, op, "scale");
  const bool e5m2 = is_e5m2(data.scalar_type(), op);
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t nbr = (rows + 127) / 128, nbc = (cols + 127) / 128;
  if (dm == hybridq::DequantMode::kMx1x32) {
    TORCH_CHECK(scale.scalar_type() == at::kByte, "hybridq::", op, ": MXFP8 scales must be uint8 (E8M0), got ",
                scale.scalar_type());
    TORCH_CHECK(cols % 32 == 0, "hybridq::", op, ": MXFP8 data needs cols divisible by 32, got data of shape ",
                data.sizes());
    TORCH_CHECK(scale.numel() == rows * (cols / 32), "hybridq::", op, ": MXFP8 scales must have ", rows * (cols / 32),
                " elements ([rows, cols/32]) for data of shape ", data.sizes(), ", got ", scale.numel());
  } else {
    TORCH_CHECK(scale.scalar_type() == at::kFloat, "hybridq::", op, ": scale must be float32, got ",
                scale.scalar_type());
    const int64_t want = dm == hybridq::DequantMode::kTensor       ? 1
                         : dm == hybridq::DequantMode::kBlock1x128 ? rows * nbc
                                                                   : nbr * nbc;
    TORCH_CHECK(scale.numel() == want, "hybridq::", op, ": mode ", mode, " needs ", want,
                " scale elements for data of shape ", data.sizes(), ", got ", scale.numel());
  }
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = at::empty({rows, cols}, data.options().dtype(out_type(out_dtype, op)));
  C10_CUDA_CHECK(hybridq::launch_dequant_fp8(dm, u8(data), scale.data_ptr(), rows, cols, e5m2,
                                             out_dtype == at::kBFloat16, out.data_ptr(),
                                             c10::cuda::getCurrentCUDAStream()));
  return out;
}

Tensor dequantize_nvfp4(const Tensor& data, const Tensor& scale, const Tensor& amax, bool rht_inverse,
                        bool apply_global, at::ScalarType out_dtype) {
  constexpr const char* op = "dequantize_nvfp4";
  check_input(data, op, "data");
  TORCH_CHECK(data.scalar_type() == at::kByte, "hybridq::", op, ": data must be uint8 (packed E2M1), got ",
              data.scalar_type());
  TORCH_CHECK(scale.is_cuda() && scale.is_contiguous() && scale.element_size() == 1,
              "hybridq::", op, ": scale must be a contiguous CUDA e4m3 tensor");
  TORCH_CHECK(amax.is_cuda() && amax.scalar_type() == at::kFloat && amax.numel() == 1,
              "hybridq::", op, ": amax must be a CUDA float32 tensor of one element");
  check_same_device(scale, data, op, "scale");
  check_same_device(amax, data, op, "amax");
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  TORCH_CHECK(cols % 16 == 0, "hybridq::", op, ": NVFP4 needs cols (2 * data.size(1)) divisible by 16, got data of shape ",
              data.sizes());
  TORCH_CHECK(scale.numel() == rows * (cols / 16), "hybridq::", op, ": scale must have ", rows * (cols / 16),
              " elements ([rows, cols/16]) for data of shape ", data.sizes(), ", got ", scale.numel());
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = at::empty({rows, cols}, data.options().dtype(out_type(out_dtype, op)));
  C10_CUDA_CHECK(hybridq::launch_dequant_nvfp4(u8(data), static_cast<const uint8_t*>(scale.data_ptr()),
                                               amax.contiguous().data_ptr<float>(), rows, cols, rht_inverse,
                                               apply_global, out_dtype == at::kBFloat16, out.data_ptr(),
                                               c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace ops
}  // namespace hybridq
