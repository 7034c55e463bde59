// Shared argument checks, allocation and registration helpers of the op bindings (csrc/quantize_*.cu and the other
// kernels' .cu files). Every bad argument raises a RuntimeError that names the op, the tensor and the rule it
// breaks, before anything is allocated or launched.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "hybridq.h"

namespace hybridq {
namespace ops {

using at::Tensor;

// (The messages format integers and shapes through std::ostream: that needs the extension to share torch's
// libstdc++, see setup.py.)

inline hybridq::InType in_type(const Tensor& x, const char* op, const char* name = "x") {
  switch (x.scalar_type()) {
    case at::kFloat:
      return hybridq::InType::kF32;
    case at::kBFloat16:
      return hybridq::InType::kBF16;
    case at::kHalf:
      return hybridq::InType::kF16;
    default:
      TORCH_CHECK(false, "hybridq::", op, ": input ", name, " has dtype ", x.scalar_type(),
                  "; expected float32, bfloat16 or float16");
  }
}

inline void check_input(const Tensor& x, const char* op, const char* name = "x") {
  TORCH_CHECK(x.defined(), "hybridq::", op, ": input ", name, " is an undefined tensor");
  TORCH_CHECK(x.is_cuda(), "hybridq::", op, ": input ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "hybridq::", op, ": input ", name, " must be 2-D, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "hybridq::", op, ": input ", name, " of shape ", x.sizes(), " and strides ",
              x.strides(), " must be contiguous (call .contiguous())");
}

inline void check_same_device(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "hybridq::", op, ": ", name, " is on ", t.device(), " but the input is on ",
              x.device());
}

// An operand of an FP8 block-scaled GEMM (csrc/block_gemm.cu, grouped_block_gemm.cu): E4M3, contiguous, 2-D, on the
// device of `like`
inline void check_block_gemm_operand(const Tensor& t, const Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.defined() && t.is_cuda(), "hybridq::", op, ": ", name, " must be a CUDA tensor");
  check_same_device(t, like, op, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, "hybridq::", op, ": ", name,
              " must be torch.float8_e4m3fn (FP8 block GEMMs are E4M3 x E4M3), got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "hybridq::", op, ": ", name, " must be a contiguous 2-D tensor, got ",
              t.sizes(), " with strides ", t.strides());
}

// An FP8 block-scaled GEMM's result dtype: bfloat16 / float32 from the GEMM, float16 through float32 (as
// native_gemm._block_run)
inline at::ScalarType block_gemm_dtype(at::ScalarType out_dtype, const char* op) {
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat || out_dtype == at::kHalf, "hybridq::", op,
              ": out_dtype must be bfloat16, float32 or float16, got ", out_dtype);
  return out_dtype == at::kHalf ? at::kFloat : out_dtype;
}

inline bool is_e5m2(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2, "hybridq::", op,
              ": fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
  return t == at::kFloat8_e5m2;
}

inline Tensor empty0(const Tensor& x, at::ScalarType t) { return at::empty({0}, x.options().dtype(t)); }

inline uint8_t* u8(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// The tile-kernel arguments of one format (A: its policy's Args, csrc/tile/policy_<format>.cuh) for the input x and
// the directions asked for; zero elsewhere (the caller sets the outputs and the format's fields)
template <class A>
inline A tile_args(const Tensor& x, bool rowwise, bool columnwise) {
  A a{};
  a.x = x.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.rowwise = rowwise;
  a.columnwise = columnwise;
  return a;
}

// A row map for a quantize op (optional `src_rows`, int32 [S] on x's device): the op then quantizes the [S, K] whose
// row r is x's row src_rows[r], a zero row where that is < 0 (values must lie in [-1, x.size(0)): checked on the
// device before the quantize, check_row_map_values), instead of x --
// bitwise the quantization of that buffer, which is never materialized (the tile kernel's RowMap::kLoads). Sets the
// arguments' rows and map; returns the rows quantized (S, else x's).
template <class A>
inline int64_t apply_row_map(A& a, const Tensor& x, const std::optional<Tensor>& src_rows, const char* op) {
  if (!src_rows.has_value()) return x.size(0);
  const Tensor& m = *src_rows;
  TORCH_CHECK(m.is_cuda() && m.scalar_type() == at::kInt && m.dim() == 1 && m.is_contiguous(), "hybridq::", op,
              ": src_rows must be a contiguous 1-D int32 CUDA tensor, got ", m.scalar_type(), " of shape ", m.sizes(),
              " on ", m.device());
  check_same_device(m, x, op, "src_rows");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31), "hybridq::", op,
              ": a row map addresses at most 2^31 - 1 input rows, x has ", x.size(0));
  a.M = m.size(0);
  a.src_rows = m.data_ptr<int32_t>();
  return a.M;
}

