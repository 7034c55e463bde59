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

// Every bad argument raises a RuntimeError that names the op, the tensor and the rule it breaks.
// (The messages format integers and shapes through std::ostream: that needs the extension to share torch's
// libstdc++, see setup.py.)

hybridq::InType in_type(const Tensor& x, const char* op, const char* name = "x") {
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

void check_input(const Tensor& x, const char* op, const char* name = "x") {
  TORCH_CHECK(x.defined(), "hybridq::", op, ": input ", name, " is an undefined tensor");
  TORCH_CHECK(x.is_cuda(), "hybridq::", op, ": input ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "hybridq::", op, ": input ", name, " must be 2-D, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "hybridq::", op, ": input ", name, " of shape ", x.sizes(), " and strides ",
              x.strides(), " must be contiguous (call .contiguous())");
}

void check_same_device(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "hybridq::", op, ": ", name, " is on ", t.device(), " but the input is on ",
              x.device());
}

bool is_e5m2(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2, "hybridq::", op,
              ": fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
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

void set_fp8(hybridq::QuantArgs& a, at::ScalarType dtype, double eps, bool pow2, const char* op) {
  TORCH_CHECK(eps >= 0.0, "hybridq::", op, ": amax epsilon must be >= 0, got ", eps);
  a.e5m2 = is_e5m2(dtype, op);
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
  constexpr const char* op = "fp8_tensor_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, eps, pow2, op);
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == 1, "hybridq::", op, ": scale must have one element, got shape ", scale->sizes());
  } else if (amax.has_value()) {
    TORCH_CHECK(amax->numel() == 1, "hybridq::", op, ": amax must have one element, got shape ", amax->sizes());
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  Tensor amax_out, scale_t;
  if (scale.has_value()) {
    scale_t = scale->to(x.device(), at::kFloat).contiguous();
    a.scale_in = scale_t.data_ptr<float>();
    if (want_amax) {
      amax_out = zeros_amax(x);
      a.amax_out = amax_bits(amax_out);
    } else {
      amax_out = empty0(x, at::kFloat);
    }
  } else if (amax.has_value()) {
    amax_out = amax->to(x.device(), at::kFloat).reshape({1}).clone();
    a.amax_in = amax_out.data_ptr<float>();
  } else {
    amax_out = zeros_amax(x);
    C10_CUDA_CHECK(hybridq::launch_absmax(it, x.data_ptr(), M * K, amax_bits(amax_out), stream));
    a.amax_in = amax_out.data_ptr<float>();
  }
  a.row_q = rowwise ? u8(row) : nullptr;
  a.col_q = columnwise ? u8(col) : nullptr;
  a.scale_inv_out = scale_inv.data_ptr<float>();
  C10_CUDA_CHECK(hybridq::launch_quantize_fp8_tensor(it, a, stream));
  return {row, col, scale_inv, amax_out};
}

// ---- FP8 block ----------------------------------------------------------------------------------------
// returns (rowwise, rowwise scale_inv, columnwise, columnwise scale_inv); block_dim 1: [M, ceil(K/128)] and
// [K, ceil(M/128)]; block_dim 2: [ceil(M/128), ceil(K/128)] and its transpose
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize(const Tensor& x, at::ScalarType dtype,
                                                              int64_t block_dim, double eps, bool pow2, bool rowwise,
                                                              bool columnwise) {
  constexpr const char* op = "fp8_block_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(block_dim == 1 || block_dim == 2, "hybridq::", op,
              ": block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got ", block_dim);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t nbm = (M + 127) / 128, nbk = (K + 127) / 128;
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, eps, pow2, op);
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
  C10_CUDA_CHECK(hybridq::launch_quantize_fp8_block(it, block_dim == 2, a, stream));
  return {row, row_s, col, col_s};
}

