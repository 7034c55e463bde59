"""The computation of a hybridq Linear, apart from the module: its configuration, the input sharing between layers
that read one tensor, the forward (what it saves for backward), the gradients, and the autograd function that joins
them (its three GEMMs read the directions of [Note: direction], enums.py). `Linear` (linear.py), `GroupedLinear`
(one call per expert), tensor parallelism and the compiled path (compiled_linear.py) all run it."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..formats.base import Quantizer
from ..gemm import gemm
from ..switches import Switch, Turned
from ..enums import COLUMNWISE, ROWWISE, BackwardOverride, Direction
from ..tensor import QuantizedTensor, save_quantized, saved_quantized
from ..weight_forms import HighPrecisionSource
from .first_order import describe_quantizers, first_order_only
from .fused_input import prequantized_input
from .known_amax import known_amax
from .side_table import TensorSideTable
from .weight_fingerprint import WeightFingerprint

log = logging.getLogger("hybridq")


class _LinearConfig:
    """What the autograd function needs from its module (a plain object: not saved as a tensor)."""

    __slots__ = ("name", "input_q", "weight_q", "grad_output_q", "backward_override", "save_original_input",
                 "input_gather")

    def __init__(self, module, backward_override: str | None):  # module: a Linear (or one expert's view of one)
        self.name = module.name
        self.input_q = module.input_quantizer
        self.weight_q = module.weight_quantizer
        self.grad_output_q = module.grad_output_quantizer
        self.backward_override = backward_override
        self.save_original_input = module.save_original_input
        # sequence parallelism (hybridq.distributed.sequence.SequenceGather): the input is this rank's rows of
        # the layer's whole input, quantized here and all-gathered in its quantized form; None: x is whole
        self.input_gather = None

    def describe(self) -> str:
        """The layer and its formats, for messages."""
        quantizers = {"input": self.input_q, "weight": self.weight_q, "grad_output": self.grad_output_q}
        override = ("" if self.backward_override is None
                    else f", backward_override={getattr(self.backward_override, 'value', self.backward_override)!r}")
        return f"{self.name} ({describe_quantizers(quantizers)}{override})"

    def replace(self, **changes) -> "_LinearConfig":
        new = object.__new__(_LinearConfig)
        for n in self.__slots__:
            setattr(new, n, changes.get(n, getattr(self, n)))
        return new


class SharedParts:
    """A shared input as the eager FP8 fast path quantized it (nn/float8_graph.py): its tensors as that path reads
    them (rowwise data, scale_inv, columnwise data, scale_inv; None for a direction not made) and `make`, which
    builds the QuantizedTensor the general path reads, once, when a layer on that path asks for it (building the
    wrapper subclass and its parts costs ~20 us of host time: the fast path's layers never need it)."""

    __slots__ = ("tensors", "_make", "_quantized", "__weakref__")

    def __init__(self, tensors: tuple, make: Callable[[], QuantizedTensor]):
        self.tensors = tensors
        self._make = make
        self._quantized = None

    def has(self, direction: str) -> bool:
        return self.tensors[0 if direction == ROWWISE else 2] is not None

    def quantized(self) -> QuantizedTensor:
        if self._quantized is None:
            self._quantized = self._make()
        return self._quantized


class _SharedInputs(TensorSideTable):
    """The last few quantized Linear inputs, so that layers reading the same tensor (wq/wk/wv, w1/w3) quantize
    it once: an entry serves an equal deterministic quantizer and the directions it holds (see TensorSideTable for
    when an entry lives). A value is a QuantizedTensor or the fast path's SharedParts (`get` answers the
    QuantizedTensor; the fast path reads `find_any`'s answer)."""

    def __init__(self):
        super().__init__(slots=2)

    def get(self, x: torch.Tensor, q: Quantizer, columnwise: bool) -> QuantizedTensor | None:
        xq = self.find_any(x, q, columnwise)
        return xq.quantized() if isinstance(xq, SharedParts) else xq

    def find_any(self, x: torch.Tensor, q: Quantizer, columnwise: bool) -> QuantizedTensor | SharedParts | None:
        return self.find(x, lambda eq, xq: (eq is q or eq == q) and (not columnwise or xq.has(COLUMNWISE)))

    def put(self, x: torch.Tensor, q: Quantizer, xq: QuantizedTensor | SharedParts) -> None:
        super().put(x, q, xq, same_key=lambda eq: eq is q or eq == q)


_SHARED = _SharedInputs()
# Layers reading one input tensor share one quantization of it, or each quantizes it (bitwise equal; tests compare
# the two). HYBRIDQ_SHARED_INPUT_QUANTIZATION=0 starts a process without sharing.
_SHARING = Switch("HYBRIDQ_SHARED_INPUT_QUANTIZATION")


class _SharingTurned(Turned):
    """The sharing switch turned: whenever it ends up off, the table is emptied (nothing is read from it then)."""

    __slots__ = ()

    def __init__(self, on: bool):
        super().__init__(_SHARING, on)
        if not on:
            _SHARED.clear()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if not _SHARING.on:
            _SHARED.clear()


def shared_input_quantization(enabled: bool) -> Turned:
    """Whether Linear layers reading the same input tensor share one quantization of it (default: on; the
    environment variable HYBRIDQ_SHARED_INPUT_QUANTIZATION=0 starts a process with it off). Only deterministic
    input quantizers are shared (`Quantizer.is_deterministic`: not delayed scaling, not stochastic rounding);
    results are bitwise equal either way. `shared_input_quantization(False)` turns sharing off from then on;
    `with shared_input_quantization(False): ...` only inside the block (like torch.set_grad_enabled)."""
    return _SharingTurned(enabled)


def _quantize_input(q: Quantizer, x: torch.Tensor, x2d: torch.Tensor, columnwise: bool,
                    name: str, gather=None) -> QuantizedTensor:
    """`x2d` (the `[M, K]` view of the Linear's input `x`) quantized rowwise (+ columnwise), reusing the
    quantization of another layer that read the same `x` when that is exact (see _SharedInputs). With `gather`
    (sequence parallelism), `x2d` is this rank's rows and the result the whole input's quantization, shared
    under the tensor the layers received (`gather.source`)."""
    if gather is not None:
        x = gather.source
    share = (_SHARING.on and q.is_deterministic and not x.is_inference()
             and not torch.compiler.is_compiling())
    if gather is not None:  # (its forward and backward gathers are shared by the gather itself)
        return gather.quantize(q, x2d, columnwise, name, share=share)
    xq = _SHARED.get(x, q, columnwise) if share else None
    # (a norm may have written the rowwise form already: [Note: pre-quantized norm outputs])
    if xq is None:
        xq = prequantized_input(q, x, x2d, columnwise, name)
        if share and xq is not None:
            _SHARED.put(x, q, xq)
    if xq is None:
        amax = None if torch.compiler.is_compiling() else known_amax(x)  # (its producer computed max|x|)
        stats = None if amax is None else q.stats_from_amax(amax, True, columnwise)
        kw = {} if stats is None else {"global_stats": stats}
        xq = q.quantize(x2d, rowwise=True, columnwise=columnwise, name=name, **kw)
        if share:
            _SHARED.put(x, q, xq)
    return xq


def _only(q: QuantizedTensor, direction: Direction) -> QuantizedTensor:
    """Keep a single direction (drop what backward does not read, so it is not held in memory). Taken by reference
    (`held_part`): FSDP2's backward unshard fills a gathered weight's columnwise part after this forward."""
    if direction == COLUMNWISE:
        return QuantizedTensor(None, q.held_part(COLUMNWISE), shape=q.shape, dtype=q.dtype)
    return QuantizedTensor(q.held_part(ROWWISE), None, shape=q.shape, dtype=q.dtype)


def _fprop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cached_weight: QuantizedTensor | None,
           cfg: _LinearConfig, x_col: bool, w_col: bool
           ) -> tuple[torch.Tensor, QuantizedTensor, QuantizedTensor, torch.Tensor]:
    """`y = x W^T + b` on the rowwise forms; the input and weight are quantized rowwise plus columnwise where
    `x_col` / `w_col` ask (for backward), so only those directions' shape rules apply. Returns (the `[M, K]`
    view of x, quantized x, quantized W, y `[M, N]`)."""
    x2d = x.reshape(-1, x.shape[-1])
    xq = _quantize_input(cfg.input_q, x, x2d, x_col, f"input of {cfg.name}", cfg.input_gather)
    if cached_weight is not None:  # the is_first_microbatch cache, or a quantized parameter's call form
        wq = cached_weight
    elif isinstance(weight, QuantizedTensor):  # already quantized (e.g. gathered by FSDP2)
        wq = weight
    else:
        wq = cfg.weight_q.quantize(weight, rowwise=True, columnwise=w_col, name=f"weight of {cfg.name}")
    y = gemm(xq.part(ROWWISE), wq.part(ROWWISE), x.dtype, f"fprop of {cfg.name}")
    if bias is not None:
        y = y + bias.to(x.dtype)
    return x2d, xq, wq, y


