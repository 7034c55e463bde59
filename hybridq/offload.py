"""Activation offload: the tensors a layer saves for backward go to CPU memory after its forward and come back,
one layer ahead, in backward (as Transformer Engine's CPU-offload context does).

hybridq layers save their quantized activations as the plain tensors of their parts (`tensor.save_quantized`), so
what travels is the quantized bytes (1 byte per element for FP8, ~0.56 for NVFP4, both directions of a hybrid),
not a high-precision copy.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.nn as nn

from .tensor import QuantizedTensor

__all__ = ["CPUOffload"]


class _Saved:
    """One offloaded tensor: its CPU copy (+ the event that says the copy is done) and, once reloaded, its device
    copy until autograd takes it."""

    __slots__ = ("group", "device", "cpu", "copied", "reloaded", "ready")

    def __init__(self, group: "_Group", device: torch.device, cpu: torch.Tensor, copied):
        self.group, self.device, self.cpu, self.copied = group, device, cpu, copied
        self.reloaded: torch.Tensor | None = None
        self.ready = None  # event recorded after the host-to-device copy (CUDA)


class _Group:
    """The tensors one `layer()` block saved; `prev` is the block before it in forward order, which backward
    reaches next (it is prefetched when this group is first unpacked)."""

    __slots__ = ("saved", "prev", "reloading", "__weakref__")

    def __init__(self, prev: "_Group | None"):
        self.saved: list[_Saved] = []
        self.prev = prev
        self.reloading = False


class CPUOffload:
    """Offloads the tensors saved for backward inside `layer()` blocks to CPU memory, layer by layer.

    ```python
    offload = hybridq.CPUOffload()
    for block in model.blocks:
        with offload.layer():
            x = block(x)
    loss(x).backward()
    ```

    On CUDA, each saved activation is copied to (pinned, with `pin_memory=True`) CPU memory on a side stream as
    soon as it is saved, and its device memory is released once the copy is done (the allocator waits for the
    copy stream); in backward, the first tensor unpacked from a block brings that block back (waiting only for
    what is not prefetched yet) and starts copying the previous block's tensors on the side stream, so the
    transfer of block i-1 overlaps the backward of block i. Quantized activations of hybridq layers travel as
    their quantized bytes. Gradients are bit for bit those of the run without offload.

    Not offloaded (kept as they are): parameters and views of parameters (FSDP2 frees and re-gathers its
    unsharded parameters itself; hybridq layers keep FSDP2's gathered weight as a handle), and tensors that are
    already in CPU memory: on a CPU-only machine the offload is a no-op move (everything already lives in CPU
    memory), and the blocks run synchronously. `copy_cpu_tensors=True` copies CPU tensors too (into fresh CPU
    tensors), which exercises the same bookkeeping on a machine without an accelerator.

    `stats()` reports the last forward's numbers (tensors and bytes offloaded, kept, blocks, prefetches).
    """

    def __init__(self, *, pin_memory: bool = True, copy_cpu_tensors: bool = False):
        self.pin_memory = pin_memory
        self.copy_cpu_tensors = copy_cpu_tensors
        self._last: weakref.ref | None = None  # the newest group (weak: a freed graph frees its groups)
        self._current: _Group | None = None
        self._streams: dict = {}
        self._stats = {"blocks": 0, "offloaded": 0, "offloaded_bytes": 0, "kept": 0, "reloaded": 0,
                       "prefetched": 0}

    # -- public ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        """Offload what the code inside the block saves for backward (one block = one layer: the unit of
        prefetch in backward)."""
        if self._current is not None:
            raise RuntimeError("hybridq.CPUOffload: layer() blocks do not nest (one block per layer)")
        last = self._last() if self._last is not None else None
        group = _Group(last)
        self._current = group
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._current = None
            if group.saved:
                self._last = weakref.ref(group)
                self._stats["blocks"] += 1

    def stats(self) -> dict:
        """Counters since construction or the last `reset_stats()`: blocks with offloaded tensors, tensors and
        bytes offloaded, tensors kept (parameters, CPU tensors), tensors brought back, blocks prefetched."""
        return dict(self._stats)

    def reset_stats(self) -> None:
        for k in self._stats:
            self._stats[k] = 0

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _keep(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        if t.device.type == "cpu" and not self.copy_cpu_tensors:
            return True
        return t.device.type == "meta" or t.is_sparse

    def _pack(self, t: torch.Tensor):
        if isinstance(t, QuantizedTensor):  # (hybridq layers save parts as plain tensors; other code may not)
            specs = [None if p is None else
                     (type(p), p.rows, p.cols, p.columnwise, p.meta(),
                      {n: None if x is None else self._pack(x) for n, x in p.tensors().items()})
                     for p in (t._rowwise, t._columnwise)]
            return ("q", specs, t.shape, t.dtype)
        if self._keep(t):
            self._stats["kept"] += 1
            return ("keep", t)
        group = self._current
        saved = self._offload(group, t)
        group.saved.append(saved)
        self._stats["offloaded"] += 1
        self._stats["offloaded_bytes"] += t.numel() * t.element_size()
        return ("saved", saved)

    def _unpack(self, packed):
        kind = packed[0]
        if kind == "keep":
            return packed[1]
        if kind == "q":
            _, specs, shape, dtype = packed
            parts = [None if s is None else
                     s[0](rows=s[1], cols=s[2], columnwise=s[3], **s[4],
                          **{n: None if v is None else self._unpack(v) for n, v in s[5].items()})
                     for s in specs]
            return QuantizedTensor(parts[0], parts[1], shape=shape, dtype=dtype)
        saved: _Saved = packed[1]
        group = saved.group
        if not group.reloading:
            self._reload(group)
        if group.prev is not None and not group.prev.reloading:  # the next block backward reaches
            self._reload(group.prev)
            self._stats["prefetched"] += 1
        t = saved.reloaded
        if t is None:  # unpacked once already (retain_graph): bring it back again
            self._reload_one(saved)
            t = saved.reloaded
        saved.reloaded = None  # autograd holds it from here; the CPU copy stays for a second backward
        if saved.ready is not None:
            stream = torch.cuda.current_stream(t.device)
            stream.wait_event(saved.ready)
            t.record_stream(stream)
        return t

    # -- copies --------------------------------------------------------------------------------------------------
    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _offload(self, group: _Group, t: torch.Tensor) -> _Saved:
        stream = self._stream(t.device)
        if stream is None:  # CPU (copy_cpu_tensors) or a device without streams here: synchronous copy
            return _Saved(group, t.device, t.detach().clone(memory_format=torch.contiguous_format), None)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed on the compute stream
        with torch.cuda.stream(stream):
            cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
            cpu.copy_(t.detach(), non_blocking=self.pin_memory)
            copied = torch.cuda.Event()
            copied.record(stream)
        t.record_stream(stream)  # its memory is reused only after the copy
        return _Saved(group, t.device, cpu, copied)

    def _reload(self, group: _Group) -> None:
        group.reloading = True
        todo = [s for s in group.saved if s.reloaded is None]
        for device in {s.device for s in todo}:
            self._copy_back(device, [s for s in todo if s.device == device])
        self._stats["reloaded"] += len(todo)

    def _reload_one(self, saved: _Saved) -> None:
        self._copy_back(saved.device, [saved])

    def _copy_back(self, device: torch.device, saved: list[_Saved]) -> None:
        stream = self._stream(device)
        if stream is None:
            for s in saved:
                s.reloaded = s.cpu.clone()
            return
        # the new device buffers may reuse memory the compute stream used until now
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for s in saved:
                s.reloaded = s.cpu.to(device, non_blocking=self.pin_memory)
            ready = torch.cuda.Event()
            ready.record(stream)
        for s in saved:
            s.ready = ready
