"""`QuantizedTensor`: a torch.Tensor wrapper subclass over one or two quantized parts (see [Note: part],
formats/base.py, and [Note: direction], enums.py).

It reports the shape and dtype of the high-precision tensor it stands for, so it can flow through
autograd (`ctx.save_for_backward`, saved-tensor hooks for offload / recompute) like the original. The op
surface is deliberately narrow: aliasing/detach, clone, device moves and pinning. Anything else raises and
names the op; call `.dequantize()` to get a plain tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .enums import COLUMNWISE, ROWWISE, Direction
from .torch_private import graph_task_id

if TYPE_CHECKING:
    from .formats.base import QuantizedPart

aten = torch.ops.aten


class QuantizedTensor(torch.Tensor):
    _rowwise: QuantizedPart | None
    _columnwise: QuantizedPart | None

    @staticmethod
    def __new__(cls, rowwise: QuantizedPart | None, columnwise: QuantizedPart | None, *, shape, dtype,
                requires_grad: bool = False):
        if rowwise is None and columnwise is None:
            raise ValueError("QuantizedTensor needs at least one of a rowwise and a columnwise part")
        device = (rowwise or columnwise).device
        self = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._rowwise = rowwise
        self._columnwise = columnwise
        return self

    # -- public accessors -----------------------------------------------------------------------
    @property
    def rowwise(self) -> QuantizedPart | None:
        """The rowwise part (`[M, K]`, blocks along K), or None if it was not produced."""
        return self._rowwise

    @property
    def columnwise(self) -> QuantizedPart | None:
        """The columnwise part (stored transposed, `[K, M]`, blocks along M), or None."""
        return self._columnwise

    def part(self, direction: str) -> QuantizedPart:
        if direction == ROWWISE:
            p = self._rowwise
        elif direction == COLUMNWISE:
            p = self._columnwise
        else:
            Direction.parse(direction, "direction")
        if p is None:
            raise RuntimeError(
                f"QuantizedTensor {tuple(self.shape)} has no {direction} form (it holds {self.usage}); "
                f"quantize with {direction}=True"
            )
        return p

    def held_part(self, direction: str) -> QuantizedPart:
        """The part in `direction` taken by reference for a later use that reads it (a Linear's backward), not read
        now: `part` here. A weight whose direction a later step fills (FSDP2's gathered weight: its backward unshard)
        gives it before that step, where `part` -- a read -- raises (distributed/gathered.py)."""
        return self.part(direction)

    def has(self, direction: str) -> bool:
        if direction == ROWWISE:
            return self._rowwise is not None
        Direction.parse(direction, "direction")
        return self._columnwise is not None

    @property
    def usage(self) -> str:
        return "+".join(d for d in (ROWWISE, COLUMNWISE) if self.has(d))

    @property
    def formats(self) -> tuple[str | None, str | None]:
        """(rowwise format, columnwise format) names; None for a missing direction."""
        return tuple(p.format_name if p is not None else None for p in (self._rowwise, self._columnwise))

    def dequantize(self, dtype: torch.dtype | None = None, direction: str | None = None) -> torch.Tensor:
        """High-precision tensor of the original shape. Reads the rowwise form unless `direction` says
        otherwise (or only the columnwise form exists)."""
        if direction is None:
            direction = ROWWISE if self._rowwise is not None else COLUMNWISE
        p = self.part(direction)
        x = p.dequantize_2d()
        if p.columnwise:
            x = x.t()
        return x.reshape(self.shape).to(dtype or self.dtype)

    def nbytes_quantized(self) -> int:
        return sum(p.nbytes() for p in (self._rowwise, self._columnwise) if p is not None)

    # attributes a quantized parameter carries (hybridq.nn.quantized_params) that survive detach, device moves and
    # re-wrapping as nn.Parameter (Module.to / _apply build a new Parameter from the moved tensor)
    carried_attributes = ("_hybridq_param", "_hybridq_init_value")

    def map_parts(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedTensor":
        r = self._rowwise.map_tensors(fn) if self._rowwise is not None else None
        c = self._columnwise.map_tensors(fn) if self._columnwise is not None else None
        out = QuantizedTensor(r, c, shape=self.shape, dtype=self.dtype)
        for name in self.carried_attributes:
            if name in self.__dict__:
                out.__dict__[name] = self.__dict__[name]
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"rowwise={self._rowwise!r}, columnwise={self._columnwise!r})")

    # -- serialization: pickle and torch.save / torch.load(weights_only=True) ---------------------
    def __reduce_ex__(self, protocol):
        """Rebuilt from plain values only (tensors, ints, bools, strings, dtypes), so `torch.load` with
        `weights_only=True` accepts it once `_rebuild_quantized_tensor` is an allowed global (registered when
        hybridq is imported). Part classes travel by name and are looked up among the registered part types. The
        `carried_attributes` a quantized parameter's tensor holds travel with it (`_rebuild_carrying`: not plain
        values, so such a tensor loads with weights_only=False only): without them a loaded quantized parameter was a
        bare QuantizedTensor its layer no longer knew as one (no derived columnwise form, no optimizer guard)."""
        parts = {}
        for d, p in ((ROWWISE, self._rowwise), (COLUMNWISE, self._columnwise)):
            if p is not None:
                tensors = {n: _as_picklable(t) for n, t in p.tensors().items()}
                parts[d.value] = (_part_class_name(type(p)), p.rows, p.cols, tensors, p.meta())  # plain str
        args = (parts, tuple(self.shape), self.dtype, self.requires_grad)
        carried = {n: self.__dict__[n] for n in self.carried_attributes if n in self.__dict__}
        return (_rebuild_carrying, (args, carried)) if carried else (_rebuild_quantized_tensor, args)

    # -- tracing support (torch.compile): parts' tensors are the inner tensors -----------------
    def __tensor_flatten__(self):
        names, ctx = [], {"shape": self.shape, "dtype": self.dtype, "parts": {}}
        for d, p in ((ROWWISE, self._rowwise), (COLUMNWISE, self._columnwise)):
            if p is None:
                continue
            present = [n for n, t in p.tensors().items() if t is not None]
            ctx["parts"][d] = (type(p), p.rows, p.cols, p.meta(), present)
            names += [f"{d}.{n}" for n in present]
        return names, ctx

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        parts = {}
        for d, (cls, rows, cols, meta, present) in ctx["parts"].items():
            fields = {n: inner.get(f"{d}.{n}") for n in cls.tensor_fields}
            parts[d] = cls(rows=rows, cols=cols, columnwise=d == COLUMNWISE, **fields, **meta)
        return QuantizedTensor(parts.get(ROWWISE), parts.get(COLUMNWISE), shape=outer_size, dtype=ctx["dtype"])

    # -- the narrow op surface ------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"hybridq QuantizedTensor does not support {func}; call .dequantize() to get a plain "
                f"tensor first" + _parameter_hint(args)
            )
        return handler(func, *args, **kwargs)

    __torch_function__ = torch._C._disabled_torch_function_impl


_OPS: dict = {}


def _implements(*ops):
    def register(fn):
        for op in ops:
            _OPS[op] = fn
        return fn
    return register


@_implements(aten.detach.default, aten.alias.default)
def _alias(func, t, *args, **kwargs):
    return t.map_parts(lambda x: func(x))


@_implements(aten.clone.default)
def _clone(func, t, *, memory_format=None):
    return t.map_parts(lambda x: x.clone())


@_implements(aten._to_copy.default)
def _to_copy(func, t, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    if dtype is not None and dtype != t.dtype:
        info = t.__dict__.get("_hybridq_param")  # (a quantized parameter: name its layer and format)
        if info is not None:
            raise NotImplementedError(
                f"hybridq: the quantized weight of {info.layer} ({info.describe()}, nominal {t.dtype}) cannot be cast "
                f"to {dtype}: a quantized parameter holds its format's values only (model.to(dtype) / .half() / "
                f".double() stop here; parameters converted before it keep the new dtype). Convert the model's dtype "
                f"before quantize_parameters / quantized_model_init")
        raise NotImplementedError(
            f"hybridq QuantizedTensor cannot be cast to {dtype}; use .dequantize(dtype={dtype})"
        )
    # (a copy even on the same device: aten._to_copy never aliases its input)
    return t.map_parts(lambda x: x.to(device=device, non_blocking=non_blocking, copy=True)
                       if not pin_memory else x.to(device=device).pin_memory())


@_implements(aten.copy_.default)
def _copy(func, dst, src, non_blocking=False):
    """Into a quantized parameter (load_state_dict): the source is quantized with the parameter's quantizer."""
    if not isinstance(dst, QuantizedTensor):
        raise NotImplementedError("hybridq: copying a QuantizedTensor into a plain tensor: use .dequantize()")
    if not _COPY_INTO:
        raise NotImplementedError("hybridq QuantizedTensor does not support copy_ (import hybridq.nn)")
    return _COPY_INTO[0](dst, src)


_COPY_INTO: list = []  # hybridq.nn.quantized_params registers how a copy into a quantized parameter quantizes


def register_copy_into(fn: Callable) -> None:
    _COPY_INTO[:] = [fn]


def _parameter_hint(args) -> str:
    """Why an op on a quantized parameter (hybridq.quantized_model_init) cannot run, and what to do instead."""
    for a in args:
        info = getattr(a, "_hybridq_param", None) if isinstance(a, QuantizedTensor) else None
        if info is not None:
            return (f". It is the quantized weight of {info.layer} ({info.describe()}), which holds no high-precision "
                    f"values: optimizers must keep fp32 masters (hybridq.distributed.ZeroAdamW or "
                    f"quantize_master_weights); FSDP2's fully_shard does not take quantized parameters (shard the "
                    f"high-precision model with hybridq.apply_hybrid_fsdp, which all-gathers weights quantized)")
    return ""


@_implements(aten.is_pinned.default)
def _is_pinned(func, t, device=None):
    return all(x.is_pinned() for p in (t._rowwise, t._columnwise) if p is not None  # (no bytes read)
               for x in p.tensors().values() if x is not None)


@_implements(aten._pin_memory.default)
def _pin(func, t, device=None):
    return t.map_parts(lambda x: x.pin_memory())



# ---- saving for backward ----------------------------------------------------------------------------
# A QuantizedTensor saved for backward goes through autograd's saved-tensor hooks as its plain tensors (the
# quantized bytes and scales of every part), so any hook -- `save_on_cpu(pin_memory=True)`, which copies into a
# plain `torch.empty` buffer, hybridq.CPUOffload, checkpointing -- sees ordinary tensors and round-trips every part.

def flatten_quantized(tensors, keep: tuple[bool, ...] = ()) -> tuple[list, list]:
    """(plain tensors, layout) of `tensors` (QuantizedTensors split into their parts' tensors; None and plain
    tensors as they are): what `unflatten_quantized` rebuilds them from. `keep[i]` True puts tensor i itself in
    the layout, outside the flat list."""
    flat: list = []
    layout: list = []
    for i, t in enumerate(tensors):
        if i < len(keep) and keep[i]:
            layout.append(("keep", t))
        elif isinstance(t, QuantizedTensor):
            entry = []
            for p in (t._rowwise, t._columnwise):
                if p is None:
                    entry.append(None)
                    continue
                present = [(n, x) for n, x in p.tensors().items() if x is not None]
                flat.extend(x for _, x in present)
                entry.append((type(p), p.rows, p.cols, p.columnwise, p.meta(), tuple(n for n, _ in present)))
            layout.append(("q", entry, t.shape, t.dtype))
        else:
            flat.append(t)
            layout.append(("t",))
    return flat, layout


def unflatten_quantized(flat, layout: list) -> tuple:
    """The tensors `flatten_quantized` gave `(flat, layout)` for, QuantizedTensors rebuilt from their parts."""
    flat = iter(flat)
    out = []
    for entry in layout:
        if entry[0] == "keep":
            out.append(entry[1])
        elif entry[0] == "t":
            out.append(next(flat))
        else:
            _, parts, shape, dtype = entry
            built = []
            for spec in parts:
                if spec is None:
                    built.append(None)
                    continue
                cls, rows, cols, columnwise, meta, present = spec
                fields = dict.fromkeys(cls.tensor_fields)
                fields.update((n, next(flat)) for n in present)
                built.append(cls(rows=rows, cols=cols, columnwise=columnwise, **fields, **meta))
            out.append(QuantizedTensor(built[0], built[1], shape=shape, dtype=dtype))
    return tuple(out)


def save_quantized(ctx, *tensors: torch.Tensor | None, keep: tuple[bool, ...] = ()) -> None:
    """`ctx.save_for_backward(*tensors)`, with each QuantizedTensor split into its parts' tensors. `keep[i]` True
    keeps tensor i as it is on `ctx`, outside the hooks: a handle whose buffers their owner refills (FSDP2's
    gathered weight, whose storage is freed after forward and gathered again in backward), not data to pack."""
    flat, ctx.hybridq_saved_layout = flatten_quantized(tensors, keep)
    ctx.save_for_backward(*flat)


_BACKWARD = {"task": -1, "epoch": 0}


def backward_epoch() -> int:
    """A counter of the backward passes that ran a hybridq layer's backward (bumped by `saved_quantized` when the
    autograd graph task changes): delayed-scaling quantizers tell the forward casts of one step from the next."""
    return _BACKWARD["epoch"]


def count_backward_pass() -> None:
    """Bump `backward_epoch` when the autograd graph task changed since the last hybridq backward."""
    task = graph_task_id()
    if task != _BACKWARD["task"]:
        _BACKWARD["task"] = task
        _BACKWARD["epoch"] += 1


def saved_quantized(ctx) -> tuple:
    """The tensors given to `save_quantized`, QuantizedTensors rebuilt from their (unpacked) parts."""
    count_backward_pass()
    return unflatten_quantized(ctx.saved_tensors, ctx.hybridq_saved_layout)


# ---- serialization ---------------------------------------------------------------------------------

def _part_class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_PART_TYPES: dict[str, type] = {}


def register_part_type(cls: type) -> None:
    """Make a part type loadable by name (every QuantizedPart subclass registers itself when defined)."""
    _PART_TYPES[_part_class_name(cls)] = cls


def _part_classes() -> dict[str, type]:
    return _PART_TYPES


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_picklable(t: torch.Tensor | None) -> tuple:
    """(tensor, original dtype or None): FP8 tensors travel as their uint8 bytes, since torch's plain pickle
    path cannot rebuild FP8 storages."""
    if t is not None and t.dtype in _FP8_DTYPES:
        return t.view(torch.uint8), t.dtype
    return t, None


def _from_picklable(entry: tuple) -> torch.Tensor | None:
    t, dtype = entry
    return t if dtype is None else t.view(dtype)


def _rebuild_quantized_tensor(parts: dict, shape: tuple, dtype: torch.dtype, requires_grad: bool) -> QuantizedTensor:
    built = {}
    for d, (name, rows, cols, tensors, meta) in parts.items():
        cls = _part_classes().get(name)
        if cls is None:
            raise ValueError(f"hybridq: cannot load a QuantizedTensor whose {d} part is a {name!r}: no such "
                             f"quantized part type in this hybridq (import the module that defines it first)")
        fields = {n: _from_picklable(e) for n, e in tensors.items()}
        built[d] = cls(rows=rows, cols=cols, columnwise=d == COLUMNWISE, **fields, **meta)
    return QuantizedTensor(built.get(ROWWISE), built.get(COLUMNWISE), shape=shape, dtype=dtype,
                           requires_grad=requires_grad)


def _rebuild_carrying(args: tuple, carried: dict) -> QuantizedTensor:
    t = _rebuild_quantized_tensor(*args)
    t.__dict__.update(carried)
    return t


# torch.load(weights_only=True) calls only allow-listed globals
torch.serialization.add_safe_globals([_rebuild_quantized_tensor])
