"""Flat fragments of a weight (ZeRO-style optimizers): which contiguous range of the flattened `[M, K]` weight each
rank owns, and the block bookkeeping that quantizing a fragment exactly needs.

A fragment `[start, start + length)` of the flattened weight can cut a row, a 1x32 block, a 32x1 column block or
a 128x128 tile anywhere. A rank works on the rows its fragment touches, widened to whole block rows of the
direction's blocks (`padded_rows`), with the elements it does not own left zero. Only the first and the last of
those block rows can hold elements of other fragments (`edge_block_rows`): every rank computes the same sorted
union of all ranks' edge block rows from the layout, so their partial block amaxes pack into one MAX-reducible
vector. Block rows whose first row's first element a rank owns are that rank's to send (`owned_block_rows`), so the
gathered scale rows partition the weight's.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from ..formats._sharding import cdiv

__all__ = ["FragmentLayout", "gather_layouts", "padded_rows", "edge_block_rows", "owned_block_rows"]


@dataclasses.dataclass(frozen=True)
class FragmentLayout:
    """Every rank's fragment `(start, length)` of one weight of `numel` elements (a rank without one: length 0)."""

    numel: int
    ranges: tuple[tuple[int, int], ...]

    def check(self, name: str) -> None:
        """Raise ValueError unless the fragments partition `[0, numel)` (the same on every rank: no rank goes on
        alone into a collective)."""
        spans = sorted((s, n, r) for r, (s, n) in enumerate(self.ranges) if n > 0)
        at = 0
        for s, n, r in spans:
            if s != at:
                what = "overlap" if s < at else "leave a gap"
                raise ValueError(f"hybridq quantize_master_weights: the fragments of {name} ({self.numel} elements) "
                                 f"{what} at element {min(s, at)}: rank {r} starts at {s}; every element must be "
                                 f"owned by exactly one rank (ranges {list(self.ranges)})")
            at = s + n
        if at != self.numel:
            raise ValueError(f"hybridq quantize_master_weights: the fragments of {name} cover [0, {at}) of its "
                             f"{self.numel} elements (ranges {list(self.ranges)})")

    def order(self) -> list[int]:
        """Ranks in the order of their fragments (ranks without one last)."""
        return sorted(range(len(self.ranges)), key=lambda r: (self.ranges[r][1] == 0, self.ranges[r][0]))


def gather_layouts(numels: list[int], starts: list[int], lengths: list[int], group) -> list[FragmentLayout]:
    """Every rank's (start, length) of every weight: one all-gather of 2 int64 per weight."""
    world = dist.get_world_size(group)
    mine = torch.tensor([v for s, n in zip(starts, lengths) for v in (s, n)], dtype=torch.int64)
    if world == 1:
        rows = [mine]
    else:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        rows = [torch.empty_like(mine, device=device) for _ in range(world)]
        dist.all_gather(rows, mine.to(device), group=group)
    table = torch.stack([r.cpu() for r in rows]).view(world, -1, 2).tolist()
    return [FragmentLayout(n, tuple((r[i][0], r[i][1]) for r in table)) for i, n in enumerate(numels)]


def padded_rows(start: int, length: int, m: int, k: int, gr: int) -> tuple[int, int]:
    """Rows [R0, R1) of the `[m, k]` weight: those the fragment touches, widened to whole block rows of gr rows."""
    row0, row1 = start // k, cdiv(start + length, k)
    return (row0 // gr) * gr, min(cdiv(row1, gr) * gr, m)


@functools.lru_cache(maxsize=4096)
def edge_block_rows(layout: FragmentLayout, m: int, k: int, gr: int) -> tuple[int, ...]:
    """Sorted block rows (of gr rows) that some rank's padded rows share with elements it does not own: the first
    and last block row of each fragment unless wholly inside it (those in between always are)."""
    out = set()
    for s, n in layout.ranges:
        if n == 0:
            continue
        r0, r1 = padded_rows(s, n, m, k, gr)
        for b in {r0 // gr, cdiv(r1, gr) - 1}:
            lo, hi = b * gr * k, min((b + 1) * gr, m) * k
            if not (s <= lo and hi <= s + n):
                out.add(b)
    return tuple(sorted(out))


def owned_block_rows(start: int, length: int, k: int, g: int) -> tuple[int, int]:
    """[first, end) block rows (of g rows) whose first element lies in the fragment: its share of the scales."""
    if length == 0:
        return 0, 0
    return cdiv(start, g * k), cdiv(start + length, g * k)
