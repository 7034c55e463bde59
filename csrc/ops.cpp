// torch.library registration of the hybridq CUDA kernels: custom ops in the `hybridq` namespace
// (torch.ops.hybridq.*), implemented for the CUDA dispatch key. Fake (meta) implementations live in
// hybridq/kernels/cuda_ops.py. The module init at the bottom only makes the library importable as
// `hybridq._C`; loading it registers the ops.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <tuple>

#include "hybridq.h"

using at::Tensor;

namespace {

hybridq::InType in_type(const Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return hybridq::InType::kF32;
    case at::kBFloat16:
      return hybridq::InType::kBF16;
    case at::kHalf:
      return hybridq::InType::kF16;
    default:
      TORCH_CHECK(false, "hybridq: unsupported input dtype ", x.scalar_type(),
                  " (expected float32, bfloat16 or float16)");
  }
}

void check_input(const Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), "hybridq::", op, ": expected a CUDA tensor");
  TORCH_CHECK(x.dim() == 2, "hybridq::", op, ": expected a 2-D tensor, got ", x.dim(), " dims");
  TORCH_CHECK(x.is_contiguous(), "hybridq::", op, ": expected a contiguous tensor");
}

bool is_e5m2(at::ScalarType t) {
  TORCH_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2,
              "hybridq: fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
  return t == at::kFloat8_e5m2;
}

Tensor empty0(const Tensor& x, at::ScalarType t) { return at::empty({0}, x.options().dtype(t)); }

uint8_t* u8(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

hybridq::QuantArgs base_args(const Tensor& x, bool rowwise, bool columnwise) {
  hybridq::QuantArgs a{};
  a.x = x.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.rowwise = rowwise;
  a.columnwise = columnwise;
  return a;
}

void set_fp8(hybridq::QuantArgs& a, at::ScalarType dtype, double eps, bool pow2) {
  a.e5m2 = is_e5m2(dtype);
  a.fp8_max = a.e5m2 ? 57344.0f : 448.0f;
  a.eps = static_cast<float>(eps);
  a.pow2 = pow2;
}

Tensor zeros_amax(const Tensor& x) { return at::zeros({1}, x.options().dtype(at::kFloat)); }

uint32_t* amax_bits(const Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<float>()); }

// ---- per-tensor FP8 ---------------------------------------------------------------------------------
// scale given (delayed scaling): cast with it; want_amax records max|x| in the same pass.
// else amax given (e.g. a global amax): scale from it; else max|x| first (one extra read).
// returns (rowwise [M, K] | [0], columnwise [K, M] | [0], scale_inv [1], amax [1] | [0])
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize(const Tensor& x, at::ScalarType dtype,
                                                               const std::optional<Tensor>& scale,
                                                               const std::optional<Tensor>& amax, double eps,
                                                               bool pow2, bool rowwise, bool columnwise,
                                                               bool want_amax) {
  check_input(x, "fp8_tensor_quantize");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, eps, pow2);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  Tensor amax_out, scale_t;
  if (scale.has_value()) {
    scale_t = scale->to(x.device(), at::kFloat).contiguous();
    TORCH_CHECK(scale_t.numel() == 1, "hybridq::fp8_tensor_quantize: scale must have one element");
    a.scale_in = scale_t.data_ptr<float>();
    if (want_amax) {
      amax_out = zeros_amax(x);
      a.amax_out = amax_bits(amax_out);
    } else {
      amax_out = empty0(x, at::kFloat);
    }
  } else if (amax.has_value()) {
    TORCH_CHECK(amax->numel() == 1, "hybridq::fp8_tensor_quantize: amax must have one element");
    amax_out = amax->to(x.device(), at::kFloat).reshape({1}).clone();
    a.amax_in = amax_out.data_ptr<float>();
  } else {
    amax_out = zeros_amax(x);
    C10_CUDA_CHECK(hybridq::launch_absmax(in_type(x), x.data_ptr(), M * K, amax_bits(amax_out), stream));
    a.amax_in = amax_out.data_ptr<float>();
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.scale_inv_out = scale_inv.data_ptr<float>();
  C10_CUDA_CHECK(hybridq::launch_quantize_fp8_tensor(in_type(x), a, stream));
  return {row, col, scale_inv, amax_out};
}

