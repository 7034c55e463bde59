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
import enum
import functools
from typing import Callable, ClassVar, NamedTuple, Sequence

import torch

from .. import dispatch
from ..enums import COLUMNWISE, ROWWISE, Direction
from ..errors import FormatShapeError
from ..tensor import QuantizedTensor, register_part_type


_DTENSOR: list = []  # torch.distributed.tensor.DTensor, imported on first use


def is_dtensor(x) -> bool:
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(x, _DTENSOR[0])


def check_direction(direction: str) -> Direction:
    return Direction.parse(direction, "direction")


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
        out = dispatch.transpose_bytes(t)
        if out is not None:
            return out
    return t.t().contiguous()


def transposed_copy_into(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`transposed_copy(t)`'s bytes written into `out` (contiguous `[cols, rows]` of `t`'s dtype: an own buffer that
    already holds its storage, e.g. one FSDP2 allocated) instead of a fresh allocation; on CUDA, 1-byte data goes
    through the extension's tiled transpose into the buffer, elsewhere a strided copy. Returns `out`."""
    if t.dim() != 2 or tuple(out.shape) != (t.shape[1], t.shape[0]) or out.dtype != t.dtype \
            or not out.is_contiguous() or out.device != t.device:
        raise ValueError(f"transposed_copy_into: out {tuple(out.shape)} {out.dtype} on {out.device} (contiguous "
                         f"{out.is_contiguous()}) must be the contiguous transpose of {tuple(t.shape)} {t.dtype} on "
                         f"{t.device}")
    if t.is_cuda and t.element_size() == 1 and dispatch.transpose_bytes_into(t, out):  # (any 1-byte dtype)
        return out
    out.copy_(t.t())
    return out


def transposed_copies_into(pairs: list) -> None:
    """`transposed_copy_into(t, out)` for every `(t, out)` of `pairs`, each checked before any is written; 1-byte CUDA
    tensors in one call of the device's list transpose where it has one (a unit's derived columnwise forms, [Note:
    unit fill]), the others one by one."""
    for t, out in pairs:
        if t.dim() != 2 or tuple(out.shape) != (t.shape[1], t.shape[0]) or out.dtype != t.dtype \
                or not out.is_contiguous() or out.device != t.device:
            transposed_copy_into(t, out)  # (raises, naming the pair; nothing written yet)
    if not pairs:
        return
    if not pairs[0][0].is_cuda:  # (the CPU: transposed_copy_into's strided copy, its checks made above)
        for t, out in pairs:
            out.copy_(t.t())
        return
    if len(pairs) > 1 and all(t.is_cuda and t.element_size() == 1 for t, _ in pairs) and \
            dispatch.transpose_bytes_into_list([t for t, _ in pairs], [o for _, o in pairs]):
        return
    for t, out in pairs:
        transposed_copy_into(t, out)


@functools.lru_cache(maxsize=None)
def option_names(cls: type) -> frozenset[str]:
    """The options (dataclass fields) of a quantizer class: the names a kernel checks it implements before it takes
    a quantizer, so that an option added later is never silently ignored. Cached per class (asked on every call)."""
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()


class ScaleLayout(enum.Enum):
    """How a part's scales cover its stored `[rows, cols]` matrix: what a hardware GEMM asks of its operands
    (`hybridq.dispatch.register_layout_gemm` selects by it, with `QuantizedPart.block_shape` and `scale_dtype`)."""

    TENSOR = "tensor"  # one scale for the whole part
    ROW = "row"  # one scale per stored row (all of the contracted dim)
    BLOCK = "block"  # one scale per `block_shape` block (1 x b along the contracted dim, or b x b tiles)
    NONE = "none"  # no scale (a high-precision passthrough)


