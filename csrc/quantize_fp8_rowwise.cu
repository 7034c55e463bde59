// Rowwise FP8: the amax pre-pass (max|x| of every row and every column in one read of x) and the tile kernel with
// Fp8RowwisePolicy (both parts from one read of each tile), and their op fp8_rowwise_quantize.
#include "binding_checks.h"
#include "tile/policy_fp8_rowwise.cuh"

namespace hybridq {

namespace {

constexpr int kAmaxCols = 256;  // columns per CTA (one per thread)
constexpr int kAmaxRows = 32;   // rows per CTA step

// max|x| of every row (row_out [M]) and every column (col_out [K]) of x [M, K], as fp32 bits atomically maxed into
// the zeroed outputs (NaN bits are above inf's: a NaN wins, as torch's amax keeps it); either output may be null.
// A CTA holds 256 consecutive columns (coalesced row reads) and walks 32-row steps (grid-stride along M).
template <typename T>
__global__ void __launch_bounds__(kAmaxCols) row_col_absmax_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                                   uint32_t* row_out, uint32_t* col_out) {
  __shared__ uint32_t s_row[kAmaxRows];
  const int t = threadIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kAmaxCols + t;
  uint32_t cm = 0;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kAmaxRows; r0 < M;
       r0 += static_cast<int64_t>(gridDim.y) * kAmaxRows) {
    if (t < kAmaxRows) s_row[t] = 0u;
    __syncthreads();
    const int nr = static_cast<int>(min64(kAmaxRows, M - r0));
    for (int i = 0; i < nr; ++i) {
      const uint32_t v = c < K ? abs_bits(to_f32(x[(r0 + i) * K + c])) : 0u;
      cm = max(cm, v);
      if (row_out != nullptr) {
        const uint32_t wm = warp_max(v);
        if ((t & 31) == 0 && wm != 0u) atomicMax(&s_row[i], wm);
      }
    }
    __syncthreads();
    if (row_out != nullptr && t < nr && s_row[t] != 0u) atomicMax(row_out + r0 + t, s_row[t]);
  }
  if (col_out != nullptr && c < K && cm != 0u) atomicMax(col_out + c, cm);
}

cudaError_t launch_row_col_absmax(InType t, const void* x, int64_t M, int64_t K, uint32_t* row_out,
                                  uint32_t* col_out, cudaStream_t stream) {
  if (M == 0 || K == 0 || (row_out == nullptr && col_out == nullptr)) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((K + kAmaxCols - 1) / kAmaxCols),
                  static_cast<unsigned>(min64((M + kAmaxRows - 1) / kAmaxRows, 65535)));
  HQ_DISPATCH_IN(t, {
    row_col_absmax_kernel<T><<<grid, kAmaxCols, 0, stream>>>(static_cast<const T*>(x), M, K, row_out, col_out);
    return cudaGetLastError();
  });
}

cudaError_t launch_quantize_fp8_rowwise(InType t, const Fp8RowwiseArgs& a, cudaStream_t stream) {
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fp8RowwisePolicy>(a, stream)));
}

}  // namespace

namespace ops {

namespace {
// A given amax vector (`what`: one per row / column of x): `n` fp32 values on x's device, contiguous
Tensor given_amax(const Tensor& amax, const Tensor& x, int64_t n, const char* op, const char* name, const char* what) {
  TORCH_CHECK(amax.numel() == n, "hybridq::", op, ": ", name, " needs ", n, " values (one per ", what,
              " of x of shape ", x.sizes(), "), got shape ", amax.sizes());
  return amax.to(x.device(), at::kFloat).reshape({n}).contiguous();
}
}  // namespace

// x [M, K] -> (rowwise [M, K] | [0], its scale_inv [M, 1] | [0], columnwise [K, M] | [0], its scale_inv [K, 1] | [0]):
// each row of x (rowwise) and each column of x (columnwise) scaled by its own amax, given (row_amax [M], col_amax [K]:
// e.g. reduced over the pieces of a larger tensor) or else computed in one pre-pass.
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_rowwise_quantize(const Tensor& x, at::ScalarType dtype, double eps,
                                                                bool pow2, bool rowwise, bool columnwise,
                                                                const std::optional<Tensor>& row_amax,
                                                                const std::optional<Tensor>& col_amax) {
  constexpr const char* op = "fp8_rowwise_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M > 0 && K > 0, "hybridq::", op, ": x must have elements, got shape ", x.sizes());
  TORCH_CHECK(rowwise || columnwise, "hybridq::", op, ": asked for neither the rowwise nor the columnwise part");
  auto a = tile_args<Fp8RowwiseArgs>(x, rowwise, columnwise);
  a.fp8 = fp8_encoding(dtype, eps, pow2, op);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor ra, ca;
  bool need_rows = false, need_cols = false;
  if (rowwise) {
    need_rows = !row_amax.has_value();
    ra = need_rows ? zeros_on_stream({M}, f32) : given_amax(*row_amax, x, M, op, "row_amax", "row");
  }
  if (columnwise) {
    need_cols = !col_amax.has_value();
    ca = need_cols ? zeros_on_stream({K}, f32) : given_amax(*col_amax, x, K, op, "col_amax", "column");
  }
  C10_CUDA_CHECK(launch_row_col_absmax(it, x.data_ptr(), M, K, need_rows ? amax_bits(ra) : nullptr,
                                       need_cols ? amax_bits(ca) : nullptr, stream));
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor row_s = rowwise ? at::empty({M, 1}, f32) : empty0(x, at::kFloat);
  Tensor col_s = columnwise ? at::empty({K, 1}, f32) : empty0(x, at::kFloat);
  a.row_amax = rowwise ? ra.data_ptr<float>() : nullptr;
  a.col_amax = columnwise ? ca.data_ptr<float>() : nullptr;
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  C10_CUDA_CHECK(launch_quantize_fp8_rowwise(it, a, stream));
  return {row, row_s, col, col_s};
}

namespace {
void impls(torch::Library& m) { m.impl("fp8_rowwise_quantize", &fp8_rowwise_quantize); }
}  // namespace

}  // namespace ops
}  // namespace hybridq

TORCH_LIBRARY_FRAGMENT(hybridq, m) {
  m.def(
      "fp8_rowwise_quantize(Tensor x, ScalarType dtype, float eps, bool pow2, bool rowwise, bool columnwise, "
      "Tensor? row_amax=None, Tensor? col_amax=None) -> (Tensor, Tensor, Tensor, Tensor)");
}
HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
