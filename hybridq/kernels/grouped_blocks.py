"""Grouped FP8 block-scaled GEMMs of GroupedLinear's packed path (`hybridq.nn.grouped_packed_blocks`) on CUDA sm_90:
one Triton launch per phase for all experts (`triton_grouped_blocks`) on the packed quantized parts as they are,
instead of one `hybridq.gemm.gemm` per expert.

Operands are taken by what their parts declare (`QuantizedPart.gemm_kind`), as `native_gemm` does: E4M3 1x128 blocks
(`native_gemm.BLOCK_1X128`) for the token operands, 128x128 tiles or 1x128 blocks for the weight. Taken where every
piece runs: a CUDA sm_90 device, Triton, native GEMMs enabled (`native_gemm.disabled()` turns them off), real tensors
(not torch.compile's fakes), and `HYBRIDQ_GROUPED_BLOCK_GEMM` not "0" (`ENABLED.on`: the per-expert GEMM loop,
which the tests compare against). Elsewhere the caller runs one `gemm` per expert.

Group bounds (`GroupBounds`): int32 `[6, E]` on the device, made once per layout from the host's counts (one
host-to-device copy, no sync), or on the device from a counts tensor (`GroupBounds.on_device`, GroupedLinear's
device-count path: no host counts at all; the launches' grids are bounded by the shapes and programs past the used
tiles exit): slot start in the packed buffer, first output row (the token order), tokens, slot size, slot end, token
end.

Two backends run the same phases (`backend` picks one per phase with a cost model, `CUBLAS_COST`): the Triton
grouped kernels above (bounds on the device only) and one cuBLAS block-scaled GEMM per expert issued from C++ in
one op call per phase (`cublas_mm` / `cublas_wgrad`: csrc/grouped_block_gemm.cu), which needs the host's counts
(GroupedLinear's packed path has them) and gives bitwise the per-expert path's GEMMs (the same cuBLAS call on the
same operands, views of the slots; only the scales are rearranged, one pass per operand, into cuBLAS's layouts).
`HYBRIDQ_GROUPED_BLOCK_CUBLAS=0` turns the cuBLAS loop off (`CUBLAS.on`); with `HYBRIDQ_GROUPED_BLOCK_GEMM=0`
both backends are off.

A grouped kernel that fails to compile or launch (`run_or_none`) is turned off for the process with one warning; the
per-expert GEMMs run instead.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..switches import Switch
from . import _ext, native_gemm
from .expert_streams import streams_for

log = logging.getLogger("hybridq")
_E4M3 = torch.float8_e4m3fn
BLOCK = 128  # elements per scale along the contracted dim (FP8 blocks), the kernels' K tile
ENABLED = Switch("HYBRIDQ_GROUPED_BLOCK_GEMM")
# one cuBLAS block-scaled GEMM per expert beats the grouped kernel where each expert's GEMM is long enough to hide
# its call's host cost: the mean expert GEMM estimated at >= this many microseconds at 1 PFLOP/s (BENCHMARKS.md
# "Grouped FP8 block GEMMs"); 0: always the per-expert GEMMs, inf: never. Measured with bench_grouped's "(packed path
# forced)" rows (one H200, 2026-11-27 10:2x UTC, fp8_block, 2 rounds): 8 experts (mean expert GEMM 481 us by this
# estimate) per-expert path 14.9 ms vs packed 19.3; 16 experts (94 us) packed 12.1 vs per-expert 23.4; 64 experts
# (26 us) packed 12.8-18.7 vs per-expert 67.4: the threshold lies between 94 and 481
PER_EXPERT_MIN_US = 200.0
CUBLAS = Switch("HYBRIDQ_GROUPED_BLOCK_CUBLAS")
FORCE = {"backend": None}  # "triton" / "cublas": that backend wherever it runs (tests, benchmarks); None: the model
FPROP, DGRAD, WGRAD = "fprop", "dgrad", "wgrad"
TRITON, CUBLAS_LOOP = "triton", "cublas"
# The cost model of `backend` (microseconds), measured on one H200 (2026-11-27 ~21:55 UTC, each phase alone on random
# operands in the slot layout: benchmarks/bench_grouped_block_gemms.py at bench_grouped's three configs, the loop's
# GEMMs through cuBLASLt with cached plans, csrc/cublaslt_fp8.h): the Triton grouped kernels ran fprop / dgrad at
# 757-846 TFLOP/s and wgrad at 424-478 whatever the expert count; the cuBLAS loop's GPU time fits FLOPs at 1.21 / 1.15
# / 0.96 PFLOP/s (fprop / dgrad / wgrad) plus ~8.5 / 10 / 8 us per expert GEMM (the last wave of each small GEMM
# runs part-empty: 64 experts of 2048 x 3072 reach only 0.78-0.87 PFLOP/s), and its host time is ~12 / 11 / 11 us per
# expert (half of torch's `_scaled_mm_v2` per call, whose argument checks, descriptors and heuristic query the cached
# plans skip; the same machine with HYBRIDQ_CUBLASLT_DIRECT=0: ~21 us), so a phase takes max(host, GPU): at 64
# experts x ~2048 tokens (2048 x 3072) fprop 1.92 vs Triton 2.10 ms, dgrad 2.11 vs 1.98, wgrad 2.19 vs 3.89; at
# 16 x ~4096 (2048 x 5632) 1.37 / 1.35 / 1.91 vs 2.00 / 1.87 / 3.27; at 8 x ~4096 (4096 x 14336) 3.27 / 3.46 / 4.00
# vs 4.55 / 4.89 / 8.06. Counting the host time in full keeps the Triton kernels for many short experts, where a
# host-bound training step would pay it. Where the expert GEMMs are short the loop runs on two streams
# (kernels/expert_streams.py: every phase), with its own per-expert term below.
CUBLAS_COST = {
    "triton_tflops": {FPROP: 790.0, DGRAD: 810.0, WGRAD: 455.0},
    "cublas_tflops": {FPROP: 1200.0, DGRAD: 1150.0, WGRAD: 960.0},
    "cublas_expert_us": {FPROP: 8.5, DGRAD: 10.0, WGRAD: 8.0},  # GPU time per expert GEMM beyond its FLOPs
    # ... where the loop runs on two streams (`streams_for`: short expert GEMMs), whose next expert fills the SMs
    # that one expert's last wave leaves idle
    # (2026-11-29 11:10 UTC, the same benchmark: at 64 experts fprop / dgrad / wgrad 1.89 / 2.05 / 2.30 ms on one
    # stream, 1.63 / 1.60 / 1.88 on two, vs Triton 2.08 / 1.98 / 3.84; at 16 experts 1.36 / 1.26 / 2.01 -> 1.33 / 1.26 /
    # 1.67; at 8 experts, one stream picked, 3.27 / 3.51 / 3.93 vs 3.31 / 3.46 / 4.04)
    "cublas_expert_us_two_streams": {FPROP: 4.0, DGRAD: 2.5, WGRAD: 3.0},
    "cublas_host_us": {FPROP: 12.0, DGRAD: 11.0, WGRAD: 11.0},  # per expert GEMM
}


def _triton():
    """triton_grouped_blocks when Triton imports, else None (imported on first use: Triton is optional)."""
    from . import triton_grouped_blocks
    return triton_grouped_blocks if triton_grouped_blocks.available() else None


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along its rows (the CUDA quantize kernels write them so; the CPU reference's columnwise
    parts are transposed views, copied here)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _real_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and not isinstance(t, FakeTensor)


def supports(a, b) -> bool:
    """Whether the grouped kernels take token operand part `a` (1x128 blocks) against `b` (a weight part, 128x128
    tiles or 1x128 blocks; or a token operand for wgrad)."""
    return _block_pair_on_sm90(a, b) and _triton() is not None


def _block_pair_on_sm90(a, b) -> bool:
    """What both grouped backends take: E4M3 1x128 token blocks against 1x128 blocks or 128x128 tiles, real CUDA
    tensors on one sm_90 device, the grouped GEMMs and the native GEMMs on."""
    if not (ENABLED.on and native_gemm.native_enabled() and _real_cuda(a.data) and b.data.device == a.data.device):
        return False
    if a.gemm_kind != native_gemm.BLOCK_1X128 or b.gemm_kind not in (native_gemm.BLOCK_1X128,
                                                                      native_gemm.TILE_128X128):
        return False
    return a.data.dtype == _E4M3 and b.data.dtype == _E4M3 and native_gemm._cap(a.data) == (9, 0)


def _cublas_op_available(device: torch.device) -> bool:
    return _ext.available_for(device) and hasattr(torch.ops.hybridq, "grouped_block_cublas_mm")


def cublas_supports(a, b) -> bool:
    """Whether the cuBLAS loop takes token part `a` against `b` (as `supports`, plus what the per-expert path's
    cuBLAS GEMM needs, `native_gemm._block_supports`: a K of whole 128-blocks, 16-multiples elsewhere; on other shapes
    the per-expert path runs its emulated GEMM, which this loop would not reproduce)."""
    return (CUBLAS.on and _block_pair_on_sm90(a, b) and hasattr(torch.nn.functional, "scaled_mm")
            and _cublas_op_available(a.data.device))


def estimate_us(phase: str, rows: list[int], k: int, n: int) -> tuple[float, float]:
    """(Triton grouped kernel, cuBLAS loop) estimated microseconds of one phase over experts of `rows` rows (the
    rows each GEMM computes), contracting `k` and writing `n` columns (`CUBLAS_COST`)."""
    c = CUBLAS_COST
    used = [r for r in rows if r]
    flops = 2.0 * sum(used) * k * n
    triton = flops / (c["triton_tflops"][phase] * 1e6)
    tail = c["cublas_expert_us_two_streams" if streams_for(used, k, n) == 2 else "cublas_expert_us"][phase]
    cublas = max(flops / (c["cublas_tflops"][phase] * 1e6) + tail * len(used), c["cublas_host_us"][phase] * len(used))
    return triton, cublas


def backend(phase: str, rows: list[int], k: int, n: int) -> str:
    """TRITON or CUBLAS_LOOP for one phase (`FORCE`, else the faster by `estimate_us`)."""
    if FORCE["backend"] is not None:
        return FORCE["backend"]
    triton, cublas = estimate_us(phase, rows, k, n)
    return CUBLAS_LOOP if cublas < triton else TRITON


def prefers_per_expert_gemms(splits: list[int], k: int, n: int) -> bool:
    """Whether one GEMM per expert is measured faster than the grouped kernel for these token counts (`[tokens, k] x
    [n, k]^T` per expert)."""
    used = [m for m in splits if m]
    return bool(used) and 2.0 * sum(used) / len(used) * k * n / 1e9 >= PER_EXPERT_MIN_US


class GroupBounds:
    """The device bounds of the packed layout's groups (module docstring), and the host facts the launches need."""

    def __init__(self, offsets: list[int], splits: list[int], slots: list[int], device: torch.device):
        starts = [sum(splits[:g]) for g in range(len(splits))]
        ends = [o + s for o, s in zip(offsets, slots)]
        token_ends = [s + m for s, m in zip(starts, splits)]
        host = torch.tensor([offsets, starts, splits, slots, ends, token_ends], dtype=torch.int32)
        self.table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        self.tokens = sum(splits)
        self.empty = [g for g, m in enumerate(splits) if m == 0]
        self.slots_aligned = all(o % BLOCK == 0 for o in offsets)  # (what wgrad needs)
        self.whole_blocks = self.slots_aligned and all(s % BLOCK == 0 for s in slots)

    @property
    def gemm_rows(self) -> torch.Tensor:
        """`table[:3]` (slot start, first output row, tokens), what the fprop / dgrad kernel reads: a view made once
        per bounds (forward and backward, and the projections of one routing, share the bounds; a slice is a
        dispatcher call on every GEMM otherwise)."""
        if "_gemm_rows" not in self.__dict__:
            self._gemm_rows = self.table[:3]
        return self._gemm_rows

    @property
    def slot_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(`table[0]`, `table[3]`): the slots' starts and sizes, what the wgrad kernel reads (as `gemm_rows`)."""
        if "_slot_rows" not in self.__dict__:
            self._slot_rows = (self.table[0], self.table[3])
        return self._slot_rows

    @classmethod
    def on_device(cls, table: torch.Tensor, tokens: int, multiple: int) -> "GroupBounds":
        """Bounds whose table was computed on the device (`grouped_packed.SlotLayout`: no host counts): every slot a
        multiple of `multiple` rows, so aligned for wgrad where that is a multiple of 128. `empty` is unknown (None):
        the kernels read the empty groups from the table."""
        out = cls.__new__(cls)
        out.table, out.tokens, out.empty = table, tokens, None
        out.slots_aligned = out.whole_blocks = multiple % BLOCK == 0
        return out


