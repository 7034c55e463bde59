"""The grouped quantize of GroupedLinear's packed block path on CUDA: the routed token rows quantized straight into
the expert slots (one launch writes both directions of one quantizer), instead of packing them into a zero-padded
buffer (`TokenLayout.pack`) and quantizing that. Bitwise the same parts: it is taken only where the packed path would
run the extension's CUDA kernel of the same quantizer (`dispatch.lookup_quantize` on the slot-shaped input), for the
formats implemented here: FP8 1x128 blocks (`Float8BlockQuantizer(block_dim=1)`) and MXFP8 1x32 blocks
(`MXFP8Quantizer(block_2d=False)`), alone or as either direction of a `HybridQuantizer` whose columnwise form comes
from the original values. Two backends (`BACKEND`): "cuda" (the default), that same CUDA kernel reading the token rows
through the slots' row map (`hybridq::fp8_block_quantize` / `mxfp8_quantize` with `src_rows`: the tile kernel's
RowMap::kLoads, csrc/tile/skeleton.cuh); "triton", `triton_slot_quantize`, which reproduces the CUDA kernel's numerics
(the two are compared bitwise in the tests; one H200, 2026-11-29, bench_grouped's 64-expert tokens: the CUDA kernel
~2x faster). Elsewhere (the CPU, other formats, NVFP4 directions, torch.compile's fake tensors, no Triton for the
"triton" backend, `HYBRIDQ_GROUPED_SLOT_QUANTIZE=0`, or after a launch failed: one warning, then off for the process)
`quantize` returns None and the caller packs.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..dispatch import lookup_quantize
from ..enums import ColumnwiseSource
from ..formats import Float8BlockPart, Float8BlockQuantizer, HybridQuantizer, MXFP8Part, MXFP8Quantizer
from ..formats._numerics import FP8_MAX
from ..formats.base import Quantizer
from ..switches import Switch
from ..tensor import QuantizedTensor
from . import cuda_fp8_block, cuda_mxfp8
from .grouped_blocks import run_or_none

ENABLED = Switch("HYBRIDQ_GROUPED_SLOT_QUANTIZE")
BACKEND = {"name": "cuda"}  # "cuda": the extension's tile kernel through a row map; "triton": triton_slot_quantize
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CUDA_KERNELS = {Float8BlockQuantizer: "cuda-fp8-block", MXFP8Quantizer: "cuda-mxfp8"}
_CUDA_RUN = {Float8BlockQuantizer: cuda_fp8_block.run, MXFP8Quantizer: cuda_mxfp8.run}  # (those kernels' `run`)


def _triton():
    """triton_slot_quantize when Triton imports, else None (imported on first use: Triton is optional)."""
    from . import triton_slot_quantize
    return triton_slot_quantize if triton_slot_quantize.available() else None


def _implemented(q: Quantizer) -> bool:
    return (type(q) is Float8BlockQuantizer and q.block_dim == 1) or (type(q) is MXFP8Quantizer and not q.block_2d)


def _direction_quantizers(q: Quantizer, rowwise: bool, columnwise: bool) -> list[tuple[Quantizer, bool]] | None:
    """(quantizer, columnwise) of each direction asked for, or None where one is not implemented here."""
    if isinstance(q, HybridQuantizer):
        if columnwise and q.columnwise_source != ColumnwiseSource.ORIGINAL:
            return None  # (its columnwise form comes from the dequantized rowwise one)
        out = ([(q.rowwise, False)] if rowwise else []) + ([(q.columnwise, True)] if columnwise else [])
    else:
        out = ([(q, False)] if rowwise else []) + ([(q, True)] if columnwise else [])
    return out if out and all(_implemented(d) for d, _ in out) else None


def _launches(q: Quantizer, rowwise: bool, columnwise: bool) -> list[tuple[Quantizer, bool, bool]]:
    """(quantizer, rowwise, columnwise) of each kernel launch: one launch writes both directions where one quantizer
    makes both (a plain quantizer: the kernel reads each tile once for both forms, and each launch costs host time),
    one per direction where a hybrid's directions differ."""
    dirs = _direction_quantizers(q, rowwise, columnwise)
    if len(dirs) == 2 and (dirs[0][0] is dirs[1][0] or dirs[0][0] == dirs[1][0]):
        return [(dirs[0][0], True, True)]
    return [(d, not col, col) for d, col in dirs]


def supports(q: Quantizer, x: torch.Tensor, slot_rows: int, rowwise: bool, columnwise: bool) -> bool:
    """Whether `quantize` takes `x` (the routed tokens `[T, K]`) for a slot layout of `slot_rows` rows."""
    return _launch_plan(q, x, slot_rows, rowwise, columnwise) is not None


def _launch_plan(q: Quantizer, x: torch.Tensor, slot_rows: int, rowwise: bool, columnwise: bool) -> tuple | None:
    """The launches of a call `quantize` takes -- (quantizer, rowwise, columnwise, mode, keyword arguments of
    `slot_quantize`) each -- or None where it does not."""
    # (the kernel writes the columnwise bytes 4 slot rows to a word; the packed path's slots are 16-aligned)
    if not (ENABLED.on and x.is_cuda and not isinstance(x, FakeTensor) and x.dim() == 2 and x.shape[0] > 0
            and x.dtype in _IN_DTYPES and slot_rows > 0 and not (columnwise and slot_rows % 4)):
        return None
    return _kept_launches(q, x, slot_rows, rowwise, columnwise)


def _kernel_takes(q: Quantizer, x: torch.Tensor, slot_rows: int, rowwise: bool, columnwise: bool) -> bool:
    """Whether every direction asked for is implemented here and the packed path would run the extension's kernel of
    its quantizer on the slot-shaped buffer. [Note: the slot quantize's decision cache] keeps the answer per call
    configuration."""
    return _kept_launches(q, x, slot_rows, rowwise, columnwise) is not None


