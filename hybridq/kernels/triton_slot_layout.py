"""The slot layout of GroupedLinear's device-count block path (`grouped_packed.SlotLayout`) from the counts tensor in
ONE Triton launch, instead of ~20 aten ops (each a launch and a dispatch on the host: ~0.5 ms of host time per MoE
layer and step on an H200, issue 30): from int64 counts `[E]`, with `multiple` the slot granularity, `tokens` the
input's rows and `rows` the buffer's bound,

  - `table` int32 `[6, E]`: slot start, first token, tokens, slot size, slot end, token end of every expert (slot
    size = the count rounded up to `multiple`, floor division as `torch.div(..., rounding_mode="floor")`; starts and
    ends by inclusive cumsums);
  - `token_rows` int64 `[tokens]`: the slot row of each token, `t + (slot start - first token)[e]` with e the number
    of token ends at or before t (clamped to E - 1), clamped to `[0, rows - 1]`;
  - `source` int32 `[rows]`: the token each slot row holds, -1 for a padding row (the inverse of `token_rows`, which
    `SlotLayout.source_rows` makes by a scatter);
  - `valid` int32 `[1]`: 1 where every count is >= 0 and they sum to `tokens` (what the device assert reads).

Bitwise the aten ops' results (`grouped_packed.SlotLayout`'s own code) for every valid counts tensor. For invalid ones
`table` and `valid` are too, `token_rows` where no count is negative (else the token ends are unsorted and
`searchsorted` answers by its binary search), every write stays inside its tensor and `source` names only rows of
the input (-1 elsewhere): the device assert reports those counts.

Taken by `SlotLayout` where the counts are a real CUDA tensor, eagerly (not traced), with Triton; `HYBRIDQ_SLOT_LAYOUT_
KERNEL=0` (`ENABLED`) keeps the aten ops, which a kernel that fails to compile or launch also turns to (one warning).
Triton is optional: without it (CPU machines, CI) this module imports and `available()` is False.
"""

from __future__ import annotations

import torch

from .triton_grouped_fp8 import _cdiv, _next_pow2, available  # noqa: F401 (available: this module's too)
from ..switches import Switch
from .triton_launch import launch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

ENABLED = Switch("HYBRIDQ_SLOT_LAYOUT_KERNEL")

if triton is not None:
    @triton.jit
    def _floor_div(a, m: tl.constexpr):
        # floor(a / m) for m > 0 from divisions of non-negative numbers only (Triton's integer division truncates on
        # the GPU, numpy's floors under the interpreter: the two agree there)
        pos = tl.where(a >= 0, a, 0)
        neg = tl.where(a < 0, -a, 0)
        return tl.where(a >= 0, pos // m, -((neg + (m - 1)) // m))

    @triton.jit(do_not_specialize=["T", "R", "E"])
    def _slot_layout_kernel(counts_ptr, table_ptr, token_rows_ptr, source_ptr, valid_ptr, T, R, E,
                            MULT: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr):
        """Each program: the whole (small) routing's cumsums, then BLOCK tokens' slot rows and BLOCK slot rows'
        tokens; program 0 also writes the table and the validity."""
        pid = tl.program_id(0)
        gi = tl.arange(0, EP)
        on = gi < E
        c = tl.load(counts_ptr + gi, mask=on, other=0).to(tl.int64)
        slots = _floor_div(c + (MULT - 1), MULT) * MULT
        ends = tl.cumsum(slots, 0)
        token_ends = tl.cumsum(c, 0)
        offsets = ends - slots
        starts = token_ends - c
        if pid == 0:
            tl.store(table_ptr + gi, offsets.to(tl.int32), mask=on)
            tl.store(table_ptr + E + gi, starts.to(tl.int32), mask=on)
            tl.store(table_ptr + 2 * E + gi, c.to(tl.int32), mask=on)
            tl.store(table_ptr + 3 * E + gi, slots.to(tl.int32), mask=on)
            tl.store(table_ptr + 4 * E + gi, ends.to(tl.int32), mask=on)
            tl.store(table_ptr + 5 * E + gi, token_ends.to(tl.int32), mask=on)
            negative = tl.sum((on & (c < 0)).to(tl.int32), axis=0)
            total = tl.sum(c, axis=0)
            tl.store(valid_ptr, ((negative == 0) & (total == T)).to(tl.int32))
        i = pid * BLOCK + tl.arange(0, BLOCK)
        # token i's expert: the token ends at or before it (searchsorted right), at most E - 1
        expert = tl.sum(((token_ends[None, :] <= i[:, None]) & on[None, :]).to(tl.int32), axis=1)
        expert = tl.minimum(expert, E - 1)
        shift = tl.sum(tl.where(gi[None, :] == expert[:, None], (offsets - starts)[None, :], 0), axis=1)
        row = tl.minimum(tl.maximum(i.to(tl.int64) + shift, 0), R - 1)
        tl.store(token_rows_ptr + i, row, mask=i < T)
        # slot row i's expert: the first slot ending after it (E: past the last slot)
        g = tl.sum(((ends[None, :] <= i[:, None]) & on[None, :]).to(tl.int32), axis=1)
        hit = gi[None, :] == g[:, None]
        local = i.to(tl.int64) - tl.sum(tl.where(hit, offsets[None, :], 0), axis=1)
        count = tl.sum(tl.where(hit, c[None, :], 0), axis=1)
        first = tl.sum(tl.where(hit, starts[None, :], 0), axis=1)
        # (a token past the input -- counts summing to more -- is never named: the quantize reads the rows named)
        tok = first + local
        src = tl.where((g < E) & (local >= 0) & (local < count) & (tok >= 0) & (tok < T), tok, -1)
        tl.store(source_ptr + i, src.to(tl.int32), mask=i < R)


def slot_layout(counts: torch.Tensor, tokens: int, rows: int, multiple: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table int32 `[6, E]`, token_rows int64 `[tokens]`, source int32 `[rows]`, valid int32 `[1]`) of int64
    `counts [E]` (contiguous, on a CUDA device or under the interpreter), module docstring."""
    e = counts.shape[0]
    dev = counts.device
    table = torch.empty(6, e, dtype=torch.int32, device=dev)
    token_rows = torch.empty(tokens, dtype=torch.int64, device=dev)
    source = torch.empty(rows, dtype=torch.int32, device=dev)
    valid = torch.empty(1, dtype=torch.int32, device=dev)
    grid, kw = _plan(tokens, rows, e, multiple)
    launch(_slot_layout_kernel, grid, counts, table, token_rows, source, valid, tokens, rows, e, **kw)
    return table, token_rows, source, valid


def _plan(tokens: int, rows: int, e: int, multiple: int) -> tuple:
    """(grid, the constexprs and options) per sizes (kept: a routing's sizes are the step's)."""
    key = (tokens, rows, e, multiple)
    hit = _PLANS.get(key)
    if hit is None:
        ep = max(16, _next_pow2(e))
        block = max(16, min(256, 8192 // ep))  # (a BLOCK x EP comparison per program)
        if len(_PLANS) >= 256:
            _PLANS.clear()
        hit = _PLANS[key] = ((max(1, _cdiv(max(tokens, rows), block)),),
                             dict(MULT=multiple, EP=ep, BLOCK=block, num_warps=4))
    return hit


_PLANS: dict = {}
