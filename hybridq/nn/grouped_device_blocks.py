"""The packed block path of `GroupedLinear` with `m_splits` as a device tensor: no host sync in forward or backward
(issue 30). For block formats without tensor-wide statistics (FP8 1x128 / 128x128 blocks, MXFP8: `BLOCKS`), the slot
layout is computed on the device (`grouped_packed.SlotLayout`: each expert's slot its count rounded up to
`slot_multiple` rows, offsets by a cumsum, a buffer of `bound_rows` rows: a bound from the shapes alone), the tokens
quantized straight into it (`grouped_slots`: FP8 1x128 / MXFP8 1x32 blocks, fed the device-built source-row map; else
the packing copy by the device's token rows, then one `quantize` of the buffer), and every phase runs as one grouped
GEMM reading the group bounds on the device (FP8 blocks: the Triton grouped kernels, `grouped_blocks.mm` / `wgrad`,
whose grids are bounded by the shapes; MXFP8 on sm_90: the grouped bf16 emulation, `grouped_emulated`). The cuBLAS
loop needs host counts: with device counts the Triton kernels run.

Numbers: bitwise the host-count packed path with the same GEMM backend, hence the per-expert path where that is: the
same quantized bytes (zero rows change no block's scale, and no block spans two experts: slots are whole blocks) and
the same GEMMs on the same operands; only where the bounds come from changes.

Where no grouped GEMM takes a phase's operands (no Triton, another device, a kernel failed once), that phase reads the
host counts (`SlotLayout.host`: a sync on a GPU) and runs one `gemm` per expert on the per-expert path's padded rows,
as the host-count path does. On the CPU (the reference) the counts are read when the layout is built.

`device_path_runs` says where the GroupedLinear takes this path eagerly: CUDA, the grouped GEMMs taking every phase of
these formats and shapes. `forward` / `backward` are also the compiled ops' bodies (nn/compiled_grouped_blocks.py).
"""

from __future__ import annotations

import math

import torch

from ..enums import COLUMNWISE, ROWWISE, Direction
from ..formats import MXFP8Quantizer
from ..formats.base import QuantizedPart, Quantizer
from ..gemm import gemm, native_row_multiple
from ..kernels import grouped_blocks, grouped_emulated, grouped_slots, native_gemm
from ..tensor import QuantizedTensor, save_quantized, saved_quantized
from ..weight_forms import GroupedGatheredForm
from .first_order import describe_quantizers, first_order_only
from .grouped_packed import SlotLayout, padded_tokens
from .grouped_packed_blocks import ExpertWeights, GatheredExpertWeights, _per_expert_mm, _used, token_multiple
from .linear_function import _SHARING, _only
from .side_table import TensorSideTable


def slot_multiple(quantizers: dict[str, Quantizer], need_dgrad: bool, need_wgrad: bool) -> int:
    """Rows each expert's slot is a multiple of: whole scaling blocks along the tokens of every cast (`token_multiple`:
    128 for FP8 1x128's columnwise blocks, 32 for MXFP8's) and 16 (the hardware GEMMs' row multiple, which the
    per-expert path pads to)."""
    return math.lcm(token_multiple(quantizers, need_dgrad, need_wgrad), 16)


def slot_layout(m_splits: torch.Tensor, x: torch.Tensor, in_features: int, out_features: int,
                quantizers: dict[str, Quantizer], need_dgrad: bool, need_wgrad: bool, name: str,
                fake: bool = False) -> SlotLayout:
    """The device-count slot layout of a call (the eager layer's and the compiled ops'): each slot whole scaling
    blocks along the tokens (`slot_multiple`), the per-expert GEMMs (where one runs) on the per-expert path's padded
    counts (`grouped_packed.padded_tokens`)."""
    multiple = native_row_multiple(x.device)

    def padded_of(m: int) -> int:
        return padded_tokens(m, in_features, out_features, quantizers, need_dgrad, need_wgrad, multiple)
    return SlotLayout.build(m_splits, x.shape[0], x.device, slot_multiple(quantizers, need_dgrad, need_wgrad),
                            padded_of, name, fake)


def _formats(quantizers: dict[str, Quantizer]) -> str | None:
    """"fp8" (E4M3 blocks: 1x128 tokens, 1x128 / 128x128 weight), "mxfp8" (1x32 blocks throughout) or None."""
    qs = [quantizers[t] for t in ("input", "weight", "grad_output")]
    if grouped_blocks.cublas_formats(quantizers):
        return "fp8"
    if all(type(q) is MXFP8Quantizer and not q.block_2d for q in qs):
        return "mxfp8"
    return None


