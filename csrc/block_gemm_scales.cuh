// The scale operands of the dense FP8 block GEMM (block_gemm.cu, [Note: the dense block GEMM op]) element by element,
// for the device kernel and for a host test (tests/test_block_gemm_op.py compiles it with nvcc for the CPU and checks
// it against native_gemm.block_scale_operands, the layout F.scaled_mm is given).
#pragma once

#include <cstdint>

namespace hybridq {

// a's [m, kb] 1x128 scales and b's [nb, kb] scales (128x128 tiles: nb = ceil(N/128); 1x128 blocks: nb = N), both
// row-major as the quantize kernels store them. The op's buffer holds region A (a's scales outer-dim-major: n_a()
// floats) and then, from some offset, region B (tiles: [nb, kb4] row-major with K blocks zero-padded to kb4 =
// round_up(kb, 4); 1x128 blocks: b's scales outer-dim-major: n_b() floats).
struct BlockGemmScales {
  int64_t m, nb, kb, kb4;
  bool tiles;
  __host__ __device__ int64_t n_a() const { return kb * m; }
  __host__ __device__ int64_t n_b() const { return tiles ? nb * kb4 : kb * nb; }
};

// Element i of region A (i < n_a()) or element i - n_a() of region B
__host__ __device__ inline float block_gemm_scale(const float* a_scale, const float* b_scale, const BlockGemmScales& s,
                                                  int64_t i) {
  if (i < s.n_a()) {
    const int64_t c = i / s.m, r = i - c * s.m;
    return a_scale[r * s.kb + c];
  }
  const int64_t j = i - s.n_a();
  if (s.tiles) {
    const int64_t t = j / s.kb4, c = j - t * s.kb4;
    return c < s.kb ? b_scale[t * s.kb + c] : 0.0f;  // (the padding: zeros, as F.pad's)
  }
  const int64_t c = j / s.nb, r = j - c * s.nb;
  return b_scale[r * s.kb + c];
}

}  // namespace hybridq
