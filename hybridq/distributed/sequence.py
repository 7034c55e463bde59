"""Sequence parallelism: the input of a column-parallel Linear arrives as this rank's slice of the sequence, is
quantized here (statistics reduced over the tensor-parallel group: see [Note: piece], pieces.py) and all-gathered in
its quantized form (a payload: see [Note: payload], payload.py).

Each rank's tokens are a row shard of the whole input's `[M, K]` view when the sequence dim is the first dim
that is larger than 1 (`[S, B, H]`, or `[B, S, H]` with B = 1): the FSDP2 row-shard machinery then applies as
is, blocks that straddle two ranks' tokens included (`shard_stats`, `payload`). Otherwise (`[B, S, H]` with
B > 1) a rank's tokens are B separate runs of rows; each run must be a multiple of the format's row blocks
(`split_granularity`), the rank's rows are quantized as one stacked shard and the gathered block rows are put
back in the whole input's order. Gradients of the input go back as a reduce-scatter in high precision.

[Note: sequence phases]
What travels is chosen per format, input shape and dtype (`gather_plan`), never more bytes per step than plain
sequence parallelism in the input's dtype (one gather of the rows in forward, the gathered rows kept for wgrad):
- per phase (the default where it fits that bound: per-tensor FP8, NVFP4, MXFP8 / NVFP4): forward all-gathers only
  what fprop reads (the rowwise form); the rank keeps its own shard's form for wgrad (its columnwise part, or its
  rowwise part when the columnwise form is an exact transform of it, quantized in forward with the reduced
  statistics, so the backward gather rebuilds the forward's bits; its rows in the input's dtype would never be
  fewer bytes) and backward all-gathers it (asynchronously, issued before the dgrad GEMM and waited for at wgrad).
  The layers reading one input (q/k/v) share one backward gather, as they share the forward one (`_WgradShare`).
  The activation kept from forward to backward is the rank's shard, not the whole input's columnwise form;
- forward only (where per phase would send more than the rows: the 8-bit block formats, whose two directions are
  33/32 of the bf16 bytes each, an identity columnwise form): one forward all-gather of the rows in the input's
  dtype (every rank quantizing the whole input: the same bits, since the sharded quantization reduces every
  statistic that crosses a rank boundary) or of the quantized directions, whichever is fewer bytes; the whole
  columnwise form is kept for wgrad.
A backward override or save_original_input keeps the rank's rows and all-gathers them in backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from ..enums import SequenceSend
from ..errors import FormatShapeError
from ..formats._sharding import RowShard
from ..formats.base import COLUMNWISE, ROWWISE, Quantizer
from ..formats._reduce import amax_all_reduce_
from ..nn.side_table import TensorSideTable
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
    """What the sequence-parallel all-gathers of one input send (see [Note: sequence phases]). Forward: `kind`
    "quantized" (each rank's quantized `send` directions; the columnwise form derived after the gather when
    `derive`) or "high_precision" (each rank's rows in the input's dtype, every rank quantizing the whole input),
    `nbytes` per rank. Backward (`backward_send` not empty: the per-phase plan): the rank's own part of that
    direction for wgrad, kept from forward and all-gathered in backward, `backward_nbytes` per rank. `kept_nbytes`:
    what a rank keeps for wgrad from forward to backward (the most any rank keeps); `quantized_nbytes`: the
    forward-only quantized payload (sent or not)."""

    kind: SequenceSend
    send: tuple[str, ...]
    derive: bool
    nbytes: int
    quantized_nbytes: int
    backward_send: tuple[str, ...] = ()
    backward_nbytes: int = 0
    kept_nbytes: int = 0

    @property
    def per_phase(self) -> bool:
        return bool(self.backward_send)


def _local_parts(q: Quantizer, gather: "SequenceGather", local_rows: int, k: int, dtype: torch.dtype, directions,
                 rank: int = 0):
    """(parts of rank `rank`'s shard for `directions`, the payload's bytes per rank), on the meta device: every
    rank's payload has the same layout."""
    x = torch.empty(local_rows, k, dtype=dtype, device="meta")
    shards = gather.shards(local_rows)
    parts = quantize_shard(q, x, shards[rank], directions, q.shard_stats(x, shards[rank]))
    _, meta = build_payload(q, parts, shards[rank], shards, (shards[rank].rows, k), x.device, pack=False)
    return parts, meta.nbytes


