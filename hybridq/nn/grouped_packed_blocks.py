"""The packed path of `GroupedLinear` for block formats: those without tensor-wide statistics (FP8 1x128 / 128x128
blocks, MXFP8 and hybrids of them: `Quantizer.local_scaling`) and NVFP4 with its hybrids, whose global amaxes are kept
per expert (`Quantizer.packs_row_groups`). All experts' tokens are packed into one zero-padded buffer (`TokenLayout`)
and quantized by ONE `Quantizer.quantize_groups` call (rowwise, plus columnwise when wgrad needs it), the gradient
likewise in backward -- on CUDA, FP8 1x128 / MXFP8 1x32 blocks go straight from the token rows into the slots, the
same bytes without the packing copy (`quantize_slots`, hybridq/kernels/grouped_slots.py) -- the weight `[E*N, K]`
in one call; each expert's GEMMs then run on its row slice of the quantized parts (`BlockScaledPart.row_slice(...,
group=e)`, which also picks the expert's global amax), one `hybridq.gemm.gemm` per expert, or one grouped GEMM per
phase where `grouped_blocks` / `grouped_emulated` take the operands (FP8 blocks: the Triton grouped kernels or the
cuBLAS loop -- the per-expert cuBLAS GEMMs issued from C++ -- whichever `grouped_blocks.backend` estimates faster).

Numbers: bitwise the per-expert path. Each expert's slot in the packed buffer is its per-expert zero-padded token
count rounded up to whole scaling blocks along the tokens (`token_multiple`, from the quantizers'
`split_granularity`): no block spans two experts, and the zero rows change no block's scale, so each expert's
slice is bitwise its own quantization; every GEMM reads the per-expert path's operands with its shapes (the padded
count, not the slot). With per-expert statistics (NVFP4) the slot is the padded count itself (its shape rule already
asks for whole 16-row blocks), each expert gets its own global amax and encode scale, and stochastic rounding draws
each expert's numbers as the per-expert call would: the input's experts first to last (as the per-expert forward
quantizes them), grad_output's last to first (autograd runs the per-expert backward from the last expert created).
The weight is quantized packed when N is a whole number of its blocks along N (128x128 tiles: 128; MXFP8's
columnwise 1x32 blocks: 32; NVFP4: always, its shape rule asks for it), else expert by expert (`ExpertWeights`).
A weight FSDP2 gathered quantized (`GroupedGatheredForm`, block formats) is not quantized here: its experts' parts
are read as gathered (`GatheredExpertWeights`), the rowwise ones in forward, the columnwise ones in backward (which
the backward unshard fills), joined into the packed weight's layout -- the same bytes, since each expert's gathered
part is the quantization of its full weight and the packed quantization's row slices are too.

This path reads the counts on the host (one sync per layer with a CUDA `m_splits`). With the counts on the device, FP8
blocks and MXFP8 run the device-count variant instead (grouped_device_blocks.py: the layout computed on the device,
the grouped GEMMs on its bounds, no sync; NVFP4 stays here).
"""

from __future__ import annotations

import math

import torch

from ..enums import COLUMNWISE, ROWWISE, Direction
from ..formats.base import QuantizedPart, Quantizer
from ..gemm import gemm
from ..kernels import grouped_blocks, grouped_emulated, grouped_slots
from ..tensor import QuantizedTensor, save_quantized, saved_quantized
from ..weight_forms import ExpertsTensor, GroupedGatheredForm
from .first_order import describe_quantizers, first_order_only
from .grouped_packed import FP8_TENSOR, TokenLayout
from .linear_function import _only


def token_multiple(quantizers: dict[str, Quantizer], rowwise_grad: bool, columnwise: bool) -> int:
    """Rows every expert's slot must be a multiple of, so that no scaling block (or tile) along the tokens spans
    two experts: of the input (rowwise, plus columnwise for wgrad) and of grad_output (rowwise for dgrad,
    columnwise for wgrad). 1 when every block lies in one row (rowwise 1-D blocks)."""
    m = quantizers["input"].split_granularity(True, columnwise)[0]
    if rowwise_grad or columnwise:
        m = math.lcm(m, quantizers["grad_output"].split_granularity(rowwise_grad, columnwise)[0])
    return m