class OperandKind(NamedTuple):
    """What a hardware GEMM needs to know of an operand before it looks at shapes and devices, as its part declares
    it (`QuantizedPart.gemm_kind`): how the scales cover the stored matrix, the stored rows x cols one scale covers
    (`BLOCK` layouts: `(1, b)` along the contracted dim, `(b, b)` tiles) and the dtype the scales decode as.
    `hybridq.dispatch.register_layout_gemm` keys GEMMs by it, so a new format whose parts declare a kind gets that
    kind's GEMMs without being named anywhere."""

    layout: ScaleLayout
    block: tuple[int, int] | None = None
    scale_dtype: torch.dtype | None = None


# [Note: part]
# A part is one direction of one quantized tensor (see [Note: direction], hybridq/enums.py) in one format: its own
# tensors (data, scales, a global amax...) and metadata, `rows` x `cols` as stored (a columnwise part is stored
# transposed). A QuantizedTensor (tensor.py) holds a rowwise and/or a columnwise part; a GEMM reads two parts; the
# distributed code moves parts as buffers that concatenate along dim 0 (GatherablePart, see [Note: payload]). The
# quantizer decides the numbers; the part only stores them, dequantizes them and describes them (`meta`, scale
# layout, bytes), so that code outside formats/ needs no format's name.
class QuantizedPart:
    """One direction of a quantized tensor: a 2-D matrix in GEMM orientation plus its scales.

    Subclasses list their tensor fields in `tensor_fields` (None allowed) and everything else in
    `meta_fields`; `map_tensors` rebuilds the part with a function applied to every tensor field, which
    is all that detach / clone / device moves / pinning need. Its tensors are contiguous wherever the part is made
    (the CPU reference as the CUDA kernels): a device move keeps a part's strides, and the kernels and GEMMs that
    read it take only contiguous tensors.
    """

    format_name: ClassVar[str] = "?"
    scale_layout: ClassVar[ScaleLayout | None] = None  # None: not declared (GEMMs are then keyed by part type)
    scale_dtype: ClassVar[torch.dtype | None] = None  # what the scales decode as (E8M0 stored as bytes included)
    quantizer_type: ClassVar[type | None] = None  # the quantizer class whose default instance makes this part type
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
        register_part_type(cls)  # loadable by name (pickle, torch.load)

    # -- subclasses implement -------------------------------------------------------------------
    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        """Pure-PyTorch dequantization (the numerics contract)."""
        raise NotImplementedError

    def element_values(self) -> torch.Tensor:
        """The stored element values before scaling, 2-D in stored orientation, as comparable integers or floats
        (fp8 bytes, unpacked 4-bit codes, a passthrough's data): what a test compares bit for bit."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its element values")

    def element_scales(self) -> torch.Tensor:
        """The fp32 decode scale of every element (stored orientation): dequantize = decode(values) * scales."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its element scales")

    @property
    def transform(self) -> str | None:
        """Name of an orthogonal transform applied along the contracted dim (e.g. "rht16"), else None.
        Two operands with the same transform can be multiplied without undoing it."""
        return None

    # -- what a hardware GEMM reads (declared, so that kernels/native_gemm.py names no format) ----------
    @property
    def block_shape(self) -> tuple[int, int] | None:
        """Stored rows x cols that one stored scale covers, for `ScaleLayout.BLOCK` parts (else None)."""
        return None

    @property
    def scales(self) -> torch.Tensor | None:
        """The decode scales as stored (`scale_layout` and `block_shape` say how they cover the data; None: none)."""
        return None

    @property
    def global_decode_scale(self) -> torch.Tensor | None:
        """An fp32 `[1]` factor every element is multiplied by on top of its block scale (a tensor-wide decode
        scale), or None."""
        return None

    @property
    def element_dtype(self) -> torch.dtype:
        """The dtype of the stored elements as a GEMM names them (packed 4-bit pairs: `torch.float4_e2m1fn_x2`)."""
        return self.data.dtype

    @property
    def gemm_kind(self) -> OperandKind | None:
        """`OperandKind` of this part (None where it declares no scale layout)."""
        if self.scale_layout is None:
            return None
        return OperandKind(self.scale_layout, self.block_shape, self.scale_dtype)

    # -- generic --------------------------------------------------------------------------------
    def dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        """fp32 `[rows, cols]` matrix this part represents (in stored orientation); a device kernel when one
        is registered for this part type and device, else the reference."""
        impl = dispatch.lookup_dequantize(self, undo_transform)
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

    # -- what a format states about itself (docs/numerics.md; the test suite reads these, so a new format is
    # -- covered by the existing tests without editing them) ------------------------------------------------------
    @property
    def round_trip_bound(self) -> float:
        """The stated bound on ||dequantize(quantize(x)) - x|| / ||x|| for x ~ N(0, 1) (docs/numerics.md)."""
        raise NotImplementedError(f"{type(self).__name__} states no round-trip error bound")

    def storage_bytes(self, m: int, k: int, rowwise: bool, columnwise: bool,
                      dtype: torch.dtype = torch.float32) -> int:
        """Bytes the requested parts of a `[m, k]` tensor of `dtype` take (each part's `nbytes`, a buffer two parts
        share counted in each), by the format's definition."""
        raise NotImplementedError(f"{type(self).__name__} states no storage size")

    @property
    def columnwise_is_transpose(self) -> bool:
        """True when the columnwise part stores the exact transpose of the rowwise part (values and scales), by the
        format's definition (one scale per tensor, or square tiles shared by both directions)."""
        return False

    # -- generic --------------------------------------------------------------------------------
    def quantize_parts(
        self, x2d: torch.Tensor, rowwise: bool, columnwise: bool, **kw
    ) -> tuple[QuantizedPart | None, QuantizedPart | None]:
        """The requested parts of `x2d`; a device kernel when one is registered and accepts the call,
        else the reference. Keyword arguments (e.g. a global amax) pass through to either."""
        if x2d.device.type != "cpu":  # (the references run on the CPU: no kernel lookup)
            impl = dispatch.lookup_quantize(self, x2d, rowwise, columnwise, **kw)
            if impl is not None:
                return impl.run(self, x2d, rowwise, columnwise, **kw)
        return self.reference_parts(x2d, rowwise, columnwise, **kw)

    @property
    def usage(self) -> tuple[bool, bool]:
        """(rowwise, columnwise): the directions `quantize` produces when the call does not say."""
        return self.rowwise, self.columnwise

    def validate(self, shape, name: str = "tensor", *, rowwise: bool | None = None,
                 columnwise: bool | None = None) -> None:
        """Raise FormatShapeError (a ValueError) naming the tensor, the format and the rule if `shape` is not
        quantizable."""
        rowwise = self.usage[0] if rowwise is None else rowwise
        columnwise = self.usage[1] if columnwise is None else columnwise
        m, k = shape_2d(tuple(shape))
        why = self.shape_rule(m, k, rowwise, columnwise)
        if why is not None:
            shown = f" (shape {tuple(shape)})" if 0 not in tuple(shape) else ""
            raise FormatShapeError(f"{self.describe()} {why} for {name}{shown}")

    def stats_from_amax(self, amax: torch.Tensor, rowwise: bool, columnwise: bool) -> torch.Tensor | None:
        """This format's `global_stats` of a tensor whose max|x| is `amax`, when they are that value alone (per-tensor
        current scaling); None when they are something else or there are none (then `quantize` computes what it
        needs itself)."""
        return None

    def quantize(self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None,
                 name: str = "tensor", global_stats: torch.Tensor | None = None) -> QuantizedTensor:
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
                f"Tensor-parallel layers: parallelize them with hybridq.distributed.ColwiseParallel / "
                f"RowwiseParallel; under FSDP2 use hybridq.apply_hybrid_fsdp (both quantize the local pieces "
                f"with the whole tensor's statistics)")
        if not x.is_floating_point():
            raise TypeError(f"{self.describe()}: {name} must be a floating-point tensor, got {x.dtype}")
        self.validate(x.shape, name, rowwise=rowwise, columnwise=columnwise)
        x2d = x.detach() if x.requires_grad else x
        kw = {} if global_stats is None else {"global_stats": global_stats}  # (e.g. a max|x| known beforehand)
        row, col = self.quantize_parts(x2d if x2d.dim() == 2 else as_2d(x2d), rowwise, columnwise, **kw)
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

    @property
    def packs_row_groups(self) -> bool:
        """True when `quantize_groups` quantizes consecutive row groups of one buffer in one call, each
        group bitwise as it would be quantized alone: the formats with `local_scaling` (one plain quantization of
        the buffer) and those that keep their tensor-wide statistics per group (NVFP4's global amaxes)."""
        return self.local_scaling

    def quantize_groups(self, x2d: torch.Tensor, sizes: Sequence[int], *, rowwise: bool = True,
                        columnwise: bool = False, name: str = "tensor",
                        draw_order: Sequence[int] | None = None) -> QuantizedTensor:
        """Quantize the consecutive row groups of `x2d` (group g: the next `sizes[g]` rows) in one call, each group
        exactly as quantizing it alone would: its rows of the result, `part(d).row_slice(start, stop, group=g)`, are
        bitwise that quantization (GroupedLinear's packed paths: one group per expert).

        With `local_scaling` this is one plain `quantize` of `x2d`: every group must be a whole number of the
        scaling blocks along the rows (`split_granularity(...)[0]`; the caller pads groups with zero rows, which
        change no block's scale). Formats with per-group statistics override it (NVFP4). `draw_order`: the order
        in which the groups draw their stochastic-rounding numbers, as if each group were quantized by its own call
        in that order (default: first to last; groups without rows draw nothing)."""
        if not self.packs_row_groups:
            raise NotImplementedError(f"{self.describe()}: row groups of {name} cannot be quantized in one call "
                                      f"(a tensor-wide statistic, state or random draws that are not per group)")
        sizes = check_row_groups(self, x2d, sizes, name)
        g = self.split_granularity(rowwise, columnwise)[0]
        for i, n in enumerate(sizes):
            if n % g:
                raise ValueError(f"{self.describe()}: row group {i} of {name} has {n} rows; {self.describe()} "
                                 f"blocks span {g} rows, so every group must be a multiple of {g} rows (pad it with "
                                 f"zero rows) or a block would hold two groups")
        return self.quantize(x2d, rowwise=rowwise, columnwise=columnwise, name=name)

    @property
    def local_scaling(self) -> bool:
        """True when every scale is a function of its own scaling block (or tile) alone -- no tensor-wide
        statistic, no state, no random draws -- and zero elements change no block's scale (scales come from block
        amaxes), e.g. FP8 blocks and MXFP8, not per-tensor FP8 or NVFP4. A tensor made of row groups, each padded
        with zero rows to a multiple of `split_granularity(...)[0]`, then quantizes group by group exactly as each
        group would alone, and the parts' `row_slice` cuts the groups apart (GroupedLinear's packed path for block
        formats)."""
        return False


def check_row_groups(q: Quantizer, x2d: torch.Tensor, sizes: Sequence[int], name: str) -> tuple[int, ...]:
    """`sizes` as a tuple of ints after the checks every row-groups quantization makes (a 2-D input whose rows the
    groups, all >= 0, cover exactly)."""
    sizes = tuple(int(n) for n in sizes)
    if x2d.dim() != 2 or sum(sizes) != x2d.shape[0] or any(n < 0 for n in sizes):
        raise ValueError(f"{q.describe()}: row groups {list(sizes)} of {name} must be >= 0 and sum to its "
                         f"{x2d.shape[0] if x2d.dim() == 2 else tuple(x2d.shape)} rows")
    return sizes


def draw_sequence(sizes: Sequence[int], draw_order: Sequence[int] | None, what: str) -> list[int]:
    """The groups with rows, in the order they draw stochastic-rounding numbers (`draw_order`, default first to
    last): a permutation of the groups is required (each group draws once)."""
    order = list(range(len(sizes))) if draw_order is None else [int(g) for g in draw_order]
    if sorted(order) != list(range(len(sizes))):
        raise ValueError(f"{what}: draw_order {order} must list each of the {len(sizes)} row groups once")
    return [g for g in order if sizes[g]]
