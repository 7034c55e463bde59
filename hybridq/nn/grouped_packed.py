"""The packed paths of `GroupedLinear`: every expert's tokens, weight and gradient quantized in one call per tensor
instead of one per expert, when every expert has the same quantizers (`packed_quantizers` says which path):

- per-tensor FP8 with current scaling (`FP8_TENSOR`, here): `Float8Quantizer.quantize_row_groups` (per-expert
  scales) and the three GEMMs as grouped GEMMs where the device has them (`torch._scaled_grouped_mm` on sm_90 for
  E4M3 x E4M3), else one GEMM per expert on views of the packed parts;
- block formats without tensor-wide statistics (`BLOCKS`: FP8 1x128 / 128x128 blocks, MXFP8 and hybrids of them,
  `Quantizer.local_scaling`): one plain `quantize` of the packed buffer, one GEMM per expert on its row slice
  (grouped_packed_blocks.py);
- NVFP4 and hybrids with it (`ROW_GROUPS`, `Quantizer.packs_row_groups`): the same, with one `quantize_groups` call
  per tensor that keeps NVFP4's global amaxes per expert and draws each expert's stochastic-rounding numbers as its
  own call would (grouped_packed_blocks.py).

Numbers: each expert's slice is quantized exactly as the per-expert path quantizes it (same zero-padded token
count, its own amax or block scales), and each GEMM multiplies the same quantized operands: on the CPU (emulated
GEMMs) the result is bitwise that of the per-expert path; on a GPU the FP8 grouped GEMM may round differently from
the per-expert `torch._scaled_mm` (docs/numerics.md, "Row groups and grouped GEMMs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..enums import Scaling
from ..errors import FormatShapeError
from ..formats import Float8Quantizer
from ..formats.base import Quantizer, transposed_copy
from ..formats.float8 import Float8RowGroups, Float8TensorPart, aligned_scales
from ..gemm import gemm, grouped_fp8_gemm_kernel, grouped_gemm_fp8
from ..torch_private import current_raw_stream
from .first_order import describe_quantizers, first_order_only

TENSORS = ("input", "weight", "grad_output")
FP8_TENSOR = "fp8_tensor"  # per-tensor FP8, current scaling: row groups and grouped GEMMs
BLOCKS = "blocks"  # block scales only (Quantizer.local_scaling): one quantize of the packed buffer, row slices
ROW_GROUPS = "row_groups"  # statistics per expert (NVFP4's global amaxes): one quantize_groups call, row slices

_MAX_PAD = 4096  # larger than any format's block along the token dimension

class PackedKind(NamedTuple):
    """Which packed path runs (`FP8_TENSOR`, `BLOCKS` or `ROW_GROUPS`) and the quantizer per tensor type every expert
    shares."""

    kind: str
    quantizers: dict[str, Quantizer]


def padded_tokens(m: int, in_features: int, out_features: int, quantizers: dict[str, Quantizer],
                  rowwise_grad: bool, columnwise: bool, multiple: int = 1) -> int:
    """The smallest token count >= m, a multiple of `multiple` (what the device's hardware GEMMs need, see
    `gemm.native_row_multiple`), that every cast of an expert's call accepts: the input rowwise, plus the
    grad_output rowwise when dgrad is quantized (`rowwise_grad`), plus both columnwise when wgrad is quantized
    (`columnwise`). Zero rows appended up to it leave every scale (amax, block maxima) as it was, add only zero
    products to wgrad, and give output rows that are dropped. With hardware GEMMs (`multiple` > 1) and a quantized
    wgrad, the count is also a multiple of the columnwise scaling blocks along the tokens (e.g. 128 for FP8 1x128
    blocks, which the block-scaled GEMM needs whole along its contraction)."""
    if multiple > 1 and columnwise:
        for t in ("input", "grad_output"):
            granularity = getattr(quantizers[t], "split_granularity", None)
            if granularity is not None:
                multiple = math.lcm(multiple, granularity(False, True)[0])

    def fits(n: int) -> bool:
        return (n % multiple == 0 and quantizers["input"].shape_rule(n, in_features, True, columnwise) is None
                and (not (rowwise_grad or columnwise)
                     or quantizers["grad_output"].shape_rule(n, out_features, rowwise_grad, columnwise) is None))
    for n in range(m, m + _MAX_PAD + 1):
        if fits(n):
            return n
    raise FormatShapeError(f"no token count in [{m}, {m + _MAX_PAD}] fits the formats "
                           f"{quantizers['input'].describe()} / {quantizers['grad_output'].describe()}")


def packed_quantizers(expert_quantizers: list[dict[str, Quantizer]]) -> PackedKind | None:
    """The packed path for these experts' quantizers, or None (the per-expert path): every expert must have the
    same quantizer per tensor type, and input, weight and grad_output must all be

    - plain per-tensor FP8 with current scaling (`FP8_TENSOR`), or
    - formats whose scales come from their own blocks only -- deterministic, no tensor-wide statistic (`BLOCKS`:
      FP8 blocks, MXFP8, hybrids of these), or
    - formats that quantize row groups in one call with per-group statistics (`ROW_GROUPS`,
      `Quantizer.packs_row_groups`: NVFP4 and its hybrids with the formats above, with or without RHT and 16x16
      tiles), where the weight draws no random numbers (the per-expert path quantizes each expert's input and
      weight in turn, so two random tensors would draw in another order; a weight of an expert without tokens is
      not quantized there). Stochastic rounding of the input and grad_output is drawn expert by expert in the
      per-expert path's order.

    Delayed scaling and per-tensor FP8 mixed with block formats run per expert."""
    first = expert_quantizers[0]
    if any(qs[t] != first[t] for qs in expert_quantizers[1:] for t in TENSORS):
        return None
    qs = [first[t] for t in TENSORS]
    if all(type(q) is Float8Quantizer and q.scaling == Scaling.CURRENT for q in qs):
        return PackedKind(FP8_TENSOR, first)
    if all(q.local_scaling for q in qs):
        return PackedKind(BLOCKS, first)
    if all(q.packs_row_groups for q in qs) and first["weight"].is_deterministic:
        return PackedKind(ROW_GROUPS, first)
    return None


@dataclass
class TokenLayout:
    """Where each expert's tokens sit in the packed buffer: expert e's `splits[e]` tokens start at row
    `offsets[e]`, followed by zero rows. Its GEMMs read `padded[e]` rows (the per-expert path's zero-padded token
    count); it occupies `slots[e]` >= `padded[e]` rows (padded further to whole scaling blocks along the tokens
    where the packed quantization needs them: `multiple` in `build`)."""

    splits: list[int]
    padded: list[int]
    slots: list[int]
    rows: torch.Tensor | None  # packed row of each token (None: no padding, the buffer is the input itself)
    # per device, what kernels derive from the layout once for forward and backward (the grouped GEMMs' bounds)
    device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, splits: list[int], padded: list[int], device: torch.device, multiple: int = 1
              ) -> "TokenLayout":
        slots = [-(-p // multiple) * multiple for p in padded]
        if splits == slots:
            return cls(splits, padded, slots, None)
        counts = torch.tensor(splits)
        gaps = torch.tensor([s - m for s, m in zip(slots, splits)])
        shift = gaps.cumsum(0) - gaps
        rows = torch.arange(sum(splits)) + torch.repeat_interleave(shift, counts)
        return cls(splits, padded, slots, rows.to(device, non_blocking=True))

    @property
    def total(self) -> int:
        return sum(self.slots)

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for n in self.slots:
            out.append(o)
            o += n
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return t.contiguous()
        if t.is_floating_point() and t.element_size() == 1:  # fp8 bytes: copied as uint8 (index_copy_ has no fp8 kernels)
            return self.pack(t.view(torch.uint8)).view(t.dtype)
        return t.new_zeros(self.total, t.shape[1]).index_copy_(0, self.rows, t)

    def source_rows(self, device: torch.device) -> torch.Tensor:
        """int32 `[total]` on `device`: the token row each slot row holds, -1 for a padding row (what the grouped
        quantize reads instead of a packed buffer; made once per layout, forward and backward share it)."""
        key = ("source_rows", device)
        if key not in self.device_cache:
            tokens = sum(self.splits)
            if self.rows is None:
                src = torch.arange(tokens, dtype=torch.int32, device=device)
            else:
                src = torch.full((self.total,), -1, dtype=torch.int32, device=device)
                src[self.rows.to(device)] = torch.arange(tokens, dtype=torch.int32, device=device)
            self.device_cache[key] = src
        return self.device_cache[key]

    def quantize(self, q: Float8Quantizer, t: torch.Tensor, name: str) -> Float8RowGroups:
        """`t`'s expert slices quantized each alone, laid out in the padded buffer. Zero rows change no amax and
        quantize to zero bytes, so padding the fp8 bytes equals quantizing the zero-padded slices (and moves half
        the bytes of padding `t`)."""
        groups = q.quantize_row_groups(t.contiguous(), self.splits, name=name)
        return Float8RowGroups(data=self.pack(groups.data), scale_inv=groups.scale_inv, sizes=tuple(self.slots))

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows is None else t.index_select(0, self.rows)


def bound_rows(tokens: int, experts: int, multiple: int) -> int:
    """Rows that hold every layout of `tokens` tokens in `experts` slots, each rounded up to `multiple` rows, whatever
    the counts: each slot adds fewer than `multiple` rows of padding (a bound from the shapes alone)."""
    return -(-(tokens + experts * (multiple - 1)) // multiple) * multiple


class SlotLayout:
    """`TokenLayout`'s slots with the counts on the device (`m_splits` a tensor: no host sync): expert e's slot is
    its count rounded up to `multiple` rows (whole scaling blocks along the tokens), the slots one after another
    from row 0 (an exclusive cumsum), all computed on the device; the buffer has `rows` = `bound_rows(...)` rows, a
    bound from the shapes alone (what a compiled graph's fakes and a CUDA graph need), the rows after the last slot
    zero. `table`: int32 `[6, E]` on the device, as `grouped_blocks.GroupBounds.table` (slot start, first token, tokens,
    slot size, slot end, token end); `token_rows`: int64 `[T]`, the slot row of each token.

    The host's counts (`host()`: a `TokenLayout` of the same slots, whose GEMMs read the per-expert path's padded
    counts, `padded_of(m)`) are read only where a GEMM needs them: on the CPU (the reference: read when the layout is
    built, with the value rules checked, ValueError), or on a GPU where no grouped GEMM takes the operands (a sync).
    On CUDA the value rules are checked on the device, asynchronously (a device assert)."""

    def __init__(self, counts: torch.Tensor, tokens: int, multiple: int, padded_of, splits: list[int] | None,
                 device_parts: tuple | None = None):
        self.counts, self.tokens, self.multiple, self.padded_of = counts, tokens, multiple, padded_of
        self.num_experts = counts.shape[0]
        self.rows = bound_rows(tokens, self.num_experts, multiple)
        self._splits = splits
        self._host: TokenLayout | None = None
        self._source: torch.Tensor | None = None
        self._bounds = None
        self.valid: torch.Tensor | None = None  # (int32 [1], 1 for valid counts: made by the layout kernel)
        if device_parts is not None:  # (another layer's layout of the same routing: `build`)
            self.table, self.token_rows, self._source, self._bounds = device_parts
            return
        if _layout_kernel_takes(counts):  # (one launch for the ops below and `source_rows`' scatter)
            from ..kernels import grouped_blocks, triton_slot_layout as k
            made = grouped_blocks.run_or_none(k.ENABLED, "slot layout kernel", lambda: k.slot_layout(
                counts, tokens, self.rows, multiple), instead="the slot layout is computed by aten ops")
            if made is not None:
                self.table, self.token_rows, self._source, self.valid = made
                return
        slots = (counts + (multiple - 1)).div_(multiple, rounding_mode="floor").mul_(multiple)
        ends = slots.cumsum(0)
        token_ends = counts.cumsum(0)
        offsets, starts = ends - slots, token_ends - counts
        self.table = torch.stack([offsets, starts, counts, slots, ends, token_ends]).to(torch.int32)
        # each token's expert: the number of token ends at or before it (bounded whatever the counts: a bad count
        # is the device assert's to report, never an out-of-bounds write)
        t = torch.arange(tokens, device=counts.device)
        expert = torch.searchsorted(token_ends, t, right=True).clamp_(max=self.num_experts - 1)
        self.token_rows = (t + (offsets - starts)[expert]).clamp_(0, self.rows - 1)

    @classmethod
    def build(cls, m_splits: torch.Tensor, tokens: int, device: torch.device, multiple: int, padded_of,
              name: str, fake: bool = False) -> "SlotLayout":
        """From a checked 1-D integer tensor `m_splits` (`checked_m_splits` / the compiled op's checks). CUDA (or
        `fake`: compile's tracing): the counts stay on the device, checked there asynchronously; CPU: read and
        checked (ValueError naming `name`). On CUDA, eagerly, the projections of one MoE layer share their routing
        (and backward reads it again): the device tensors of the last `_SLOT_ROUTINGS` routings are reused while the
        counts tensor is the same and unmodified (its version), with the same tokens, multiple and stream."""
        from .m_splits import check_split_values
        if fake or device.type == "cpu" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            key = None  # (traced or captured: the graph holds its own; the CPU reads the counts anyway)
        else:
            key = (id(m_splits), tokens, device, multiple, current_raw_stream(device))
            hit = _SLOTS.get(key)
            if hit is not None and hit[0] is m_splits and hit[1] == m_splits._version:
                return cls(hit[2].counts, tokens, multiple, padded_of, None,
                           (hit[2].table, hit[2].token_rows, hit[2].source_rows(), hit[2].bounds()))
        counts = m_splits.to(device=device, dtype=torch.int64)
        splits = None
        if not fake and counts.device.type == "cpu":
            splits = check_split_values([int(v) for v in counts.tolist()], counts.shape[0], tokens, name)
        layout = cls(counts, tokens, multiple, padded_of, splits)
        if not fake and counts.device.type != "cpu":  # (the layout's writes are bounded whatever the counts)
            valid = layout.valid if layout.valid is not None else (counts >= 0).all() & (counts.sum() == tokens)
            torch._assert_async(valid, f"{name}: m_splits must be >= 0 and sum to the input's {tokens} tokens")
        if key is not None:
            _SLOTS.pop(key, None)
            if len(_SLOTS) >= _SLOT_ROUTINGS:
                del _SLOTS[next(iter(_SLOTS))]  # (the oldest routing)
            _SLOTS[key] = (m_splits, m_splits._version, layout)
        return layout

    def bounds(self):
        """The grouped GEMMs' bounds (`grouped_blocks.GroupBounds`) from the device table (made once: forward,
        backward and the other projections of the routing share them, with the table rows they slice)."""
        if self._bounds is None:
            from ..kernels.grouped_blocks import GroupBounds
            self._bounds = GroupBounds.on_device(self.table, self.tokens, self.multiple)
        return self._bounds

    def source_rows(self, device: torch.device | None = None) -> torch.Tensor:
        """int32 `[rows]`: the token row each slot row holds, -1 for a padding row (`TokenLayout.source_rows`)."""
        if self._source is None:
            src = torch.full((self.rows,), -1, dtype=torch.int32, device=self.counts.device)
            self._source = src.scatter_(0, self.token_rows,
                                        torch.arange(self.tokens, dtype=torch.int32, device=src.device))
        return self._source

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s rows in their slots of a zero `[rows, cols]` buffer."""
        if t.is_floating_point() and t.element_size() == 1:  # fp8 bytes: copied as uint8 (no fp8 index_copy_)
            return self.pack(t.view(torch.uint8)).view(t.dtype)
        return t.new_zeros(self.rows, t.shape[1]).index_copy_(0, self.token_rows, t)

    def host(self) -> TokenLayout:
        """The same slots with the host's counts (read here on a GPU: a sync), for the per-expert GEMMs."""
        if self._host is None:
            if self._splits is None:
                self._splits = [int(v) for v in self.counts.tolist()]
            padded = [self.padded_of(m) if m else 0 for m in self._splits]
            host = TokenLayout.build(self._splits, padded, self.counts.device, self.multiple)
            if any(p > s for p, s in zip(host.padded, host.slots)):  # (slot_multiple keeps padded_of's granularity)
                raise RuntimeError(f"slot layout: padded token counts {host.padded} exceed the slots {host.slots}")
            self._host = host
        return self._host