def packed_path_pays(kind, splits: list[int], in_features: int, out_features: int, device: torch.device,
                     quantizers: dict[str, Quantizer] | None = None) -> bool:
    """Whether the packed path is the faster choice for block formats at these host counts. Where the experts are
    long enough that the packed path would run one GEMM per expert anyway (CUDA: `grouped_blocks.
    prefers_per_expert_gemms`), the per-expert path computes the same bits with fewer launches of longer GEMMs:
    measured on one H200 (fp8_block, 8 experts x 4096 tokens, 4096 x 14336): per-expert path 1.10-1.16x bf16
    `_grouped_mm`, packed 0.87-0.91x (BENCHMARKS.md, 2026-11-27; bench_grouped's "(packed path forced)" rows) --
    unless the packed path's cuBLAS loop takes the `quantizers` (`grouped_blocks.cublas_takes`): it runs those same
    per-expert GEMMs without the per-expert path's Python work, so the packed path is never the slower.
    Per-tensor FP8 (FP8_TENSOR) decides on its own (the jagged path's rule)."""
    if kind == FP8_TENSOR or device.type != "cuda":
        return True
    if quantizers is not None and grouped_blocks.cublas_takes(quantizers, device):
        return True
    return not grouped_blocks.prefers_per_expert_gemms(splits, in_features, out_features)


class ExpertWeights:
    """The experts' quantized weights: one quantization of the `[E*N, K]` weight cut into experts by row slices
    (`packed`), or, when N would put a scaling block of the weight format across two experts (128x128 tiles with
    N % 128 != 0), one quantization per expert."""

    def __init__(self, tensors: list[QuantizedTensor], n: int, packed: bool):
        self.tensors, self.n, self.packed = tensors, n, packed

    @classmethod
    def quantize(cls, q: Quantizer, weight: torch.Tensor, columnwise: bool, name: str) -> "ExpertWeights":
        e, n, k = weight.shape
        packed = e > 1 and n % q.split_granularity(True, columnwise)[0] == 0
        if packed:  # the experts' N rows are the row groups
            tensors = [q.quantize_groups(weight.reshape(e * n, k), [n] * e, rowwise=True, columnwise=columnwise,
                                         name=name)]
        else:
            tensors = [q.quantize(w, rowwise=True, columnwise=columnwise, name=f"{name} (expert {g})")
                       for g, w in enumerate(weight.unbind(0))]
        return cls(tensors, n, packed)

    def whole(self, direction: str) -> QuantizedPart:
        """The packed weight's part in `direction` (`packed` only): rowwise `[E*N, K]`, columnwise `[K, E*N]`."""
        return self.tensors[0].part(direction)

    def part(self, g: int, direction: str) -> QuantizedPart:
        """Expert g's part in `direction` (a columnwise row slice is a copy: slice it once per GEMM)."""
        if self.packed:
            return self.whole(direction).row_slice(g * self.n, (g + 1) * self.n, group=g)
        return self.tensors[g].part(direction)

    def stacked(self, direction: str):
        """(expert 0's part, {tensor name: `[E, ...]` view}) of `direction` where the experts' tensors are views of
        stacked buffers (FSDP2's gathered experts), else None."""
        return None

    def only(self, direction: str) -> "ExpertWeights":
        """The same weights holding `direction` only (what backward reads)."""
        return ExpertWeights([_only(t, direction) for t in self.tensors], self.n, self.packed)


