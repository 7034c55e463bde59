"""Per-tensor FP8 (E4M3 / E5M2) with current or delayed scaling (docs/numerics.md "Per-tensor FP8 (current, delayed)").

One fp32 scale for the whole tensor; the columnwise part is the exact byte transpose of the rowwise one,
so it is derived from it rather than cast twice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import torch
import torch.distributed as dist

from .. import dispatch
from ._numerics import FLT_MAX, FP8_MAX, FP8_NAMES, fp8_dtype, rcp, satfinite_fp8, scale_from_amax
from ._reduce import amax_all_reduce_
from ..enums import AmaxComputeAlgo, Scaling
from ..tensor import backward_epoch
from ..torch_private import in_backward
from .base import QuantizedPart, Quantizer, ScaleLayout, transposed_copies_into, transposed_copy, transposed_copy_into
from .shardable import GatherablePart, ShardableQuantizer


class ScaledFP8Values:
    """What FP8 parts of fp8 `data` and an fp32 `scale_inv` that broadcasts over it share (per tensor `[1]`, per row
    `[rows, 1]`): dequantize = fp32(data) * scale_inv."""

    scale_dtype = torch.float32

    @property
    def scales(self) -> torch.Tensor:
        return self.scale_inv

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        return self.data.float() * self.scale_inv

    def element_values(self) -> torch.Tensor:
        return self.data.view(torch.uint8)

    def element_scales(self) -> torch.Tensor:
        return self.scale_inv.expand(self.rows, self.cols)


class Float8TensorPart(ScaledFP8Values, GatherablePart, QuantizedPart):
    """data: fp8 `[rows, cols]`; scale_inv: fp32 `[1]` (dequantize = fp32(data) * scale_inv)."""

    format_name = "FP8"
    tensor_fields = ("data", "scale_inv")
    scale_layout = ScaleLayout.TENSOR

    def transposed(self) -> "Float8TensorPart":
        return Float8TensorPart(rows=self.cols, cols=self.rows, columnwise=not self.columnwise,
                                data=transposed_copy(self.data), scale_inv=self.scale_inv)

    # FSDP buffer protocol: only the data travels; the scale is global (one all-reduced amax), so every shard
    # holds the same scale_inv.
    def extract_buffers(self, shard=None, *, tile_rows=None):
        data = transposed_copy(self.data) if self.columnwise else self.data
        return [("data", data, 1)], {"scale_inv": self.scale_inv}

    @classmethod
    def assign_gathered(cls, buffers, replicated, *, rows, cols, columnwise, meta, tile_rows=None):
        data = buffers["data"]
        return cls(rows=rows, cols=cols, columnwise=columnwise,
                   data=transposed_copy(data) if columnwise else data, scale_inv=replicated["scale_inv"])


def aligned_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """`[G, 4]` whose column 0 is `scale_inv [G]`: row g's `[:1]` is group g's scale as a tensor of its own that
    starts 16-byte aligned (cuBLASLt refuses FP8 GEMMs whose scale pointers are not; a `scale_inv[g:g + 1]` view
    is only 4-byte aligned)."""
    out = scale_inv.new_zeros(scale_inv.numel(), 4)
    out[:, 0] = scale_inv.reshape(-1)
    return out


@dataclasses.dataclass
class Float8RowGroups:
    """Per-tensor FP8 of consecutive row groups, each quantized as its own tensor (the experts of a grouped linear):
    group g is rows `[offsets[g], offsets[g] + sizes[g])` of `data` (fp8 `[rows, cols]`, rowwise) with the scale
    `scale_inv[g]` (fp32 `[groups]`) from that group's own max|x|."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    sizes: tuple[int, ...]
    _aligned: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for n in self.sizes:
            out.append(o)
            o += n
        return out

    def part(self, g: int) -> Float8TensorPart:
        """Group g's rowwise part (views of `data` and `scale_inv`)."""
        o, n = self.offsets[g], self.sizes[g]
        return Float8TensorPart(rows=n, cols=self.data.shape[1], columnwise=False, data=self.data[o:o + n],
                                scale_inv=self.aligned_scale_inv(g))

    def aligned_scale_inv(self, g: int) -> torch.Tensor:
        """Group g's scale_inv as a `[1]` view that starts 16-byte aligned (see `aligned_scales`)."""
        if self._aligned is None:
            self._aligned = aligned_scales(self.scale_inv)
        return self._aligned[g, :1]

    def columnwise_part(self, g: int, transposed: torch.Tensor, whole: bool = False) -> Float8TensorPart:
        """Group g's columnwise part (per-tensor FP8: the byte transpose of the rowwise one) from `transposed`: the
        transpose of all of `data` (whole=False) or of group g's rows only (whole=True)."""
        o, n = self.offsets[g], self.sizes[g]
        data = transposed if whole else transposed[:, o:o + n].contiguous()
        return Float8TensorPart(rows=self.data.shape[1], cols=n, columnwise=True, data=data,
                                scale_inv=self.aligned_scale_inv(g))


