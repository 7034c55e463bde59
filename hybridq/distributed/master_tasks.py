"""What `quantize_master_weights` does for each direction of each weight (a `Task`): how the direction is made
from fragments (`FragmentKind`; see master_weights.py), which buffers it sends
in row order, how many bytes each rank's piece of them takes, and how the gathered buffers become the part."""

from __future__ import annotations

import dataclasses

import torch

from ..enums import COLUMNWISE, ROWWISE, FragmentKind
from ..formats._sharding import cdiv
from ..formats.base import Quantizer, shape_2d
from ..formats.float8_block import Float8BlockPart
from ..formats.hybrid import HybridQuantizer
from ..nn.quantized_params import quantized_param_info
from ..tensor import QuantizedTensor
from .fragments import owned_block_rows

__all__ = ["Task", "as_bytes", "build_part", "piece_sizes", "plan_tasks", "row_buffers"]


@dataclasses.dataclass
class Task:
    """One direction of one weight (or a plain weight): how it is made and what it sends."""

    index: int
    direction: str | None
    kind: FragmentKind
    q: Quantizer | None  # the plain quantizer of this direction
    m: int
    k: int
    dtype: torch.dtype
    gr: int = 1
    gc: int = 1
    n_global: int = 0  # length of the direction's global statistics
    edges: tuple[int, ...] = ()
    stats_at: int = 0
    packed: bool = False  # two codes per byte (NVFP4)
    code_dtype: torch.dtype | None = None  # the data buffer's dtype
    scales: tuple = ()  # (name, row_block, row shape, dtype) of each scale buffer in row order
    part_type: type | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    hints: dict = dataclasses.field(default_factory=dict)
    local: torch.Tensor | None = None  # this rank's padded rows, other ranks' elements 0 (blocks)
    replicated: dict = dataclasses.field(default_factory=dict)  # tensors every rank computes alike (global scale)

    @property
    def columnwise(self) -> bool:
        return self.direction == COLUMNWISE


def _direction_quantizer(q: Quantizer, d: str) -> Quantizer:
    if isinstance(q, HybridQuantizer):
        return q.rowwise if d == ROWWISE else q.columnwise
    return q


def _grid_tiles(part) -> bool:
    """FP8 128x128 tiles: the part holds its tile-scale grid (sent here as scale rows of 128 tensor rows)."""
    return isinstance(part, Float8BlockPart) and part.block_dim == 2


def row_buffers(part, hints: dict) -> tuple[list, dict]:
    """The part's buffers in row order (name, tensor, row_block), and the tensors every rank computes alike."""
    if _grid_tiles(part):
        grid = part.scale_inv.t() if part.columnwise else part.scale_inv
        return [("data", part.data_in_row_order(), 1), ("scale_inv", grid.contiguous(), 128)], {}
    return part.extract_buffers(None, **hints)


def build_part(t: Task, buffers: dict, replicated: dict):
    rows, cols = (t.k, t.m) if t.columnwise else (t.m, t.k)
    if t.part_type is Float8BlockPart and t.meta.get("block_dim") == 2:
        grid = buffers["scale_inv"]
        return Float8BlockPart(rows=rows, cols=cols, columnwise=t.columnwise,
                               data=Float8BlockPart.data_from_row_order(buffers["data"], t.columnwise),
                               scale_inv=grid.t().contiguous() if t.columnwise else grid, block_dim=2)
    return t.part_type.assign_gathered(buffers, replicated, rows=rows, cols=cols, columnwise=t.columnwise,
                                       meta=t.meta, **t.hints)


def plan_tasks(index: int, w: torch.Tensor, name: str) -> list[Task]:
    m, k = shape_2d(tuple(w.shape))
    info = quantized_param_info(w)
    if info is None:
        if isinstance(w, QuantizedTensor):
            raise TypeError(f"hybridq quantize_master_weights: {name} is a QuantizedTensor but not a quantized "
                            f"parameter (hybridq.quantized_model_init / quantize_parameters)")
        return [Task(index, None, FragmentKind.PLAIN, None, m, k, w.dtype)]
    tasks = []
    for d in (ROWWISE, COLUMNWISE):
        if not w.has(d):
            continue
        qd = _direction_quantizer(info.quantizer, d)
        if qd.is_stateful or getattr(qd, "stochastic_rounding", False):
            raise ValueError(f"hybridq quantize_master_weights: the {d} form of {name} ({info.layer}) uses "
                             f"{qd.describe()}; {'delayed scaling carries a scale across steps' if qd.is_stateful else 'stochastic rounding draws per fragment'}, "
                             f"so fragments cannot reproduce the whole weight's quantization")
        row, col = d == ROWWISE, d == COLUMNWISE
        if col and getattr(qd, "rht", False):
            tasks.append(Task(index, d, FragmentKind.HIGH_PRECISION, qd, m, k, w.dtype))
            continue
        gr, gc = qd.fragment_block(m, k, row, col)
        per_axis = qd.stats_per_axis  # (a row's or a column's amax: blocks of whole rows or columns, nothing global)
        kind = FragmentKind.ELEMENTWISE if (gr, gc) == (1, 1) and not per_axis else FragmentKind.BLOCKS
        g = None if per_axis else qd.global_stats(torch.empty(1, 0, device="meta"), row, col)
        probe_rows = 1 if kind == FragmentKind.ELEMENTWISE else min(gr, m)
        width = k if kind == FragmentKind.BLOCKS else 1
        probe = qd.quantize_parts(torch.empty(probe_rows, width, dtype=w.dtype, device="meta"),
                                  row, col, **({} if g is None else {"global_stats": torch.zeros(g.numel(),
                                                                                                 device="meta")}))
        part = probe[0] if row else probe[1]
        hints = qd.buffer_hints(d)
        bufs, _ = row_buffers(part, hints)
        data = dict((n, t) for n, t, _ in bufs)["data"]
        tasks.append(Task(
            index, d, kind, qd, m, k, w.dtype, gr, gc, 0 if g is None else g.numel(),
            packed=data.shape[-1] * 2 == width and width > 1, code_dtype=data.dtype,
            scales=tuple((n, rb, tuple(t.shape[1:]), t.dtype) for n, t, rb in bufs if n != "data"),
            part_type=type(part), meta=part.meta(), hints=hints))
    return tasks


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=dtype).element_size()


def piece_sizes(t: Task, start: int, length: int) -> list[int]:
    """Bytes each piece of the task takes in a rank's payload: codes, then each scale buffer's rows."""
    if t.kind in (FragmentKind.PLAIN, FragmentKind.HIGH_PRECISION):
        return [length * _nbytes((), t.dtype)]
    codes = cdiv(length, 2) if t.packed else length * _nbytes((), t.code_dtype)
    out = [codes]
    for _, rb, shape, dtype in t.scales:
        a, b = owned_block_rows(start, length, t.k, rb)
        out.append((b - a) * _nbytes(shape, dtype))
    return out


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(-1) if x.numel() else x.new_empty(0, dtype=torch.uint8)