def _kept_launches(q: Quantizer, x: torch.Tensor, slot_rows: int, rowwise: bool, columnwise: bool) -> tuple | None:
    """`_launch_plan` past the checks of the call itself: kept per call configuration (the decision cache)."""
    dirs = _direction_quantizers(q, rowwise, columnwise)  # (first: only the formats here are kept, none with tensors)
    backend = BACKEND["name"]
    if dirs is None or (backend == "triton" and _triton() is None):
        return None
    key = (id(q), x.dtype, x.device, x.shape[1], slot_rows, rowwise, columnwise, backend)
    hit = _DECISIONS.get(key)
    if hit is not None and hit[0] is q and hit[1] == q:
        return hit[2]
    takes = True
    probe = x[:1].expand(slot_rows, x.shape[1])  # (the packed buffer's shape, for the CUDA kernel's checks)
    for d, col in dirs:  # only where the packed path would run the extension's kernel
        impl = lookup_quantize(d, probe, not col, col)
        if impl is None or impl.name != _CUDA_KERNELS[type(d)]:
            takes = False
            break
    launches = tuple(_launch_args(d, row, col) for d, row, col in _launches(q, rowwise, columnwise)) if takes else None
    if len(_DECISIONS) >= _MAX_DECISIONS:
        del _DECISIONS[next(iter(_DECISIONS))]  # (the oldest configuration)
    _DECISIONS[key] = (q, copy.deepcopy(q), launches)  # (a copy: a quantizer changed in place no longer equals it)
    return launches


def _launch_args(d: Quantizer, rowwise: bool, columnwise: bool) -> tuple:
    """(quantizer, rowwise, columnwise, mode, keyword arguments of `triton_slot_quantize.slot_quantize`) of one
    launch (the mode and arguments: the "triton" backend's)."""
    from . import triton_slot_quantize as t  # (its constants import without Triton)
    mode = t.MODE_FP8_BLOCK if type(d) is Float8BlockQuantizer else t.MODE_MXFP8
    kw = dict(fp8_max=FP8_MAX[d.dtype])
    if mode == t.MODE_FP8_BLOCK:
        kw.update(eps=d.amax_epsilon, pow2=d.power_2_scale)
    return d, rowwise, columnwise, mode, kw


# [Note: the slot quantize's decision cache]
# Whether the grouped quantize takes a call depends only on the quantizer's configuration, the input's dtype and
# device, K, the slot count and the directions -- never on values -- yet asking (a probe view, the extension's
# `supports` per direction) cost host time on every call of every layer. The answer, with the launches it makes (each
# one's quantizer, directions, mode and scaling arguments), is kept per (quantizer id, dtype, device, K, slots,
# directions), with the quantizer itself (its id is not reused while kept) and a copy of its fields at the time: a
# quantizer changed in place (another block size, epsilon) no longer equals the copy and is asked again. `ENABLED`
# and the extension's availability are read on every call / at the first call of a configuration.
_DECISIONS: dict = {}
_MAX_DECISIONS = 64


def _part(q: Quantizer, data: torch.Tensor, scales: torch.Tensor, rows: int, cols: int, columnwise: bool):
    if type(q) is Float8BlockQuantizer:
        return Float8BlockPart(rows=rows, cols=cols, columnwise=columnwise, data=data, scale_inv=scales, block_dim=1)
    return MXFP8Part(rows=rows, cols=cols, columnwise=columnwise, data=data, scale=scales)


def quantize(q: Quantizer, x: torch.Tensor, source_rows: torch.Tensor, rowwise: bool, columnwise: bool
             ) -> QuantizedTensor | None:
    """The slot layout's quantized tensor `[S, K]` (`S = len(source_rows)`; slot row r is token row `source_rows[r]`
    of `x`, a zero row where it is < 0), bitwise `q.quantize_groups(packed buffer, slots)`; None where `supports`
    says no (the caller packs and quantizes)."""
    s, k = source_rows.shape[0], x.shape[1]
    launches = _launch_plan(q, x, s, rowwise, columnwise)
    if launches is None:
        return None
    x = x.contiguous()

    def launch():
        parts = {False: None, True: None}
        for d, row, col, mode, kw in launches:
            r, c = _launch(x, source_rows, d, row, col, mode, kw)
            if row:
                parts[False] = r
            if col:
                parts[True] = c
        return QuantizedTensor(parts[False], parts[True], shape=(s, k), dtype=x.dtype)
    # (a kernel that fails to compile or launch is turned off with a warning; the caller then packs)
    return run_or_none(ENABLED, "grouped slot quantize", launch,
                       instead="the packed path packs the tokens before quantizing them")


def _launch(x: torch.Tensor, source_rows: torch.Tensor, d: Quantizer, rowwise: bool, columnwise: bool, mode: int,
            kw: dict) -> tuple:
    """One launch of `BACKEND`: (rowwise part `[S, K]`, columnwise part `[K, S]`), None for a direction not asked
    for. "cuda": the format's own CUDA kernel -- the implementation the decision found the packed path would run --
    given the row map."""
    if BACKEND["name"] == "cuda":
        return _CUDA_RUN[type(d)](d, x, rowwise, columnwise, src_rows=source_rows)
    rq, rs, cq, cs = _triton().slot_quantize(x, source_rows, mode, d.dtype, rowwise, columnwise, **kw)
    s, k = source_rows.shape[0], x.shape[1]
    return (_part(d, rq, rs, s, k, False) if rowwise else None, _part(d, cq, cs, k, s, True) if columnwise else None)