def _forward_only(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cached_weight: QuantizedTensor | None, cfg: _LinearConfig) -> torch.Tensor:
    """The forward of a call that no gradient will flow through (no_grad, inference_mode, or nothing requires
    grad): rowwise forms only, rowwise shape rules only, nothing saved."""
    _, _, _, y = _fprop(x, weight, bias, cached_weight, cfg, False, False)
    return _output(y, x, cfg)


def _output(y: torch.Tensor, x: torch.Tensor, cfg: _LinearConfig) -> torch.Tensor:
    """The `[M, N]` GEMM result in the input's leading shape (the whole input's under sequence parallelism), as
    a tensor of its own rather than a view (as aten::matmul returns it): FSDP2 drops the pre-backward hook of a
    module whose output is a view, and warns."""
    lead = x.shape[:-1] if cfg.input_gather is None else cfg.input_gather.full_shape[:-1]
    return torch.ops.aten._unsafe_view(y.contiguous(), (*lead, y.shape[-1]))


def cached_quantized_weight(cache: tuple[Any, QuantizedTensor, WeightFingerprint] | None, cache_columnwise: bool,
                            w: torch.Tensor, q: Quantizer, is_first_microbatch: bool, need_columnwise: bool, name: str
                            ) -> tuple[tuple[Any, QuantizedTensor, WeightFingerprint], bool, QuantizedTensor]:
    """The is_first_microbatch weight cache: returns (new cache entry (key, quantized weight, fingerprint), new
    columnwise flag, quantized weight). The weight is quantized again on the first micro-batch, when it changed
    or when a direction asked for now or before is missing: the cache keeps every direction it was ever asked
    for (usage preservation). A change is seen from the key (storage or version) or, for writes that change
    neither (through `.data`), from the weight's fingerprint: at once on the CPU (re-quantized with a warning),
    asynchronously on a GPU (StaleWeightError at a later call: see weight_fingerprint.py)."""
    key = (w.data_ptr(), w._version)
    cache_columnwise |= need_columnwise
    if cache is not None:  # what the asynchronous checks of earlier calls found (waited for on a refresh)
        cache[2].check(name, wait=is_first_microbatch)
    stale = cache is None or cache[0] != key or (not is_first_microbatch and cache[2].changed(w))
    if not is_first_microbatch and cache is not None and stale:
        log.warning("%s: is_first_microbatch=False but the weight changed since it was quantized; "
                    "quantizing it again", name)
    missing = cache is not None and cache_columnwise and not cache[1].has(COLUMNWISE)
    if is_first_microbatch or stale or missing:
        cache = (key, q.quantize(w.detach(), rowwise=True, columnwise=cache_columnwise, name=f"weight of {name}"),
                 WeightFingerprint(w))
    return cache, cache_columnwise, cache[1]