_CAPABILITIES: dict = {}  # (a CUDA device with an index -> its compute capability: asked once, never changes)


def _capability(device: torch.device) -> tuple[int, int]:
    """`torch.cuda.get_device_capability(device)`, kept per device with an index (each GroupedLinear call asks, and
    the properties lookup behind it is host time on every call)."""
    cap = _CAPABILITIES.get(device)
    if cap is None:
        cap = torch.cuda.get_device_capability(device)
        if device.index is not None:  # ("cuda" alone is the current device, which may change)
            _CAPABILITIES[device] = cap
    return cap


def device_path_runs(quantizers: dict[str, Quantizer], device: torch.device, e: int, n: int, k: int) -> bool:
    """Whether every phase of experts `[e, n, k]` quantized by `quantizers` runs as a grouped GEMM on `device` with
    device counts (so the path never reads the counts on the host): CUDA sm_90, native GEMMs on, the FP8 block
    Triton kernels (a weight whose blocks stay inside an expert: N a multiple of 128) or the MXFP8 grouped emulation
    (K and N multiples of 16, each expert's weight rows 16-byte aligned)."""
    if device.type != "cuda" or not (torch.cuda.is_available() and native_gemm.native_enabled()):
        return False
    if _capability(device) != (9, 0) or e < 1:
        return False
    kind = _formats(quantizers)
    if kind == "fp8":
        return (grouped_blocks.ENABLED.on and grouped_blocks._triton() is not None and n % 128 == 0
                and n % quantizers["weight"].split_granularity(True, True)[0] == 0)
    if kind == "mxfp8":
        return (grouped_emulated.ENABLED.on and hasattr(torch, "_grouped_mm") and k % 16 == 0 and n % 32 == 0
                and grouped_emulated._ext.available_for(device))
    return False


def _quantize(q: Quantizer, t: torch.Tensor, layout: SlotLayout, rowwise: bool, columnwise: bool,
              name: str) -> QuantizedTensor:
    """The tokens `t` quantized in the layout's slots: straight from the token rows (`grouped_slots`, fed the
    device-built source-row map), else the packing copy then one `quantize` of the buffer (`quantize_groups` of
    local-scaling formats: the same bytes)."""
    out = grouped_slots.quantize(q, t, layout.source_rows(), rowwise, columnwise)
    if out is not None:
        return out
    return q.quantize(layout.pack(t), rowwise=rowwise, columnwise=columnwise, name=name)


class _SharedSlotInputs(TensorSideTable):
    """[Note: shared slot input] The experts' projections that read one input tensor on one routing (an MoE layer's
    gate and up projections, w1 and w3, on the dispatched tokens) quantize it into the slots once in eager: an entry
    is the input's slot quantization under (input quantizer, the layout's source-row map -- one tensor for every
    projection of a routing, `SlotLayout.build`), and serves an equal quantizer on the same map where it holds the
    columnwise form asked for: the same kernel on the same tokens and rows, so bitwise the second quantization
    (TensorSideTable: the same tensor object at the same version, never keeping it alive). Off where Linear's input
    sharing is (`shared_input_quantization(False)`), for non-deterministic quantizers and in the compiled ops' bodies
    (an op's outputs must be its own tensors: only the eager Function passes `share`). Saves a slot quantize (a launch,
    four allocations, one read of the tokens) per MoE layer and step, and one saved columnwise copy of the input."""

    def __init__(self):
        super().__init__(slots=2)

    @staticmethod
    def _same(key: tuple, q: Quantizer, source: torch.Tensor) -> bool:
        return (key[0] is q or key[0] == q) and key[1] is source

    def get(self, x: torch.Tensor, q: Quantizer, source: torch.Tensor, columnwise: bool) -> QuantizedTensor | None:
        return self.find(x, lambda key, xq: self._same(key, q, source) and (not columnwise or xq.has(COLUMNWISE)))

    def put(self, x: torch.Tensor, q: Quantizer, source: torch.Tensor, xq: QuantizedTensor) -> None:
        super().put(x, (q, source), xq, same_key=lambda key: self._same(key, q, source))


_SHARED_INPUTS = _SharedSlotInputs()


def _quantize_input(q: Quantizer, x: torch.Tensor, layout: SlotLayout, columnwise: bool, name: str,
                    share: bool) -> QuantizedTensor:
    """The input quantized in the layout's slots (rowwise, plus columnwise for wgrad), or the quantization another
    projection made of the same tensor on the same routing where `share` ([Note: shared slot input])."""
    share = share and _SHARING.on and q.is_deterministic and not x.is_inference()
    source = layout.source_rows() if share else None
    xq = _SHARED_INPUTS.get(x, q, source, columnwise) if share else None
    if xq is None:
        xq = _quantize(q, x, layout, True, columnwise, name)
        if share:
            _SHARED_INPUTS.put(x, q, source, xq)
    return xq


