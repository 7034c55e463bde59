"""TokenGroups.row_group (the group of each row, read by the CUDA grouped quantize) as one searchsorted of the rows'
positions in the group ends: equal to `repeat_interleave(arange(n), counts)`, the form it replaces, for any counts
(empty groups, one group, every row in the last); int32; the positions made once per size."""

from __future__ import annotations

import pytest
import torch

from hybridq.nn import grouped_jagged
from hybridq.nn.grouped_jagged import TokenGroups

COUNTS = [[5, 0, 17, 40], [0, 0, 0, 3], [16, 16, 16, 14], [0, 0, 0, 0], [1], [0, 7, 0], [3, 0, 0, 0, 0, 9]]


@pytest.mark.parametrize("counts", COUNTS, ids=[str(c) for c in COUNTS])
def test_row_group_is_the_repeat_interleave_of_the_group_ids(counts):
    t = torch.tensor(counts)
    got = TokenGroups(t, sum(counts), None).row_group
    want = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), t, output_size=sum(counts))
    assert got.dtype == torch.int32 and torch.equal(got, want), f"counts {counts}: {got.tolist()} != {want.tolist()}"


def test_the_row_positions_are_made_once_per_size():
    a = TokenGroups(torch.tensor([2, 3]), 5, None).row_group
    grouped_jagged._POSITIONS.clear()
    first = grouped_jagged._positions(5, torch.device("cpu"))
    assert grouped_jagged._positions(5, torch.device("cpu")) is first
    assert torch.equal(first, torch.arange(5, dtype=torch.int32)) and torch.equal(a, torch.tensor([0, 0, 1, 1, 1],
                                                                                                  dtype=torch.int32))