def weight_supported(b, b_experts: int) -> bool:
    """Whether `mm` takes the whole packed weight part `b` of `b_experts` experts: each expert's rows a whole number
    of its scale blocks (and of 128 columns of a columnwise form, whose K blocks run along the experts' rows)."""
    n = (b.cols if b.columnwise else b.rows) // b_experts
    return n % (BLOCK if b.columnwise else b.block_shape[0]) == 0


def mm(a, b, b_experts: int, bounds: GroupBounds, out_dtype: torch.dtype) -> torch.Tensor:
    """fprop / dgrad of every expert: `[tokens, n]` in token order, expert g's rows = its tokens' rows of `a` (the
    packed rowwise token part, `[S, K]`) times `b_g^T`, where `b` is the whole packed weight part (fprop: the rowwise
    `[E*n, K]`; dgrad: the columnwise `[K, E*n]`, whose expert g is the column block `[:, g*n:(g+1)*n]`)."""
    t = _triton()
    blocks = b.block_shape[0]  # rows of b per scale row: 128 (tiles) or 1 (1x128 blocks)
    s, data = _row_major(b.scales), _row_major(b.data)
    if b.columnwise:  # b_g[j, c] = data[j, g*n + c]; its scale at scales[j // blocks, (g*n + c) // 128]
        n = b.rows
        gn = b.cols // b_experts
        group_stride, row_stride = gn, data.stride(0)
        scale_strides = (gn // BLOCK, s.stride(0), 1)
    else:  # b_g[j, :] = data[g*n + j, :]
        n = b.rows // b_experts
        group_stride, row_stride = n * data.stride(0), data.stride(0)
        scale_strides = (n // blocks * s.stride(0), s.stride(0), 1)
    return t.grouped_block_mm(_row_major(a.data), _row_major(a.scales), data, group_stride, row_stride, n, s,
                              scale_strides, blocks, bounds.gemm_rows, bounds.tokens, out_dtype)


def mm_stacked(a, b0, views: dict[str, torch.Tensor], bounds: GroupBounds, out_dtype: torch.dtype) -> torch.Tensor:
    """`mm` of a weight whose experts' tensors are the `[E, ...]` views `views` of their stacked buffers (FSDP2's
    gathered experts: `GroupedWeightState.stacked`; `b0`: expert 0's part, which says the format and direction), each
    expert read at its own place -- bitwise `mm` of the experts joined into one part (`grouped_packed_blocks._joined`:
    the same bytes and scales, the same kernel), without the join, a copy across experts for a columnwise weight.
    Expert g's part is `[n, contraction]` either way (rowwise `W_g`, columnwise `W_g^T`): its data `views["data"][g]`
    with unit stride along the contraction, its scales `[n / blocks, contraction blocks]`."""
    data, s = views["data"], views[b0.scale_field]
    return _triton().grouped_block_mm(_row_major(a.data), _row_major(a.scales), data, data.stride(0), data.stride(1),
                                      b0.rows, s, tuple(s.stride()), b0.block_shape[0], bounds.gemm_rows,
                                      bounds.tokens, out_dtype)


def stacked_supported(b0, views: dict[str, torch.Tensor]) -> bool:
    """Whether `mm_stacked` takes these views: 3-D data with unit stride along the contraction (the kernel's K
    loads) and 3-D scales, both of all experts."""
    data, s = views.get("data"), views.get(b0.scale_field)
    return (data is not None and s is not None and data.dim() == 3 and s.dim() == 3 and data.stride(2) == 1
            and data.shape[0] == s.shape[0] and tuple(data.shape[1:]) == (b0.rows, b0.cols))


def wgrad(a_t, b_t, bounds: GroupBounds, out_dtype: torch.dtype) -> torch.Tensor:
    """dW of every expert, `[E, M, N]`: the columnwise token parts `a_t [M, S]`, `b_t [N, S]` contracted over each
    expert's slot (zero for an empty one)."""
    operands = (_row_major(t) for t in (a_t.data, a_t.scales, b_t.data, b_t.scales))
    return _triton().grouped_block_wgrad(*operands, *bounds.slot_rows, bounds.whole_blocks, out_dtype)


def _cublas_weight_scales(b, e: int) -> torch.Tensor:
    """The packed weight part's scales as `[E, R, C]`, expert g's cuBLAS scale operand being `[g].t()`: 128x128 tiles
    `[N/128, round_up(K/128, 4)]` per expert (K blocks fastest, padded to 4: what cuBLAS reads), 1x128 rows
    `[K/128, N]` (the rows fastest). One copy for all experts (none for rowwise tiles whose K blocks are a multiple
    of 4). The columnwise (dgrad) part holds `W^T`: its experts are column blocks."""
    s = _row_major(b.scales)
    if b.columnwise:  # [N_out, E * kb] (1x128 rows) or [N_out / 128, E * kb] (tiles): contracted blocks per expert
        r, kb = s.shape[0], s.shape[1] // e
        s = s.reshape(r, e, kb)
        if b.block_shape[0] == 1:
            return s.permute(1, 2, 0).contiguous()
        return torch.nn.functional.pad(s.permute(1, 0, 2), (0, -kb % 4)).contiguous()
    if b.block_shape[0] == 1:  # [E * n, kb]
        return s.reshape(e, s.shape[0] // e, s.shape[1]).transpose(1, 2).contiguous()
    kb = s.shape[1]  # [E * n / 128, kb]
    s = torch.nn.functional.pad(s, (0, -kb % 4)) if kb % 4 else s
    return s.reshape(e, s.shape[0] // e, s.shape[1])


def cublas_mm(a, b, b_experts: int, offsets: list[int], rows: list[int], tokens: list[int], bounds: GroupBounds,
              out_dtype: torch.dtype) -> torch.Tensor:
    """fprop / dgrad of every expert as `mm`, by one cuBLAS block-scaled GEMM per expert (`hybridq::
    grouped_block_cublas_mm`): expert g's GEMM on rows [offsets[g], offsets[g] + rows[g]) of `a` (its padded count:
    the per-expert path's shapes), its first tokens[g] rows kept, on one or two streams (`streams_for`). `bounds.table`
    rows 0 / 3 (slot offsets, slot sizes) must be `offsets` / `rows` (the slots are the padded counts)."""
    n = b.rows if b.columnwise else b.rows // b_experts
    return torch.ops.hybridq.grouped_block_cublas_mm(
        _row_major(a.data), _row_major(a.scales), _row_major(b.data), _cublas_weight_scales(b, b_experts),
        b.block_shape[0] != 1, 1 if b.columnwise else 0, offsets, rows, tokens, *bounds.slot_rows,
        out_dtype, streams_for(rows, a.cols, n))


def cublas_wgrad(a_t, b_t, offsets: list[int], rows: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """dW of every expert as `wgrad`, by one cuBLAS block-scaled GEMM per expert (`hybridq::
    grouped_block_cublas_wgrad`) over its slot's `rows[g]` tokens (multiples of 128)."""
    return torch.ops.hybridq.grouped_block_cublas_wgrad(
        _row_major(a_t.data), _row_major(a_t.scales), _row_major(b_t.data), _row_major(b_t.scales), offsets, rows,
        out_dtype, streams_for(rows, a_t.data.shape[0], b_t.data.shape[0]))


def cublas_formats(quantizers: dict) -> bool:
    """Whether the cuBLAS loop runs every GEMM of experts quantized by `quantizers`: FP8 E4M3 blocks in all three
    roles, 1x128 for the tokens (input, grad_output), 1x128 or 128x128 for the weight."""
    from ..formats.float8_block import Float8BlockQuantizer
    roles = [quantizers.get(r) for r in ("input", "weight", "grad_output")]
    if not all(isinstance(q, Float8BlockQuantizer) and q.dtype == _E4M3 for q in roles):
        return False
    return roles[0].block_dim == 1 and roles[2].block_dim == 1


def cublas_takes(quantizers: dict, device: torch.device) -> bool:
    """Whether the cuBLAS loop can run every GEMM of experts quantized by `quantizers` on `device` (before any
    tensor exists: what `grouped_packed_blocks.packed_path_pays` asks): `cublas_formats`, CUDA sm_90 with the
    extension's op."""
    if not (CUBLAS.on and ENABLED.on and cublas_formats(quantizers) and device.type == "cuda"
            and torch.cuda.is_available() and native_gemm.native_enabled()):
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and hasattr(torch.nn.functional, "scaled_mm") and \
        _cublas_op_available(device)


def run_or_none(enabled: Switch, what: str, fn, instead: str = "the packed path runs one GEMM per expert"):
    """`fn()`, a grouped kernel; None after a failure (a Triton compile or launch error, a torch refusal), which turns
    that kernel family's switch `enabled` off with one warning saying what runs `instead` (the caller's
    fallback: the per-expert GEMMs, or the packing copy before the format's quantize)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (Triton compile / launch errors have no common base; torch's RuntimeError)
        enabled.set(False)
        msg = f"hybridq: {what} failed ({type(e).__name__}: {e}); {instead} from now on"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return None