def gather_plan(q: Quantizer, gather: "SequenceGather", local_rows: int, k: int, dtype: torch.dtype,
                columnwise: bool) -> GatherPlan:
    """What the gathers of this input send (the same on every rank: computed on the meta device from rank 0's
    shard, whose payload layout every rank shares): per phase where its bytes per step are at most the rows' in
    the input's dtype, else forward only, the cheaper of the quantized directions and the rows (see [Note:
    sequence phases]). The rows stand in for a quantized payload only when strictly fewer bytes and the quantizer
    is deterministic (a whole-input quantization on every rank then gives the bits the ranks' shards would)."""
    key = (repr(q), gather.full_shape, gather.seq_dim, gather.world_size, local_rows, k, dtype, columnwise)
    plan = _PLANS.get(key)
    if plan is None:
        high = local_rows * k * dtype.itemsize

        def rows_cheaper(n: int) -> bool:
            return q.is_deterministic and high < n

        send, derive = sent_directions(q, k, dtype, columnwise)
        _, both = _local_parts(q, gather, local_rows, k, dtype, send)
        if columnwise:
            local_dir = ROWWISE if derive else COLUMNWISE
            _, row = _local_parts(q, gather, local_rows, k, dtype, (ROWWISE,))
            local = row if derive else _local_parts(q, gather, local_rows, k, dtype, (COLUMNWISE,))[1]
            if not rows_cheaper(row) and row + local <= high:
                kept = max(_local_parts(q, gather, local_rows, k, dtype, (local_dir,), r)[0][local_dir].nbytes()
                           for r in range(gather.world_size))  # (ranks whose rows cut blocks keep more scales)
                plan = GatherPlan(SequenceSend.QUANTIZED, (ROWWISE,), derive, row, both, (local_dir,), local, kept)
        if plan is None:
            whole = torch.empty(math.prod(gather.full_shape[:-1]), k, dtype=dtype, device="meta")
            kept = q.quantize_parts(whole, False, True)[1].nbytes() if columnwise else 0
            if rows_cheaper(both):
                plan = GatherPlan(SequenceSend.HIGH_PRECISION, (), False, high, both, kept_nbytes=kept)
            else:
                plan = GatherPlan(SequenceSend.QUANTIZED, send, derive, both, both, kept_nbytes=kept)
        _PLANS[key] = plan
    return plan


@dataclasses.dataclass(eq=False)
class _Pending:
    """An all-gather in flight: `wait()` returns what `finish` makes of its output (once). `inputs`: what the
    collective reads, held until it is done (an asynchronous collective may still read its input)."""

    work: object
    finish: Callable[[], object]
    inputs: tuple = ()
    value: object = None

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work, self.inputs, self.value = None, (), self.finish()
        return self.value


@dataclasses.dataclass(eq=False)
class _WgradShare:
    """The whole input's columnwise form gathered in backward, shared by the layers that read one input and kept
    their shard's form in forward (`readers`): the first of them to run backward issues the all-gather, the last
    lets go of it, so it lives only between their wgrads (a second backward pass through a retained graph gathers
    again)."""

    readers: int = 0
    _left: int = 0
    _pending: _Pending | None = None

    def take(self, start: Callable[[], _Pending]) -> _Pending:
        if self._pending is None:
            self._pending, self._left = start(), self.readers
        pending = self._pending
        self._left -= 1
        if self._left <= 0:
            self._pending = None
        return pending