class GatheredExpertWeights(ExpertWeights):
    """One direction of the experts FSDP2 gathered quantized (`GroupedGatheredForm`): made available on construction
    (a collective when it was not gathered yet: every rank builds it, whatever its token counts), read as gathered.
    Packed where no scaling block of `direction` would span two experts (as `ExpertWeights.quantize`): `whole` is
    the packed weight's part, the experts' stacked buffers joined along the experts -- a view of them rowwise where
    they are one allocation with no gap, one copy columnwise (`[K, E*N]`: expert g's columns g*N..(g+1)*N)."""

    def __init__(self, weight: torch.Tensor, q: Quantizer, direction: Direction):
        e, n, _ = weight.shape
        columnwise = direction == COLUMNWISE
        self.direction, self.n = direction, n
        self._stacked = weight.stacked_part(direction)  # (makes the direction available on every rank)
        self._owner = getattr(weight, "_hq", None)  # (FSDP2's state: keeps the joined stacked part)
        if self._stacked is None:
            weight.ensure_direction(direction)
        # (the experts themselves: under inference_mode a view op on the weight is refused, see _unbind_experts)
        self.tensors = list(weight._experts) if isinstance(weight, ExpertsTensor) else list(weight.unbind(0))
        self.packed = e > 1 and n % q.split_granularity(not columnwise, columnwise)[0] == 0
        self._whole: QuantizedPart | None = None

    def whole(self, direction: str) -> QuantizedPart:
        if direction != self.direction or not self.packed:
            raise RuntimeError(f"gathered experts: the packed {direction} part of a weight read {self.direction}"
                               f"{'' if self.packed else ' expert by expert'}")
        if self._whole is None:  # (stacked: expert 0 speaks for all, as ensure_direction; no part per expert)
            self._whole = (_joined_stacked(self._stacked, len(self.tensors), direction, self._owner)
                           if self._stacked is not None else
                           _joined(None, [w.part(direction) for w in self.tensors]))
        return self._whole

    def stacked(self, direction: str):
        return self._stacked if direction == self.direction else None

    def only(self, direction: str) -> "ExpertWeights":
        raise RuntimeError("gathered experts are read per direction where used, never kept for backward")


def _joined(stacked, parts: list[QuantizedPart]) -> QuantizedPart:
    """The experts' parts (2-D tensors each, equal geometry) as one part of all experts, packed as one quantization of
    `[E*N, K]` lays it out: rowwise tensors joined along their rows, columnwise ones along their columns (stored
    `[K, N]` per expert). `stacked`: (expert 0's part, {field: `[E, ...]` view}) or None (joined by a copy)."""
    p0, e = parts[0], len(parts)
    dim = 1 if p0.columnwise else 0
    fields = {}
    for name, t in p0.tensors().items():
        if t is None:
            continue
        if stacked is not None and name in stacked[1]:
            v = stacked[1][name]  # [E, a, b]: a view when no copy is needed (rowwise, no gap between experts)
            fields[name] = (v.permute(1, 0, 2).reshape(v.shape[1], e * v.shape[2]) if dim else
                            v.reshape(e * v.shape[1], v.shape[2]))
        else:
            fields[name] = torch.cat([p.tensors()[name] for p in parts], dim)
    rows, cols = (p0.rows, e * p0.cols) if dim else (e * p0.rows, p0.cols)
    return type(p0)(rows=rows, cols=cols, columnwise=p0.columnwise, **{**p0.tensors(), **fields}, **p0.meta())


def _joined_stacked(stacked, e: int, direction: str, owner) -> QuantizedPart:
    """`_joined` of experts whose every tensor is a view of one stacked buffer (`stacked`: (expert 0's part, {field:
    `[E, ...]` view})): views only, kept with `owner` (the weight's FSDP2 state; None: not kept). [Note: joined
    stacked experts]"""
    p0, views = stacked
    kept = owner.__dict__.setdefault("joined_experts", {}) if hasattr(owner, "__dict__") else {}
    hit = kept.get(direction)
    if hit is not None and hit[0] is views and hit[1] is p0 and hit[2] == e:
        return hit[3]
    joined = _joined(stacked, [p0] * e)  # (every field is stacked: parts past expert 0 are never read)
    # kept only where every joined tensor is a view of its stacked buffer: a columnwise join across experts with a gap
    # between them is a copy (`_joined`'s reshape), whose values the next unshard would leave stale
    joined_tensors = joined.tensors()
    if all(joined_tensors[n].untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
           for n, v in views.items()):
        kept[direction] = (views, p0, e, joined)
    return joined


# [Note: joined stacked experts]
# FSDP2's stacked block experts keep their tensors' storage and offsets across unshards (it resizes the storage), and
# their state hands back the same views dict (with expert 0's same part) while that holds (`GroupedWeightState.
# stacked`). The joined part of all experts is then views of the same buffers each step: kept in that state per
# direction with the views dict and expert 0's part, rebuilt when either is another object -- kept only where it
# holds no values of its own (every tensor a view of its stacked buffer), so that what FSDP2 writes into the buffers
# (each unshard, the backward unshard's columnwise fill) is what the GEMMs read; a join that copies (columnwise
# experts laid side by side) is made again per call.