def float8_current_scaling(x2d: torch.Tensor, dtype: torch.dtype, amax_epsilon: float = 0.0,
                           power_2_scale: bool = False, amax: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 with current scaling on plain tensors, the reference (docs/numerics.md "Per-tensor FP8"):
    (fp8 data `[M, K]`, scale_inv `[1]`). `amax` overrides the tensor's own max|x| (e.g. a global amax)."""
    if amax is None:
        amax = x2d.float().abs().amax() if x2d.numel() else torch.zeros((), device=x2d.device)
    scale = scale_from_amax(amax.to(x2d.device).reshape(1), FP8_MAX[dtype], amax_epsilon, power_2_scale)
    return satfinite_fp8(x2d.float() * scale, dtype), rcp(scale)


@dataclasses.dataclass
class Float8Quantizer(ShardableQuantizer, Quantizer):
    """Per-tensor FP8. `Float8Quantizer()` is E4M3 with current scaling.

    scaling="delayed" keeps an amax history and a scale per quantizer: each cast uses the current scale and
    records its amax; the history/scale update runs before the next cast (or on `update()`), with an
    optional MAX all-reduce over `amax_reduction_group`.
    """

    fp8: str | torch.dtype = "e4m3"
    scaling: Scaling | str = Scaling.CURRENT
    amax_epsilon: float = 0.0
    power_2_scale: bool = False
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo | str = AmaxComputeAlgo.MAX
    margin: int = 0
    amax_reduction_group: object = dataclasses.field(default=None, repr=False, compare=False)

    format_name: ClassVar[str] = "FP8"

    def __post_init__(self):
        self.dtype = fp8_dtype(self.fp8)
        self.scaling = Scaling.parse(self.scaling, "Float8Quantizer scaling")
        self.amax_compute_algo = AmaxComputeAlgo.parse(self.amax_compute_algo, "Float8Quantizer amax_compute_algo")
        if self.amax_history_len < 1:
            raise ValueError(f"Float8Quantizer amax_history_len must be >= 1, got {self.amax_history_len}")
        # delayed-scaling state (unused with current scaling)
        self.scale = torch.ones(1)
        self.amax_history = torch.zeros(self.amax_history_len)
        self._update_pending = False
        self._casts_in_forward = False  # this quantizer casts in forward (input, weight), not only in backward
        self._forward_scale = self.scale  # the scale of the last forward cast (what a replay uses)
        self._epoch = self._step_casts = self._step_grad_casts = 0  # forward casts of the current step

    def describe(self) -> str:
        return f"FP8 {FP8_NAMES[self.dtype]} ({self.scaling} scaling)"

    @property
    def round_trip_bound(self) -> float:
        return 0.030 if self.dtype == torch.float8_e4m3fn else 0.060

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        return (rowwise + columnwise) * (m * k + 4)

    @property
    def columnwise_is_transpose(self) -> bool:
        return True

    @property
    def is_stateful(self) -> bool:
        return self.scaling == Scaling.DELAYED

    # -- delayed-scaling state (docs/numerics.md "Per-tensor FP8", delayed) -------------------------
    # A cast reads `scale` and records its amax into `amax_history[0]`; the history/scale update then waits until
    # the next cast (or an explicit `update()`), so that a batched update of many quantizers can run in between.
    @property
    def update_pending(self) -> bool:
        """True when an amax was recorded since the last update (the next cast updates first)."""
        return self._update_pending

    # A cast that runs inside a backward pass by a quantizer that casts in forward is a replay of its last forward
    # cast: activation recompute (torch.utils.checkpoint), or save_original_input's backward cast of the same
    # input. It uses the scale that forward cast used and changes no state (no pending update applied, no amax
    # recorded), so the recomputed tensor is bitwise the original and the amax history is that of the run without
    # recompute. A quantizer that cast more than once in the forward being replayed (a layer called twice) cannot
    # tell which cast is replayed: that raises.
    def replaying(self) -> bool:
        """True when a cast now would be a replay of the last forward cast (see above)."""
        return self._casts_in_forward and in_backward()

    def check_replay(self, name: str = "tensor") -> None:
        """Raise RuntimeError (changing nothing) when a cast now would be a replay that is ambiguous."""
        if self.replaying() and self._step_casts > 1:
            raise RuntimeError(
                f"{self.describe()}: recomputing the forward cast of {name} in backward (activation checkpointing, "
                f"save_original_input) needs the scale that cast used, but the quantizer cast {self._step_casts} "
                f"tensors in that forward (a layer called more than once per step), each with its own scale, so "
                f"which one is replayed is ambiguous; do not recompute such a layer, or use current scaling")

    def _note_forward_cast(self) -> None:
        # the casts of one step's forward: a backward pass (backward_epoch) or the first grad-enabled cast after
        # no-grad ones (an evaluation forward) starts a new count
        epoch, grad = backward_epoch(), torch.is_grad_enabled()
        if epoch != self._epoch or (grad and not self._step_grad_casts):
            self._epoch, self._step_casts, self._step_grad_casts = epoch, 0, 0
        self._step_casts += 1
        self._step_grad_casts += grad
        self._casts_in_forward = True
        # the live scale itself, not a copy (a launch per cast): an in-place update (the CUDA one) comes either at
        # this quantizer's next non-replayed cast, after which no replay of this cast can come, or from a batched
        # `update_delayed_scaling`, which copies it first (`detach_forward_scale`)
        self._forward_scale = self.scale

    def begin_delayed_cast(self, device: torch.device,
                           run_update: Callable[[], None] | None = None) -> torch.Tensor:
        """Move the state to `device`, apply the pending update (by `run_update`, e.g. a batched kernel, else
        `update()`), and return the scale this cast uses (the live state tensor: clone it to keep it). A replayed
        cast (see `replaying`) applies no update: it returns the scale of the forward cast it replays."""
        if self.scale.device != device:
            self.scale = self.scale.to(device)
            self.amax_history = self.amax_history.to(device)
        if self.replaying():
            self.check_replay()
            return self._forward_scale.to(device)
        if self._update_pending:
            (run_update or self.update)()
        if not in_backward():
            self._note_forward_cast()
        return self.scale

    def record_amax(self, amax: torch.Tensor) -> None:
        """Record a cast's amax (`[1]` fp32) into the current history slot; the next cast updates first. A replayed
        cast records nothing."""
        if self.replaying():
            return
        slot = self.amax_history[:1]
        torch.maximum(slot, amax.to(slot.device).reshape(1), out=slot)  # (one launch, in place)
        self.mark_amax_recorded()

    def mark_amax_recorded(self) -> None:
        """A cast's amax was max-combined into `amax_history[0]` in place (by `record_amax` or by the cast's kernel
        itself); the next cast updates first."""
        self._update_pending = True

    def mark_updated(self) -> None:
        """The state was updated in place by a batched update (see hybridq.update_delayed_scaling)."""
        self._update_pending = False

    def detach_forward_scale(self) -> None:
        """Before an in-place update of `scale` that a replay of the last forward cast may still follow: keep that
        cast's scale in a copy."""
        if self._forward_scale is self.scale:
            self._forward_scale = self.scale.clone()

    def quantize(self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None,
                 name: str = "tensor", global_stats: torch.Tensor | None = None):
        if self.scaling == Scaling.DELAYED:
            self.check_replay(name)  # (before anything is cast: the error names the tensor)
        return super().quantize(x, rowwise=rowwise, columnwise=columnwise, name=name, global_stats=global_stats)

    def stats_from_amax(self, amax, rowwise, columnwise):
        """Current scaling: the amax itself (one value for both directions); delayed scaling has no statistics."""
        return amax.reshape(1).float() if self.scaling == Scaling.CURRENT else None

    # -- delayed scaling ---------------------------------------------------------------------------
    def update(self) -> None:
        """Delayed scaling: reduce the recorded amax, roll the history and compute the next scale."""
        if self.scaling != Scaling.DELAYED:
            return
        if self.amax_reduction_group is not None and dist.is_initialized():
            amax_all_reduce_(self.amax_history[:1], self.amax_reduction_group)
        h = self.amax_history
        amax = h.max().reshape(1) if self.amax_compute_algo == AmaxComputeAlgo.MAX else h[:1].clone()
        self.amax_history = torch.roll(h, -1)
        self.amax_history[0] = 0
        scale = (torch.full_like(amax, FP8_MAX[self.dtype]) / amax) / (2.0 ** self.margin)
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
        keep = (amax <= 0) | ~torch.isfinite(amax)
        self.scale = torch.where(keep, self.scale, scale)
        self._update_pending = False

    def _delayed_scale(self, x2d: torch.Tensor) -> torch.Tensor:
        scale = self.begin_delayed_cast(x2d.device).clone()
        amax = x2d.float().abs().amax().reshape(1) if x2d.numel() else torch.zeros(1, device=x2d.device)
        self.record_amax(amax)
        return scale

    # -- quantization ----------------------------------------------------------------------------
    def reference_parts(self, x2d, rowwise, columnwise, amax: torch.Tensor | None = None, *, shard=None,
                        stats=None, global_stats=None):
        """`amax` overrides the local max|x| (e.g. a global amax of a sharded tensor). `shard` / `stats`:
        `x2d` is a row shard and `stats` the MAX-reduced `shard_stats` (the global amax); `global_stats`: `x2d`
        is any piece and this the MAX-reduced `global_stats`. Rows are independent otherwise, so nothing else
        changes."""
        for given in (stats, global_stats):
            if given is not None and amax is None and self.scaling != Scaling.DELAYED:
                amax = given.reshape(-1)[0]
        if self.scaling == Scaling.DELAYED:
            scale = self._delayed_scale(x2d)
            data, scale_inv = satfinite_fp8(x2d.float() * scale, self.dtype), rcp(scale)
        else:
            data, scale_inv = float8_current_scaling(x2d, self.dtype, self.amax_epsilon, self.power_2_scale, amax)
        m, k = x2d.shape
        row = Float8TensorPart(rows=m, cols=k, columnwise=False, data=data, scale_inv=scale_inv)
        col = row.transposed() if columnwise else None
        return (row if rowwise else None), col

    def quantize_row_groups(self, x2d: torch.Tensor, sizes: list[int] | tuple[int, ...],
                            name: str = "tensor") -> Float8RowGroups:
        """Quantize consecutive row groups of `x2d` (group g: the next `sizes[g]` rows), each exactly as `quantize`
        would quantize it alone (its own amax and scale): one amax pass and one cast for all groups on a device
        with the kernel, a loop over the groups with the reference otherwise. Current scaling only (a delayed
        scale is one state for the whole tensor)."""
        if self.scaling != Scaling.CURRENT:
            raise ValueError(f"{self.describe()}: row groups of {name} need current scaling, got {self.scaling}")
        if x2d.dim() != 2 or sum(sizes) != x2d.shape[0] or any(n < 0 for n in sizes):
            raise ValueError(f"{self.describe()}: row groups {list(sizes)} of {name} must be >= 0 and sum to its "
                             f"{x2d.shape[0] if x2d.dim() == 2 else tuple(x2d.shape)} rows")
        self.validate(x2d.shape, name, rowwise=True, columnwise=False)
        sizes = tuple(int(n) for n in sizes)
        run = dispatch.row_groups_kernel(type(self), x2d.device.type)
        out = run(self, x2d, sizes) if run is not None else None
        if out is not None:
            data, scale_inv = out
        else:
            parts, o = [], 0
            for n in sizes:
                parts.append(self.reference_parts(x2d[o:o + n], True, False)[0])
                o += n
            data = torch.cat([p.data for p in parts]) if parts else x2d.new_empty(0, x2d.shape[1], dtype=self.dtype)
            scale_inv = torch.cat([p.scale_inv.reshape(1) for p in parts])
        return Float8RowGroups(data=data, scale_inv=scale_inv, sizes=sizes)

    # -- sharded quantization (FSDP) -------------------------------------------------------------
    def shard_stats(self, x2d, shard):
        """The global amax (one value for both directions)."""
        if self.scaling == Scaling.DELAYED:
            raise ValueError(f"{self.describe()}: delayed scaling keeps its own scale state; sharded "
                             f"quantization (FSDP) supports current scaling only")
        return (x2d.float().abs().amax().reshape(1) if x2d.numel()
                else torch.zeros(1, dtype=torch.float32, device=x2d.device))

    def global_stats(self, x2d, rowwise, columnwise):
        """Current scaling: the amax (one value for both directions). Delayed scaling: none (the scale is state;
        its amax history is reduced over `amax_reduction_group`)."""
        if self.scaling == Scaling.DELAYED:
            return None
        return (x2d.float().abs().amax().reshape(1) if x2d.numel()
                else torch.zeros(1, dtype=torch.float32, device=x2d.device))

    def with_global_stats(self, stats, shard, k, global_stats):
        return stats if global_stats is None else global_stats.reshape(1).clone()

    def derive_part(self, part, direction, dtype=None):
        """One scale for the whole tensor: either direction is the exact byte transpose of the other."""
        if self.scaling != Scaling.CURRENT or part.direction == direction:
            return None
        return part.transposed()

    def derive_part_into(self, part, into, dtype=None):
        """`derive_part` into `into`'s own buffers: the byte transpose written into its data, the scale copied."""
        if self.scaling != Scaling.CURRENT or part.direction == into.direction:
            return False
        if tuple(into.scale_inv.shape) != tuple(part.scale_inv.shape):
            raise ValueError(f"{self.describe()}: the {into.direction} part's scale_inv {tuple(into.scale_inv.shape)} "
                             f"cannot take the {part.direction} part's {tuple(part.scale_inv.shape)}")
        transposed_copy_into(part.data, into.data)
        if into.scale_inv is not part.scale_inv:
            into.scale_inv.copy_(part.scale_inv)
        return True

    def derive_parts_into(self, items, dtype=None) -> bool:
        """`derive_part_into(part, into)` for every `(q, part, into)` of `items` (each `q` a current-scaling
        quantizer of this type: several weights' parts, [Note: unit fill]), every item checked before any is written:
        the byte transposes in one call of the device's list transpose, the scales in one `_foreach_copy_`. False,
        nothing written, where an item is not so derived (its own `derive_part_into` then says so)."""
        scales_to, scales_from = [], []
        for q, part, into in items:
            if type(q) is not type(self) or q.scaling != Scaling.CURRENT or part.direction == into.direction \
                    or tuple(into.scale_inv.shape) != tuple(part.scale_inv.shape):
                return False
            if into.scale_inv is not part.scale_inv:
                scales_to.append(into.scale_inv)
                scales_from.append(part.scale_inv)
        transposed_copies_into([(part.data, into.data) for _, part, into in items])
        if scales_to:
            torch._foreach_copy_(scales_to, scales_from)
        return True


Float8TensorPart.quantizer_type = Float8Quantizer