def _mm(a: QuantizedPart, weights: ExpertWeights, e: int, direction: Direction, layout: SlotLayout,
        out_dtype: torch.dtype, what: str) -> torch.Tensor:
    """fprop (`direction` ROWWISE) / dgrad (COLUMNWISE) of every expert, `[tokens, n]` in token order: one grouped GEMM
    on the device's bounds, else (host counts) one `gemm` per expert."""
    if layout.tokens == 0:  # (no product to compute: the grouped GEMMs are not asked for an empty one)
        n_out = weights.n if direction == ROWWISE else weights.part(0, direction).rows
        return a.data.new_zeros(0, n_out, dtype=out_dtype)
    if weights.packed:
        stacked = weights.stacked(direction)  # (FSDP2's gathered experts: read in place, no join)
        if (stacked is not None and grouped_blocks.supports(a, stacked[0])
                and grouped_blocks.weight_supported(stacked[0], 1) and grouped_blocks.stacked_supported(*stacked)):
            out = grouped_blocks.run_or_none(grouped_blocks.ENABLED, "grouped FP8 block GEMM", lambda: grouped_blocks.
                                             mm_stacked(a, *stacked, layout.bounds(), out_dtype))
            if out is not None:
                return out
        b = weights.whole(direction)
        out = None
        if grouped_blocks.supports(a, b) and grouped_blocks.weight_supported(b, e):
            out = grouped_blocks.run_or_none(grouped_blocks.ENABLED, "grouped FP8 block GEMM",
                                             lambda: grouped_blocks.mm(a, b, e, layout.bounds(), out_dtype))
        elif grouped_emulated.supports(a, b) and grouped_emulated.weight_supported(b, e):
            table = layout.table
            out = grouped_blocks.run_or_none(grouped_emulated.ENABLED, "grouped MXFP8 GEMM", lambda: grouped_emulated.
                                             mm(a, b, e, table[4], layout.token_rows, out_dtype, token_ends=table[5]))
        if out is not None:
            return out
    return _per_expert_mm(a, weights, direction, _used(layout.host()), out_dtype, what)


def _wgrad(dy_col: QuantizedPart, x_col: QuantizedPart, layout: SlotLayout, e: int, n: int, k: int,
           out_dtype: torch.dtype, what: str) -> torch.Tensor:
    """wgrad of every expert `[E, n, k]` (zero for an expert without tokens): one grouped GEMM contracted over each
    slot (its zero rows add zero products), else (host counts) one `gemm` per expert over its padded rows."""
    if layout.tokens == 0:
        return dy_col.data.new_zeros(e, n, k, dtype=out_dtype)
    out = None
    if grouped_blocks.supports(dy_col, x_col) and layout.multiple % grouped_blocks.BLOCK == 0:
        out = grouped_blocks.run_or_none(grouped_blocks.ENABLED, "grouped FP8 block GEMM",
                                         lambda: grouped_blocks.wgrad(dy_col, x_col, layout.bounds(), out_dtype))
    elif grouped_emulated.supports(dy_col, x_col) and layout.multiple % grouped_emulated.ALIGN == 0:
        out = grouped_blocks.run_or_none(grouped_emulated.ENABLED, "grouped MXFP8 GEMM", lambda: grouped_emulated.wgrad(
            dy_col, x_col, layout.table[4], [], out_dtype))
        if out is not None:  # (an empty group's product is not written by the grouped GEMM: zero it on the device)
            out = torch.where((layout.counts > 0)[:, None, None], out, out.new_zeros(()))
    if out is not None:
        return out
    dw = dy_col.data.new_zeros(e, n, k, dtype=out_dtype)
    for g, o, p, _ in _used(layout.host()):
        dw[g] = gemm(dy_col.row_slice(o, o + p, group=g), x_col.row_slice(o, o + p, group=g), out_dtype,
                     f"{what} (expert {g})")
    return dw


