"""Host work of the compiled GroupedLinear ops' bodies per call (issue 30: the compiled fp8_tensorwise MoE job is
host-bound), and that what they keep between calls is never stale:

- the token counts' device check ([Note: counts checked in the graph]): computed in the compiled graph on a GPU and
  asserted by the op -- one aten op in the op where it was seven (an int64 copy of the compiled router's int32 counts,
  five ops of the check, the assert); the rule it computes is the host check's;
- int32 counts are kept as they are: the groups' bounds are those of the int64 counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridq.nn.grouped_jagged import TokenGroups, counts_valid

META = torch.device("meta")
# (counts, tokens, valid): empty groups, one group, every row in one group, negative, sums off by one either way
COUNT_CASES = [([5, 0, 17, 42], 64, True), ([0, 0, 0, 0], 0, True), ([64], 64, True), ([0, 64, 0], 64, True),
               ([10, -1, 55], 64, False), ([-5, 69], 64, False), ([10, 1, 1], 64, False), ([33, 32], 64, False),
               ([0, 0], 1, False)]
INT_DTYPES = [torch.int32, torch.int64]


class _Ops(TorchDispatchMode):
    """The aten ops called inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("counts, tokens, valid", COUNT_CASES, ids=[str(c[:2]) for c in COUNT_CASES])
def test_counts_valid_is_the_host_rule(counts, tokens, valid, dtype):
    got = counts_valid(torch.tensor(counts, dtype=dtype), tokens)
    assert got.dtype == torch.bool and got.dim() == 0, f"counts_valid gave a {got.dim()}-D {got.dtype} tensor"
    assert bool(got) is valid, f"counts {counts} ({dtype}) for {tokens} tokens: counts_valid {bool(got)}, rule {valid}"


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_device_counts_checked_by_the_graph_cost_the_op_one_aten_op(dtype):
    """Counts not on the CPU (meta here, as a GPU's: the host does not read them): with the graph's check given, the
    groups' build issues the assert alone (before: seven ops for the compiled router's int32 counts); without it, the
    check's five ops and the assert, and no copy of int32 or int64 counts."""
    counts = torch.empty(4, dtype=dtype, device=META)
    valid = counts_valid(counts, 64)
    with _Ops() as given:
        TokenGroups._build(counts, 64, META, "moe", valid)
    assert given.ops == ["aten._assert_async.msg"], f"build with the graph's check issued {given.ops}"
    with _Ops() as own:
        TokenGroups._build(counts, 64, META, "moe")
    assert own.ops == ["aten.ge.Scalar", "aten.all.default", "aten.sum.default", "aten.eq.Scalar",
                       "aten.bitwise_and.Tensor", "aten._assert_async.msg"], \
        f"build with its own check issued {own.ops}"


def test_int32_counts_are_kept_and_give_the_int64_counts_groups():
    counts = [5, 0, 17, 42, 0, 16]
    c32 = torch.tensor(counts, dtype=torch.int32)
    g32 = TokenGroups._build(c32, sum(counts), torch.device("cpu"), "moe")
    g64 = TokenGroups._build(torch.tensor(counts), sum(counts), torch.device("cpu"), "moe")
    assert g32._counts is c32, "int32 counts were copied"
    for what in ("ends", "padded_ends", "row_group"):
        a, b = getattr(g32, what), getattr(g64, what)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), f"{what}: int32 counts {a}, int64 {b}"
    assert g32.host_sizes() == counts, g32.host_sizes()


def test_small_integer_counts_are_widened():
    """(uint8 counts would overflow the padded bounds' `+ 15`: they are copied to int64 as before.)"""
    g = TokenGroups._build(torch.tensor([250, 3], dtype=torch.uint8), 253, torch.device("cpu"), "moe")
    assert g._counts.dtype == torch.int64 and g.padded_ends.tolist() == [256, 272], (g._counts.dtype, g.padded_ends)
