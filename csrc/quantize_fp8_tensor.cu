// Per-tensor FP8: the tile kernel with Fp8TensorPolicy (fused cast + transpose; the amax pass is in amax.cu), the
// dequantize kernel with the same policy, and their ops fp8_tensor_quantize / fp8_tensor_quantize_delayed /
// fp8_tensor_quantize_grouped / fp8_tensor_dequantize.
#include "binding_checks.h"
#include "ops.h"
#include "tile/dequantize.cuh"
#include "tile/policy_fp8_tensor.cuh"

namespace hybridq {

namespace {
cudaError_t launch_quantize_fp8_tensor(InType t, const Fp8TensorArgs& a, cudaStream_t stream) {
  if (a.src_rows != nullptr) {
    HQ_DISPATCH_IN(t, return (launch_tile_row_map<T, Fp8TensorPolicy>(a, stream)));
  }
  HQ_DISPATCH_IN(t, return (launch_tile<T, Fp8TensorPolicy>(a, stream)));
}
}  // namespace

namespace ops {

// ---- per-tensor FP8 ---------------------------------------------------------------------------------
namespace {

// The cast of both ops below. scale given (delayed scaling): cast with it and, with record_into, max-combine max|x|
// into *record_into in the same pass (the kernels' atomic max of fp32 bit patterns: the value maximum for the
// non-negative amaxes recorded there); else amax given (e.g. a global amax): scale from it; else max|x| first (one
// extra read). Returns (rowwise [M, K] | [0], columnwise [K, M] | [0], scale_inv [1], amax used [1] | [0]).
std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_fp8_tensor(const char* op, const Tensor& x, at::ScalarType dtype,
                                                               const std::optional<Tensor>& scale,
                                                               const std::optional<Tensor>& amax, double eps,
                                                               bool pow2, bool rowwise, bool columnwise,
                                                               uint32_t* record_into) {
  const auto it = in_type(x, op);
  auto a = tile_args<Fp8TensorArgs>(x, rowwise, columnwise);
  a.fp8 = fp8_encoding(dtype, eps, pow2, op);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  Tensor row = rowwise ? at::empty({M, K}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor col = columnwise ? at::empty({K, M}, x.options().dtype(dtype)) : empty0(x, dtype);
  Tensor scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  Tensor amax_out, scale_t;  // (allocated in its branch: one allocation fewer per cast on the host's critical path)
  if (scale.has_value()) {
    amax_out = empty0(x, at::kFloat);
    scale_t = scale->to(x.device(), at::kFloat).contiguous();
    a.scale_in = scale_t.data_ptr<float>();
    a.amax_out = record_into;
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
  C10_CUDA_CHECK(launch_quantize_fp8_tensor(it, a, stream));
  return {row, col, scale_inv, amax_out};
}

void check_scale(const Tensor& scale, const char* op) {
  TORCH_CHECK(scale.numel() == 1, "hybridq::", op, ": scale must have one element, got shape ", scale.sizes());
}

}  // namespace

// scale given (delayed scaling): cast with it; want_amax returns max|x| of the same pass. Else amax given (e.g. a
// global amax): scale from it; else max|x| first (one extra read).
// returns (rowwise [M, K] | [0], columnwise [K, M] | [0], scale_inv [1], amax [1] | [0])
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize(const Tensor& x, at::ScalarType dtype,
                                                               const std::optional<Tensor>& scale,
                                                               const std::optional<Tensor>& amax, double eps,
                                                               bool pow2, bool rowwise, bool columnwise,
                                                               bool want_amax) {
  constexpr const char* op = "fp8_tensor_quantize";
  check_input(x, op);
  if (scale.has_value()) {
    check_scale(*scale, op);
  } else if (amax.has_value()) {
    TORCH_CHECK(amax->numel() == 1, "hybridq::", op, ": amax must have one element, got shape ", amax->sizes());
  }
  c10::cuda::CUDAGuard guard(x.device());
  Tensor recorded = scale.has_value() && want_amax ? zeros_amax(x) : Tensor();
  auto out = quantize_fp8_tensor(op, x, dtype, scale, amax, eps, pow2, rowwise, columnwise,
                                 recorded.defined() ? amax_bits(recorded) : nullptr);
  if (recorded.defined()) std::get<3>(out) = recorded;
  return out;
}

// fp8_tensor_quantize's current-scaling cast (max|x| first, no amax or scale given) into memory the caller allocated:
// linear_fp8.cpp packs a Linear call's outputs into fewer allocations (each at::empty is several microseconds of host
// time per call). row / col: [M, K] / [K, M] fp8 bytes, 16-byte aligned (nullptr: that direction not asked for);
// amax: one fp32 the caller zeroed on the current stream; scale_inv: one fp32. The same checks, kernels and kernel
// arguments as fp8_tensor_quantize, so the same bits. The caller holds a CUDAGuard for x's device.
void fp8_tensor_quantize_into(const Tensor& x, at::ScalarType dtype, double eps, bool pow2, void* row, void* col,
                              float* amax, float* scale_inv) {
  constexpr const char* op = "fp8_tensor_quantize";
  check_input(x, op);
  const auto it = in_type(x, op);
  auto a = tile_args<Fp8TensorArgs>(x, row != nullptr, col != nullptr);
  a.fp8 = fp8_encoding(dtype, eps, pow2, op);
  auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(hybridq::launch_absmax(it, x.data_ptr(), x.size(0) * x.size(1), reinterpret_cast<uint32_t*>(amax),
                                        stream));
  a.amax_in = amax;
  a.row_q = static_cast<uint8_t*>(row);
  a.col_q = static_cast<uint8_t*>(col);
  a.scale_inv_out = scale_inv;
  C10_CUDA_CHECK(launch_quantize_fp8_tensor(it, a, stream));
}

// Delayed scaling's cast: with the quantizer's scale, max|x| max-combined in place into amax_history[0] (its current
// slot) by the cast kernel itself -- one memset and one torch.maximum launch fewer per cast than returning it.
// A separate op so that fp8_tensor_quantize stays functional (a mutable argument would make torch.compile wrap
// every call in auto_functionalized). returns (rowwise [M, K] | [0], columnwise [K, M] | [0], scale_inv [1])
std::tuple<Tensor, Tensor, Tensor> fp8_tensor_quantize_delayed(const Tensor& x, at::ScalarType dtype,
                                                               const Tensor& scale, const Tensor& amax_history,
                                                               double eps, bool pow2, bool rowwise, bool columnwise) {
  constexpr const char* op = "fp8_tensor_quantize_delayed";
  check_input(x, op);
  check_scale(scale, op);
  const Tensor& h = amax_history;
  TORCH_CHECK(h.is_cuda() && h.device() == x.device(), "hybridq::", op, ": amax_history must be on ", x.device(),
              ", got ", h.device());
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 1 && h.numel() >= 1 && h.is_contiguous(), "hybridq::", op,
              ": amax_history must be a contiguous 1-D fp32 tensor with at least one element, got ", h.scalar_type(),
              " of shape ", h.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  auto out = quantize_fp8_tensor(op, x, dtype, scale, std::nullopt, eps, pow2, rowwise, columnwise, amax_bits(h));
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

// Per-tensor FP8 of row groups (the experts of a grouped linear, each expert's rows one group): every group
// quantized as its own tensor (its max|x|, its scale), in one amax pass and one cast.
// row_group: int32 [M], the group of each row (values in [0, n_groups)). col_pitch: elements between the columnwise
// rows (0: M; else >= M, e.g. M rounded up to 16 for 16-byte aligned rows, the grouped wgrad GEMM's reads); the
// columnwise part is then a [K, M] view of a [K, col_pitch] buffer whose extra columns are left unwritten.
// ends, padded_ends (both or neither; int32 [n_groups] cumulative row counts on x's device, padded_ends' groups
// multiples of 16): the columnwise part in the padded layout instead, [K, col_pitch] (col_pitch >= padded_ends[-1],
// a device-side assert): group g's rows from column padded_ends[g-1], zeros in every other column -- what the
// grouped wgrad GEMMs read, written by the cast itself (its tiles read the rows through a row map).
// returns (rowwise [M, K], columnwise [K, M] | [K, col_pitch] | [0], scale_inv [n_groups], amax [n_groups])
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_tensor_quantize_grouped(const Tensor& x, at::ScalarType dtype,
                                                                       const Tensor& row_group, int64_t n_groups,
                                                                       double eps, bool pow2, bool columnwise,
                                                                       int64_t col_pitch,
                                                                       const std::optional<Tensor>& ends,
                                                                       const std::optional<Tensor>& padded_ends) {
  constexpr const char* op = "fp8_tensor_quantize_grouped";
  check_input(x, op);
  const auto it = in_type(x, op);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(row_group.scalar_type() == at::kInt && row_group.dim() == 1 && row_group.numel() == M &&
                  row_group.is_contiguous() && row_group.device() == x.device(),
              "hybridq::", op, ": row_group must be a contiguous int32 [", M, "] tensor on ", x.device(), ", got ",
              row_group.scalar_type(), " ", row_group.sizes(), " on ", row_group.device());
  TORCH_CHECK(n_groups >= 1 && n_groups <= (int64_t{1} << 30), "hybridq::", op, ": n_groups must be >= 1, got ",
              n_groups);
  TORCH_CHECK(col_pitch == 0 || col_pitch >= M, "hybridq::", op, ": col_pitch must be 0 or >= the ", M,
              " rows, got ", col_pitch);
  const bool padded = ends.has_value() || padded_ends.has_value();
  if (padded) {
    TORCH_CHECK(ends.has_value() && padded_ends.has_value() && columnwise && col_pitch > 0 && col_pitch < (1LL << 31),
                "hybridq::", op, ": the padded columnwise layout takes ends, padded_ends, columnwise and a col_pitch "
                "in [1, 2^31)");
    for (const Tensor* b : {&*ends, &*padded_ends}) {
      const char* what = b == &*ends ? "ends" : "padded_ends";
      TORCH_CHECK(b->scalar_type() == at::kInt && b->dim() == 1 && b->numel() == n_groups && b->is_contiguous() &&
                      b->device() == x.device(),
                  "hybridq::", op, ": ", what, " must be a contiguous int32 [", n_groups, "] tensor on ", x.device(),
                  ", got ", b->scalar_type(), " ", b->sizes(), " on ", b->device());
    }
  }
  const int64_t pitch = col_pitch > 0 ? col_pitch : M;
  auto a = tile_args<Fp8TensorArgs>(x, true, columnwise);
  a.col_pitch = pitch;
  a.fp8 = fp8_encoding(dtype, eps, pow2, op);
  c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  Tensor row = at::empty({M, K}, x.options().dtype(dtype));
  Tensor col = !columnwise ? empty0(x, dtype)
               : padded    ? at::empty({K, pitch}, x.options().dtype(dtype))
                           : at::empty({K, pitch}, x.options().dtype(dtype)).narrow(1, 0, M);
  Tensor scale_inv = at::empty({n_groups}, x.options().dtype(at::kFloat));
  Tensor amax = zeros_on_stream({n_groups}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(hybridq::launch_grouped_absmax(it, x.data_ptr(), M, K, row_group.data_ptr<int32_t>(),
                                                amax_bits(amax), stream));
  Tensor src_rows;
  if (padded && M > 0 && K > 0) {  // the kernel tiles the padded layout's pitch rows, reading x's through the map
    src_rows = at::empty({pitch}, x.options().dtype(at::kInt));
    C10_CUDA_CHECK(hybridq::launch_padded_rows(ends->data_ptr<int32_t>(), padded_ends->data_ptr<int32_t>(),
                                               static_cast<int>(n_groups), M, pitch, src_rows.data_ptr<int32_t>(),
                                               stream));
    a.M = pitch;
    a.src_rows = src_rows.data_ptr<int32_t>();
  }
  a.amax_in = amax.data_ptr<float>();
  a.row_group = row_group.data_ptr<int32_t>();
  a.n_groups = static_cast<int>(n_groups);
  a.row_q = u8(row);
  a.col_q = columnwise ? u8(col) : nullptr;
  a.scale_inv_out = scale_inv.data_ptr<float>();
  if (M > 0 && K > 0) {
    C10_CUDA_CHECK(launch_quantize_fp8_tensor(it, a, stream));
  } else {  // no element: every group is empty, amax 0 (the kernel, which writes the scales, does not run)
    scale_inv.fill_(1.0f / hybridq::scale_from_amax(0.0f, a.fp8.max, a.fp8.eps, a.fp8.pow2));
    if (padded) col.zero_();  // (every column a padding one)
  }
  return {row, col, scale_inv, amax};
}

// data [rows, cols] fp8 with its one scale_inv [1] -> [rows, cols] of out_dtype
Tensor fp8_tensor_dequantize(const Tensor& data, const Tensor& scale_inv, at::ScalarType out_dtype) {
  constexpr const char* op = "fp8_tensor_dequantize";
  check_input(data, op, "data");
  const bool e5m2 = is_e5m2(data.scalar_type(), op);
  check_part_scale(scale_inv, data, op, "scale_inv", at::kFloat, "float32", 1, "one per-tensor scale");
  c10::cuda::CUDAGuard guard(data.device());
  Tensor out = dequant_out(data, data.size(1), out_dtype, op);
  auto a = dequant_args<Fp8TensorDequantArgs>(data, data.size(1));
  a.scale_inv = scale_inv.data_ptr<float>();
  a.e5m2 = e5m2;
  C10_CUDA_CHECK(launch_dequantize<Fp8TensorPolicy>(a, out_dtype == at::kBFloat16, out.data_ptr(),
                                                    c10::cuda::getCurrentCUDAStream()));
  return out;
}

namespace {
void impls(torch::Library& m) {
  m.impl("fp8_tensor_quantize", &fp8_tensor_quantize);
  m.impl("fp8_tensor_quantize_delayed", &fp8_tensor_quantize_delayed);
  m.impl("fp8_tensor_quantize_grouped", &fp8_tensor_quantize_grouped);
  m.impl("fp8_tensor_dequantize", &fp8_tensor_dequantize);
}
}  // namespace

}  // namespace ops
}  // namespace hybridq

TORCH_LIBRARY_FRAGMENT(hybridq, m) {
  m.def(
      "fp8_tensor_quantize(Tensor x, ScalarType dtype, Tensor? scale, Tensor? amax, float eps, bool pow2, "
      "bool rowwise, bool columnwise, bool want_amax) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fp8_tensor_quantize_delayed(Tensor x, ScalarType dtype, Tensor scale, Tensor(a!) amax_history, float eps, "
      "bool pow2, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fp8_tensor_quantize_grouped(Tensor x, ScalarType dtype, Tensor row_group, int n_groups, float eps, bool pow2, "
      "bool columnwise, int col_pitch=0, Tensor? ends=None, Tensor? padded_ends=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_tensor_dequantize(Tensor data, Tensor scale_inv, ScalarType out_dtype) -> Tensor");
  // the jagged experts' GEMMs as one cuBLAS GEMM per expert (implemented in csrc/grouped_fp8_tensor_gemm.cpp)
  m.def(
      "grouped_fp8_tensor_cublas_mm(Tensor a, Tensor a_scale, Tensor b, int b_group_stride, int b_row_stride, int n, "
      "Tensor b_scale, int[] sizes, ScalarType out_dtype, bool fast_accum, int streams=1) -> Tensor");
  m.def(
      "grouped_fp8_tensor_cublas_wgrad(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, int[] offsets, "
      "int[] rows, ScalarType out_dtype, int streams=1) -> Tensor");
  // many fp32 tensors (an FSDP2 unit's master shards), each rounded to param_dtype and quantized as its own tensor
  // into its region of one byte buffer: implemented in csrc/fp8_tensors.cu
  m.def(
      "fp8_tensors_quantize(Tensor[] xs, ScalarType param_dtype, Tensor?[] amax, int[] e5m2, float[] eps, "
      "int[] pow2, int[] regions) -> (Tensor, Tensor, Tensor)");
  // the whole per-tensor FP8 Linear (forward + a C++ autograd node): implemented in csrc/linear_fp8.cpp
  m.def(
      "fp8_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? x_row, Tensor? x_row_scale_inv, Tensor? x_col, "
      "Tensor? x_col_scale_inv, ScalarType x_dtype, float x_eps, bool x_pow2, ScalarType w_dtype, float w_eps, "
      "bool w_pow2, ScalarType g_dtype, float g_eps, bool g_pow2, bool need_dgrad, bool need_wgrad, "
      "bool save_original_input, bool fast_accum_fprop, Tensor? w_row=None, Tensor? w_row_scale_inv=None, "
      "Tensor? w_col=None, Tensor? w_col_scale_inv=None) -> Tensor");
  // the same with delayed scaling: the quantizers' scales and amax histories given, the histories changed in place
  // (x's and the weight's in the call, dy's in backward; eager only: implemented in csrc/linear_fp8.cpp)
  m.def(
      "fp8_linear_delayed(Tensor x, Tensor weight, Tensor? bias, Tensor x_scale, Tensor? x_amax_history, "
      "Tensor w_scale, Tensor? w_amax_history, Tensor? g_scale, Tensor? g_amax_history, ScalarType x_dtype, "
      "float x_eps, bool x_pow2, ScalarType w_dtype, float w_eps, bool w_pow2, ScalarType g_dtype, float g_eps, "
      "bool g_pow2, bool need_dgrad, bool need_wgrad, bool fast_accum_fprop) -> Tensor");
  // the compiled Linear's gathered per-tensor FP8 fast path, one op per phase (implemented in csrc/linear_fp8.cpp)
  m.def(
      "fp8_linear_fprop(Tensor x, Tensor w_row, Tensor w_row_scale_inv, Tensor? bias, ScalarType x_dtype, "
      "float x_eps, bool x_pow2, bool need_wgrad, bool save_original_input, bool fast_accum_fprop, "
      "Tensor? x_row=None, Tensor? x_row_scale_inv=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fp8_linear_grads(Tensor dy, Tensor? x_saved, Tensor? x_col_scale_inv, Tensor? w_col, "
      "Tensor? w_col_scale_inv, ScalarType x_dtype, float x_eps, bool x_pow2, ScalarType g_dtype, float g_eps, "
      "bool g_pow2, bool save_original_input, bool need_dgrad, bool need_wgrad, bool need_bgrad, int[] x_shape, "
      "ScalarType w_dtype, ScalarType b_dtype) -> (Tensor, Tensor, Tensor)");
}
HQ_IMPL_CUDA_AND_CPU(hybridq::ops::impls)