def forward(x: torch.Tensor, weight: torch.Tensor, layout: SlotLayout, quantizers: dict[str, Quantizer], name: str,
            need_dgrad: bool, need_wgrad: bool, fake: bool = False, share: bool = False
            ) -> tuple[torch.Tensor, QuantizedTensor | None, list[QuantizedTensor], bool]:
    """(y `[tokens, n]`, the input's columnwise form (wgrad) or None, the weight's columnwise tensors (dgrad), whether
    the weight is packed). `fake`: compile's tracing: the quantized forms are made (their shapes), y is not computed.
    `share`: the input's quantization may be another projection's ([Note: shared slot input]; eager only)."""
    e, n, k = weight.shape
    gathered = isinstance(weight, GroupedGatheredForm)  # FSDP2's: read as gathered, its columnwise form in backward
    xq = _quantize_input(quantizers["input"], x, layout, need_wgrad, f"input of {name}", share and not fake)
    wq = (GatheredExpertWeights(weight, quantizers["weight"], ROWWISE) if gathered else
          ExpertWeights.quantize(quantizers["weight"], weight.detach(), need_dgrad, f"weight of {name}"))
    y = (x.new_empty(x.shape[0], n) if fake else
         _mm(xq.part(ROWWISE), wq, e, ROWWISE, layout, x.dtype, f"fprop of {name}"))
    # backward reads the input's columnwise form (wgrad) and the weight's (dgrad) only
    return (y, _only(xq, COLUMNWISE) if need_wgrad else None,
            wq.only(COLUMNWISE).tensors if need_dgrad and not gathered else [], wq.packed)


def backward(dy: torch.Tensor, layout: SlotLayout, quantizers: dict[str, Quantizer], name: str,
             x_col: QuantizedTensor | None, w_saved: list[QuantizedTensor], packed_weight: bool,
             w_shape: tuple[int, int, int], w_dtype: torch.dtype, need_dgrad: bool, need_wgrad: bool,
             gathered: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dW) from what `forward` returned for backward (`gathered`: the FSDP2-gathered weight forward read, whose
    columnwise form dgrad reads); a gradient not asked for is None."""
    e, n, k = w_shape
    need_dgrad = need_dgrad and (bool(w_saved) or gathered is not None)
    need_wgrad = need_wgrad and x_col is not None
    if not (need_dgrad or need_wgrad):
        return None, None
    weights = None
    if need_dgrad:  # (the gathered columnwise form first: a collective when not gathered yet, whatever the tokens)
        weights = (GatheredExpertWeights(gathered, quantizers["weight"], COLUMNWISE) if gathered is not None else
                   ExpertWeights(w_saved, n, packed_weight))
    dyq = _quantize(quantizers["grad_output"], dy, layout, need_dgrad, need_wgrad, f"grad_output of {name}")
    dx = dw = None
    if need_dgrad:  # dy rowwise x W columnwise
        dx = _mm(dyq.part(ROWWISE), weights, e, COLUMNWISE, layout, dy.dtype, f"dgrad of {name}")
    if need_wgrad:  # dy columnwise x x columnwise, contracted over each expert's slot
        dw = _wgrad(dyq.part(COLUMNWISE), x_col.part(COLUMNWISE), layout, e, n, k, dy.dtype,
                    f"wgrad of {name}").to(w_dtype)
    return dx, dw


class DeviceBlockExperts(torch.autograd.Function):
    """`y[tokens of e] = x[tokens of e] W[e]^T` for every expert e with the counts on the device (module docstring).
    `need_dgrad` / `need_wgrad`: the gradients backward will compute."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layout: SlotLayout, quantizers: dict[str, Quantizer],
                name: str, need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
        y, x_col, w_saved, packed = forward(x, weight, layout, quantizers, name, need_dgrad, need_wgrad, share=True)
        ctx.layout, ctx.quantizers, ctx.layer_name, ctx.packed_weight = layout, quantizers, name, packed
        ctx.gathered = weight if isinstance(weight, GroupedGatheredForm) and need_dgrad else None
        ctx.w_shape, ctx.w_dtype, ctx.n_weight = tuple(weight.shape), weight.dtype, len(w_saved)
        save_quantized(ctx, x_col, *w_saved)
        return y

    @staticmethod
    @first_order_only(lambda ctx: f"{ctx.layer_name} ({describe_quantizers(ctx.quantizers)})")
    def backward(ctx, dy: torch.Tensor):
        x_col, *w_saved = saved_quantized(ctx)
        dx, dw = backward(dy.contiguous(), ctx.layout, ctx.quantizers, ctx.layer_name, x_col, w_saved,
                          ctx.packed_weight, ctx.w_shape, ctx.w_dtype, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                          ctx.gathered)
        if ctx.needs_input_grad[0] and dx is None:
            dx = dy.new_zeros(dy.shape[0], ctx.w_shape[2])
        if ctx.needs_input_grad[1] and dw is None:
            dw = dy.new_zeros(ctx.w_shape, dtype=ctx.w_dtype)
        return dx, dw, None, None, None, None, None