def _used(layout: TokenLayout) -> list[tuple[int, int, int, int]]:
    """(expert, slot offset, padded rows, tokens) of every expert with tokens."""
    return [(g, o, p, m) for g, (o, p, m) in enumerate(zip(layout.offsets, layout.padded, layout.splits)) if m]


def _bounds(layout: TokenLayout, device: torch.device) -> grouped_blocks.GroupBounds:
    """The layout's group bounds on the device for the grouped GEMMs (made once: forward and backward share them)."""
    if device not in layout.device_cache:
        layout.device_cache[device] = grouped_blocks.GroupBounds(layout.offsets, layout.splits, layout.slots, device)
    return layout.device_cache[device]


def _fp8_block_backend(a: QuantizedPart, b: QuantizedPart, phase: str, layout: TokenLayout, k: int, n: int,
                       cublas_shapes: bool) -> str | None:
    """The FP8 block GEMM of one phase contracting `k` into `n` columns: `grouped_blocks.CUBLAS_LOOP`, `TRITON`, or
    None (one `gemm` per expert). Where the cuBLAS loop takes the operands (`cublas_shapes`: the per-expert path's
    cuBLAS GEMM takes these shapes; the slots are the padded counts, its GEMMs' rows) the cost model picks between it
    and the Triton kernels (`grouped_blocks.backend`: the loop is the per-expert GEMMs without Python per expert, so
    these are never slower); elsewhere the Triton kernels unless one GEMM per expert is measured faster."""
    if not grouped_blocks.supports(a, b):
        return None
    if cublas_shapes and layout.slots == layout.padded and grouped_blocks.cublas_supports(a, b):
        return grouped_blocks.backend(phase, layout.padded, k, n)
    if grouped_blocks.FORCE["backend"] == grouped_blocks.TRITON:
        return grouped_blocks.TRITON
    return None if grouped_blocks.prefers_per_expert_gemms(layout.splits, k, n) else grouped_blocks.TRITON


def _run_fp8_block(choice: str | None, cublas, triton) -> torch.Tensor | None:
    """The chosen backend's result: the cuBLAS loop (`cublas()`), or, where it is not chosen or fails (then it is
    turned off with one warning), the Triton kernels (`triton()`); None where neither runs."""
    if choice == grouped_blocks.CUBLAS_LOOP:
        out = grouped_blocks.run_or_none(grouped_blocks.CUBLAS, "grouped FP8 block GEMM (cuBLAS loop)", cublas,
                                         instead="the Triton grouped kernels run")
        if out is not None:
            return out
    if choice is None:
        return None
    return grouped_blocks.run_or_none(grouped_blocks.ENABLED, "grouped FP8 block GEMM", triton)


def _grouped_mm(a: QuantizedPart, weights: ExpertWeights, e: int, direction: Direction, layout: TokenLayout,
                out_dtype: torch.dtype) -> torch.Tensor | None:
    """fprop (`direction` ROWWISE) / dgrad (COLUMNWISE) of all `e` experts in one grouped GEMM (FP8 blocks: the Triton
    kernels or the cuBLAS loop; MXFP8 on sm_90: the grouped bf16 emulation), or None where no grouped GEMM takes the
    operands (then one `gemm` per expert runs)."""
    if not weights.packed:
        return None
    b = weights.whole(direction)
    n_out = b.rows // e if direction == ROWWISE else b.rows
    if grouped_blocks.weight_supported(b, e):
        phase = grouped_blocks.FPROP if direction == ROWWISE else grouped_blocks.DGRAD
        shapes = a.cols % 128 == 0 and n_out % 16 == 0 and all(p % 16 == 0 for p in layout.padded)
        choice = _fp8_block_backend(a, b, phase, layout, a.cols, n_out, shapes)
        out = _run_fp8_block(choice, lambda: grouped_blocks.cublas_mm(
            a, b, e, layout.offsets, layout.padded, layout.splits, _bounds(layout, a.data.device), out_dtype),
            lambda: grouped_blocks.mm(a, b, e, _bounds(layout, a.data.device), out_dtype))
        if out is not None:
            return out
    if grouped_emulated.supports(a, b) and grouped_emulated.weight_supported(b, e):
        table = _bounds(layout, a.data.device).table
        return grouped_blocks.run_or_none(grouped_emulated.ENABLED, "grouped MXFP8 GEMM", lambda: grouped_emulated.mm(
            a, b, e, table[4], layout.rows, out_dtype, token_ends=table[5]))
    return None


