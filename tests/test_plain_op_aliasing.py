"""hybridq's plain ops (hybridq/nn/plain_ops.py) keep `torch.library.custom_op`'s rule that an op's outputs alias
neither its inputs nor one another, checked on the arguments that can hold a tensor (the schema's Tensor, Tensor?,
Tensor[] arguments): an output that is, or views, a tensor argument -- wherever it sits among the other arguments,
positional, inside a list, optional, given by keyword or keyword-only -- or another output is refused, naming the op;
fresh outputs pass."""

from __future__ import annotations

import pytest
import torch

from hybridq.nn.plain_ops import plain_op


@plain_op("hybridq::_test_aliasing_mixed_args")
def _mixed(key: str, a: torch.Tensor, shape: list[int], dtype: torch.dtype, flag: bool,
           items: list[torch.Tensor], b: torch.Tensor | None = None, *, c: torch.Tensor | None = None,
           which: str = "fresh") -> list[torch.Tensor]:
    """Returns [what `which` names, a fresh tensor]: "fresh", "a", "a view", "items[1]", "b", "c", "twice" (the
    fresh tensor twice)."""
    fresh = a * 2
    picked = {"fresh": lambda: fresh.clone(), "a": lambda: a, "a view": lambda: a.view(-1)[1:],
              "items[1]": lambda: items[1], "b": lambda: b, "c": lambda: c, "twice": lambda: fresh}[which]()
    return [picked, fresh]


@_mixed.register_fake
def _(key, a, shape, dtype, flag, items, b=None, *, c=None, which="fresh"):
    return [torch.empty_like(a), torch.empty_like(a)]


def _call(which: str, **kw):
    a, items, b, c = torch.randn(4), [torch.randn(2), torch.randn(3)], torch.randn(4), torch.randn(4)
    kw = {"b": b, "c": c, **kw}
    return torch.ops.hybridq._test_aliasing_mixed_args("k", a, [2, 2], torch.float32, True, items, which=which, **kw)


def test_fresh_outputs_pass():
    out = _call("fresh")
    assert len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)


@pytest.mark.parametrize("which", ["a", "a view", "items[1]", "b", "c", "twice"])
def test_an_output_aliasing_a_tensor_argument_or_another_output_is_refused(which):
    with pytest.raises(RuntimeError, match=r"hybridq::_test_aliasing_mixed_args.*may not alias"):
        _call(which)


def test_an_optional_tensor_left_out_is_no_alias_and_one_given_positionally_is_checked():
    a, items = torch.randn(4), [torch.randn(2)]
    op = torch.ops.hybridq._test_aliasing_mixed_args
    assert len(op("k", a, [4], torch.float32, False, items)) == 2  # (b, c left at None)
    b = torch.randn(4)
    with pytest.raises(RuntimeError, match="may not alias"):
        op("k", a, [4], torch.float32, False, items, b, which="b")
