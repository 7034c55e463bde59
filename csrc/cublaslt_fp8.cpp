// An FP8 GEMM through cuBLASLt with a cached plan: see cublaslt_fp8.h (what is covered, why it is bitwise
// at::_scaled_mm, the cache's rules).
#include <Python.h>

#include "cublaslt_fp8.h"
#include "ops.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDADataType.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>

namespace hybridq {
namespace cublaslt {
namespace {

std::atomic<int64_t> g_calls{0}, g_queries{0}, g_declined{0};

void check(cublasStatus_t s, const char* what) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "hybridq cuBLASLt FP8 GEMM: ", what, " failed with cuBLAS status ",
              static_cast<int>(s));
}

template <class T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T value) {
  check(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)), "cublasLtMatmulDescSetAttribute");
}

// at::cuda::blas::scaled_gemm's get_scale_mode for the scaling types covered here (-1: not covered)
int scale_mode(ScalingType t) {
  switch (t) {
    case ScalingType::TensorWise:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case ScalingType::BlockWise1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScalingType::BlockWise128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default:
      return -1;
  }
}

bool fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// The scaling pairs _scaled_mm / _scaled_mm_v2 run through scaled_gemm (cuBLAS's A is torch's mat2): per-tensor x
// per-tensor (fast accumulation allowed) and the three DeepSeek block pairings (scaled_gemm refuses fast accumulation
// with block scales: left to torch, which raises)
bool covered(const Gemm& g) {
  if (!fp8(g.a_dtype) || !fp8(g.b_dtype) || (g.a_dtype == at::kFloat8_e5m2 && g.b_dtype == at::kFloat8_e5m2)) {
    return false;
  }
  if (g.d_dtype != at::kBFloat16 && g.d_dtype != at::kHalf && g.d_dtype != at::kFloat) return false;
  // _scaled_mm's shape rules (K and N multiples of 16), and no empty GEMM (torch returns early)
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.m % 16 != 0 || g.k % 16 != 0) return false;
  const bool tensorwise = g.a_scaling == ScalingType::TensorWise && g.b_scaling == ScalingType::TensorWise;
  const bool v = g.a_scaling == ScalingType::BlockWise1x128, t = g.a_scaling == ScalingType::BlockWise128x128;
  const bool bv = g.b_scaling == ScalingType::BlockWise1x128, bt = g.b_scaling == ScalingType::BlockWise128x128;
  const bool blocks = (v && bv) || (v && bt) || (t && bv);
  if (!tensorwise && !(blocks && !g.fast_accum)) return false;
  // scaled_gemm sets CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET under an SM carveout: left to torch
  return !at::globalContext()._SMCarveout_EXPERIMENTAL().has_value();
}

struct Key {
  int64_t m, n, k, lda, ldb, ldd;
  size_t workspace;
  int16_t device;
  int8_t a_dtype, b_dtype, d_dtype, a_scaling, b_scaling;
  uint8_t flags;  // fast_accum | 16-byte alignment of a, a_scale, b, b_scale, d << 1..5
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
};
static_assert(sizeof(Key) == 64, "Key has padding: its bytes (hash, ==) must all be fields");

struct KeyHash {
  size_t operator()(const Key& key) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&key);
    size_t h = 1469598103934665603ull;  // FNV-1a over the key's bytes
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

Key key_of(const Gemm& g, int device, size_t workspace) {
  Key key;
  key.m = g.m;
  key.n = g.n;
  key.k = g.k;
  key.lda = g.lda;
  key.ldb = g.ldb;
  key.ldd = g.ldd;
  key.workspace = workspace;
  key.device = static_cast<int16_t>(device);
  key.a_dtype = static_cast<int8_t>(g.a_dtype);
  key.b_dtype = static_cast<int8_t>(g.b_dtype);
  key.d_dtype = static_cast<int8_t>(g.d_dtype);
  key.a_scaling = static_cast<int8_t>(g.a_scaling);
  key.b_scaling = static_cast<int8_t>(g.b_scaling);
  key.flags = static_cast<uint8_t>(g.fast_accum | aligned16(g.a) << 1 | aligned16(g.a_scale) << 2 |
                                   aligned16(g.b) << 3 | aligned16(g.b_scale) << 4 | aligned16(g.d) << 5);
  return key;
}

// The descriptors of one problem and the algorithm the heuristic chose for them
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {  // (host objects only: no CUDA call)
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  ~Preference() {
    if (p != nullptr) cublasLtMatmulPreferenceDestroy(p);
  }
};

