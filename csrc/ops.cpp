// torch.library registration of the hybridq CUDA kernels: the op schemas of the `hybridq` namespace
// (torch.ops.hybridq.*) and their CUDA implementations, which live next to their kernels (declared in ops.h). Fake
// (meta) implementations live in hybridq/kernels/cuda_ops.py. The module init at the bottom only makes the library
// importable as `hybridq._C`; loading it registers the ops.
#include <Python.h>

#include <torch/library.h>

#include "ops.h"

using namespace hybridq::ops;

TORCH_LIBRARY(hybridq, m) {
  m.def(
      "fp8_tensor_quantize(Tensor x, ScalarType dtype, Tensor? scale, Tensor? amax, float eps, bool pow2, "
      "bool rowwise, bool columnwise, bool want_amax) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fp8_tensor_quantize_delayed(Tensor x, ScalarType dtype, Tensor scale, Tensor(a!) amax_history, float eps, "
      "bool pow2, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fp8_tensor_quantize_grouped(Tensor x, ScalarType dtype, Tensor row_group, int n_groups, float eps, bool pow2, "
      "bool columnwise, int col_pitch=0) -> (Tensor, Tensor, Tensor, Tensor)");
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
  m.def(
      "nvfp4_quantize_grouped(Tensor x, bool block_2d, bool rht, bool stochastic_rounding, Generator? generator, "
      "bool rowwise, bool columnwise, int[] sizes, int[] draw_rank, int n_draws) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("rms_norm_forward(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, bool weight_grad) -> (Tensor, Tensor)");
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
  m.impl("fp8_tensor_quantize_delayed", &fp8_tensor_quantize_delayed); \
  m.impl("fp8_tensor_quantize_grouped", &fp8_tensor_quantize_grouped); \
  m.impl("fp8_block_quantize", &fp8_block_quantize);     \
  m.impl("mxfp8_quantize", &mxfp8_quantize);             \
  m.impl("nvfp4_quantize", &nvfp4_quantize);             \
  m.impl("nvfp4_quantize_grouped", &nvfp4_quantize_grouped); \
  m.impl("rms_norm_forward", &rms_norm_forward);         \
  m.impl("rms_norm_backward", &rms_norm_backward);       \
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
