"""max|y| from the norm or SwiGLU kernel to the next Linears' cast inside a torch.compile graph: an Inductor post-grad
pass ([Note: known max|y| in the graph])."""

from __future__ import annotations

import hashlib
import operator
import pathlib

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..switches import Switch

__all__ = ["ENABLED", "KnownAmaxPass", "install"]

# [Note: known max|y| in the graph]
# Eager, hq.RMSNorm / hq.LayerNorm / hq.SwiGLU record the max|y| their kernels compute in passing (known_amax.py)
# and the per-tensor FP8 cast of the Linears reading y skips its own max|y| pass. Under torch.compile the kernels
# are custom ops whose max|y| output (`hybridq::compiled_norm_forward`'s 4th, `compiled_swiglu_forward`'s 2nd) was
# dropped, and the Linears' shared input cast (`hybridq::linear_input_quantize`, float8_graph.py's [Note: one dense
# input quantization in the graph]) read y once more for it: one extra pass over each norm / SwiGLU output per step.
# No Python object can carry the value from one module's traced code to another's (dynamo traces no side table), so
# the graph does: an Inductor post-grad pass (`KnownAmaxPass`, installed in `torch._inductor.config.
# post_grad_custom_post_pass` when hybridq is imported, chained after a pass already set there) finds each
# `linear_input_quantize` whose input is such an op's y -- directly or through views, which hold the same elements --
# and hands it the op's max|y| (its `amax` argument). The value is what the cast's own pass computes (the kernels'
# contract, docs/numerics.md: NaN where y holds one), so the bytes are the same; the graph loses one reduction per
# norm / SwiGLU output. Where another backend runs the graph (aot_eager, no Inductor) nothing changes. Switch:
# `HYBRIDQ_COMPILED_KNOWN_AMAX=0` (read when the pass runs: graphs compiled after a change see it).

ENABLED = Switch("HYBRIDQ_COMPILED_KNOWN_AMAX")

_aten = torch.ops.aten
# ops whose output holds the same elements as their input (a view of all of them)
_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.alias.default})
_SOURCE_HASH = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()


def _producers() -> dict:
    """op -> (index of y, index of max|y|) among its outputs."""
    ops = torch.ops.hybridq
    return {ops.compiled_norm_forward.default: (0, 3), ops.compiled_swiglu_forward.default: (0, 1)}


def _amax_of(node: torch.fx.Node, producers: dict) -> torch.fx.Node | None:
    """The node of max|y| where `node` is a producer's y (or a view of all of it), else None."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source, index = node.args
    if not isinstance(source, torch.fx.Node) or source.op != "call_function" or source.target not in producers:
        return None
    y_at, amax_at = producers[source.target]
    if index != y_at:
        return None
    for user in source.users:  # (its getitem when the graph reads it; else a new one after the op)
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == amax_at:
            return user
    with source.graph.inserting_after(source):
        got = source.graph.call_function(operator.getitem, (source, amax_at))
    got.meta = {k: v[amax_at] for k, v in source.meta.items() if k == "val" and isinstance(v, (list, tuple))}
    return got


class KnownAmaxPass(CustomGraphPass):
    """The post-grad pass of [Note: known max|y| in the graph]; `handed` counts the casts it handed a max|y|."""

    handed = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not ENABLED.on:
            return
        cast = torch.ops.hybridq.linear_input_quantize.default
        producers = _producers()
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not cast or node.kwargs.get("amax") is not None \
                    or len(node.args) > 5:
                continue
            amax = _amax_of(node.args[0], producers)
            if amax is not None:
                node.kwargs = {**node.kwargs, "amax": amax}
                KnownAmaxPass.handed += 1

    def uuid(self) -> str:
        return f"hybridq-known-amax-{_SOURCE_HASH}-{int(ENABLED.on)}"


class _Chained(CustomGraphPass):
    """A pass set before hybridq's, then hybridq's."""

    def __init__(self, first, ours: KnownAmaxPass):
        self.first, self.ours = first, ours

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.ours(graph)

    def uuid(self):
        # (None: the FX graph cache is bypassed, as for the earlier pass alone when it gives none)
        first = self.first.uuid() if isinstance(self.first, CustomGraphPass) else None
        return None if first is None else (first, self.ours.uuid())


def install() -> None:
    """Put KnownAmaxPass into Inductor's post-grad custom pass (after one already there); idempotent."""
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, KnownAmaxPass) or (isinstance(current, _Chained) and isinstance(current.ours, KnownAmaxPass)):
        return
    ours = KnownAmaxPass()
    inductor_config.post_grad_custom_post_pass = ours if current is None else _Chained(current, ours)