def _grouped_wgrad(dy_col: QuantizedPart, x_col: QuantizedPart, layout: TokenLayout, n: int, k: int,
                   out_dtype: torch.dtype) -> torch.Tensor | None:
    """wgrad of every expert `[E, n, k]` in one grouped GEMM (as `_grouped_mm`), or None. The slots' zero tokens after
    each expert's padded count add zero products."""
    bounds = _bounds(layout, dy_col.data.device) if dy_col.data.is_cuda else None
    if bounds is not None and bounds.slots_aligned:
        shapes = n % 16 == 0 and k % 16 == 0 and x_col.block_shape[0] == 1 and all(p % 128 == 0 for p in layout.padded)
        choice = _fp8_block_backend(dy_col, x_col, grouped_blocks.WGRAD, layout, n, k, shapes)
        out = _run_fp8_block(choice, lambda: grouped_blocks.cublas_wgrad(dy_col, x_col, layout.offsets,
                                                                         layout.padded, out_dtype),
                             lambda: grouped_blocks.wgrad(dy_col, x_col, bounds, out_dtype))
        if out is not None:
            return out
    if grouped_emulated.supports(dy_col, x_col) and all(s % grouped_emulated.ALIGN == 0 for s in layout.slots):
        return grouped_blocks.run_or_none(grouped_emulated.ENABLED, "grouped MXFP8 GEMM",
                                          lambda: grouped_emulated.wgrad(dy_col, x_col, bounds.table[4], bounds.empty,
                                                                         out_dtype))
    return None


def _per_expert_mm(a: QuantizedPart, weights: ExpertWeights, direction: Direction, used, out_dtype: torch.dtype,
                   what: str) -> torch.Tensor:
    """fprop / dgrad as one `gemm` per expert with tokens, on its padded rows (the per-expert path's shapes); the
    rows of its tokens, in token order."""
    outs = []
    for g, o, p, m in used:
        y = gemm(a.row_slice(o, o + p, group=g), weights.part(g, direction), out_dtype, f"{what} (expert {g})")
        outs.append(y[:m] if p != m else y)
    return torch.cat(outs)


def quantize_slots(q: Quantizer, t: torch.Tensor, layout: TokenLayout, rowwise: bool, columnwise: bool, name: str,
                   draw_order=None) -> QuantizedTensor:
    """The routed tokens `t` quantized in the layout's slots, one call for all experts: `q.quantize_groups` of the
    packed buffer, or, where the grouped quantize takes it (CUDA, FP8 1x128 / MXFP8 1x32 blocks:
    `grouped_slots`), the same bytes and scales written straight from the token rows, without the packing copy."""
    g = q.split_granularity(rowwise, columnwise)[0]
    if layout.rows is not None and all(s % g == 0 for s in layout.slots):  # (else quantize_groups names the error)
        out = grouped_slots.quantize(q, t, layout.source_rows(t.device), rowwise, columnwise)
        if out is not None:
            return out
    return q.quantize_groups(layout.pack(t), layout.slots, rowwise=rowwise, columnwise=columnwise, name=name,
                             draw_order=draw_order)


def _check_slots(layout: TokenLayout, quantizers: dict[str, Quantizer]) -> None:
    """Per-expert statistics and draws (NVFP4) are those of the expert's padded slice: its slot must be exactly that
    (padded_tokens already gives whole 16-row blocks, so this holds; a layout that broke it would change draws)."""
    if layout.slots != layout.padded and not all(q.local_scaling for q in quantizers.values()):
        raise RuntimeError(f"packed row groups: expert slots {layout.slots} differ from the padded token counts "
                           f"{layout.padded}, which per-expert statistics need")


