"""torch.distributed's single-tensor collectives under names that no supported torch deprecates.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` (a FutureWarning at every call) in
favour of `all_gather_single` / `reduce_scatter_single`, which torch 2.11 does not have yet; both pairs take the
same arguments and run the same c10d ops.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
