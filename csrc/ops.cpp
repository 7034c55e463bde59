// torch.library registration of the hybridq CUDA kernels: the `hybridq` namespace (torch.ops.hybridq.*) with the
// schemas of the format-independent ops and their implementations, which live next to their kernels (declared in
// ops.h). Each format's csrc/quantize_<format>.cu adds its own ops to the namespace (TORCH_LIBRARY_FRAGMENT). Fake
// (meta) implementations live in hybridq/kernels/cuda.py and cuda_<format>.py. The module init at the bottom only
// makes the library importable as `hybridq._C`; loading it registers the ops.
#include <Python.h>

#include <torch/library.h>

#include "binding_checks.h"
#include "cublaslt_fp8.h"
#include "ops.h"

using namespace hybridq::ops;

TORCH_LIBRARY(hybridq, m) {
  m.def("rms_norm_forward(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, bool weight_grad) -> (Tensor, Tensor)");
  m.def("layer_norm_forward(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool weight_grad, "
      "bool bias_grad) -> (Tensor, Tensor, Tensor)");
  m.def(
      "norm_quantize_forward(Tensor x, Tensor? weight, Tensor? bias, float eps, bool centered, int block, "
      "ScalarType dtype, float amax_eps, bool pow2) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "swiglu_forward(Tensor a, Tensor b, int block, ScalarType dtype, float amax_eps, bool pow2) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def("swiglu_backward(Tensor dy, Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("amax(Tensor x) -> Tensor");
  m.def("transpose_bytes(Tensor x) -> Tensor");
  m.def("transpose_bytes_into(Tensor x, Tensor(a!) out) -> ()");
  m.def("transpose_bytes_into_list(Tensor[] x, Tensor(a!)[] out) -> ()");
  m.def(
      "fp8_delayed_update(Tensor(a!)[] histories, Tensor(b!)[] scales, float[] fp8_maxes, float[] divisors, "
      "int[] most_recent) -> ()");
}

namespace {
void impls(torch::Library& m) {
  m.impl("transpose_bytes", &transpose_bytes);
  m.impl("transpose_bytes_into", &transpose_bytes_into);
  m.impl("transpose_bytes_into_list", &transpose_bytes_into_list);
  m.impl("rms_norm_forward", &rms_norm_forward);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("layer_norm_forward", &layer_norm_forward);
  m.impl("layer_norm_backward", &layer_norm_backward);
  m.impl("norm_quantize_forward", &norm_quantize_forward);
  m.impl("swiglu_forward", &swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("amax", &amax_op);
  m.impl("fp8_delayed_update", &fp8_delayed_update);
}
}  // namespace

HQ_IMPL_CUDA_AND_CPU(impls)

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

PyMODINIT_FUNC HQ_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  hq_module.m_methods = hq_cublaslt_py_methods();  // (cublaslt_fp8.h: the direct FP8 GEMM's counters)
  return PyModule_Create(&hq_module);
}
