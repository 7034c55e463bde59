// Host-side interface of the hybridq CUDA kernels (plain C++: included by the torch bindings and the .cu files).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace hybridq {

enum class InType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Stochastic-rounding stream: torch's PhiloxCudaState, flattened (seed/offset by value, or by pointer while a
// CUDA graph is captured).
struct PhiloxArgs {
  uint64_t seed;
  uint64_t offset;
  const int64_t* seed_ptr;
  const int64_t* offset_ptr;
  uint64_t offset_intragraph;
  bool captured;
};

// One fused quantization of a 2-D [M, K] input into its rowwise ([M, K], blocks along K) and/or columnwise
// ([K, M] = transposed, blocks along M) parts. Unused pointers are null.
struct QuantArgs {
  const void* x;
  int64_t M, K;
  bool rowwise, columnwise;
  uint8_t* row_q;  // fp8 bytes, or packed E2M1 nibbles for NVFP4
  uint8_t* col_q;
  int64_t col_pitch;  // elements between the columnwise rows (0: M)
  void* row_s;  // per-block scales: fp32 scale_inv (FP8 block), E8M0 bytes (MXFP8), E4M3 bytes (NVFP4)
  void* col_s;
  // FP8 (all FP8 formats)
  bool e5m2;
  float fp8_max;
  float eps;
  bool pow2;
  // per-tensor FP8: scale_in (delayed scaling) or amax_in (current scaling) gives the scale
  const float* scale_in;
  const float* amax_in;
  float* scale_inv_out;
  uint32_t* amax_out;  // |x| max as fp32 bits (atomicMax), when not null
  // per-tensor FP8 of row groups (the experts of a grouped linear): row r takes the scale of group row_group[r]
  // from amax_in[group]; scale_inv_out gets one value per group. Null: one scale for the whole tensor.
  const int32_t* row_group;
  int n_groups;
  // MXFP8: GEMM-ready swizzled scales (128x4 tiles) instead of compact [rows, cols/32]
  bool swizzle;
  int64_t row_s_cols_pad, col_s_cols_pad;
  // NVFP4: global amaxes (fp32 [1]) of the rowwise input and of the (transformed) columnwise input
  const float* amax_row;
  const float* amax_col;
  bool rht;
  bool sr;
  PhiloxArgs philox;
  // NVFP4 of row groups (row_group != null, n_groups groups, each a whole number of 16-row groups when a block or
  // tile runs along M): amax_row / amax_col hold one global amax per group, group g's rows start at group_start[g]
  // (int64 [n_groups + 1]), and its stochastic-rounding draws are those of the draw_rank[g]-th per-group launch
  // (Philox offset + 4 * draw_rank[g], element indices relative to the group)
  const int64_t* group_start;
  const int32_t* draw_rank;
  // tile order of the persistent CTAs: groups of `tile_group` tile rows, column-major inside a group (1: row-major);
  // set by the launcher
  int tile_group;
};

cudaError_t launch_quantize_fp8_tensor(InType t, const QuantArgs& a, cudaStream_t stream);
cudaError_t launch_quantize_fp8_block(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream);
cudaError_t launch_quantize_mxfp8(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream);
cudaError_t launch_quantize_nvfp4(InType t, bool two_d, const QuantArgs& a, cudaStream_t stream);

// max|x| over n elements, as fp32 bits, atomically maxed into *out (which the caller zeroes)
cudaError_t launch_absmax(InType t, const void* x, int64_t n, uint32_t* out, cudaStream_t stream);
// max|x| of each row group of x [M, K] (row r belongs to group row_group[r]), as fp32 bits, atomically maxed into
// out[group] (which the caller zeroes)
cudaError_t launch_grouped_absmax(InType t, const void* x, int64_t M, int64_t K, const int32_t* row_group,
                                  uint32_t* out, cudaStream_t stream);
// NVFP4 with RHT: max|x| into *row_amax and max|RHT16(x^T)| into *col_amax in one pass (M % 16 == 0)
cudaError_t launch_nvfp4_rht_amax(InType t, const void* x, int64_t M, int64_t K, uint32_t* row_amax, uint32_t* col_amax,
                           cudaStream_t stream);
// ... per row group (row r in group row_group[r]; every group a whole number of 16-row groups): into
// row_amax[group] / col_amax[group] (zeroed by the caller), one launch for all groups
cudaError_t launch_grouped_nvfp4_rht_amax(InType t, const void* x, int64_t M, int64_t K, const int32_t* row_group,
                                          uint32_t* row_amax, uint32_t* col_amax, cudaStream_t stream);
// row_group[r] (int32 [M]) = the group g with starts[g] <= r < starts[g + 1] (starts: int64 [n_groups + 1] on the
// device, non-decreasing, starts[n_groups] == M)
cudaError_t launch_row_groups_from_starts(const int64_t* starts, int n_groups, int64_t M, int32_t* row_group,
                                          cudaStream_t stream);

// Delayed-scaling update of one per-tensor FP8 quantizer's state (in place), see delayed_scaling.cu
struct DelayedEntry {
  float* hist;   // amax history [len], fp32, contiguous
  float* scale;  // scale [1]
  int64_t len;   // 1 <= len <= kDelayedMaxLen
  float fp8_max;
  float divisor;  // fp32(2^margin)
  int32_t most_recent;
  int32_t pad_;
};
constexpr int kDelayedMaxPerThread = 16;
constexpr int64_t kDelayedMaxLen = 256 * kDelayedMaxPerThread;  // longer histories: the Python update
// out[c, r] = in[r, c] for a row-major [R, C] matrix of 1-byte elements (R < 2^22 rows)
cudaError_t launch_transpose_u8(const uint8_t* in, uint8_t* out, int64_t R, int64_t C, cudaStream_t stream);

cudaError_t launch_delayed_update(const DelayedEntry* entries_dev, int64_t n, cudaStream_t stream);

// Scale layout of FP8 data to dequantize; the values are the `mode` argument of the dequantize_fp8 op
enum class DequantMode : int {
  kTensor = 0,       // per-tensor scale_inv [1]
  kBlock1x128 = 1,   // fp32 scale_inv of 1x128 blocks [rows, ceil(cols/128)]
  kTile128 = 2,      // fp32 scale_inv of 128x128 tiles [ceil(rows/128), ceil(cols/128)]
  kMx1x32 = 3,       // E8M0 bytes of 1x32 blocks [rows, cols/32]
};

// Dequantize to fp32 (out_bf16: to bf16)
cudaError_t launch_dequant_fp8(DequantMode mode, const uint8_t* q, const void* scale, int64_t rows, int64_t cols, bool e5m2,
                        bool out_bf16, void* out, cudaStream_t stream);
// NVFP4: q * s (times amax / 2688 if apply_global, see nvfp4_apply_global), then the inverse RHT along cols if rht_inverse
cudaError_t launch_dequant_nvfp4(const uint8_t* q, const uint8_t* s, const float* amax, int64_t rows, int64_t cols,
                          bool rht_inverse, bool apply_global, bool out_bf16, void* out, cudaStream_t stream);

}  // namespace hybridq
