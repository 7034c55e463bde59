// Host-side interface of the hybridq CUDA kernels (plain C++: included by the torch bindings and the .cu files).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace hybridq {

enum class InType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// The format-independent arguments of the tile quantization kernel (csrc/tile/skeleton.cuh): one fused
// quantization of a 2-D [M, K] input into its rowwise ([M, K], blocks along K) and/or columnwise ([K, M] =
// transposed, blocks along M) parts. Each format's policy extends it with its own fields (Policy::Args, in
// csrc/tile/policy_<format>.cuh). Unused pointers are null.
struct TileArgs {
  const void* x;
  int64_t M, K;
  bool rowwise, columnwise;
  uint8_t* row_q;  // element codes: fp8 bytes, or packed E2M1 nibbles
  uint8_t* col_q;
  int64_t col_pitch;  // elements between the columnwise rows (0: M)
  // the row map of a ROW_MAP launch (csrc/tile/skeleton.cuh): row m of the [M, K] the kernel tiles is input row
  // src_rows[m], a zero row where that is < 0 (e.g. the padding between row groups placed at 16-aligned rows)
  const int32_t* src_rows;
  void* row_s;  // per-block scales, in the format's scale type and layout
  void* col_s;
  // tile order of the persistent CTAs: groups of `tile_group` tile rows, column-major inside a group (1: row-major);
  // set by the launcher
  int tile_group;
};

// The element encoding of the FP8 formats (per-tensor, block, MXFP8): E4M3 or E5M2, its largest finite value, and
// the scale rule from an amax (csrc/numerics.cuh scale_from_amax)
struct Fp8Encoding {
  bool e5m2;
  float max;
  float eps;
  bool pow2;
};

// The format-independent arguments of the dequantize kernel (csrc/tile/dequantize.cuh): the [rows, cols] element
// codes of one part (cols elements per row, kElemsPerByte of them per byte). Each format's policy extends it with
// its scales (Policy::DequantArgs).
struct DequantTile {
  const uint8_t* q;
  int64_t rows, cols;
};

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
// Checks every value of a row map of n entries against [-1, src_M) (device-side assert: amax.cu)
cudaError_t launch_check_row_map(const int32_t* src_rows, int64_t n, int64_t src_M, cudaStream_t stream);
// src_rows (int32 [width]) of the padded row-group layout: row m is the input row placed there (group g's rows
// from row padded_ends[g-1], a multiple of 16), or -1 (zero rows); ends / padded_ends: int32 [n_groups] cumulative
// row counts on the device, ends[n_groups-1] == M, padded_ends[n_groups-1] <= width (device-side assert)
cudaError_t launch_padded_rows(const int32_t* ends, const int32_t* padded_ends, int n_groups, int64_t M,
                               int64_t width, int32_t* src_rows, cudaStream_t stream);

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
// out[c, r] = in[r, c] for a row-major [R, C] matrix of 1-byte elements (R < 2^22 rows); G matrices at the batch
// strides in_batch / out_batch (elements) apart
cudaError_t launch_transpose_u8(const uint8_t* in, uint8_t* out, int64_t R, int64_t C, cudaStream_t stream,
                                int64_t G = 1, int64_t in_batch = 0, int64_t out_batch = 0);

cudaError_t launch_delayed_update(const DelayedEntry* entries_dev, int64_t n, cudaStream_t stream);

}  // namespace hybridq
