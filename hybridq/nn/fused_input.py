"""Norm outputs that arrive at their Linear layers already quantized rowwise (Transformer Engine's LayerNormLinear
role, without merging the modules): hybridq.nn.RMSNorm / LayerNorm write the rowwise part of their readers' input
format in their own kernel, and `_quantize_input` (linear_function.py) takes it instead of quantizing y again.

[Note: pre-quantized norm outputs]
A norm cannot know from the model which quantizer its output meets, and users do not rewrite their model, so the
readers tell it:
1. Every forward of a norm (eager, not under torch.compile) records its output y in a side table (`_OUTPUTS`,
   keyed by the tensor object and its version, like the shared inputs): its `NormReaders` and, once it has one,
   the rowwise part of the registered quantizer.
2. A Linear quantizing its input x finds x there. If the entry holds a part its input quantizer's rowwise form is
   (`fusable_row_quantizer(q)` equal to the registered one), it takes that part, quantizes only the columnwise form
   (when backward needs one) from x itself, and the result is bitwise what quantizing x would have given: the part
   is the format's own quantization of y (CPU: the reference; CUDA: the fused kernel, bitwise the format's kernel).
   Otherwise it registers its quantizer with the norm (`NormReaders.register`) and quantizes as before.
3. The norm's next forward writes the registered quantizer's part (on CUDA in the same kernel: FP8 block 1x128 and
   MXFP8 1x32, where K is a whole number of blocks). A part that no reader took (a recipe changed, the readers went
   away) ends the registration, so the next reader registers anew: a stale registration costs at most one step.
One quantizer per norm: q/k/v (or w1/w3) share their input quantizer; readers with another rowwise format quantize
for themselves. Formats scaled by a tensor-wide statistic (per-tensor FP8, NVFP4's global amax) need all of y before
any row: for them the norm hands over max|y| instead (known_amax.py). Backward overrides and save_original_input
are unaffected: the forward's rowwise operand is the same bits, and what backward reads comes from x as before."""

from __future__ import annotations

import torch

from typing import Callable

from ..enums import COLUMNWISE, ROWWISE
from ..formats.base import QuantizedPart, Quantizer, is_dtensor
from ..kernels.norm_quantize import RowBlocks, fusable_row_quantizer, kernel_takes, row_blocks, row_part
from ..tensor import QuantizedTensor
from .known_amax import remember_amax
from .side_table import TensorSideTable

_OUTPUTS = TensorSideTable(slots=4)


class NormReaders:
    """The input quantizer of the Linear layers that read a norm's output (see [Note: pre-quantized norm outputs]):
    the plain rowwise quantizer whose part the norm writes, and whether its last part was taken."""

    __slots__ = ("quantizer", "produced", "taken")

    def __init__(self):
        self.quantizer: Quantizer | None = None
        self.produced = self.taken = False

    def for_step(self) -> Quantizer | None:
        """The quantizer to write a part of in this forward; a part the previous forward wrote that no reader took
        ends the registration."""
        if self.produced and not self.taken:
            self.quantizer = None
        self.produced = self.taken = False
        return self.quantizer

    def register(self, q: Quantizer) -> None:
        """A reader's input quantizer: the norm writes its rowwise part from the next forward on, if it can and
        no other quantizer is registered."""
        if self.quantizer is None:
            self.quantizer = fusable_row_quantizer(q)

    def __deepcopy__(self, memo) -> "NormReaders":  # (a copied model registers its own readers)
        return NormReaders()


def remember_output(y: torch.Tensor, readers: NormReaders, q: Quantizer | None, row: QuantizedPart | None) -> None:
    """Record a norm's output `y` with its readers and, when written, `q`'s rowwise part of y (`[M, K]` view)."""
    if torch.compiler.is_compiling() or y.is_inference():
        return
    readers.produced = row is not None
    _OUTPUTS.put(y, None, (readers, q, row))


def prequantized_input(q: Quantizer, x: torch.Tensor, x2d: torch.Tensor, columnwise: bool,
                       name: str) -> QuantizedTensor | None:
    """`x2d` (the `[M, K]` view of `x`) quantized by `q` from the rowwise part x's producing norm wrote (plus the
    columnwise form quantized from x2d when asked), or None -- then x's producer, if a norm, learns `q`."""
    if torch.compiler.is_compiling() or x.is_inference():
        return None
    entry = _OUTPUTS.find(x)
    if entry is None:
        return None
    readers, rq, row = entry
    if row is None or fusable_row_quantizer(q) != rq:
        readers.register(q)
        return None
    readers.taken = True
    col = q.quantize(x2d, rowwise=False, columnwise=True, name=name).part(COLUMNWISE) if columnwise else None
    return QuantizedTensor(row, col, shape=x2d.shape, dtype=x2d.dtype)


def reference_row_part(q: Quantizer, y2d: torch.Tensor, name: str) -> QuantizedPart:
    """`q`'s rowwise part of y where no fused kernel runs (the CPU, a shape the kernel does not take): the format's
    own quantization."""
    with torch.no_grad():
        return q.quantize(y2d.detach(), rowwise=True, columnwise=False, name=name).part(ROWWISE)


def produce(x: torch.Tensor, inputs: tuple[torch.Tensor, ...], kernel: Callable[[RowBlocks | None], tuple] | None,
            reference: Callable[[], torch.Tensor], readers: NormReaders | None, name: str) -> torch.Tensor:
    """The output y of a producer (a norm of `x`, SwiGLU of `x` and another input; `inputs`: the tensors its kernel
    reads, `x` first): `kernel(blocks)` -> (y, max|y|, rowwise data, scales) on CUDA (None: it does not apply), else
    `reference()`. In eager mode it records max|y| (known_amax) and, for the quantizer its `readers` registered,
    that format's rowwise part of y: from the kernel when it takes the format and shape (`blocks`), else from the
    format's quantize (not on CUDA: there the Linear quantizes y as it would without the norm)."""
    tracing = torch.compiler.is_compiling() or is_dtensor(x)
    rq = readers.for_step() if readers is not None and not tracing and not x.is_inference() else None
    if rq is not None and rq.shape_rule(x.numel() // max(x.shape[-1], 1), x.shape[-1], True, False) is not None:
        rq = None  # (the Linear's own cast raises the format's shape error, naming the layer)
    row = None
    if kernel is not None:
        takes = rq is not None and all(kernel_takes(t.reshape(-1, t.shape[-1]).contiguous(), rq) for t in inputs)
        blocks = row_blocks(rq) if takes else None
        y, amax, data, scale = kernel(blocks)
        if not tracing:
            remember_amax(y, amax)
            if blocks is not None:
                row = row_part(rq, data, scale)
    else:
        y = reference()
        if not tracing:
            with torch.no_grad():  # what the kernel computes in passing (a cast of y would compute it anyway)
                remember_amax(y, y.float().abs().amax() if y.numel() else y.new_zeros((), dtype=torch.float32))
            if rq is not None:
                row = reference_row_part(rq, y.reshape(-1, y.shape[-1]), f"output of {name}")
    if readers is not None and not tracing:
        remember_output(y, readers, rq, row)
    return y