// ---- MXFP8 ----------------------------------------------------------------------------------------------
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize(const Tensor& x, at::ScalarType dtype, bool block_2d,
                                                          bool rowwise, bool columnwise, bool swizzle) {
  constexpr const char* op = "mxfp8_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 32), "hybridq::", op, ": MXFP8 ",
              block_2d ? "32x32 tiles need" : "rowwise (1x32 blocks along K) needs",
              " K = x.size(1) divisible by 32, got x of shape ", x.sizes());
  TORCH_CHECK(!((columnwise || block_2d) && M % 32), "hybridq::", op, ": MXFP8 ",
              block_2d ? "32x32 tiles need" : "columnwise (32x1 blocks along M) needs",
              " M = x.size(0) divisible by 32, got x of shape ", x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto a = base_args(x, rowwise, columnwise);
  set_fp8(a, dtype, 0.0, false, op);
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
  C10_CUDA_CHECK(hybridq::launch_quantize_mxfp8(it, block_2d, a, stream));
  return {row, row_s, col, col_s};
}

// ---- NVFP4 ------------------------------------------------------------------------------------------------
// returns (row data [M, K/2], row scale [M, K/16] e4m3, row amax [1], col data [K, M/2], col scale [K, M/16],
// col amax [1]); empty [0] tensors for a direction not asked for
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nvfp4_quantize(const Tensor& x, bool block_2d, bool rht,
                                                                          bool stochastic_rounding,
                                                                          const std::optional<at::Generator>& generator,
                                                                          bool rowwise, bool columnwise,
                                                                          const std::optional<Tensor>& amax,
                                                                          const std::optional<Tensor>& amax_col) {
  constexpr const char* op = "nvfp4_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  TORCH_CHECK(!(block_2d && rht), "hybridq::", op, ": NVFP4 rht applies to 1-D blocks, not to 16x16 tiles");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(!((rowwise || block_2d) && K % 16), "hybridq::", op, ": NVFP4 ",
              block_2d ? "16x16 tiles need" : "rowwise (1x16 blocks along K) needs",
              " K = x.size(1) divisible by 16, got x of shape ", x.sizes());
  TORCH_CHECK(!((columnwise || block_2d) && M % 16), "hybridq::", op, ": NVFP4 ",
              block_2d ? "16x16 tiles need" : "columnwise (16x1 blocks along M) needs",
              " M = x.size(0) divisible by 16, got x of shape ", x.sizes());
  if (stochastic_rounding && generator.has_value() && generator->defined()) {
    TORCH_CHECK(generator->device().is_cuda(), "hybridq::", op,
                ": the stochastic-rounding generator must be a CUDA generator, got one on ", generator->device());
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto a = base_args(x, rowwise, columnwise);
  a.fp8_max = 448.0f;
  auto u8o = x.options().dtype(at::kByte);
  auto e4 = x.options().dtype(at::kFloat8_e4m3fn);
  Tensor row = rowwise ? at::empty({M, K / 2}, u8o) : empty0(x, at::kByte);
  Tensor col = columnwise ? at::empty({K, M / 2}, u8o) : empty0(x, at::kByte);
  Tensor row_s = rowwise ? at::empty({M, K / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  Tensor col_s = columnwise ? at::empty({K, M / 16}, e4) : empty0(x, at::kFloat8_e4m3fn);
  // global amaxes: given (a row shard of a larger tensor, FSDP: the all-reduced amaxes of the whole tensor; with
  // rht, amax_col is the amax after the transform), else computed here
  const bool given = amax.has_value() && amax->defined();
  if (given) {
    TORCH_CHECK(amax->numel() == 1, "hybridq::", op, ": amax must have one element, got shape ", amax->sizes());
    check_same_device(*amax, x, op, "amax");
  }
  const bool given_col = amax_col.has_value() && amax_col->defined();
  if (given_col) {
    TORCH_CHECK(given, "hybridq::", op, ": amax_col is only accepted together with amax");
    TORCH_CHECK(amax_col->numel() == 1, "hybridq::", op, ": amax_col must have one element, got shape ",
                amax_col->sizes());
    check_same_device(*amax_col, x, op, "amax_col");
  }
  TORCH_CHECK(!(given && !given_col && !block_2d && rht && columnwise), "hybridq::", op,
              ": a given amax with rht needs amax_col, the amax of the transformed columnwise input");
  Tensor amax_r, amax_c;
  if (given) {
    amax_r = amax->to(at::kFloat).reshape({1}).clone();
    amax_c = columnwise ? (given_col ? amax_col->to(at::kFloat).reshape({1}).clone() : amax_r.clone())
                        : empty0(x, at::kFloat);
  } else if (!block_2d && rht && columnwise) {
    amax_r = zeros_amax(x);
    amax_c = zeros_amax(x);
    C10_CUDA_CHECK(hybridq::launch_nvfp4_rht_amax(it, x.data_ptr(), M, K, amax_bits(amax_r), amax_bits(amax_c), stream));
  } else {
    amax_r = zeros_amax(x);
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
  const auto it = in_type(x, "amax");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor out = zeros_amax(x);
  C10_CUDA_CHECK(hybridq::launch_absmax(it, x.data_ptr(), x.numel(), amax_bits(out),
                                        c10::cuda::getCurrentCUDAStream()));
  return out;
}

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

// ---- dequantize -------------------------------------------------------------------------------------------
at::ScalarType out_type(at::ScalarType t, const char* op) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "hybridq::", op, ": out_dtype must be float32 or bfloat16, got ",
              t);
  return t;
}

Tensor dequantize_fp8(const Tensor& data, const Tensor& scale, int64_t mode, at::ScalarType out_dtype) {
  constexpr const char* op = "dequantize_fp8";
  check_input(data, op, "data");
  TORCH_CHECK(mode >= 0 && mode <= 3, "hybridq::", op,
              ": mode must be 0 (per-tensor), 1 (1x128 blocks), 2 (128x128 tiles) or 3 (MX 1x32), got ", mode);
  TORCH_CHECK(scale.is_cuda() && scale.is_contiguous(), "hybridq::", op, ": scale must be a contiguous CUDA tensor");
  check_same_device(scale, data, op, "scale");
  const bool e5m2 = is_e5m2(data.scalar_type(), op);
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t nbr = (rows + 127) / 128, nbc = (cols + 127) / 128;
  if (mode == 3) {
    TORCH_CHECK(scale.scalar_type() == at::kByte, "hybridq::", op, ": MXFP8 scales must be uint8 (E8M0), got ",
                scale.scalar_type());
    TORCH_CHECK(cols % 32 == 0, "hybridq::", op, ": MXFP8 data needs cols divisible by 32, got data of shape ",
                data.sizes());
    TORCH_CHECK(scale.numel() == rows * (cols / 32), "hybridq::", op, ": MXFP8 scales must have ", rows * (cols / 32),
                " elements ([rows, cols/32]) for data of shape ", data.sizes(), ", got ", scale.numel());
  } else {
    TORCH_CHECK(scale.scalar_type() == at::kFloat, "hybridq::", op, ": scale must be float32, got ",
                scale.scalar_type());
    const int64_t want = mode == 0 ? 1 : (mode == 1 ? rows * nbc : nbr * nbc);
    TORCH_CHECK(scale.numel() == want, "hybridq::", op, ": mode ", mode, " needs ", want,
                " scale elements for data of shape ", data.sizes(), ", got ", scale.numel());
  }
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = at::empty({rows, cols}, data.options().dtype(out_type(out_dtype, op)));
  C10_CUDA_CHECK(hybridq::launch_dequant_fp8(static_cast<int>(mode), u8(data), scale.data_ptr(), rows, cols, e5m2,
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

// ---- delayed scaling: Float8Quantizer.update() of many quantizers in one launch (in place) ----------------
void fp8_delayed_update(at::TensorList histories, at::TensorList scales, at::ArrayRef<double> fp8_maxes,
                        at::ArrayRef<double> divisors, at::IntArrayRef most_recent) {
  constexpr const char* op = "fp8_delayed_update";
  const int64_t n = static_cast<int64_t>(histories.size());
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == n && static_cast<int64_t>(fp8_maxes.size()) == n &&
                  static_cast<int64_t>(divisors.size()) == n && static_cast<int64_t>(most_recent.size()) == n,
              "hybridq::", op, ": histories, scales, fp8_maxes, divisors and most_recent must have one entry per "
              "quantizer, got lengths ", histories.size(), ", ", scales.size(), ", ", fp8_maxes.size(), ", ",
              divisors.size(), ", ", most_recent.size());
  if (n == 0) return;
  const auto dev = histories[0].device();
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& h = histories[i];
    const Tensor& s = scales[i];
    TORCH_CHECK(h.defined() && h.is_cuda() && h.device() == dev, "hybridq::", op, ": histories[", i,
                "] must be a CUDA tensor on ", dev, ", got ", h.defined() ? h.device() : c10::Device("cpu"));
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 1 && h.is_contiguous(), "hybridq::", op, ": histories[", i,
                "] must be a contiguous 1-D float32 tensor, got ", h.scalar_type(), " of shape ", h.sizes());
    TORCH_CHECK(h.numel() >= 1 && h.numel() <= hybridq::kDelayedMaxLen, "hybridq::", op, ": histories[", i,
                "] must have 1 to ", hybridq::kDelayedMaxLen, " elements, got ", h.numel());
    TORCH_CHECK(s.defined() && s.is_cuda() && s.device() == dev, "hybridq::", op, ": scales[", i,
                "] must be a CUDA tensor on ", dev);
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1 && s.is_contiguous(), "hybridq::", op, ": scales[", i,
                "] must be a float32 tensor of one element, got ", s.scalar_type(), " of shape ", s.sizes());
  }
  Tensor host = at::empty({n * static_cast<int64_t>(sizeof(hybridq::DelayedEntry))},
                          at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* e = reinterpret_cast<hybridq::DelayedEntry*>(host.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    e[i] = hybridq::DelayedEntry{histories[i].data_ptr<float>(), scales[i].data_ptr<float>(), histories[i].numel(),
                                 static_cast<float>(fp8_maxes[i]), static_cast<float>(divisors[i]),
                                 most_recent[i] != 0 ? 1 : 0, 0};
  }
  c10::cuda::CUDAGuard guard(dev);
  Tensor entries = host.to(dev, /*non_blocking=*/true);
  C10_CUDA_CHECK(hybridq::launch_delayed_update(reinterpret_cast<const hybridq::DelayedEntry*>(entries.data_ptr()), n,
                                                c10::cuda::getCurrentCUDAStream()));
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
      "bool rowwise, bool columnwise, Tensor? amax=None, Tensor? amax_col=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("amax(Tensor x) -> Tensor");
  m.def("transpose_bytes(Tensor x) -> Tensor");
  m.def("dequantize_fp8(Tensor data, Tensor scale, int mode, ScalarType out_dtype) -> Tensor");
  m.def(
      "dequantize_nvfp4(Tensor data, Tensor scale, Tensor amax, bool rht_inverse, bool apply_global, "
      "ScalarType out_dtype) -> Tensor");
  m.def(
      "fp8_delayed_update(Tensor(a!)[] histories, Tensor(b!)[] scales, float[] fp8_maxes, float[] divisors, "
      "int[] most_recent) -> ()");
}

#define HQ_IMPL_ALL(m)                                   \
  m.impl("transpose_bytes", &transpose_bytes);           \
  m.impl("fp8_tensor_quantize", &fp8_tensor_quantize);   \
  m.impl("fp8_block_quantize", &fp8_block_quantize);     \
  m.impl("mxfp8_quantize", &mxfp8_quantize);             \
  m.impl("nvfp4_quantize", &nvfp4_quantize);             \
  m.impl("amax", &amax_op);                              \
  m.impl("dequantize_fp8", &dequantize_fp8);             \
  m.impl("dequantize_nvfp4", &dequantize_nvfp4);         \
  m.impl("fp8_delayed_update", &fp8_delayed_update);

TORCH_LIBRARY_IMPL(hybridq, CUDA, m) { HQ_IMPL_ALL(m) }

// CPU tensors reach the same functions, whose argument checks reject them with a clear message (rather than the
// dispatcher's "could not run ... with arguments from the 'CPU' backend"); the CPU path is the Python references.
TORCH_LIBRARY_IMPL(hybridq, CPU, m) { HQ_IMPL_ALL(m) }

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
