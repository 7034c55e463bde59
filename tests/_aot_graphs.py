"""The graphs AOTAutograd makes of a compiled step, recorded (not a test module): a `torch.compile` backend that runs
AOTAutograd with Inductor's partitioner (min-cut rematerialization, whose CSE merges equal ops) and keeps each forward
and backward graph module, run as traced. Users: tests/_shared_input.py, tests/test_compiled_grouped_host.py,
tests/test_float8_graph.py."""

from __future__ import annotations

import torch


def recording_backend(forward: list, backward: list | None = None):
    """The backend: appends each forward graph module to `forward` and each backward one to `backward` (None: not
    kept), in the order AOTAutograd compiles them."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(into: list | None):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            if into is not None:
                into.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep(forward), bw_compiler=keep(backward),
                        partition_fn=min_cut_rematerialization_partition)
