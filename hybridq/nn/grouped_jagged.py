"""The jagged path of `GroupedLinear` for per-tensor FP8 with current scaling: every expert's tokens stay where the
router put them (consecutive rows of one `[T, in]` tensor) and the group bounds live on the device, as for
`torch._grouped_mm`. Per forward + backward, one quantize call per operand for all experts (input, weight `[E*N, K]`,
gradient; each expert's rows with its own amax and scale, rowwise and the columnwise transpose in the same pass) and
one grouped GEMM per phase:

    fprop  y  [T, N]    = x rowwise (jagged rows)    x W rowwise `[E, N, K]`
    dgrad  dx [T, K]    = dy rowwise (jagged rows)   x W columnwise (column slices of its `[K, E*N]` transpose)
    wgrad  dW [E, N, K] = dy columnwise `[N, T]`     x x columnwise `[K, T]`, contracted over each expert's tokens

No padding, no packing copy, no per-expert Python work on the device path, and no host sync: `m_splits` as a device
tensor stays on the device (its values are checked there, asynchronously), a list costs one host-to-device copy.
A weight FSDP2 gathered as per-tensor FP8 (apply_hybrid_fsdp) is used as gathered, in place (`HeldFP8Experts`):
fprop reads the experts' stacked rowwise buffers `[E, N, K]`, dgrad the stacked columnwise ones `[E, K, N]` that the
backward unshard derives, so no copy of the weight is made in forward or held until backward.

Which kernels run is `hybridq.gemm.jagged_fp8_kernels`: on CUDA sm_90 the grouped quantize of the extension and the
Triton grouped GEMMs (hybridq/kernels/grouped_fp8.py); on the CPU the reference (one quantization and one emulated
GEMM per expert on its slice), which is bitwise the per-expert path. On a GPU the quantized operands are bitwise those
of the per-expert path and the GEMMs sum the same exact products in another order (docs/numerics.md "Row groups and
grouped GEMMs").
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..enums import COLUMNWISE, ROWWISE
from ..formats.base import Quantizer
from ..formats.float8 import Float8TensorPart
from ..gemm import JaggedFP8, JaggedFP8Kernels
from ..kernels.native_gemm import FAST_ACCUM_FPROP
from ..torch_private import current_raw_stream
from ..weight_forms import GroupedGatheredForm
from .first_order import describe_quantizers, first_order_only
from .linear_function import _SHARING
from .side_table import TensorSideTable

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class TokenGroups:
    """The expert groups of a jagged `[T, ...]` tensor: `n` groups, group g's rows `[ends[g-1], ends[g])`.
    `ends` (int32 `[n]`, cumulative counts) and `row_group` (int32 `[T]`, each row's group) live on the tensor's
    device and are made on first use; `host_sizes()` gives the counts as ints (a host sync when they were given as a
    device tensor: only the reference kernels ask)."""

    def __init__(self, counts: torch.Tensor, tokens: int, sizes: list[int] | None):
        self.n = counts.shape[0]
        self.tokens = tokens
        self._counts, self._sizes = counts, sizes
        self._ends: torch.Tensor | None = None
        self._padded_ends: torch.Tensor | None = None
        self._row_group: torch.Tensor | None = None
        # what the host counts say, once they are known (they never change then; each kernel call asked anew: a
        # Python loop over the groups)
        self._all_aligned16: bool | None = None
        self._padded_slots: tuple[list[int], list[int]] | None = None

    @classmethod
    def build(cls, m_splits: list[int] | torch.Tensor, tokens: int, device: torch.device,
              name: str = "GroupedLinear", valid: torch.Tensor | None = None) -> "TokenGroups":
        """From checked `m_splits` (`hybridq.nn.m_splits.checked_m_splits`): a list (one host-to-device copy, from
        pinned memory) or a device tensor (no sync: its values are checked on the device, asynchronously; `valid`:
        `counts_valid(m_splits, tokens)` already computed). The projections of one MoE layer share their routing,
        and its backward reads it again: the groups of the last `_BUILT_ROUTINGS` routings are reused while the
        counts (the same tensor, unmodified, or equal host counts), tokens, device and stream are the same."""
        if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return cls._build(m_splits, tokens, device, name, valid)  # (traced or captured: the graph holds its own)
        tensor = isinstance(m_splits, torch.Tensor)
        key = (id(m_splits) if tensor else tuple(m_splits), tokens, device,
               current_raw_stream(device) if device.type == "cuda" else None)
        hit = _BUILT.get(key)
        # (a tensor is kept with its groups, so its id is not reused while cached; its version says it is unchanged)
        if hit is not None and (not tensor or (hit[0] is m_splits and hit[1] == m_splits._version)):
            return hit[2]
        groups = cls._build(m_splits, tokens, device, name, valid)
        _BUILT.pop(key, None)
        if len(_BUILT) >= _BUILT_ROUTINGS:
            del _BUILT[next(iter(_BUILT))]  # (the oldest routing)
        _BUILT[key] = (m_splits if tensor else None, m_splits._version if tensor else None, groups)
        return groups

    @classmethod
    def _build(cls, m_splits, tokens: int, device: torch.device, name: str,
               valid: torch.Tensor | None = None) -> "TokenGroups":
        if isinstance(m_splits, torch.Tensor):
            counts = _counts_on(m_splits, device)
            if counts.device.type != "cpu":  # the host checks need the values: check them where they are
                _assert_valid(counts_valid(counts, tokens) if valid is None else valid, tokens, name)
                return cls(counts, tokens, None)
            return cls(counts, tokens, [int(v) for v in counts.tolist()])
        sizes = list(m_splits)
        host = torch.tensor(sizes, dtype=torch.int64, pin_memory=device.type == "cuda")
        return cls(host.to(device, non_blocking=True), tokens, sizes)

    @classmethod
    def with_bounds(cls, m_splits: torch.Tensor, tokens: int, device: torch.device, bounds: Sequence[torch.Tensor],
                    valid: torch.Tensor | None, name: str = "GroupedLinear") -> "TokenGroups":
        """The groups of device counts `m_splits` whose bounds a compiled graph computed (`group_bounds`, [Note: counts
        checked in the graph]): `valid` (`counts_valid`) asserted on the device, or None where a forward that did
        saved these bounds for this backward. Never kept: the bounds are buffers of the graph's, intact only for the
        call that gets them (Inductor may reuse a buffer once its last reader ran)."""
        if valid is not None:
            _assert_valid(valid, tokens, name)
        groups = cls(_counts_on(m_splits, device), tokens, None)
        groups.take_bounds(bounds)
        return groups

    @classmethod
    def uniform(cls, n: int, rows: int, device: torch.device) -> "TokenGroups":
        """n groups of `rows` rows each (the experts' weights `[E*N, K]`), cached per shape and device."""
        key = (n, rows, device)
        hit = _UNIFORM.get(key)
        if hit is None:
            if len(_UNIFORM) >= 32:
                _UNIFORM.clear()
            hit = _UNIFORM[key] = cls(torch.full((n,), rows, dtype=torch.int64, device=device), n * rows,
                                      [rows] * n)
        return hit

    @property
    def ends(self) -> torch.Tensor:
        if self._ends is None:
            self._ends = _ends_of(self._counts)
        return self._ends

    @property
    def padded_ends(self) -> torch.Tensor:
        """int32 `[n]`: the cumulative counts, each group's rounded up to a multiple of 16 (the padded layout of the
        CUDA kernels' columnwise forms, hybridq/kernels/grouped_fp8.py)."""
        if self._padded_ends is None:
            self._padded_ends = _padded_ends_of(self._counts)
        return self._padded_ends

    def padded_width(self) -> int:
        """The columns of the padded layout: the padded total where the host has the counts, else its upper bound
        (each group adds fewer than 16 columns), a multiple of 16 either way; no host sync."""
        if self._sizes is None:
            return -(-(self.tokens + 15 * self.n) // 16) * 16
        offsets, rows = self.padded_slots()
        return offsets[-1] + rows[-1] if rows else 0

    def padded_slots(self) -> tuple[list[int], list[int]]:
        """(first column, columns) of each group in the padded layout, from the host counts (which it needs): the
        slots the per-expert cuBLAS wgrad contracts."""
        if self._padded_slots is None:
            rows = [-(-m // 16) * 16 for m in self.host_sizes()]
            offsets, o = [], 0
            for r in rows:
                offsets.append(o)
                o += r
            self._padded_slots = (offsets, rows)
        return self._padded_slots

    def aligned16(self) -> bool:
        """Whether the host knows every group starts and ends at a multiple of 16 rows (then the padded layout is the
        plain one: e.g. the experts' weights `[E*N, K]` with N a multiple of 16)."""
        if self._sizes is None:
            return False
        if self._all_aligned16 is None:
            self._all_aligned16 = all(m % 16 == 0 for m in self._sizes)
        return self._all_aligned16

    @property
    def row_group(self) -> torch.Tensor:
        """int32 `[tokens]`: the group of each row, the number of group ends at or before it -- one searchsorted
        of the rows' positions (kept per size) in `ends` (which the GEMMs read anyway), equal to
        `repeat_interleave(arange(n), counts)` for any counts >= 0 (that is an arange and ~4 kernels more per routing:
        ~0.1 ms of host per MoE layer on the H200 machine)."""
        if self._row_group is None:
            self._row_group = _row_group_of(self.ends, self.tokens)
        return self._row_group

    def take_bounds(self, bounds: Sequence[torch.Tensor]) -> None:
        """Use `bounds` = `group_bounds(counts, tokens)` of these groups' counts, computed elsewhere (a compiled
        graph: [Note: counts checked in the graph]), as `ends`, `padded_ends` and `row_group`."""
        self._ends, self._padded_ends, self._row_group = bounds

    def host_sizes(self) -> list[int]:
        if self._sizes is None:
            self._sizes = [int(v) for v in self._counts.tolist()]
        return self._sizes

    def known_sizes(self) -> list[int] | None:
        """The counts if the host has them (given as a list), else None (no sync)."""
        return self._sizes


_COUNT_DTYPES = (torch.int64, torch.int32)


def _counts_on(m_splits: torch.Tensor, device: torch.device) -> torch.Tensor:
    # (int32 counts -- the compiled router's -- are kept as they are: the bounds are int32 cumsums either way; counts
    # already there are returned without a `to`, which a dispatch mode still sees as an op of its own)
    if m_splits.dtype in _COUNT_DTYPES:
        return m_splits if m_splits.device == device else m_splits.to(device=device)
    return m_splits.to(device=device, dtype=torch.int64)


def _assert_valid(valid: torch.Tensor, tokens: int, name: str) -> None:
    torch._assert_async(valid, f"{name}: m_splits must be >= 0 and sum to the input's {tokens} tokens")


def _ends_of(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0, dtype=torch.int32)


def _padded_ends_of(counts: torch.Tensor) -> torch.Tensor:
    return (counts + 15).bitwise_and_(-16).cumsum(0, dtype=torch.int32)


def _row_group_of(ends: torch.Tensor, tokens) -> torch.Tensor:
    return torch.searchsorted(ends, _positions(tokens, ends.device), right=True, out_int32=True)


def group_bounds(m_splits: torch.Tensor, tokens) -> list[torch.Tensor]:
    """[ends, padded_ends, row_group] of the counts `m_splits` (int32 or int64) for `tokens` rows: what `TokenGroups`
    makes on first use, the same expressions, for a compiled graph to compute ([Note: counts checked in the graph];
    `TokenGroups.take_bounds`)."""
    ends = _ends_of(m_splits)
    return [ends, _padded_ends_of(m_splits), _row_group_of(ends, tokens)]


def counts_valid(m_splits: torch.Tensor, tokens) -> torch.Tensor:
    """0-d bool tensor on m_splits' device: every count >= 0 and they sum to `tokens` (int64 sums) -- what
    `TokenGroups.build` asserts on the device for counts the host has not read.

    [Note: counts checked in the graph] Computed here it is five aten ops before the assert (a host cost of ~60-100
    us on the GPU machine, once per MoE layer and step), and the groups' bounds five more on first use (ends,
    padded ends, each row's group). A compiled GroupedLinear computes both in its graph instead
    (`compiled_grouped.grouped_in_graph`: `counts_valid` for counts on a GPU, `group_bounds`; Inductor fuses them
    into a few kernels, the three projections of a layer share them) and hands them to its forward op, which asserts
    the check before anything else runs, with the message its own check would give, and takes the bounds as they
    are (`TokenGroups.with_bounds`): one aten op per call in the op instead of twelve per layer. The bounds are saved
    for the backward op, which takes them too (no check: its forward's). Groups made so are never kept between
    calls (unlike `build`'s): a graph's buffer is intact only while the graph keeps it (Inductor reuses a buffer
    once its last reader ran). The op trusts them: only the graph's code passes them, computed from the counts and
    tokens the op gets."""
    return (m_splits >= 0).all() & (m_splits.sum() == tokens)


def _positions(tokens: int, device: torch.device) -> torch.Tensor:
    """int32 `arange(tokens)` on `device`, made once per size and device (read-only: `row_group`'s search values);
    traced or captured into a CUDA graph, one of the graph's own (a capture runs no kernel until it is replayed)."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.arange(tokens, dtype=torch.int32, device=device)
    key = (tokens, device)
    hit = _POSITIONS.get(key)
    if hit is None:
        if len(_POSITIONS) >= 8:
            _POSITIONS.clear()
        hit = _POSITIONS[key] = torch.arange(tokens, dtype=torch.int32, device=device)
    return hit


_POSITIONS: dict = {}
_UNIFORM: dict = {}
# (m_splits key, tokens, device, stream) -> (m_splits tensor | None, its version, TokenGroups) of the last routings:
# a model's MoE layers each have their own routing, read again in backward (last layer first)
_BUILT: dict = {}
_BUILT_ROUTINGS = 32


class HeldFP8Experts:
    """A grouped weight whose experts are already quantized as per-tensor FP8 (FSDP2's gathered experts), read per
    phase: the rowwise form in forward, the columnwise form in backward (after the backward unshard filled it), so
    nothing is copied in forward or held from forward to backward. `experts()` gives each expert's quantized weight
    (the fallback where their buffers are not one stacked allocation)."""

    __slots__ = ("weight", "experts", "_rowwise")

    def __init__(self, weight: torch.Tensor, experts: Callable[[], Sequence[torch.Tensor]]):
        self.weight, self.experts = weight, experts
        self._rowwise = None

    @classmethod
    def of(cls, weight: torch.Tensor, experts: Callable[[], Sequence[torch.Tensor]]) -> "HeldFP8Experts | None":
        """The held experts, None where their rowwise parts are not per-tensor FP8 (another path runs)."""
        held = cls(weight, experts)
        held._rowwise = held.form(ROWWISE, in_place=True)
        return held if held._rowwise is not None else None

    def take_rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rowwise form `of` read (forward's), no longer referenced here after."""
        out, self._rowwise = self._rowwise, None
        return out if out is not None else self.form(ROWWISE, in_place=True)

    def form(self, direction: str, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(data `[E, rows, cols]` -- rowwise `[E, N, K]`, columnwise `[E, K, N]` --, scale_inv fp32 `[E]`): views of
        the experts' stacked buffers where they are one allocation (no copy of the data), else stacked by one copy;
        None if an expert's part is not per-tensor FP8 of one FP8 dtype. `in_place`: the stacked scales too are a
        view (strided: a column of their 16-byte aligned `[E, 4]` buffer), read by the GEMM launched next, not kept
        (the eager Function's GEMMs take any stride; a compiled op's outputs must be tensors of their own)."""
        stacked = None
        if isinstance(self.weight, GroupedGatheredForm):  # (both make the direction available: every rank asks)
            stacked = self.weight.stacked_part(direction)
            if stacked is None:
                self.weight.ensure_direction(direction)
        if stacked is not None:
            part0, views = stacked
            if isinstance(part0, Float8TensorPart) and part0.data.dtype in FP8_DTYPES and "scale_inv" in views:
                scale = flat_view(views["scale_inv"])
                if scale.dtype != torch.float32 or not in_place:
                    scale = scale.float().contiguous()
                return views["data"], scale
        parts = [w.part(direction) for w in self.experts()]
        dtypes = {p.data.dtype for p in parts}
        if not all(isinstance(p, Float8TensorPart) for p in parts) or len(dtypes) != 1 or not dtypes <= set(FP8_DTYPES):
            return None
        return torch.stack([p.data for p in parts]), torch.cat([p.scale_inv.reshape(1) for p in parts]).float()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """`t.reshape(-1)` of a view that keeps its shape and strides (the stacked experts' scales, `[E, 1]`: the weight
    state keeps the view across steps, FSDP2 resizes only its storage), made once and kept on `t` (each op call
    reshaped it anew: an aten call of ~5-20 us on the GPU machine's host, two per expert layer's step)."""
    flat = t.__dict__.get("_hq_flat")
    if flat is None:
        flat = t._hq_flat = t.reshape(-1)
    return flat


def _strides(b: torch.Tensor, group_stride_2d: int) -> tuple[int, int]:
    """(group stride, row stride) in elements of the experts' operand of `mm`: stacked experts `[E, rows, cols]`
    (any expert pitch: the gathered experts' buffers), or the 2-D form the grouped quantize made, whose groups are
    `group_stride_2d` elements apart."""
    return (b.stride(0), b.stride(1)) if b.dim() == 3 else (group_stride_2d, b.stride(0))


class _SharedJaggedInputs(TensorSideTable):
    """[Note: shared jagged input] The experts' projections that read one input tensor (an MoE layer's gate and up
    projections, w1 and w3, on the dispatched tokens) quantize it once in eager: an entry is the input's
    `JaggedFP8` under (input quantizer, token groups, kernels), and serves an equal quantizer on the same groups
    object with the same kernels -- the same per-group amaxes, scales and bytes, so bitwise the second quantization
    -- where it holds the columnwise form asked for (TensorSideTable: the same tensor object at the same version,
    never keeping it alive). Off where Linear's input sharing is (`shared_input_quantization(False)`), for
    non-deterministic quantizers and inside the compiled ops (an op's outputs must be its own tensors: the eager
    Function alone passes `share`; a compiled graph shares through its own op instead, [Note: one input quantization
    in the graph], nn/compiled_grouped.py). Saves a quantize call (host ~160-290 us on the H200 machine) and its
    kernels per MoE layer, and one saved columnwise copy of the input."""

    def __init__(self):
        super().__init__(slots=2)

    @staticmethod
    def _same(key: tuple, q: Quantizer, groups: TokenGroups, kernels: JaggedFP8Kernels) -> bool:
        return (key[0] is q or key[0] == q) and key[1] is groups and key[2] is kernels

    def get(self, x: torch.Tensor, q: Quantizer, groups: TokenGroups, kernels: JaggedFP8Kernels,
            columnwise: bool) -> JaggedFP8 | None:
        return self.find(x, lambda key, xq: (self._same(key, q, groups, kernels)
                                             and (not columnwise or xq.col is not None)))

    def put(self, x: torch.Tensor, q: Quantizer, groups: TokenGroups, kernels: JaggedFP8Kernels,
            xq: JaggedFP8) -> None:
        super().put(x, (q, groups, kernels), xq, same_key=lambda key: self._same(key, q, groups, kernels))


_SHARED_INPUTS = _SharedJaggedInputs()


def _quantize_input(q: Quantizer, x: torch.Tensor, groups: TokenGroups, columnwise: bool, name: str,
                    kernels: JaggedFP8Kernels, share: bool) -> JaggedFP8:
    """`kernels.quantize` of the input, or the quantization another projection made of the same tensor
    ([Note: shared jagged input]) where `share`."""
    share = share and _SHARING.on and q.is_deterministic and not x.is_inference()
    xq = _SHARED_INPUTS.get(x, q, groups, kernels, columnwise) if share else None
    if xq is None:
        xq = kernels.quantize(q, x, groups, columnwise, name)
        if share:
            _SHARED_INPUTS.put(x, q, groups, kernels, xq)
    return xq


def jagged_forward(x: torch.Tensor, weight: torch.Tensor, groups: TokenGroups, quantizers: dict[str, Quantizer],
                   name: str, need_dgrad: bool, need_wgrad: bool, kernels: JaggedFP8Kernels,
                   held: JaggedFP8 | None = None, share: bool = False,
                   xq: JaggedFP8 | None = None) -> tuple[torch.Tensor, tuple]:
    """The forward of `JaggedFP8Experts` (and of the compiled op, nn/compiled_grouped.py): `y` and what backward reads,
    `(x columnwise | None, x scale_inv, W columnwise | None, W scale_inv)`. `share`: the input's quantization may be
    another projection's ([Note: shared jagged input]; eager only). `xq`: the input already quantized by `kernels`
    (the compiled graph's own op: nn/compiled_grouped.py, [Note: one input quantization in the graph])."""
    e, n, k = weight.shape
    if xq is None:
        xq = _quantize_input(quantizers["input"], x, groups, need_wgrad, f"input of {name}", kernels, share)
    wq = held if held is not None else kernels.quantize(
        quantizers["weight"], weight.detach().reshape(e * n, k), TokenGroups.uniform(e, n, x.device), need_dgrad,
        f"weight of {name}")
    y = kernels.mm(xq.row, xq.scale_inv, wq.row, *_strides(wq.row, n * k), n, wq.scale_inv, groups, x.dtype,
                   precise=not FAST_ACCUM_FPROP, name=f"fprop of {name}")
    # backward reads the columnwise forms only: x's for wgrad, W's for dgrad
    return y, (xq.col if need_wgrad else None, xq.scale_inv, wq.col if need_dgrad else None, wq.scale_inv)


def jagged_backward(dy: torch.Tensor, saved: tuple, groups: TokenGroups, quantizers: dict[str, Quantizer], name: str,
                    kernels: JaggedFP8Kernels, w_shape: tuple[int, int, int], w_dtype: torch.dtype,
                    need_dgrad: bool, need_wgrad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dW) from what `jagged_forward` saved; a gradient not asked for (or whose operand was not saved) is None."""
    x_col, x_scale, w_col, w_scale = saved
    e, n, k = w_shape
    need_dgrad = need_dgrad and w_col is not None
    need_wgrad = need_wgrad and x_col is not None
    dx = dw = None
    if not (need_dgrad or need_wgrad):
        return dx, dw
    dyq = kernels.quantize(quantizers["grad_output"], dy, groups, need_wgrad, f"grad_output of {name}")
    if need_dgrad:  # dy rowwise x W columnwise: expert g's `[K, N]` is columns [g*N, (g+1)*N) of `[K, E*N]` (the
        # grouped quantize's form) or `w_col[g]` (the gathered experts' stacked columnwise buffers `[E, K, N]`)
        dx = kernels.mm(dyq.row, dyq.scale_inv, w_col, *_strides(w_col, n), k, w_scale, groups, dy.dtype,
                        precise=True, name=f"dgrad of {name}")
    if need_wgrad:  # dy columnwise x x columnwise, contracted over each expert's tokens
        dw = kernels.wgrad(dyq.col, dyq.scale_inv, x_col, x_scale, groups, dy.dtype,
                           name=f"wgrad of {name}").to(w_dtype)
    return dx, dw


class JaggedFP8Experts(torch.autograd.Function):
    """`y[tokens of e] = x[tokens of e] W[e]^T` for every expert e, per-tensor FP8 on the jagged layout (see the
    module docstring). `need_dgrad` / `need_wgrad`: the gradients backward will compute (which columnwise forms the
    forward makes; inside forward, autograd's own flags ignore no_grad). `held`: the weight already quantized
    (`HeldFP8Experts.of`: FSDP2's gathered experts; its columnwise form is read in backward), else the weight is
    quantized here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, groups: TokenGroups, quantizers: dict[str, Quantizer],
                name: str, need_dgrad: bool, need_wgrad: bool, kernels: JaggedFP8Kernels,
                held: HeldFP8Experts | None = None) -> torch.Tensor:
        wq = None
        if held is not None:
            row, scale_inv = held.take_rowwise()
            wq = JaggedFP8(row, None, scale_inv)
        share = not torch.compiler.is_compiling()  # ([Note: shared jagged input]: eager only)
        y, saved = jagged_forward(x, weight, groups, quantizers, name, need_dgrad, need_wgrad, kernels, wq, share)
        if held is not None:  # (backward reads the held weight's columnwise form, not this view of its scales)
            saved = (*saved[:3], None)
        ctx.save_for_backward(*saved)
        ctx.groups, ctx.quantizers, ctx.layer_name, ctx.kernels = groups, quantizers, name, kernels
        ctx.w_shape, ctx.w_dtype = tuple(weight.shape), weight.dtype
        ctx.held = held if need_dgrad else None  # (a handle: the backward unshard fills its columnwise buffers)
        return y

    @staticmethod
    @first_order_only(lambda ctx: f"{ctx.layer_name} ({describe_quantizers(ctx.quantizers)})")
    def backward(ctx, dy: torch.Tensor):
        saved = ctx.saved_tensors
        if ctx.held is not None and ctx.needs_input_grad[0]:
            w_col = ctx.held.form(COLUMNWISE, in_place=True)
            if w_col is None:
                raise RuntimeError(f"hybridq: the gathered experts of {ctx.layer_name} have no per-tensor FP8 "
                                   f"columnwise form in backward (their rowwise form was per-tensor FP8 in forward)")
            saved = (saved[0], saved[1], *w_col)
        dx, dw = jagged_backward(dy, saved, ctx.groups, ctx.quantizers, ctx.layer_name, ctx.kernels,
                                 ctx.w_shape, ctx.w_dtype, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None, None, None, None
