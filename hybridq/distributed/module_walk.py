"""`modules_in_order`: a model's modules as `model.modules()` gives them, walked without its generators (the walk
`precompute_scales` and `precompute_payloads` make after every optimizer step)."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["modules_in_order"]


def modules_in_order(model: nn.Module) -> list[nn.Module]:
    """`model.modules()` as a list, in its order (pre-order, each module once), walked with a stack: the recursive
    generators of `named_modules` resume once per level for every module they yield."""
    out, seen, stack = [], set(), [model]
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append(mod)
        children = [m for m in mod._modules.values() if m is not None]
        children.reverse()
        stack += children
    return out