cublasLtMatrixLayout_t layout(at::ScalarType t, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  check(cublasLtMatrixLayoutCreate(&l, at::cuda::ScalarTypeToCudaDataType(t), rows, cols, ld),
        "cublasLtMatrixLayoutCreate");
  return l;
}

// at::cuda::blas::scaled_gemm's descriptors, step by step (transa 't', transb 'n', no bias, no D scale, no SM
// carveout, no alpha tensor); nullptr where the heuristic returns no algorithm (torch then raises NOT_SUPPORTED)
std::unique_ptr<Plan> make_plan(const Gemm& g, cublasLtHandle_t handle, size_t workspace) {
  auto plan = std::make_unique<Plan>();
  check(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.a_scale);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.b_scale);
  const int8_t fast_accum = g.fast_accum ? 1 : 0;
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum);
  // (CuBlasLtMatrixLayout(type, rows, cols, ld, t) creates cols x rows when t: A is m x k transposed)
  plan->a = layout(g.a_dtype, g.k, g.m, g.lda);
  plan->b = layout(g.b_dtype, g.k, g.n, g.ldb);
  plan->c = layout(g.d_dtype, g.m, g.n, g.ldd);  // (C's type: the bias dtype, which is the out dtype without bias)
  plan->d = layout(g.d_dtype, g.m, g.n, g.ldd);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode(g.a_scaling));
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode(g.b_scaling));
  Preference pref;
  check(cublasLtMatmulPreferenceCreate(&pref.p), "cublasLtMatmulPreferenceCreate");
  check(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof(workspace)),
        "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  g_queries.fetch_add(1, std::memory_order_relaxed);
  check(cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->d, pref.p, 1, &result,
                                       &returned),
        "cublasLtMatmulAlgoGetHeuristic");
  if (returned == 0) return nullptr;
  plan->algo = result.algo;
  return plan;
}

using Cache = std::unordered_map<Key, std::unique_ptr<Plan>, KeyHash>;

Cache& cache() {
  thread_local Cache c;
  return c;
}

bool read_enabled() {
  const char* v = std::getenv("HYBRIDQ_CUBLASLT_DIRECT");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool declined() {
  g_declined.fetch_add(1, std::memory_order_relaxed);
  return false;
}

}  // namespace

bool enabled() {
  static const bool on = read_enabled();
  return on;
}

bool run(const Gemm& g) {
  if (!enabled() || !covered(g)) return declined();
  const int device = c10::cuda::current_device();
  const size_t workspace = at::cuda::getCUDABlasLtWorkspaceSize();
  const Key key = key_of(g, device, workspace);
  Cache& plans = cache();
  auto it = plans.find(key);
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  if (it == plans.end()) {
    std::unique_ptr<Plan> plan = make_plan(g, handle, workspace);
    if (!plan) return declined();  // (not cached: torch raises for it)
    if (plans.size() >= kMaxPlans) plans.clear();
    it = plans.emplace(key, std::move(plan)).first;
  }
  Plan& p = *it->second;
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.a_scale);
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.b_scale);
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s =
      cublasLtMatmul(handle, p.desc, &alpha, g.a, p.a, g.b, p.b, &beta, g.d, p.c, g.d, p.d, &p.algo,
                     at::cuda::getCUDABlasLtWorkspace(), workspace, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "hybridq cuBLASLt FP8 GEMM: cublasLtMatmul failed with cuBLAS status ",
              static_cast<int>(s), " (m ", g.m, " n ", g.n, " k ", g.k, " lda ", g.lda, " ldb ", g.ldb, " ldd ",
              g.ldd, ")");
  g_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool run_block_scaled(void* d, int64_t ldd, at::ScalarType d_dtype, const void* x, int64_t ldx, const float* x_scale,
                      const void* w, int64_t ldw, const float* w_scale, ScalingType w_scaling, int64_t rows, int64_t n,
                      int64_t k) {
  Gemm g;
  g.m = n;
  g.n = rows;
  g.k = k;
  g.lda = ldw;
  g.ldb = ldx;
  g.ldd = ldd;
  g.a_dtype = g.b_dtype = at::kFloat8_e4m3fn;
  g.d_dtype = d_dtype;
  g.a_scaling = w_scaling;
  g.b_scaling = ScalingType::BlockWise1x128;
  g.fast_accum = false;
  g.a = w;
  g.a_scale = w_scale;
  g.b = x;
  g.b_scale = x_scale;
  g.d = d;
  return run(g);
}