def forward_and_saved(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      cached_weight: QuantizedTensor | None, cfg: _LinearConfig, need_dgrad: bool, need_wgrad: bool
                      ) -> tuple[torch.Tensor, Any, Any]:
    """The forward of a call that gradients flow through: (y `[M, N]`, what wgrad reads, what dgrad reads). The
    saved operands are quantized forms holding only the direction backward reads, or -- with
    backward_override="high_precision" or save_original_input -- the input's `[M, K]` view and the weight."""
    override = cfg.backward_override
    # With an override set, forward quantizes rowwise only: backward never reads a columnwise form.
    x_col = need_wgrad and override is None and not cfg.save_original_input
    w_col = need_dgrad and override is None
    x2d, xq, wq, y = _fprop(x, weight, bias, cached_weight, cfg, x_col, w_col)
    # sequence parallelism gathering wgrad's input in backward: this rank's own form of it (sequence.py)
    x_local = None if cfg.input_gather is None else cfg.input_gather.local_for_wgrad(x_col)
    if override == BackwardOverride.HIGH_PRECISION:
        saved_w = weight if need_dgrad else None
        if need_dgrad and isinstance(weight, QuantizedTensor):
            # a weight that can give its high-precision form (FSDP2's GatheredWeight: the backward unshard
            # gathers it in param_dtype) is kept as a handle; any other quantized weight is dequantized
            saved_w = weight.detach() if isinstance(weight, HighPrecisionSource) else weight.dequantize()
        saved_x = x2d if need_wgrad else None
    elif override == BackwardOverride.DEQUANTIZED:
        saved_x = _only(xq, ROWWISE) if need_wgrad else None
        saved_w = _only(wq, ROWWISE) if need_dgrad else None
    else:
        saved_x = (x2d if cfg.save_original_input else (_only(xq, COLUMNWISE) if x_local is None else x_local)
                   ) if need_wgrad else None
        saved_w = _only(wq, COLUMNWISE) if need_dgrad else None
    return y, saved_x, saved_w