// ---- FP8 block ----------------------------------------------------------------------------------------
// returns (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv); block_dim 1: [M, ceil(K/128)] and
// [K, ceil(M/128)]; block_dim 2: [ceil(M/128), ceil(K/128)] and its transpose
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize(const Tensor& x, at::ScalarType dtype,
                                                              int64_t block_dim, double eps, bool pow2, bool rowwise,
                                                              bool columnwise) {
  check_input(x, "fp8_block_quantize");
  TORCH_CHECK(block_dim == 1 || block_dim == 2, "hybridq::fp8_block_quantize: block_dim must be 1 or 2");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t nbm = (M + 127) / 128, nbk = (K + 127) / 128;
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, eps, pow2);
  auto f32 = x.options().dtype(at::kFloat);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor row_s, col_s;
  if (block_dim == 1) {
    row_s = rowwise ? at::empty({M, nbk}, f32) : empty0(x, at::kFloat);
    col_s = columnwise ? at::empty({K, nbm}, f32) : empty0(x, at::kFloat);
  } else {
    row_s = rowwise ? at::empty({nbm, nbk}, f32) : empty0(x, at::kFloat);
    col_s = columnwise ? at::empty({nbk, nbm}, f32) : empty0(x, at::kFloat);
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  C10_CUDA_CHECK(hybridq::launch_quantize_fp8_block(in_type(x), block_dim == 2, a, stream));
  return {row, row_s, col, col_s};
}

// ---- MXFP8 ----------------------------------------------------------------------------------------------
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize(const Tensor& x, at::ScalarType dtype, bool block_2d,
                                                          bool rowwise, bool columnwise, bool swizzle) {
  check_input(x, "mxfp8_quantize");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 32), "hybridq::mxfp8_quantize: K must be divisible by 32, got K=", K);
  TORCH_CHECK(!((columnwise || block_2d) && M % 32), "hybridq::mxfp8_quantize: M must be divisible by 32, got M=", M);
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, 0.0, false);
  auto u8o = x.options().dtype(at::kByte);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor row_s, col_s;
  a.swizzle = swizzle;
  if (swizzle) {
    a.row_s_cols_pad = round_up(K / 32, 4);
    a.col_s_cols_pad = round_up(M / 32, 4);
    row_s = rowwise ? at::zeros({round_up(M, 128) * a.row_s_cols_pad}, u8o) : empty0(x, at::kByte);
    col_s = columnwise ? at::zeros({round_up(K, 128) * a.col_s_cols_pad}, u8o) : empty0(x, at::kByte);
  } else {
    row_s = rowwise ? at::empty({M, K / 32}, u8o) : empty0(x, at::kByte);
    col_s = columnwise ? at::empty({K, M / 32}, u8o) : empty0(x, at::kByte);
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  C10_CUDA_CHECK(hybridq::launch_quantize_mxfp8(in_type(x), block_2d, a, stream));
  return {row, row_s, col, col_s};
}