class PackedBlockExperts(torch.autograd.Function):
    """`y[tokens of e] = x[tokens of e] W[e]^T` for every expert e, block formats and NVFP4 (see the module
    docstring).
    `need_dgrad` / `need_wgrad`: the gradients backward will compute (what the columnwise forms are made for;
    inside forward, autograd's own flags ignore no_grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layout: TokenLayout, quantizers: dict[str, Quantizer],
                name: str, need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
        e, n, k = weight.shape
        used = _used(layout)
        ctx.layout, ctx.quantizers, ctx.layer_name = layout, quantizers, name
        ctx.w_shape, ctx.w_dtype = (e, n, k), weight.dtype
        gathered = isinstance(weight, GroupedGatheredForm)  # (FSDP2's: its columnwise form is read in backward)
        ctx.gathered = weight if gathered and need_dgrad else None
        if not used:  # no tokens: nothing to quantize (zero gradients)
            ctx.packed_weight = False
            save_quantized(ctx, None)
            return x.new_empty(0, n)
        _check_slots(layout, quantizers)
        # (stochastic rounding: the per-expert forward quantizes the experts' inputs first to last)
        xq = quantize_slots(quantizers["input"], x, layout, rowwise=True, columnwise=need_wgrad,
                            name=f"input of {name}")
        wq = (GatheredExpertWeights(weight, quantizers["weight"], ROWWISE) if gathered else
              ExpertWeights.quantize(quantizers["weight"], weight.detach(), need_dgrad, f"weight of {name}"))
        x_row = xq.part(ROWWISE)
        y = _grouped_mm(x_row, wq, e, ROWWISE, layout, x.dtype)
        if y is None:
            y = _per_expert_mm(x_row, wq, ROWWISE, used, x.dtype, f"fprop of {name}")
        # backward reads the input's columnwise form (wgrad) and the weight's (dgrad) only
        w_saved = wq.only(COLUMNWISE).tensors if need_dgrad and not gathered else []
        ctx.packed_weight = wq.packed
        save_quantized(ctx, _only(xq, COLUMNWISE) if need_wgrad else None, *w_saved)
        return y

    @staticmethod
    @first_order_only(lambda ctx: f"{ctx.layer_name} ({describe_quantizers(ctx.quantizers)})")
    def backward(ctx, dy: torch.Tensor):
        x_col, *w_saved = saved_quantized(ctx)
        layout: TokenLayout = ctx.layout
        name = ctx.layer_name
        e, n, k = ctx.w_shape
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        used = _used(layout)
        # the gathered experts' columnwise form, made available before anything depends on this rank's tokens (a
        # collective when the backward unshard did not gather it)
        gathered = (GatheredExpertWeights(ctx.gathered, ctx.quantizers["weight"], COLUMNWISE)
                    if ctx.gathered is not None and need_dgrad else None)
        dx = dy.new_zeros(0, k) if need_dgrad else None
        zero_dw = (lambda: dy.new_zeros(e, n, k, dtype=ctx.w_dtype)) if need_wgrad else (lambda: None)
        dw = None
        if not used or not (need_dgrad or need_wgrad):
            return dx, zero_dw(), None, None, None, None, None
        # (stochastic rounding: autograd runs the per-expert backward from the last expert to the first)
        dyq = quantize_slots(ctx.quantizers["grad_output"], dy, layout, rowwise=need_dgrad, columnwise=need_wgrad,
                             name=f"grad_output of {name}", draw_order=range(e - 1, -1, -1))
        if need_dgrad:  # dy rowwise x W columnwise
            weights = gathered if gathered is not None else ExpertWeights(w_saved, n, ctx.packed_weight)
            dy_row = dyq.part(ROWWISE)
            dx = _grouped_mm(dy_row, weights, e, COLUMNWISE, layout, dy.dtype)
            if dx is None:
                dx = _per_expert_mm(dy_row, weights, COLUMNWISE, used, dy.dtype, f"dgrad of {name}")
        if need_wgrad:  # dy columnwise x x columnwise, contracted over each expert's padded tokens
            dy_col, xc = dyq.part(COLUMNWISE), x_col.part(COLUMNWISE)
            dw = _grouped_wgrad(dy_col, xc, layout, n, k, dy.dtype)
            if dw is not None:
                dw = dw.to(ctx.w_dtype)
            else:  # (an expert without tokens keeps a zero gradient)
                dw = zero_dw()
                for g, o, p, _ in used:
                    dw[g] = gemm(dy_col.row_slice(o, o + p, group=g), xc.row_slice(o, o + p, group=g), dy.dtype,
                                 f"wgrad of {name} (expert {g})").to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None