def linear_grads(cfg: _LinearConfig, dy: torch.Tensor, saved_x: Any, saved_w: Any, need_dgrad: bool,
                 need_wgrad: bool, need_bgrad: bool, x_shape: torch.Size, w_dtype: torch.dtype,
                 b_dtype: torch.dtype | None) -> tuple[torch.Tensor | None, ...]:
    """(dx in `x_shape`, dw, db) from the output gradient and what `forward_and_saved` saved."""
    dy2d = dy.reshape(-1, dy.shape[-1])
    if not dy2d.is_contiguous():
        dy2d = dy2d.contiguous()
    dx = dw = None
    override = cfg.backward_override
    gather = cfg.input_gather
    # wgrad's input: under sequence parallelism all-gathered from what this rank saved, issued now (async) so that
    # it overlaps dgrad, and waited for at wgrad
    wgrad_x = gather.start_backward(saved_x) if gather is not None and need_wgrad else lambda: saved_x

    if override == BackwardOverride.HIGH_PRECISION:
        # the same ops as torch's own linear backward, so the gradients match an unquantized Linear
        if need_dgrad:
            w = saved_w.high_precision() if isinstance(saved_w, QuantizedTensor) else saved_w
            dx = dy2d.mm(w.to(dy.dtype))
        if need_wgrad:
            dw = dy2d.t().mm(wgrad_x().to(dy.dtype))
    elif override == BackwardOverride.DEQUANTIZED:
        if need_dgrad:
            dx = dy2d.mm(saved_w.dequantize(dy.dtype))
        if need_wgrad:
            dw = dy2d.t().mm(wgrad_x().dequantize(dy.dtype))
    elif need_dgrad or need_wgrad:  # (a bias-only backward quantizes nothing)
        dyq = cfg.grad_output_q.quantize(dy2d, rowwise=need_dgrad, columnwise=need_wgrad,
                                         name=f"grad_output of {cfg.name}")
        if need_dgrad:
            dx = gemm(dyq.part(ROWWISE), saved_w.part(COLUMNWISE), dy.dtype, f"dgrad of {cfg.name}")
        if need_wgrad:
            xq = wgrad_x()
            if not isinstance(xq, QuantizedTensor):  # save_original_input: quantize it now
                xq = cfg.input_q.quantize(xq, rowwise=False, columnwise=True, name=f"input of {cfg.name}")
            dw = gemm(dyq.part(COLUMNWISE), xq.part(COLUMNWISE), dy.dtype, f"wgrad of {cfg.name}")

    if dx is not None:
        dx = dx.reshape(x_shape) if gather is None else gather.reduce_grad(dx)
    if dw is not None:
        dw = dw.to(w_dtype)
    db = dy2d.sum(0).to(b_dtype) if need_bgrad else None
    return dx, dw, db


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cached_weight: QuantizedTensor | None, cfg: _LinearConfig) -> torch.Tensor:
        y, saved_x, saved_w = forward_and_saved(x, weight, bias, cached_weight, cfg, ctx.needs_input_grad[0],
                                                ctx.needs_input_grad[1])
        # a weight quantized before this call (FSDP2's gathered weight, whose buffers its backward unshard refills;
        # the is_first_microbatch cache) is a handle kept on ctx; what this call quantized goes through the
        # saved-tensor hooks as plain tensors (offload, checkpointing: see save_quantized)
        save_quantized(ctx, saved_x, saved_w,
                       keep=(False, isinstance(saved_w, QuantizedTensor)
                             and (isinstance(weight, QuantizedTensor) or cached_weight is not None)))
        ctx.cfg = cfg
        ctx.x_shape = x.shape
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return _output(y, x, cfg)

    @staticmethod
    @first_order_only(lambda ctx: ctx.cfg.describe())
    def backward(ctx, dy: torch.Tensor):
        saved_x, saved_w = saved_quantized(ctx)
        need_bgrad = ctx.b_dtype is not None and ctx.needs_input_grad[2]
        dx, dw, db = linear_grads(ctx.cfg, dy, saved_x, saved_w, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                  need_bgrad, ctx.x_shape, ctx.w_dtype, ctx.b_dtype)
        return dx, dw, db, None, None


