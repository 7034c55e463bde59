"""Base classes shared by every format: the per-direction quantized part and the quantizer.

A quantized tensor is a pair of *parts*, one per direction (docs/numerics.md "Terms"):
- the rowwise part holds the `[M, K]` matrix with scaling blocks along K (what fprop reads);
- the columnwise part holds the transposed `[K, M]` matrix with scaling blocks along M (what the
  transposed backward GEMMs read).
Both parts are therefore stored in GEMM orientation ("rows x contracted dim"), so every GEMM is
`A @ B^T` over two parts. A plain format supplies both parts; a hybrid takes them from two formats.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import torch

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
DIRECTIONS = (ROWWISE, COLUMNWISE)


_DTENSOR: list = []  # torch.distributed.tensor.DTensor, imported on first use


def is_dtensor(x) -> bool:
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(x, _DTENSOR[0])


def check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}")
    return direction


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """The `[M, K]` view of docs/numerics.md "Terms": M = prod(shape[:-1]), K = shape[-1]."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def shape_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    k = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, k


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """`t.t().contiguous()` (an exact layout change, used to turn a part between its stored and transposed
    layouts); on CUDA, 1-byte data goes through the extension's tiled transpose kernel."""
    if t.is_cuda and t.element_size() == 1:
        from ..kernels import transpose_bytes

        out = transpose_bytes(t)
        if out is not None:
            return out
    return t.t().contiguous()