@dataclasses.dataclass(eq=False)
class _Quantized:
    """One input's quantization, shared by the layers that read it (`_SHARED`): the whole rowwise (+ columnwise)
    form, and with the per-phase plan the rank's own form for wgrad and the backward gather they share."""

    q: Quantizer
    columnwise: bool
    plan: GatherPlan
    xq: QuantizedTensor
    local: torch.Tensor | None = None
    share: _WgradShare | None = None


# the last inputs quantized, by the tensor the layers received (see TensorSideTable for when an entry lives)
_SHARED = TensorSideTable(slots=2)


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
    # set by `quantize` (read in backward: plain values, no tensors, so that recompute and offload hold nothing here)
    plan: GatherPlan | None = None
    quantizer: Quantizer | None = None
    share: _WgradShare | None = None
    _entry: _Quantized | None = None

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
    def quantize(self, q: Quantizer, x2d: torch.Tensor, columnwise: bool, name: str, *,
                 share: bool = False) -> QuantizedTensor:
        """The whole input's quantization from this rank's rows `x2d`: its rowwise form, and its columnwise form
        when `columnwise` and the plan gathers it in forward (with the per-phase plan wgrad reads it through
        `local_for_wgrad` / `start_backward` instead). `share`: reuse, and offer, the quantization of the layers
        reading the same `source` with an equal quantizer (one forward and one backward gather for all of them)."""
        entry = _SHARED.find(self.source, lambda eq, e: (eq is q or eq == q) and (e.columnwise or not columnwise)) \
            if share else None
        if entry is None:
            entry = self._quantize(q, x2d, columnwise, name)
            if share:
                _SHARED.put(self.source, q, entry, same_key=lambda eq: eq is q or eq == q)
        self.plan, self.quantizer, self._entry = entry.plan, entry.q, entry
        return entry.xq

    def _quantize(self, q: Quantizer, x2d: torch.Tensor, columnwise: bool, name: str) -> _Quantized:
        self.check(q, columnwise, name)
        if not isinstance(x2d, FakeTensor):  # (compile's fake run: no values to compare; the real run checks)
            self.check_equal_pieces(x2d, name)
        k = x2d.shape[1]
        m = math.prod(self.full_shape[:-1])  # the `[M, K]` view, as a Linear quantizes its input
        plan = gather_plan(q, self, x2d.shape[0], k, x2d.dtype, columnwise)
        if plan.kind == SequenceSend.HIGH_PRECISION:  # fewer bytes: gather the rows, quantize the whole input
            row, col = q.quantize_parts(self._all_rows(x2d), True, columnwise)
            return _Quantized(q, columnwise, plan, QuantizedTensor(row, col, shape=(m, k), dtype=x2d.dtype))
        shards = self.shards(x2d.shape[0])
        shard = shards[self.rank]
        stats = q.shard_stats(x2d, shard)
        if stats is not None:
            amax_all_reduce_(stats, self.group)
        local = None
        if plan.per_phase:  # quantized once, with the reduced statistics: the backward gather rebuilds these bits
            parts = quantize_shard(q, x2d, shard, tuple(dict.fromkeys(plan.send + plan.backward_send)), stats)
            d = plan.backward_send[0]
            local = QuantizedTensor(parts[d] if d == ROWWISE else None, parts[d] if d == COLUMNWISE else None,
                                    shape=tuple(x2d.shape), dtype=x2d.dtype)
            parts = {d: parts[d] for d in plan.send}
        else:
            parts = quantize_shard(q, x2d, shard, plan.send, stats)
        full = self._all_parts(q, parts, shard, shards, k, x2d.device).wait()
        if plan.derive and not plan.per_phase:  # an exact transform of the gathered rowwise form (per-tensor FP8)
            full[COLUMNWISE] = q.derive_part(full[ROWWISE], COLUMNWISE, x2d.dtype)
        xq = QuantizedTensor(full[ROWWISE], full.get(COLUMNWISE), shape=(m, k), dtype=x2d.dtype)
        return _Quantized(q, columnwise, plan, xq, local, _WgradShare() if plan.per_phase else None)

    def _all_parts(self, q: Quantizer, parts: dict, shard: RowShard, shards: list[RowShard], k: int,
                   device, async_op: bool = False) -> _Pending:
        """All-gather this rank's quantized `parts` (one payload); the pending result is the whole input's parts
        {direction: part} in its row order."""
        payload, meta = build_payload(q, parts, shard, shards, (shard.rows, k), device)
        gathered = payload.new_empty(self.world_size * payload.numel())
        work = all_gather_single(gathered, payload, group=self.group, async_op=async_op)

        def finish() -> dict:
            full = assemble_parts(meta, gathered.view(self.world_size, -1))
            if self.leading > 1:
                full = {d: self._in_input_order(q, d, p) for d, p in full.items()}
            return full
        return _Pending(work if async_op else _DONE, finish, (payload,))

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
    def local_for_wgrad(self, reads: bool) -> QuantizedTensor | None:
        """With the per-phase plan and `reads` (wgrad reads the input's columnwise form), what the layer keeps for
        wgrad from forward to backward: this rank's own form (a QuantizedTensor of its rows' part), all-gathered in
        backward (`start_backward`), the layer counted as a reader of the shared backward gather; else None (wgrad
        reads the forward's whole form). Called once after `quantize`: from then on the gather holds no tensor (it
        lives on the autograd context until backward)."""
        entry, self._entry = self._entry, None
        if not reads or entry is None or entry.share is None:
            return None
        entry.share.readers += 1
        self.share = entry.share
        return entry.local

    def start_backward(self, saved: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issue the backward all-gather of what this layer saved for wgrad (asynchronously: called before dgrad)
        and return the function that waits for it and gives wgrad's input: the whole input's columnwise form
        (per phase: gathered from the ranks' own forms, one gather shared by the layers reading this input), the
        whole input's rows (a backward override, save_original_input: `saved` is the rank's rows), or `saved`
        itself (the forward's whole form)."""
        if self.share is not None:
            return self.share.take(lambda: self._gather_wgrad(saved)).wait
        if isinstance(saved, torch.Tensor) and not isinstance(saved, QuantizedTensor):
            return self._all_rows(saved, async_op=True).wait
        return lambda: saved

    def _gather_wgrad(self, saved: torch.Tensor) -> _Pending:
        q, m, d = self.quantizer, math.prod(self.full_shape[:-1]), self.plan.backward_send[0]
        shards = self.shards(saved.shape[0])
        parts = self._all_parts(q, {d: saved.part(d)}, shards[self.rank], shards, saved.shape[1], saved.device,
                                async_op=True)

        def finish() -> QuantizedTensor:
            full = parts.wait()[d]
            if d == ROWWISE:  # an exact transform of the rowwise form (per-tensor FP8)
                full = q.derive_part(full, COLUMNWISE, saved.dtype)
            return QuantizedTensor(None, full, shape=(m, saved.shape[1]), dtype=saved.dtype)
        return _Pending(parts, finish)

    def _all_rows(self, x2d: torch.Tensor, async_op: bool = False):
        """The whole input's `[M, K]` in high precision from this rank's rows (async_op: pending)."""
        local = x2d.reshape(self.local_shape).movedim(self.seq_dim, 0).contiguous()
        out = local.new_empty((self.world_size * local.shape[0],) + tuple(local.shape[1:]))
        work = all_gather_single(out, local, group=self.group, async_op=async_op)
        pending = _Pending(work if async_op else _DONE,
                           lambda: out.movedim(0, self.seq_dim).reshape(-1, x2d.shape[1]), (local,))
        return pending if async_op else pending.wait()

    def reduce_grad(self, dx2d: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the summed input gradient (every rank computed a partial sum over its output
        columns): a reduce-scatter along the sequence dim, in high precision."""
        full = dx2d.reshape(self.full_shape).movedim(self.seq_dim, 0).contiguous()
        out = full.new_empty((full.shape[0] // self.world_size,) + tuple(full.shape[1:]))
        reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.group)
        return out.movedim(0, self.seq_dim).contiguous()


class _Done:
    """The handle of a collective that already completed (a synchronous call)."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()
