"""Sequence parallelism: the input of a column-parallel Linear arrives as this rank's slice of the sequence, is
quantized here (statistics reduced over the tensor-parallel group: see [Note: piece], pieces.py) and all-gathered in
its quantized form (a payload: see [Note: payload], payload.py).

Each rank's tokens are a row shard of the whole input's `[M, K]` view when the sequence dim is the first dim
that is larger than 1 (`[S, B, H]`, or `[B, S, H]` with B = 1): the FSDP2 row-shard machinery then applies as
is, blocks that straddle two ranks' tokens included (`shard_stats`, `payload`). Otherwise (`[B, S, H]` with
B > 1) a rank's tokens are B separate runs of rows; each run must be a multiple of the format's row blocks
(`split_granularity`), the rank's rows are quantized as one stacked shard and the gathered block rows are put
back in the whole input's order. Gradients of the input go back as a reduce-scatter in high precision.

When the rows in the input's dtype are fewer bytes than their quantized payload (bf16 inputs of formats that
send both directions in 8 bits, or an identity columnwise form: `gather_plan`), the rows are all-gathered as they
are and every rank quantizes the whole input: the same bits, since the sharded quantization reduces every
statistic that crosses a rank boundary. So no preset's gather sends more than bf16 sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ..enums import SequenceSend
from ..errors import FormatShapeError
from ..formats._sharding import RowShard
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats._reduce import amax_all_reduce_
from ..tensor import QuantizedTensor
from .collectives import all_gather_single, reduce_scatter_single
from .payload import assemble_parts, build_payload, quantize_shard
from .pieces import reject_stateful

__all__ = ["GatherPlan", "SequenceGather", "gather_plan", "sent_directions"]

_DERIVABLE: dict = {}
_PLANS: dict = {}


def sent_directions(q: Quantizer, k: int, dtype: torch.dtype, columnwise: bool) -> tuple[tuple[str, ...], bool]:
    """(directions all-gathered, whether the columnwise form is derived from the gathered rowwise one): a
    columnwise form that is an exact transform of the rowwise one (`derive_part`) does not travel."""
    if not columnwise:
        return (ROWWISE,), False
    key = (repr(q), k, dtype)
    if key not in _DERIVABLE:
        g = max(q.split_granularity(True, True)[0], 1)
        r, _ = q.quantize_parts(torch.empty(g, k, dtype=dtype, device="meta"), True, False)
        try:
            _DERIVABLE[key] = q.derive_part(r, COLUMNWISE, dtype) is not None
        except Exception:  # noqa: BLE001 - a derivation that cannot run on meta: gather both
            _DERIVABLE[key] = False
    derive = _DERIVABLE[key]
    return ((ROWWISE,) if derive else (ROWWISE, COLUMNWISE)), derive


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """What a sequence-parallel all-gather sends. "quantized": each rank's quantized rows (`send`, the columnwise
    form derived after the gather when `derive`); "high_precision": each rank's rows in the input's dtype, every
    rank quantizing the whole gathered input (bitwise the same parts: the sharded quantization reduces every
    cross-rank statistic, so it equals the whole input's). `nbytes`: the payload of one rank."""

    kind: SequenceSend
    send: tuple[str, ...]
    derive: bool
    nbytes: int
    quantized_nbytes: int


def gather_plan(q: Quantizer, gather: "SequenceGather", local_rows: int, k: int, dtype: torch.dtype,
                columnwise: bool) -> GatherPlan:
    """The cheaper of the two ways to gather the whole input's quantization (the same on every rank: computed on
    the meta device from rank 0's shard, whose payload layout every rank shares). The high-precision gather is
    taken when its payload is strictly smaller (e.g. bf16 inputs of 8-bit block formats sending both directions,
    or an identity columnwise form) and the quantizer is deterministic (a whole-input quantization on every rank
    then gives the bits the ranks' shards would)."""
    key = (repr(q), gather.full_shape, gather.seq_dim, gather.world_size, local_rows, k, dtype, columnwise)
    plan = _PLANS.get(key)
    if plan is None:
        send, derive = sent_directions(q, k, dtype, columnwise)
        x = torch.empty(local_rows, k, dtype=dtype, device="meta")
        shards = gather.shards(local_rows)
        parts = quantize_shard(q, x, shards[0], send, q.shard_stats(x, shards[0]))
        _, meta = build_payload(q, parts, shards[0], shards, (shards[0].rows, k), x.device, pack=False)
        high = local_rows * k * dtype.itemsize
        if q.is_deterministic and high < meta.nbytes:
            plan = GatherPlan(SequenceSend.HIGH_PRECISION, (), False, high, meta.nbytes)
        else:
            plan = GatherPlan(SequenceSend.QUANTIZED, send, derive, meta.nbytes, meta.nbytes)
        _PLANS[key] = plan
    return plan


@dataclasses.dataclass(eq=False)
class SequenceGather:
    """One call's sequence-parallel input: `source` is the tensor the layer received (layers reading the same one
    share its gathered quantization), `full_shape` the whole input's shape, `seq_dim` the sharded dim."""

    source: torch.Tensor
    full_shape: tuple[int, ...]
    seq_dim: int
    group: object
    world_size: int
    rank: int

    @classmethod
    def create(cls, source: torch.Tensor, full_shape, seq_dim: int, group, name: str) -> "SequenceGather":
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        full_shape = tuple(full_shape)
        seq_dim = seq_dim % len(full_shape)
        if seq_dim == len(full_shape) - 1:
            raise ValueError(f"{name}: the sequence-parallel input is sharded along its last dim (the features); "
                             f"a column-parallel layer's input must be sharded along a sequence dim")
        if full_shape[seq_dim] % ws:
            raise ValueError(f"{name}: sequence parallelism needs the sequence length {full_shape[seq_dim]} (dim "
                             f"{seq_dim} of the input {full_shape}) to be a multiple of the tensor-parallel size {ws}")
        return cls(source, full_shape, seq_dim, group, ws, rank)

    # -- layout ----------------------------------------------------------------------------------------
    @property
    def leading(self) -> int:
        """Runs of rows per rank: the product of the dims before the sequence dim."""
        return math.prod(self.full_shape[:self.seq_dim])

    @property
    def run_rows(self) -> int:
        """Rows of the `[M, K]` view in one run of this rank's tokens."""
        return self.full_shape[self.seq_dim] // self.world_size * math.prod(self.full_shape[self.seq_dim + 1:-1])

    @property
    def local_shape(self) -> tuple[int, ...]:
        s = list(self.full_shape)
        s[self.seq_dim] //= self.world_size
        return tuple(s)

    def check(self, q: Quantizer, columnwise: bool, name: str) -> None:
        """The format's rules for the whole input, and (runs of rows) that no block spans two runs."""
        reject_stateful(q, name)
        q.validate(self.full_shape, name, rowwise=True, columnwise=columnwise)
        g = q.split_granularity(True, columnwise)[0]
        if self.leading > 1 and self.run_rows % g:
            raise FormatShapeError(
                f"{q.describe()} cannot quantize {name} sequence-parallel: each rank holds {self.leading} runs of "
                f"{self.run_rows} rows (input {self.full_shape}, sequence dim {self.seq_dim}) and its blocks span "
                f"{g} rows; make the local sequence length a multiple of {g}, or put the sequence dim first")

    def check_equal_pieces(self, x2d: torch.Tensor, name: str) -> None:
        """Raise ValueError on every rank unless every rank holds the same number of tokens, the input's share of
        this rank (the all-gathers and the reduce-scatter move equal pieces; gloo aborts the process on unequal
        ones, NCCL may hang). A rank sees only its own count, so the counts meet in one small all-reduce (their
        max and -min) that every rank reads alike: all raise together, none is left waiting in a collective. (The
        read waits for the device: once per sequence-parallel input and forward, before its all-gather.)"""
        rows = x2d.shape[0]
        counts = torch.tensor([rows, -rows], dtype=torch.int64, device=x2d.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = counts.tolist()
        lo = -lo
        per_token = max(math.prod(self.local_shape[:-1]) // max(self.local_shape[self.seq_dim], 1), 1)
        rule = (f"{name}: sequence parallelism needs every one of the {self.world_size} tensor-parallel ranks to hold "
                f"the same share of the sequence (dim {self.seq_dim}): equal pieces are all-gathered and "
                f"reduce-scattered")
        if hi != lo:
            raise ValueError(f"{rule}; the ranks hold between {lo // per_token} and {hi // per_token} tokens (this "
                             f"rank {rows // per_token}). Split the sequence evenly: a length that is a multiple of "
                             f"{self.world_size}, padded if need be")
        if rows != math.prod(self.local_shape[:-1]):
            raise ValueError(f"{rule}; every rank holds {rows // per_token} tokens, but the input's shape "
                             f"{self.full_shape} gives each {self.local_shape[self.seq_dim]}")

    # -- forward: the quantized all-gather ----------------------------------------------------------------
    def quantize(self, q: Quantizer, x2d: torch.Tensor, columnwise: bool, name: str) -> QuantizedTensor:
        """The whole input's quantization (rowwise, + columnwise) from this rank's rows `x2d`."""
        self.check(q, columnwise, name)
        self.check_equal_pieces(x2d, name)
        ws, k = self.world_size, x2d.shape[1]
        m = math.prod(self.full_shape[:-1])  # the `[M, K]` view, as a Linear quantizes its input
        plan = gather_plan(q, self, x2d.shape[0], k, x2d.dtype, columnwise)
        if plan.kind == SequenceSend.HIGH_PRECISION:  # fewer bytes: gather the rows, quantize the whole input
            row, col = q.quantize_parts(self.full(x2d), True, columnwise)
            return QuantizedTensor(row, col, shape=(m, k), dtype=x2d.dtype)
        shards = self.shards(x2d.shape[0])
        shard = shards[self.rank]
        stats = q.shard_stats(x2d, shard)
        if stats is not None:
            amax_all_reduce_(stats, self.group)
        parts = quantize_shard(q, x2d, shard, plan.send, stats)
        payload, meta = build_payload(q, parts, shard, shards, (shard.rows, k), x2d.device)
        gathered = payload.new_empty(ws * payload.numel())
        all_gather_single(gathered, payload, group=self.group)
        full = assemble_parts(meta, gathered.view(ws, -1))
        if self.leading > 1:
            full = {d: self._in_input_order(q, d, p) for d, p in full.items()}
        if plan.derive:  # an exact transform of the gathered rowwise form (per-tensor FP8: its transpose)
            full[COLUMNWISE] = q.derive_part(full[ROWWISE], COLUMNWISE, x2d.dtype)
        return QuantizedTensor(full[ROWWISE], full.get(COLUMNWISE), shape=(m, k), dtype=x2d.dtype)

    def shards(self, local: int) -> list[RowShard]:
        """Every rank's rows: a row shard of the whole input's view, or (runs of rows) of the rank-after-rank
        stack of the ranks' rows."""
        rows = math.prod(self.full_shape[:-1]) if self.leading == 1 else local * self.world_size
        cuts = tuple(r * local for r in range(1, self.world_size))
        return [RowShard(rows, r * local, local, cuts) for r in range(self.world_size)]

    def _in_input_order(self, q: Quantizer, direction: str, part):
        """A gathered part of the rank-after-rank stack, with its block rows moved to the whole input's order
        (rank r's run b goes to run b, slot r): an exact permutation of whole blocks."""
        hints = q.buffer_hints(direction)
        buffers, replicated = part.extract_buffers(None, **hints)
        moved = {}
        for name, t, row_block in buffers:
            if self.run_rows % row_block:
                raise FormatShapeError(f"{q.describe()}: {name} has blocks of {row_block} rows across runs of "
                                       f"{self.run_rows} rows")
            per_run = self.run_rows // row_block
            t = t.reshape((self.world_size, self.leading, per_run) + tuple(t.shape[1:]))
            moved[name] = t.transpose(0, 1).reshape((-1,) + tuple(t.shape[3:])).contiguous()
        return type(part).assign_gathered(moved, replicated, rows=part.rows, cols=part.cols,
                                          columnwise=part.columnwise, meta=part.meta(), **hints)

    # -- backward ------------------------------------------------------------------------------------------
    def full(self, x2d: torch.Tensor) -> torch.Tensor:
        """The whole input's `[M, K]` in high precision from this rank's rows (backward_override="high_precision"
        and save_original_input read it; the forward's high-precision plan quantizes it)."""
        local = x2d.reshape(self.local_shape).movedim(self.seq_dim, 0).contiguous()
        out = local.new_empty((self.world_size * local.shape[0],) + tuple(local.shape[1:]))
        all_gather_single(out, local, group=self.group)
        return out.movedim(0, self.seq_dim).reshape(-1, x2d.shape[1])

    def reduce_grad(self, dx2d: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the summed input gradient (every rank computed a partial sum over its output
        columns): a reduce-scatter along the sequence dim, in high precision."""
        full = dx2d.reshape(self.full_shape).movedim(self.seq_dim, 0).contiguous()
        out = full.new_empty((full.shape[0] // self.world_size,) + tuple(full.shape[1:]))
        reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.group)
        return out.movedim(0, self.seq_dim).contiguous()
