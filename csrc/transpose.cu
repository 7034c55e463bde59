// Byte transpose of a row-major [R, C] matrix of 1-byte elements (FP8 data, E8M0 scales, packed bytes) into
// [C, R], or of a batch [G, R, C] -> [G, C, R] (the experts of a grouped weight, one launch for all): the exact
// layout change behind deriving a columnwise part from a rowwise one after an FSDP all-gather.
// torch's `x.t().contiguous()` runs a generic strided copy (~10% of copy bandwidth on H200 for 1-byte elements);
// this one stages 64x64 tiles in shared memory and moves 16-byte words on both sides.
#include "binding_checks.h"
#include "ops.h"

namespace hybridq {
namespace {

constexpr int kT = 64;      // tile edge (bytes)
constexpr int kPad = 4;     // row padding of the shared tile (keeps 4-byte alignment, spreads banks)
constexpr int kThreads = 256;  // 64 rows x 4 threads x 16 bytes

__global__ void __launch_bounds__(kThreads) transpose_u8_kernel(const uint8_t* __restrict__ in,
                                                                uint8_t* __restrict__ out, int64_t R, int64_t C,
                                                                int64_t in_batch, int64_t out_batch, bool vec) {
  __shared__ __align__(16) uint8_t tile[kT][kT + kPad];
  in += static_cast<int64_t>(blockIdx.z) * in_batch;  // matrix z of the batch (element strides)
  out += static_cast<int64_t>(blockIdx.z) * out_batch;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kT, c0 = static_cast<int64_t>(blockIdx.x) * kT;
  const int t = threadIdx.x, lr = t >> 2, lc = (t & 3) * 16;
  {
    const int64_t gr = r0 + lr, gc = c0 + lc;
    if (vec && gr < R && gc + 16 <= C) {
      const uint4 v = *reinterpret_cast<const uint4*>(in + gr * C + gc);
      uint32_t* dst = reinterpret_cast<uint32_t*>(&tile[lr][lc]);
      dst[0] = v.x;
      dst[1] = v.y;
      dst[2] = v.z;
      dst[3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) tile[lr][lc + j] = (gr < R && gc + j < C) ? in[gr * C + gc + j] : 0;
    }
  }
  __syncthreads();
  // output row c0 + lr holds input column c0 + lr; its bytes r0 + lc .. r0 + lc + 15 come from tile rows lc..lc+15
  const int64_t orow = c0 + lr, ocol = r0 + lc;
  if (orow >= C) return;
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    w[q] = static_cast<uint32_t>(tile[lc + 4 * q][lr]) | (static_cast<uint32_t>(tile[lc + 4 * q + 1][lr]) << 8) |
           (static_cast<uint32_t>(tile[lc + 4 * q + 2][lr]) << 16) |
           (static_cast<uint32_t>(tile[lc + 4 * q + 3][lr]) << 24);
  }
  if (vec && ocol + 16 <= R) {
    *reinterpret_cast<uint4*>(out + orow * R + ocol) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (ocol + j < R) out[orow * R + ocol + j] = static_cast<uint8_t>(w[j >> 2] >> (8 * (j & 3)));
  }
}

}  // namespace

cudaError_t launch_transpose_u8(const uint8_t* in, uint8_t* out, int64_t R, int64_t C, cudaStream_t stream,
                                int64_t G, int64_t in_batch, int64_t out_batch) {
  if (R == 0 || C == 0 || G == 0) return cudaSuccess;
  const int64_t gx = (C + kT - 1) / kT, gy = (R + kT - 1) / kT;
  if (gy > 65535 || G > 65535) return cudaErrorInvalidConfiguration;  // > 4M rows / 65535 matrices: callers check
  // 16-byte words on both sides need both row lengths, the batch strides and the base pointers 16-byte aligned
  const bool vec = (R % 16 == 0) && (C % 16 == 0) && (in_batch % 16 == 0) && (out_batch % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(in) % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  transpose_u8_kernel<<<dim3(static_cast<unsigned int>(gx), static_cast<unsigned int>(gy),
                             static_cast<unsigned int>(G)),
                        kThreads, 0, stream>>>(in, out, R, C, in_batch, out_batch, vec);
  return cudaGetLastError();
}

}  // namespace hybridq

