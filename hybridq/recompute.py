"""Activation recompute (`torch.utils.checkpoint`) with hybridq layers.

What replays by itself:
- stochastic rounding draws from torch's default generators unless a quantizer has its own `generator=`; torch's
  checkpoint restores the default CPU and CUDA generators before recomputing (`preserve_rng_state=True`, its
  default), so the recomputed forward draws the same numbers;
- delayed scaling: a cast in backward by a quantizer that casts in forward replays its last forward cast (same
  scale, no amax recorded: see `Float8Quantizer.replaying`).

What needs `checkpoint_contexts`: quantizers with their own generator (torch does not know them). It is a
`context_fn` for non-reentrant checkpointing that saves those generators' states at forward and restores them
for the recompute, optionally combined with torch's selective activation checkpointing policy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn

from .formats import NVFP4Quantizer

__all__ = ["checkpoint_contexts", "quantizer_generators"]


def _module_quantizers(module: nn.Module) -> list:
    out = []
    for m in module.modules():
        qs = getattr(m, "quantizers", None)
        if callable(qs) and hasattr(m, "recipe"):  # hybridq Linear
            out.extend(qs().values())
        for per_expert in getattr(m, "expert_quantizers", ()) or ():  # hybridq GroupedLinear
            out.extend(per_expert.values())
    return out


def quantizer_generators(module: nn.Module) -> list[torch.Generator]:
    """The distinct `torch.Generator`s the stochastic-rounding quantizers of `module`'s hybridq layers draw from
    (those given `generator=`; the default generators are not listed)."""
    gens: dict[int, torch.Generator] = {}
    for q in _module_quantizers(module):
        for p in q.quantizers():
            if isinstance(p, NVFP4Quantizer) and p.stochastic_rounding and p.generator is not None:
                gens[id(p.generator)] = p.generator
    return list(gens.values())


class _SaveGenerators:
    """Forward side: remembers the generators' states at the start of the checkpointed forward."""

    def __init__(self, gens: list[torch.Generator], cell: dict):
        self.gens, self.cell = gens, cell

    def __enter__(self):
        self.cell["states"] = [g.get_state() for g in self.gens]
        return self

    def __exit__(self, *exc):
        return None


class _ReplayGenerators:
    """Recompute side: the forward's states during the recompute, the states of now afterwards."""

    def __init__(self, gens: list[torch.Generator], cell: dict):
        self.gens, self.cell = gens, cell
        self.now: list = []

    def __enter__(self):
        self.now = [g.get_state() for g in self.gens]
        for g, s in zip(self.gens, self.cell["states"]):
            g.set_state(s)
        return self

    def __exit__(self, *exc):
        for g, s in zip(self.gens, self.now):
            g.set_state(s)
        return None


def checkpoint_contexts(module: nn.Module, policy: Callable[..., Any] | None = None
                        ) -> tuple[ContextManager, ContextManager]:
    """A `context_fn` result for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the recomputed
    forward of `module` replays the random stream of every stochastic-rounding quantizer that has its own
    `generator=` (torch restores only its default generators). With `policy` (an op-level policy function or a
    list of ops to save, as `torch.utils.checkpoint.create_selective_checkpoint_contexts` takes), selective
    activation checkpointing applies too.

        checkpoint(block, x, use_reentrant=False, context_fn=lambda: hybridq.checkpoint_contexts(block, policy))
    """
    gens = quantizer_generators(module)
    cell: dict = {}
    fwd: list[ContextManager] = [_SaveGenerators(gens, cell)] if gens else []
    rec: list[ContextManager] = [_ReplayGenerators(gens, cell)] if gens else []
    if policy is not None:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        f, r = create_selective_checkpoint_contexts(policy)
        fwd.append(f)
        rec.append(r)
    return _stack(fwd), _stack(rec)


@contextlib.contextmanager
def _stack(cms: list[ContextManager]):
    with contextlib.ExitStack() as stack:
        for cm in cms:
            stack.enter_context(cm)
        yield