class QuantizedPart:
    """One direction of a quantized tensor: a 2-D matrix in GEMM orientation plus its scales.

    Subclasses list their tensor fields in `tensor_fields` (None allowed) and everything else in
    `meta_fields`; `map_tensors` rebuilds the part with a function applied to every tensor field, which
    is all that detach / clone / device moves / pinning need.
    """

    format_name: ClassVar[str] = "?"
    tensor_fields: ClassVar[tuple[str, ...]] = ()
    meta_fields: ClassVar[tuple[str, ...]] = ()
    _field_set: ClassVar[frozenset] = frozenset()

    def __init__(self, *, rows: int, cols: int, columnwise: bool, **fields):
        self.rows = rows  # rows of the stored matrix (M for rowwise, K for columnwise)
        self.cols = cols  # contracted dim of the stored matrix
        self.columnwise = columnwise
        # (one comparison and one dict update: parts are built several times per Linear call, on the host's
        # critical path)
        if fields.keys() != self._field_set:
            raise TypeError(f"{type(self).__name__}: missing fields {sorted(self._field_set - fields.keys())}, "
                            f"unexpected fields {sorted(fields.keys() - self._field_set)}")
        self.__dict__.update(fields)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._field_set = frozenset(cls.tensor_fields + cls.meta_fields)

    # -- subclasses implement -------------------------------------------------------------------
    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        """Pure-PyTorch dequantization (the numerics contract)."""
        raise NotImplementedError

    @property
    def transform(self) -> str | None:
        """Name of an orthogonal transform applied along the contracted dim (e.g. "rht16"), else None.
        Two operands with the same transform can be multiplied without undoing it."""
        return None

    # -- generic --------------------------------------------------------------------------------
    def dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        """fp32 `[rows, cols]` matrix this part represents (in stored orientation); a device kernel when one
        is registered for this part type and device, else the reference."""
        from ..kernels import lookup_dequantize

        impl = lookup_dequantize(self, undo_transform)
        if impl is not None:
            return impl.run(self, undo_transform)
        return self.reference_dequantize_2d(undo_transform)

    @property
    def direction(self) -> str:
        return COLUMNWISE if self.columnwise else ROWWISE

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {n: getattr(self, n) for n in self.tensor_fields}

    def meta(self) -> dict:
        return {n: getattr(self, n) for n in self.meta_fields}

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedPart":
        fields = {n: (None if t is None else fn(t)) for n, t in self.tensors().items()}
        return type(self)(rows=self.rows, cols=self.cols, columnwise=self.columnwise, **fields, **self.meta())

    @property
    def device(self) -> torch.device:
        for n in self.tensor_fields:
            t = getattr(self, n)
            if t is not None:
                return t.device
        raise RuntimeError(f"{type(self).__name__} holds no tensor")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values() if t is not None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.direction}, [{self.rows}, {self.cols}])"

    # -- FSDP buffer protocol (hybridq.distributed talks to parts only through these two) ----------
    def extract_buffers(self, shard=None, *, tile_rows: int | None = None
                        ) -> tuple[list[tuple[str, torch.Tensor, int]], dict[str, torch.Tensor]]:
        """This part in dim-0-gatherable form: `(buffers, replicated)`.

        `buffers` is a list of `(name, tensor, row_block)`: the tensor's dim 0 runs over the block rows (of
        `row_block` rows of the full `[M, K]` tensor) that `shard` (a `RowShard`; None = the whole tensor)
        owns, in the original (rowwise) orientation, with scale padding stripped, so the buffers of all
        shards concatenate along dim 0 into the full tensor's buffers. A columnwise part is turned back
        (its transposed `[K, M]` layout becomes `[M, K]`). `replicated` holds tensors that every shard
        computes identically (a per-tensor scale, a global amax): they are not gathered. `tile_rows` says
        that a per-row scale repeats one tile scale on `tile_rows` consecutive rows (2-D weight tiles): it is
        then sent once per tile row. The part may be a shard part (see `_sharding.py`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the FSDP buffer protocol")

    @classmethod
    def assign_gathered(cls, buffers: dict[str, torch.Tensor], replicated: dict[str, torch.Tensor], *,
                        rows: int, cols: int, columnwise: bool, meta: dict,
                        tile_rows: int | None = None) -> "QuantizedPart":
        """Rebuild the full part (stored orientation `[rows, cols]`) from the gathered buffers (each the dim-0
        concatenation over all shards of what `extract_buffers` returned) and the replicated tensors:
        re-transposes columnwise layouts and re-expands tile scales."""
        raise NotImplementedError(f"{cls.__name__} does not implement the FSDP buffer protocol")


@dataclasses.dataclass
class Quantizer:
    """Base quantizer: usage flags plus the shape checks and part production of one format.

    `quantize(x)` returns a `QuantizedTensor` holding the directions asked for (the quantizer's usage
    flags unless overridden per call; per-call usage never mutates the quantizer, so an eval step can
    not leave a training step without its columnwise form).
    """

    rowwise: bool = dataclasses.field(default=True, kw_only=True)
    columnwise: bool = dataclasses.field(default=False, kw_only=True)

    format_name: ClassVar[str] = "?"

    # -- subclasses implement -------------------------------------------------------------------
    def reference_parts(
        self, x2d: torch.Tensor, rowwise: bool, columnwise: bool, **kw
    ) -> tuple[QuantizedPart | None, QuantizedPart | None]:
        """Pure-PyTorch quantization of a 2-D tensor into (rowwise part, columnwise part) (the contract)."""
        raise NotImplementedError

    def shape_rule(self, m: int, k: int, rowwise: bool, columnwise: bool) -> str | None:
        """Why a `[m, k]` tensor cannot be quantized in the requested directions, or None if it can."""
        return None

    def describe(self) -> str:
        return self.format_name

    # -- generic --------------------------------------------------------------------------------
    def quantize_parts(
        self, x2d: torch.Tensor, rowwise: bool, columnwise: bool, **kw
    ) -> tuple[QuantizedPart | None, QuantizedPart | None]:
        """The requested parts of `x2d`; a device kernel when one is registered and accepts the call,
        else the reference. Keyword arguments (e.g. a global amax) pass through to either."""
        if x2d.device.type != "cpu":  # (the references run on the CPU: no kernel lookup)
            from ..kernels import lookup_quantize

            impl = lookup_quantize(self, x2d, rowwise, columnwise, **kw)
            if impl is not None:
                return impl.run(self, x2d, rowwise, columnwise, **kw)
        return self.reference_parts(x2d, rowwise, columnwise, **kw)

    @property
    def usage(self) -> tuple[bool, bool]:
        """(rowwise, columnwise): the directions `quantize` produces when the call does not say."""
        return self.rowwise, self.columnwise

    def validate(self, shape, name: str = "tensor", *, rowwise: bool | None = None,
                 columnwise: bool | None = None) -> None:
        """Raise ValueError naming the tensor, the format and the rule if `shape` is not quantizable."""
        rowwise = self.usage[0] if rowwise is None else rowwise
        columnwise = self.usage[1] if columnwise is None else columnwise
        m, k = shape_2d(tuple(shape))
        why = self.shape_rule(m, k, rowwise, columnwise)
        if why is not None:
            shown = f" (shape {tuple(shape)})" if 0 not in tuple(shape) else ""
            raise ValueError(f"{self.describe()} {why} for {name}{shown}")

    def quantize(self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None,
                 name: str = "tensor") -> "QuantizedTensor":
        from ..tensor import QuantizedTensor

        rowwise = self.usage[0] if rowwise is None else rowwise
        columnwise = self.usage[1] if columnwise is None else columnwise
        if not (rowwise or columnwise):
            raise ValueError(f"{self.describe()}: quantize of {name} asked for neither direction")
        if isinstance(x, QuantizedTensor):
            raise TypeError(f"{self.describe()}: {name} is already quantized; dequantize() it first")
        if is_dtensor(x):
            # block and global statistics of a DTensor depend on its placement: quantizing the local shard
            # as if it were the whole tensor gives silently wrong numbers
            raise NotImplementedError(
                f"{self.describe()}: {name} is a DTensor ({x.placements}); hybridq quantizes plain tensors. "
                f"Tensor parallelism (parallelize_module) over hybridq layers is not supported yet; under FSDP2 "
                f"use hybridq.apply_hybrid_fsdp, which quantizes the local shards itself")
        if not x.is_floating_point():
            raise TypeError(f"{self.describe()}: {name} must be a floating-point tensor, got {x.dtype}")
        self.validate(x.shape, name, rowwise=rowwise, columnwise=columnwise)
        x2d = x.detach() if x.requires_grad else x
        row, col = self.quantize_parts(x2d if x2d.dim() == 2 else as_2d(x2d), rowwise, columnwise)
        return QuantizedTensor(row, col, shape=x.shape, dtype=x.dtype)

    def __call__(self, x: torch.Tensor, **kw) -> "QuantizedTensor":
        return self.quantize(x, **kw)

    @property
    def is_stateful(self) -> bool:
        """True for quantizers whose scale depends on earlier steps (delayed scaling)."""
        return False

    @property
    def is_deterministic(self) -> bool:
        """True when `quantize` is a pure function of its input (no state updated per cast, no random draws):
        an equal quantizer then gives the same result for the same tensor, so one quantization can be shared."""
        return not self.is_stateful

    def quantizers(self) -> tuple["Quantizer", ...]:
        """The plain quantizers this one is made of (itself, or a hybrid's two)."""
        return (self,)

    # -- sharded quantization (FSDP; see _sharding.py) ---------------------------------------------
    def shard_stats(self, x2d: torch.Tensor, shard) -> torch.Tensor | None:
        """Statistics that must be reduced across shards, for both directions: a flat fp32 tensor whose length
        depends only on the full shape and `shard`'s layout (same on every rank), such that an elementwise MAX
        over all shards (one all-reduce) gives what `reference_parts(x2d, ..., shard=shard, stats=...)` needs
        to quantize `x2d` (rows `[shard.offset, shard.end)` of the full tensor) exactly as the full tensor
        would be quantized. None when nothing has to be reduced (the default: every block lies in one row)."""
        return None

    def derive_part(self, part: QuantizedPart, direction: str, dtype: torch.dtype | None = None
                    ) -> QuantizedPart | None:
        """The `direction` part of a tensor computed from its other part (both produced by this quantizer from
        the same full tensor of `dtype`) when that is an exact transform (per-tensor FP8 transpose, 2-D tile
        transpose, ...), else None. FSDP gathers one direction and derives the other after the gather."""
        return None

    def buffer_hints(self, direction: str) -> dict:
        """Keyword arguments for the part's `extract_buffers` / `assign_gathered` (e.g. `tile_rows`)."""
        return {}

    def shard_is_plain(self, shard, rowwise: bool, columnwise: bool) -> bool:
        """True when plainly quantizing the shard's rows gives its rows of the full tensor's quantization (no
        cross-shard statistics, no split block): the plain path, device kernels included, can then be used."""
        return shard.is_whole