class _EmptyProduct(torch.autograd.Function):
    """`x W^T + b` of a layer with in_features or out_features 0, as nn.Linear computes it: the product has no
    element to quantize and is exact in any precision (zeros: the output is the bias, or has no columns), and so
    are its gradients (dx zeros or empty, dW empty, db the summed output gradient). Reads only the weight's shape
    and dtype, so a weight held quantized takes it too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.meta = (x.shape, tuple(weight.shape), weight.dtype, None if bias is None else bias.dtype)
        shape = (*x.shape[:-1], weight.shape[0])
        if bias is None:
            return x.new_zeros(shape)
        return bias.to(x.dtype).expand(shape).clone(memory_format=torch.contiguous_format)  # (never the bias itself)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_shape, w_shape, w_dtype, b_dtype = ctx.meta
        dx = dy.new_zeros(x_shape) if ctx.needs_input_grad[0] else None
        dw = dy.new_zeros(w_shape, dtype=w_dtype) if ctx.needs_input_grad[1] else None
        db = (dy.reshape(dy.shape[:-1].numel(), dy.shape[-1]).sum(0).to(b_dtype)  # (linear_grads' bias gradient)
              if b_dtype is not None and ctx.needs_input_grad[2] else None)
        return dx, dw, db


def gradients_needed(x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, bool]:
    """(need_dgrad, need_wgrad) of a call: what backward will differentiate. Nothing under no_grad /
    inference_mode (torch.autograd.Function's ctx.needs_input_grad only looks at requires_grad)."""
    grad = torch.is_grad_enabled()
    return grad and x.requires_grad, grad and weight.requires_grad


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: _LinearConfig,
                 weight_cache: Callable[[bool], QuantizedTensor] | None = None) -> torch.Tensor:
    """`x W^T + b` with the three GEMMs on `cfg`'s quantizers (the computation of one Linear; GroupedLinear runs
    it once per expert). `weight_cache(need_columnwise)`, when given, returns the cached quantized weight."""
    if x.shape[-1] == 0 or weight.shape[0] == 0:  # (in_features or out_features 0: nothing to quantize)
        return _EmptyProduct.apply(x, weight, bias)
    need_dgrad, need_wgrad = gradients_needed(x, weight)
    needs_grad = need_dgrad or need_wgrad or (torch.is_grad_enabled() and bias is not None and bias.requires_grad)
    cached = None
    if weight_cache is not None:
        cached = weight_cache(cfg.backward_override is None and need_dgrad)
    if not needs_grad:
        return _forward_only(x, weight, bias, cached, cfg)
    return _LinearFunction.apply(x, weight, bias, cached, cfg)