// The device check of a row map set by apply_row_map (none without one), on `stream` before the quantize's launch:
// once every host check has passed
template <class A>
inline void check_row_map_values(const A& a, const Tensor& x, cudaStream_t stream) {
  if (a.src_rows != nullptr) C10_CUDA_CHECK(hybridq::launch_check_row_map(a.src_rows, a.M, x.size(0), stream));
}

inline hybridq::Fp8Encoding fp8_encoding(at::ScalarType dtype, double eps, bool pow2, const char* op) {
  TORCH_CHECK(eps >= 0.0, "hybridq::", op, ": amax epsilon must be >= 0, got ", eps);
  hybridq::Fp8Encoding e{};
  e.e5m2 = is_e5m2(dtype, op);
  e.max = e.e5m2 ? 57344.0f : 448.0f;
  e.eps = static_cast<float>(eps);
  e.pow2 = pow2;
  return e;
}

// Zeroed by one cudaMemsetAsync on the tensor's device's current stream: at::zeros goes through a fill kernel's
// TensorIterator set-up, several microseconds more of host time per call on the step's critical path.
inline Tensor zeros_on_stream(at::IntArrayRef size, const at::TensorOptions& options) {
  Tensor t = at::empty(size, options);
  if (t.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), c10::cuda::getCurrentCUDAStream(t.device().index())));
  }
  return t;
}

inline Tensor zeros_amax(const Tensor& x) { return zeros_on_stream({1}, x.options().dtype(at::kFloat)); }

inline uint32_t* amax_bits(const Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<float>()); }

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline at::ScalarType out_type(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "hybridq::", op, ": out_dtype must be float32 or bfloat16, got ",
              t);
  return t;
}

// The dequantize kernel's arguments of one format (A: its policy's DequantArgs) for the codes `data` of a part with
// `cols` elements per row; zero elsewhere (the caller sets the scales)
template <class A>
inline A dequant_args(const Tensor& data, int64_t cols) {
  A a{};
  a.q = u8(data);
  a.rows = data.size(0);
  a.cols = cols;
  return a;
}

// A scale tensor of a part to dequantize: contiguous, on the codes' device, with `want` elements (`layout` names its
// shape rule)
inline void check_part_scale_layout(const Tensor& scale, const Tensor& data, const char* op, const char* name,
                                    int64_t want, const char* layout) {
  TORCH_CHECK(scale.is_cuda() && scale.is_contiguous(), "hybridq::", op, ": ", name,
              " must be a contiguous CUDA tensor");
  check_same_device(scale, data, op, name);
  TORCH_CHECK(scale.numel() == want, "hybridq::", op, ": ", name, " needs ", want, " scale elements (", layout,
              ") for data of shape ", data.sizes(), ", got ", scale.numel());
}

// ... and of dtype `dtype` (`what` names the format's scale type)
inline void check_part_scale(const Tensor& scale, const Tensor& data, const char* op, const char* name,
                             at::ScalarType dtype, const char* what, int64_t want, const char* layout) {
  TORCH_CHECK(scale.scalar_type() == dtype, "hybridq::", op, ": ", name, " must be ", what, ", got ",
              scale.scalar_type());
  check_part_scale_layout(scale, data, op, name, want, layout);
}

// The output of a dequantize op: [rows, cols] of out_dtype (float32 or bfloat16)
inline Tensor dequant_out(const Tensor& data, int64_t cols, at::ScalarType out_dtype, const char* op) {
  return at::empty({data.size(0), cols}, data.options().dtype(out_type(out_dtype, op)));
}

}  // namespace ops
}  // namespace hybridq

// Registers the implementations of one file's ops (a function `void (torch::Library&)` that calls m.impl for each)
// for CUDA tensors, and for CPU tensors: their argument checks reject those with a clear message (rather than the
// dispatcher's "could not run ... with arguments from the 'CPU' backend"; the CPU path is the Python references).
// The file declares its schemas itself, in a TORCH_LIBRARY_FRAGMENT(hybridq, m) block.
#define HQ_IMPL_CUDA_AND_CPU(impls)              \
  TORCH_LIBRARY_IMPL(hybridq, CUDA, m) { impls(m); } \
  TORCH_LIBRARY_IMPL(hybridq, CPU, m) { impls(m); }