Tensor scaled_mm_tensorwise(const Tensor& a, const Tensor& b, const Tensor& sa, const Tensor& sb,
                            at::ScalarType out_dtype, bool fast_accum) {
  // cublasCommonArgs' mapping holds for a row-major a [M, K], b [N, K] (mat2 = b^T column-major) and a contiguous
  // out: anything else goes to torch, which checks it and raises where it must
  const bool ok = enabled() && a.defined() && b.defined() && sa.defined() && sb.defined() && a.is_cuda() &&
                  a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1) && a.size(0) > 0 && a.stride(1) == 1 &&
                  a.stride(0) >= a.size(1) && b.stride(1) == 1 && b.stride(0) >= b.size(1) &&
                  b.device() == a.device() && sa.device() == a.device() && sb.device() == a.device() &&
                  sa.numel() == 1 && sb.numel() == 1 && sa.scalar_type() == at::kFloat &&
                  sb.scalar_type() == at::kFloat;
  if (!ok) {
    declined();
    return Tensor();
  }
  const c10::cuda::CUDAGuard guard(a.device());
  Gemm g;
  g.m = b.size(0);
  g.n = a.size(0);
  g.k = a.size(1);
  g.lda = b.stride(0);
  g.ldb = a.stride(0);
  g.ldd = g.m;
  g.a_dtype = b.scalar_type();
  g.b_dtype = a.scalar_type();
  g.d_dtype = out_dtype;
  g.a_scaling = g.b_scaling = ScalingType::TensorWise;
  g.fast_accum = fast_accum;
  if (!covered(g)) {  // (before the output is allocated)
    declined();
    return Tensor();
  }
  Tensor out = at::empty({g.n, g.m}, a.options().dtype(out_dtype));
  g.a = b.data_ptr();
  g.a_scale = sb.data_ptr();
  g.b = a.data_ptr();
  g.b_scale = sa.data_ptr();
  g.d = out.data_ptr();
  return run(g) ? out : Tensor();
}

Stats stats() {
  return {g_calls.load(), g_queries.load(), g_declined.load(), static_cast<int64_t>(cache().size())};
}

void clear_plans() { cache().clear(); }

}  // namespace cublaslt
}  // namespace hybridq

// ---- Python methods of hybridq._C ---------------------------------------------------------------------------
namespace {

PyObject* py_stats(PyObject*, PyObject*) {
  const hybridq::cublaslt::Stats s = hybridq::cublaslt::stats();
  return Py_BuildValue("{s:L,s:L,s:L,s:L}", "calls", static_cast<long long>(s.calls), "heuristic_queries",
                       static_cast<long long>(s.heuristic_queries), "declined", static_cast<long long>(s.declined),
                       "plans", static_cast<long long>(s.plans));
}

PyObject* py_clear(PyObject*, PyObject*) {
  hybridq::cublaslt::clear_plans();
  Py_RETURN_NONE;
}

PyObject* py_enabled(PyObject*, PyObject*) { return PyBool_FromLong(hybridq::cublaslt::enabled()); }

// (the FP8 Linear op's switch, csrc/linear_fp8.cpp: listed with these methods, the module's only ones)
PyObject* py_linear_packed(PyObject*, PyObject* on) {
  const int v = PyObject_IsTrue(on);
  if (v < 0) return nullptr;
  return PyBool_FromLong(hybridq::ops::set_linear_packed(v != 0));
}

}  // namespace

PyMethodDef* hq_cublaslt_py_methods() {
  static PyMethodDef methods[] = {
      {"cublaslt_stats", py_stats, METH_NOARGS,
       "The direct cuBLASLt FP8 GEMM's counters: calls, heuristic_queries, declined (process-wide) and plans (this "
       "thread's cache)"},
      {"cublaslt_clear_plans", py_clear, METH_NOARGS, "Empties the calling thread's cuBLASLt plan cache"},
      {"cublaslt_enabled", py_enabled, METH_NOARGS, "Whether the direct path is on (HYBRIDQ_CUBLASLT_DIRECT)"},
      {"linear_packed_allocations", py_linear_packed, METH_O,
       "Sets whether hybridq::fp8_linear packs its tensors into fewer allocations (HYBRIDQ_LINEAR_PACKED); returns "
       "the previous setting"},
      {nullptr, nullptr, 0, nullptr}};
  return methods;
}