namespace hybridq {
namespace ops {

// ---- byte transpose --------------------------------------------------------------------------------------
// x.t().contiguous() for a contiguous 2-D tensor of 1-byte elements (any 1-byte dtype; the result keeps it)
Tensor transpose_bytes(const Tensor& x) {
  constexpr const char* op = "transpose_bytes";
  TORCH_CHECK(x.defined() && x.is_cuda(), "hybridq::", op, ": input must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 2, "hybridq::", op, ": input must be 2-D, got shape ", x.sizes());
  TORCH_CHECK(x.element_size() == 1, "hybridq::", op, ": input must have 1-byte elements, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "hybridq::", op, ": input of shape ", x.sizes(), " and strides ", x.strides(),
              " must be contiguous");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 22), "hybridq::", op, ": at most 4194303 rows, got ", x.size(0));
  c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty({x.size(1), x.size(0)}, x.options());
  C10_CUDA_CHECK(hybridq::launch_transpose_u8(static_cast<const uint8_t*>(x.data_ptr()), u8(out), x.size(0),
                                              x.size(1), c10::cuda::getCurrentCUDAStream()));
  return out;
}

// out[g] = x[g]^T for x [G, R, C] and out [G, C, R] (or x [R, C] and out [C, R]), each matrix row-major with unit
// element stride and rows of its own length; the batch strides may be any (the stacked buffers of gathered experts)
void transpose_bytes_into(const Tensor& x, const Tensor& out) {
  constexpr const char* op = "transpose_bytes_into";
  TORCH_CHECK(x.defined() && x.is_cuda() && out.defined() && out.is_cuda() && x.device() == out.device(),
              "hybridq::", op, ": x and out must be CUDA tensors on one device");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && out.dim() == x.dim(), "hybridq::", op,
              ": x and out must both be 2-D or both 3-D, got shapes ", x.sizes(), " and ", out.sizes());
  TORCH_CHECK(x.element_size() == 1 && out.element_size() == 1, "hybridq::", op,
              ": x and out must have 1-byte elements, got ", x.scalar_type(), " and ", out.scalar_type());
  const int64_t b = x.dim() == 3 ? 1 : 0, G = b ? x.size(0) : 1, R = x.size(b), C = x.size(b + 1);
  TORCH_CHECK((!b || out.size(0) == G) && out.size(b) == C && out.size(b + 1) == R, "hybridq::", op,
              ": out of shape ", out.sizes(), " is not the transpose of x of shape ", x.sizes());
  TORCH_CHECK(x.stride(b + 1) == 1 && x.stride(b) == C && out.stride(b + 1) == 1 && out.stride(b) == R, "hybridq::",
              op, ": each matrix must be row-major with rows of its own length; x strides ", x.strides(),
              ", out strides ", out.strides());
  TORCH_CHECK(R < (int64_t{1} << 22) && G <= 65535, "hybridq::", op, ": at most 4194303 rows and 65535 matrices, got ",
              x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(hybridq::launch_transpose_u8(static_cast<const uint8_t*>(x.data_ptr()), u8(out), R, C,
                                              c10::cuda::getCurrentCUDAStream(), G, b ? x.stride(0) : 0,
                                              b ? out.stride(0) : 0));
}

// transpose_bytes_into(x[i], out[i]) for every i, in one call from Python (the derived columnwise forms of a
// `fully_shard` unit's weights, distributed/unit_fill.py: one dispatch instead of one per weight; a launch each).
// Each pair is checked as transpose_bytes_into checks it, all of them before the first launch.
void transpose_bytes_into_list(at::TensorList x, at::TensorList out) {
  TORCH_CHECK(x.size() == out.size(), "hybridq::transpose_bytes_into_list: ", x.size(), " inputs but ", out.size(),
              " outputs");
  for (size_t i = 0; i < x.size(); ++i) {
    const Tensor &a = x[i], &b = out[i];
    TORCH_CHECK(a.defined() && b.defined() && a.is_cuda() && b.is_cuda() && a.device() == b.device() &&
                    a.dim() == 2 && b.dim() == 2 && a.element_size() == 1 && b.element_size() == 1 &&
                    b.size(0) == a.size(1) && b.size(1) == a.size(0) && a.stride(1) == 1 && a.stride(0) == a.size(1) &&
                    b.stride(1) == 1 && b.stride(0) == b.size(1) && a.size(0) < (int64_t{1} << 22),
                "hybridq::transpose_bytes_into_list: pair ", i, " is not a row-major 2-D CUDA matrix of 1-byte "
                "elements (< 4194304 rows) and its row-major transpose on the same device: x ", a.sizes(), " strides ",
                a.strides(), ", out ", b.sizes(), " strides ", b.strides());
  }
  for (size_t i = 0; i < x.size(); ++i) transpose_bytes_into(x[i], out[i]);
}

}  // namespace ops
}  // namespace hybridq
