"""What the training step sends through its collectives, per rank, counted at the collective calls, by wire:

  allgather       FSDP2's parameter all-gathers (forward and backward unshards) over the data-parallel group;
  reduce_scatter  FSDP2's gradient reduce-scatters over the data-parallel group: its own in `reduce_dtype` (fp32),
                  or hybridq's low-precision wire (`--grad-reduce bf16|mxfp8`: one all-to-all per param group);
  tp              the tensor-parallel group's all-gathers and reduce-scatters in both directions (the sequence-
                  parallel input gathers of the column-parallel layers and their gradients' reduce-scatters, the
                  row-parallel outputs' reduce-scatters and their gradients' gathers).

Bytes are each call's payload per rank: an all-gather's input (the rank's shard), a reduce-scatter's or an
all-to-all's input divided by the group size (the rank's chunk of each destination): on a ring each rank then
sends W-1 times these bytes for every kind, so the columns compare directly (bf16's all-gather of a weight = half
of fp32's reduce-scatter of its gradient). The `hybridq.precompute_scales` statistics and other all-reduces are not
counted.

The calls are counted where they are made: `torch.distributed`'s single-tensor collectives (FSDP2 calls
`all_gather_into_tensor` / `reduce_scatter_tensor` on torch 2.11, `all_gather_single` / `reduce_scatter_single`
on 2.13; hybridq's gradient wire `all_to_all_single`), torch's functional collectives (DTensor redistributions:
torch's tensor-parallel styles), and the names hybridq's sequence parallelism bound at import
(`hybridq.distributed.sequence`). The all-gather and reduce-scatter *time* is the NCCL kernels' GPU time:
benchmarks/profile_step.py under torchrun splits its collectives row by kind.
"""

from __future__ import annotations

import importlib
import inspect

import torch.distributed as dist

KINDS = ("allgather", "reduce_scatter", "tp")
# (module, function, collective): the input tensor is the parameter named input_tensor / input / self, the group `group`
_SITES = [("torch.distributed", n, c) for n, c in (
    ("all_gather_single", "gather"), ("all_gather_into_tensor", "gather"), ("reduce_scatter_single", "scatter"),
    ("reduce_scatter_tensor", "scatter"), ("all_to_all_single", "scatter"))] + [
    ("torch.distributed._functional_collectives", n, c) for n, c in (
        ("all_gather_tensor", "gather"), ("all_gather_single", "gather"), ("reduce_scatter_tensor", "scatter"),
        ("reduce_scatter_single", "scatter"))] + [
    ("hybridq.distributed.sequence", "all_gather_single", "gather"),
    ("hybridq.distributed.sequence", "reduce_scatter_single", "scatter")]


def _process_group(group) -> dist.ProcessGroup:
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed import _functional_collectives as funcol  # a mesh, (mesh, dim) or a group name
    return dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))


class CommCounter:
    """Counts the bytes this rank hands to the step's all-gathers and reduce-scatters, by kind (`KINDS`: `bytes`
    and `calls`, running totals), while entered; a collective calling another is counted once. `tp_group`: the
    tensor-parallel process group (None without tensor parallelism: nothing is counted as tp)."""

    def __init__(self, tp_group: dist.ProcessGroup | None = None):
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = dict.fromkeys(KINDS, 0)
        self._tp = tp_group
        self._saved: list[tuple[object, str, object]] = []
        self._depth = 0

    def _count(self, collective: str, tensor, group) -> None:
        pg = _process_group(group)
        n = tensor.numel() * tensor.element_size()
        kind = ("tp" if self._tp is not None and pg.group_name == self._tp.group_name else
                "allgather" if collective == "gather" else "reduce_scatter")
        self.bytes[kind] += n if collective == "gather" else n // pg.size()
        self.calls[kind] += 1

    def _wrap(self, fn, collective: str):
        sig = inspect.signature(fn)
        name = next(n for n in ("input_tensor", "input", "self") if n in sig.parameters)

        def counted(*args, **kwargs):
            if self._depth == 0:
                bound = sig.bind(*args, **kwargs).arguments
                self._count(collective, bound[name], bound.get("group"))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def __enter__(self) -> "CommCounter":
        for mod_name, name, collective in _SITES:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            fn = getattr(mod, name, None)
            if fn is not None:
                self._saved.append((mod, name, fn))
                setattr(mod, name, self._wrap(fn, collective))
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()