// ---- NVFP4 ------------------------------------------------------------------------------------------------
// returns (row data [M, K/2], row scale [M, K/16] e4m3, row amax [1], col data [K, M/2], col scale [K, M/16],
// col amax [1]); empty [0] tensors for a direction not asked for
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nvfp4_quantize(const Tensor& x, bool block_2d, bool rht,
                                                                          bool stochastic_rounding,
                                                                          const std::optional<at::Generator>& generator,
                                                                          bool rowwise, bool columnwise) {
  check_input(x, "nvfp4_quantize");
  TORCH_CHECK(!(block_2d && rht), "hybridq::nvfp4_quantize: rht applies to 1-D blocks, not 16x16 tiles");
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 16), "hybridq::nvfp4_quantize: K must be divisible by 16, got K=", K);
  TORCH_CHECK(!((columnwise || block_2d) && M % 16), "hybridq::nvfp4_quantize: M must be divisible by 16, got M=", M);
  auto a = base_args(x, rowwise, columnwise);
  a.fp8_max = 448.0f;
  auto u8o = x.options().dtype(at::kByte);
  auto e4 = x.options().dtype(at::kFloat8_e4m3fn);
  Tensor row = rowwise ? at::empty({M, K / 2}, u8o) : empty0(x, at::kByte);
  Tensor col = columnwise ? at::empty({K, M / 2}, u8o) : empty0(x, at::kByte);
  Tensor row_s = rowwise ? at::empty({M, K / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  Tensor col_s = columnwise ? at::empty({K, M / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  // global amaxes
  Tensor amax_r = zeros_amax(x), amax_c;
  const auto it = in_type(x);
  if (!block_2d && rht && columnwise) {
    amax_c = zeros_amax(x);
    C10_CUDA_CHECK(hybridq::launch_nvfp4_rht_amax(it, x.data_ptr(), M, K, amax_bits(amax_r), amax_bits(amax_c), stream));
  } else {
    C10_CUDA_CHECK(hybridq::launch_absmax(it, x.data_ptr(), M * K, amax_bits(amax_r), stream));
    amax_c = columnwise ? (rowwise ? amax_r.clone() : amax_r) : empty0(x, at::kFloat);
  }
  if (!rowwise) {
    if (block_2d) a.amax_row = amax_c.data_ptr<float>();  // the 2-D tiles use one amax for both directions
    amax_r = empty0(x, at::kFloat);
  } else {
    a.amax_row = amax_r.data_ptr<float>();
  }
  if (columnwise) a.amax_col = amax_c.data_ptr<float>();
  else amax_c = empty0(x, at::kFloat);
  a.rht = rht;
  a.sr = stochastic_rounding;
  if (stochastic_rounding) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        generator, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
    at::PhiloxCudaState st;
    {
      std::lock_guard<std::mutex> lock(gen->mutex_);
      st = gen->philox_cuda_state(4);
    }
    a.philox.captured = st.captured_;
    if (st.captured_) {
      a.philox.seed_ptr = st.seed_.ptr;
      a.philox.offset_ptr = st.offset_.ptr;
      a.philox.offset_intragraph = st.offset_intragraph_;
    } else {
      a.philox.seed = st.seed_.val;
      a.philox.offset = st.offset_.val;
    }
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.row_s = rowwise ? row_s.data_ptr() : nullptr;
  a.col_s = columnwise ? col_s.data_ptr() : nullptr;
  C10_CUDA_CHECK(hybridq::launch_quantize_nvfp4(it, block_2d, a, stream));
  return {row, row_s, amax_r, col, col_s, amax_c};
}

Tensor amax_op(const Tensor& x) {
  check_input(x, "amax");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor out = zeros_amax(x);
  C10_CUDA_CHECK(hybridq::launch_absmax(in_type(x), x.data_ptr(), x.numel(), amax_bits(out),
                                        c10::cuda::getCurrentCUDAStream()));
  return out;
}

// ---- dequantize -------------------------------------------------------------------------------------------
at::ScalarType out_type(at::ScalarType t) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "hybridq: dequantize out_dtype must be float32 or bfloat16");
  return t;
}

Tensor dequantize_fp8(const Tensor& data, const Tensor& scale, int64_t mode, at::ScalarType out_dtype) {
  check_input(data, "dequantize_fp8");
  TORCH_CHECK(mode >= 0 && mode <= 3, "hybridq::dequantize_fp8: mode must be 0..3");
  TORCH_CHECK(scale.is_cuda() && scale.is_contiguous(), "hybridq::dequantize_fp8: scale must be a contiguous CUDA tensor");
  c10::cuda::CUDAGuard guard(data.device());
  const bool e5m2 = is_e5m2(data.scalar_type());
  const int64_t rows = data.size(0), cols = data.size(1);
  if (mode == 3) {
    TORCH_CHECK(scale.scalar_type() == at::kByte && cols % 32 == 0, "hybridq::dequantize_fp8: MX needs uint8 scales and cols divisible by 32");
  } else {
    TORCH_CHECK(scale.scalar_type() == at::kFloat, "hybridq::dequantize_fp8: scale must be float32");
  }
  Tensor out = at::empty({rows, cols}, data.options().dtype(out_type(out_dtype)));
  C10_CUDA_CHECK(hybridq::launch_dequant_fp8(static_cast<int>(mode), u8(data), scale.data_ptr(), rows, cols, e5m2,
                                             out_dtype == at::kBFloat16, out.data_ptr(),
                                             c10::cuda::getCurrentCUDAStream()));
  return out;
}

Tensor dequantize_nvfp4(const Tensor& data, const Tensor& scale, const Tensor& amax, bool rht_inverse,
                        bool apply_global, at::ScalarType out_dtype) {
  check_input(data, "dequantize_nvfp4");
  TORCH_CHECK(data.scalar_type() == at::kByte, "hybridq::dequantize_nvfp4: data must be uint8");
  TORCH_CHECK(scale.is_cuda() && scale.is_contiguous() && scale.element_size() == 1,
              "hybridq::dequantize_nvfp4: scale must be a contiguous CUDA e4m3 tensor");
  TORCH_CHECK(amax.is_cuda() && amax.scalar_type() == at::kFloat && amax.numel() == 1,
              "hybridq::dequantize_nvfp4: amax must be a CUDA float32 tensor of one element");
  c10::cuda::CUDAGuard guard(data.device());
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  TORCH_CHECK(cols % 16 == 0, "hybridq::dequantize_nvfp4: cols must be divisible by 16");
  Tensor out = at::empty({rows, cols}, data.options().dtype(out_type(out_dtype)));
  C10_CUDA_CHECK(hybridq::launch_dequant_nvfp4(u8(data), static_cast<const uint8_t*>(scale.data_ptr()),
                                               amax.contiguous().data_ptr<float>(), rows, cols, rht_inverse,
                                               apply_global, out_dtype == at::kBFloat16, out.data_ptr(),
                                               c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY(hybridq, m) {
  m.def(
      "fp8_tensor_quantize(Tensor x, ScalarType dtype, Tensor? scale, Tensor? amax, float eps, bool pow2, "
      "bool rowwise, bool columnwise, bool want_amax) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fp8_block_quantize(Tensor x, ScalarType dtype, int block_dim, float eps, bool pow2, bool rowwise, "
      "bool columnwise) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "mxfp8_quantize(Tensor x, ScalarType dtype, bool block_2d, bool rowwise, bool columnwise, bool swizzle) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "nvfp4_quantize(Tensor x, bool block_2d, bool rht, bool stochastic_rounding, Generator? generator, "
      "bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("amax(Tensor x) -> Tensor");
  m.def("dequantize_fp8(Tensor data, Tensor scale, int mode, ScalarType out_dtype) -> Tensor");
  m.def(
      "dequantize_nvfp4(Tensor data, Tensor scale, Tensor amax, bool rht_inverse, bool apply_global, "
      "ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridq, CUDA, m) {
  m.impl("fp8_tensor_quantize", &fp8_tensor_quantize);
  m.impl("fp8_block_quantize", &fp8_block_quantize);
  m.impl("mxfp8_quantize", &mxfp8_quantize);
  m.impl("nvfp4_quantize", &nvfp4_quantize);
  m.impl("amax", &amax_op);
  m.impl("dequantize_fp8", &dequantize_fp8);
  m.impl("dequantize_nvfp4", &dequantize_nvfp4);
}

// ---- Python module (so that `import hybridq._C` loads the library) --------------------------------------
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
#define HQ_CAT2(a, b) a##b
#define HQ_CAT(a, b) HQ_CAT2(a, b)
#define HQ_STR2(a) #a
#define HQ_STR(a) HQ_STR2(a)

static struct PyModuleDef hq_module = {PyModuleDef_HEAD_INIT, HQ_STR(TORCH_EXTENSION_NAME),
                                       "hybridq CUDA kernels; the operations are torch.ops.hybridq.*", -1, nullptr};

PyMODINIT_FUNC HQ_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&hq_module); }