def _layout_kernel_takes(counts: torch.Tensor) -> bool:
    """Whether the slot layout kernel (kernels/triton_slot_layout.py) computes this layout: real CUDA counts,
    eagerly (not traced by torch.compile), Triton there, its switch on."""
    if not counts.is_cuda or isinstance(counts, FakeTensor) or torch.compiler.is_compiling():
        return False
    from ..kernels import triton_slot_layout
    return triton_slot_layout.ENABLED.on and triton_slot_layout.available()


# (m_splits id, tokens, device, multiple, stream) -> (m_splits, its version, SlotLayout) of the last routings (a tensor
# is kept with its layout, so its id is not reused while cached)
_SLOTS: dict = {}
_SLOT_ROUTINGS = 32


class PackedFP8Experts(torch.autograd.Function):
    """`y[tokens of e] = x[tokens of e] W[e]^T` for every expert e, per-tensor FP8 (see the module docstring). Its
    layout has slots == padded (the GEMMs read the whole packed buffer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layout: TokenLayout, quantizers: dict, name: str
                ) -> torch.Tensor:
        e, n, k = weight.shape
        xg = layout.quantize(quantizers["input"], x, f"input of {name}")
        wg = quantizers["weight"].quantize_row_groups(weight.detach().reshape(e * n, k), [n] * e,
                                                      name=f"weight of {name}")
        y = _grouped_rows_gemm(xg, wg.data.view(e, n, k), wg.scale_inv, x.dtype, f"fprop of {name}",
                               b_columnwise=False)
        ctx.save_for_backward(xg.data, xg.scale_inv, wg.data, wg.scale_inv)
        ctx.layout, ctx.quantizers, ctx.layer_name, ctx.w_dtype = layout, quantizers, name, weight.dtype
        return layout.unpack(y)

    @staticmethod
    @first_order_only(lambda ctx: f"{ctx.layer_name} ({describe_quantizers(ctx.quantizers)})")
    def backward(ctx, dy: torch.Tensor):
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        layout: TokenLayout = ctx.layout
        name = ctx.layer_name
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        e, k = len(layout.padded), x_data.shape[1]
        n = w_data.shape[0] // e
        dx = dw = None
        dyg = layout.quantize(ctx.quantizers["grad_output"], dy, f"grad_output of {name}")
        if need_dgrad:  # dy rowwise x W columnwise (per-tensor FP8: each expert's W rowwise bytes transposed)
            w_t = [transposed_copy(w) for w in w_data.view(e, n, k)]
            dx = layout.unpack(_grouped_rows_gemm(dyg, w_t, w_scale, dy.dtype, f"dgrad of {name}",
                                                  b_columnwise=True))
        if need_wgrad:  # dy columnwise x x columnwise, contracted over each expert's tokens
            xg = Float8RowGroups(data=x_data, scale_inv=x_scale, sizes=tuple(layout.padded))
            dw = _grouped_wgrad(dyg, xg, n, k, dy.dtype, f"wgrad of {name}").to(ctx.w_dtype)
        return dx, dw, None, None, None


def _grouped_rows_gemm(a: Float8RowGroups, b: torch.Tensor | list[torch.Tensor], b_scale_inv: torch.Tensor,
                       out_dtype: torch.dtype, name: str, b_columnwise: bool) -> torch.Tensor:
    """Rows of expert e of `a` (rowwise) times `b[e]^T` (`b`: fp8 `[E, N, K]` or E `[N, K]` tensors, one scale per
    expert; the weight's rowwise form for fprop, its columnwise form for dgrad): `[rows, N]`."""
    e = len(b)
    n, k = b[0].shape
    if isinstance(b, list) and a.data.dtype == b[0].dtype == torch.float8_e4m3fn and grouped_fp8_gemm_kernel(
            a.data.device.type) is not None:  # (the grouped GEMMs take E4M3 only: stack for them alone)
        b = torch.stack(b)
    if not isinstance(b, list):
        out = grouped_gemm_fp8(a.data, a.scale_inv, list(a.sizes), b, b_scale_inv, out_dtype,
                               columnwise=(False, b_columnwise))
        if out is not None:
            return out
    parts = []
    b_scales = aligned_scales(b_scale_inv)
    for g in range(e):
        if a.sizes[g] == 0:
            continue
        bp = Float8TensorPart(rows=n, cols=k, columnwise=b_columnwise, data=b[g], scale_inv=b_scales[g, :1])
        parts.append(gemm(a.part(g), bp, out_dtype, f"{name} (expert {g})"))
    return torch.cat(parts) if parts else a.data.new_zeros(0, n, dtype=out_dtype)


def _grouped_wgrad(dyg: Float8RowGroups, xg: Float8RowGroups, n: int, k: int, out_dtype: torch.dtype,
                   name: str) -> torch.Tensor:
    """dW[e] = dy_e^T x_e for every expert: `[E, N, K]` (zero for an expert without tokens)."""
    out = grouped_gemm_fp8(dyg.data, dyg.scale_inv, list(dyg.sizes), xg.data, xg.scale_inv, out_dtype,
                           columnwise=(True, True))
    if out is not None:
        return out
    dw = dyg.data.new_empty(len(dyg.sizes), n, k, dtype=out_dtype)
    for g, (o, m) in enumerate(zip(dyg.offsets, dyg.sizes)):
        if m == 0:
            dw[g].zero_()
            continue
        # each expert's columnwise forms: the transposes of its rows (per-tensor FP8)
        dy_t, x_t = transposed_copy(dyg.data[o:o + m]), transposed_copy(xg.data[o:o + m])
        dw[g] = gemm(dyg.columnwise_part(g, dy_t, whole=True), xg.columnwise_part(g, x_t, whole=True), out_dtype,
                     f"{name} (expert {g})")
    return dw
