"""What FSDP2 sends through its parameter all-gathers: bytes per rank, counted at the collective call.

FSDP2 calls `torch.distributed.all_gather_into_tensor` (torch 2.11) or `all_gather_single` (torch 2.13) once per
unshard of a parameter group, with the rank's packed shard as input; the counter wraps both for as long as it is
entered. What a quantized recipe saves on the wire shows here (FP8 sends ~half of bf16's bytes); the statistics
all-reduces of `hybridq.precompute_scales` are all-reduces and are not counted. The all-gather *time* is the
NCCL kernels' GPU time: benchmarks/profile_step.py under torchrun splits its collectives row by kind.
"""

from __future__ import annotations

import torch.distributed as dist


class GatherCounter:
    """Counts the bytes this rank sends through FSDP2's tensor all-gathers (nested calls counted once)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._orig = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        self._depth = 0

    def __enter__(self) -> "GatherCounter":
        for name, fn in self._orig.items():
            def counted(output_tensor, input_tensor, *args, _fn=fn, **kwargs):
                if self._depth == 0:
                    self.bytes += input_tensor.numel() * input_tensor.element_size()
                    self.calls += 1
                self._depth += 1
                try:
                    return _fn(output_tensor, input_tensor, *args, **kwargs)
                finally:
                    self._depth -= 1

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)
