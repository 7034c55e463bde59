"""Quantized parameters: a hybridq Linear whose weight *is* its quantized form (a `QuantizedTensor` parameter of
the model's dtype and shape), as Transformer Engine's quantized params / torchao's quantized training hold them.

- `quantized_model_init()`: Linear (and GroupedLinear: quantized_experts.py) layers built inside hold their weight
  only quantized; `quantize_parameters(model)` (param_conversion.py) converts the layers of an existing model.
- Stored directions: rowwise (fprop) always; columnwise (dgrad) only when the recipe's backward reads it and it is
  not an exact transform of the rowwise form (per-tensor FP8, 2-D tiles, double quantization derive it at each
  training forward, so FP8 weights take ~1 byte per element and NVFP4 16x16 ~0.56).
- Gradients: backward returns a high-precision gradient of the nominal dtype and shape (`param.grad` is a plain
  tensor). The parameter cannot be stepped in place: high-precision masters live in the optimizer
  (`hybridq.distributed.ZeroAdamW`, or your own ZeRO optimizer with `quantize_master_weights`). A torch optimizer
  given a quantized parameter raises before it changes anything (a global optimizer step pre-hook).
- state_dict: a quantized weight is saved as its dequantized rowwise form (plain tensor, nominal dtype) and
  `load_state_dict` quantizes what it loads (`copy_` into a quantized parameter quantizes).
- torch.compile: the parameter (a `HeldQuantizedWeight`) enters a compiled graph as its handle, as FSDP2's gathered
  weight does (nn/weight_handle.py): the compiled Linear's ops read its parts when they run, so the bytes an
  optimizer writes into them in place between steps are what the next step reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ..enums import COLUMNWISE, ROWWISE
from ..errors import RecipeError
from ..formats.base import Quantizer, shape_2d
from ..tensor import QuantizedTensor, register_copy_into
from .weight_handle import HandledWeight, weight_handle

__all__ = ["HeldQuantizedWeight", "QuantizedParamInfo", "quantized_model_init", "quantize_layer", "parameter_memory",
           "ParameterMemory", "quantized_param_info", "weight_for_call", "high_precision_init_value"]

INFO_ATTR = "_hybridq_param"  # QuantizedParamInfo on a quantized parameter
INIT_ATTR = "_hybridq_init_value"  # the high-precision value it was quantized from (preserve_high_precision_init_val)

_STATE = threading.local()


@dataclasses.dataclass(frozen=True)
class QuantizedParamInfo:
    """What a quantized parameter is: its layer, quantizer and the directions it stores."""

    layer: str
    quantizer: Quantizer
    columnwise_stored: bool  # the columnwise form is held (it is not derivable from the rowwise one)
    columnwise_derived: bool  # the columnwise form is made from the rowwise one at each training forward

    def describe(self) -> str:
        return self.quantizer.describe()


def quantized_param_info(t: object):
    """The `QuantizedParamInfo` of a Linear's quantized weight (a `QuantizedExpertsInfo` for a GroupedLinear's,
    quantized_experts.py), or None for any other tensor."""
    return getattr(t, INFO_ATTR, None) if isinstance(t, torch.Tensor) else None


def high_precision_init_value(p: torch.Tensor) -> torch.Tensor | None:
    """The high-precision value a quantized parameter was created from, when `quantized_model_init(
    preserve_high_precision_init_val=True)` kept it (on the CPU), else None."""
    return getattr(p, INIT_ATTR, None)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, *, preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Inside, every hybridq `Linear` and `GroupedLinear` built (or made by `convert_linears` / `convert_experts`)
    holds its weight only quantized, in its recipe's weight format (see the module docstring). `preserve_high_precision_init_val=True` also keeps each
    weight's initial high-precision value on the CPU (`high_precision_init_value(p)`), which `ZeroAdamW` takes as
    the fp32 master; without it the masters start from the dequantized weight."""
    prev = getattr(_STATE, "config", None)
    _STATE.config = {"preserve": preserve_high_precision_init_val} if enabled else None
    try:
        yield
    finally:
        _STATE.config = prev


def init_config() -> dict | None:
    """The active `quantized_model_init` configuration (None outside one)."""
    return getattr(_STATE, "config", None)


def columnwise_plan(q: Quantizer, shape, dtype: torch.dtype, columnwise: bool) -> tuple[bool, bool]:
    """(store the columnwise form, derive it at use): derive when the format makes it an exact transform of the
    rowwise form (decided on a meta tensor: no data)."""
    if not columnwise:
        return False, False
    m, k = shape_2d(tuple(shape))
    row, _ = q.quantize_parts(torch.empty(m, k, dtype=dtype, device="meta"), True, False)
    try:
        derivable = q.derive_part(row, COLUMNWISE, dtype) is not None
    except Exception:  # noqa: BLE001 - a derivation that cannot run on meta: store the direction
        derivable = False
    return not derivable, derivable


def quantize_layer(layer: nn.Module, *, preserve_high_precision_init_val: bool = False) -> None:
    """Make one hybridq Linear's weight a quantized parameter (checked first; see `check_layer`)."""
    _install(layer, check_layer(layer), preserve_high_precision_init_val)


def check_layer(layer: nn.Module) -> tuple[Quantizer, bool, bool]:
    """The layer's (weight quantizer, store columnwise, derive columnwise), after every check; changes nothing."""
    from ..formats.base import is_dtensor

    w = layer.weight
    q = layer.weight_quantizer
    name = f"weight of {layer.name}"
    if is_dtensor(w) or type(w).__name__ == "HybridWeight":
        raise NotImplementedError(
            f"hybridq: {name} is sharded (FSDP2 / tensor parallelism); quantized parameters are for unsharded models "
            f"(FSDP2 already all-gathers weights quantized: apply_hybrid_fsdp). Quantize the parameters of an "
            f"unsharded model and use hybridq.distributed.ZeroAdamW for data parallelism")
    if q.is_stateful:
        raise ValueError(f"hybridq: {name} uses {q.describe()}: a quantized parameter is re-quantized from its "
                         f"master once per optimizer step, which delayed scaling's scale state does not follow; use "
                         f"current scaling (e.g. the 'fp8_tensorwise' preset)")
    columnwise = layer.recipe.backward_override is None
    q.validate(w.shape, name, rowwise=True, columnwise=columnwise)
    store, derive = columnwise_plan(q, w.shape, w.dtype, columnwise)
    return q, store, derive


# a held weight's handle (made on first use; kept apart from the tensor's __dict__, which copy.deepcopy copies: a
# copy gets a handle of its own)
_HELD_HANDLES = WeakIdKeyDictionary()


class HeldQuantizedWeight(HandledWeight, QuantizedTensor):
    """A quantized parameter's tensor: a QuantizedTensor that keeps its type through detach, clone, device moves
    and re-wrapping as nn.Parameter, and under torch.compile is its handle (nn/weight_handle.py; the handle names
    the parameter itself): a compiled Linear's ops read its parts when they run, never copying or saving them, so
    the bytes ZeroAdamW / quantize_master_weights write into the parts in place between steps are what the next
    compiled step reads. What backward reads of it comes from `part` then: a columnwise form the format derives
    from the rowwise one is derived at that call, as `weight_for_call` derives it for an eager call."""

    @property
    def _handle(self) -> torch.Tensor:
        traced = self.__dict__.get("_traced_handle")
        if traced is not None:  # (a stand-in compile traces with)
            return traced
        h = _HELD_HANDLES.get(self)
        if h is None:
            h = _HELD_HANDLES[self] = weight_handle(self, _itself)
        return h

    @classmethod
    def _traced_fields(cls) -> tuple[str, ...]:
        return ("_rowwise", "_columnwise")

    @classmethod
    def of(cls, qt: QuantizedTensor) -> "HeldQuantizedWeight":
        """`qt`'s parts (and the quantized-parameter attributes it carries) as a held weight."""
        out = cls(qt.rowwise, qt.columnwise, shape=qt.shape, dtype=qt.dtype)
        for name in QuantizedTensor.carried_attributes:
            if name in qt.__dict__:
                out.__dict__[name] = qt.__dict__[name]
        return out

    def map_parts(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "HeldQuantizedWeight":
        if self._rowwise is None and self._columnwise is None:  # a traced stand-in (no parts): an alias
            return self._traced_alias()
        return self.of(QuantizedTensor.map_parts(self, fn))

    def part(self, direction: str):
        if direction == COLUMNWISE and self._columnwise is None and self._rowwise is not None:
            return _columnwise_for_call(self)
        return super().part(direction)

    def high_precision(self) -> torch.Tensor:
        """The dequantized (rowwise) weight: what backward_override="high_precision" multiplies with, as an eager
        call saves it (`linear_function.forward_and_saved`)."""
        return self.dequantize()

    def __reduce_ex__(self, protocol):
        # pickled (torch.save of a model, pickle) as what it is: a held weight, a parameter where it is one (its
        # class is this one, not nn.Parameter's, so Parameter's own pickling never runs), with its attributes
        return _rebuild_held, (QuantizedTensor.__reduce_ex__(self, protocol), isinstance(self, nn.Parameter))

    def __repr__(self, *, tensor_contents=None) -> str:
        if self._rowwise is None and self._columnwise is None:
            return f"HeldQuantizedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, traced)"
        return "Held" + super().__repr__()


def _itself(p: HeldQuantizedWeight) -> HeldQuantizedWeight:
    return p


def _rebuild_held(reduced: tuple, is_param: bool) -> HeldQuantizedWeight:
    rebuild, args = reduced
    qt = rebuild(*args)
    held = HeldQuantizedWeight.of(qt)
    if not is_param:
        return held.requires_grad_(qt.requires_grad)
    p = nn.Parameter(held, requires_grad=qt.requires_grad)
    for name in QuantizedTensor.carried_attributes:  # (as quantized_parameter sets them on the parameter)
        if name in held.__dict__:
            setattr(p, name, held.__dict__[name])
    return p


def quantized_parameter(info: QuantizedParamInfo, value: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """`value` (high precision, the nominal dtype) as the quantized parameter `info` describes."""
    with torch.no_grad():
        qt = info.quantizer.quantize(value.detach(), rowwise=True, columnwise=info.columnwise_stored,
                                     name=f"weight of {info.layer}")
    p = nn.Parameter(HeldQuantizedWeight.of(qt), requires_grad=requires_grad)
    setattr(p, INFO_ATTR, info)
    return p


def _install(layer: nn.Module, plan: tuple[Quantizer, bool, bool], preserve: bool) -> None:
    q, store, derive = plan
    w = layer.weight
    p = quantized_parameter(QuantizedParamInfo(layer.name, q, store, derive), w, w.requires_grad)
    if preserve:
        setattr(p, INIT_ATTR, w.detach().to("cpu", copy=True))
    layer._parameters["weight"] = p
    layer.mark_weight_quantized_elsewhere()
    install_quantized_hooks(layer)


def check_held_weight_format(weight: torch.Tensor, weight_quantizers: list[Quantizer], layer: str) -> None:
    """A weight held quantized keeps the format it was quantized in: a recipe giving it another weight quantizer
    would be silently ignored, so it is refused (RecipeError, nothing changed)."""
    info = quantized_param_info(weight)
    if info is None:
        return
    held = [i.quantizer for i in getattr(info, "experts", (info,))]
    for new, old in zip(weight_quantizers, held):
        if new != old:
            raise RecipeError(
                f"{layer}: its weight is held quantized in {old.describe()} (quantized_model_init / "
                f"quantize_parameters); a recipe with another weight format ({new.describe()}) cannot be applied to "
                f"it. Set the recipe before quantizing the parameters")


def weight_for_call(p: QuantizedTensor, need_columnwise: bool) -> QuantizedTensor:
    """The quantized weight a Linear call multiplies with: the parameter's parts, plus the columnwise form derived
    from the rowwise one when this call's backward reads it (a detached handle: autograd tracks the parameter)."""
    col = p.columnwise
    if need_columnwise and col is None:
        col = _columnwise_for_call(p)
    return QuantizedTensor(p.rowwise, col, shape=p.shape, dtype=p.dtype)


def _columnwise_for_call(p: QuantizedTensor):
    """The columnwise part dgrad reads of a quantized parameter holding only the rowwise one: derived from it."""
    info: QuantizedParamInfo = getattr(p, INFO_ATTR)
    if not info.columnwise_derived:
        raise RuntimeError(
            f"hybridq: the quantized weight of {info.layer} holds no columnwise form (it was quantized while a "
            f"backward override was in force); quantize the parameters again without the override")
    return info.quantizer.derive_part(p.rowwise, COLUMNWISE, p.dtype)


# ---- state_dict: dequantized values out, quantized on the way in --------------------------------------------

def _dequantized_state_dict(module, state_dict, prefix, local_metadata):
    for key, v in list(state_dict.items()):
        if key.startswith(prefix) and (isinstance(v, QuantizedTensor) or quantized_param_info(v) is not None):
            state_dict[key] = v.dequantize()  # the rowwise values, in the nominal dtype
    return state_dict


# load_state_dict(assign=True) would put the loaded high-precision tensor in place of a quantized parameter (the
# layer silently back to 2 bytes per element): instead the loaded value is quantized into a new quantized parameter
# on its device, which is what assign means for a parameter held quantized (e.g. after building on the meta device)
_REQUANTIZE: dict[type, Callable] = {}


def register_requantize(param_type: type, fn: Callable) -> None:
    """How a quantized parameter of `param_type` is rebuilt from a high-precision value (`fn(param, value)` -> a
    new nn.Parameter holding the value quantized as `param` is)."""
    _REQUANTIZE[param_type] = fn


def _requantize_linear_weight(p: QuantizedTensor, value: torch.Tensor) -> nn.Parameter:
    return quantized_parameter(getattr(p, INFO_ATTR), value.to(dtype=p.dtype), p.requires_grad)


register_requantize(QuantizedTensor, _requantize_linear_weight)
register_requantize(HeldQuantizedWeight, _requantize_linear_weight)


def _quantizing_assign(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if (quantized_param_info(p) is None or value is None or quantized_param_info(value) is not None
                or not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape)):
            continue  # (a wrong shape is torch's size-mismatch error)
        state_dict[prefix + name] = _REQUANTIZE[type(p)](p, value)


def install_quantized_hooks(layer: nn.Module) -> None:
    """state_dict gives quantized parameters dequantized; load_state_dict quantizes (copy_, or a new quantized
    parameter with assign=True); a torch optimizer refuses them."""
    if not getattr(layer, "_hybridq_qparam_hooks", False):
        layer._register_state_dict_hook(_dequantized_state_dict)
        layer._register_load_state_dict_pre_hook(_quantizing_assign, with_module=True)
        layer._hybridq_qparam_hooks = True
    _install_optimizer_guard()


def copy_into(dst: QuantizedTensor, src: torch.Tensor) -> QuantizedTensor:
    """`dst.copy_(src)` for a quantized parameter: `src` (high precision, cast to the nominal dtype first, or a
    QuantizedTensor with the same parts) quantized into dst's own buffers (what load_state_dict does)."""
    info = quantized_param_info(dst)
    if isinstance(src, QuantizedTensor):
        new = src
    else:
        if info is None:
            raise NotImplementedError("hybridq QuantizedTensor.copy_ of a plain tensor needs a quantized parameter "
                                      "(it knows its quantizer); quantize the source first")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"hybridq: cannot copy a tensor of shape {tuple(src.shape)} into the quantized weight of "
                             f"{info.layer} {tuple(dst.shape)}")
        new = info.quantizer.quantize(src.detach().to(device=dst.device, dtype=dst.dtype), rowwise=True,
                                      columnwise=info.columnwise_stored, name=f"weight of {info.layer}")
    for d in (ROWWISE, COLUMNWISE):
        if dst.has(d) != new.has(d):
            raise ValueError(f"hybridq: copy_ into a QuantizedTensor holding {dst.usage} from one holding {new.usage}")
        if dst.has(d):
            copy_part_into(dst.part(d), new.part(d))
    return dst


register_copy_into(copy_into)


def copy_part_into(dst, src) -> None:
    """Copy a part's tensors into another part of the same layout, in place (the buffers keep their identity)."""
    if type(dst) is not type(src) or (dst.rows, dst.cols) != (src.rows, src.cols) or dst.meta() != src.meta():
        raise ValueError(f"hybridq: cannot copy {src!r} into {dst!r} (different layouts)")
    for n, t in dst.tensors().items():
        s = getattr(src, n)
        if t is None or s is None:
            if (t is None) != (s is None):
                raise ValueError(f"hybridq: {n} of {dst!r} and {src!r} differ in presence")
            continue
        if t is not s:
            t.copy_(s)


# ---- a torch optimizer must not step a quantized parameter ---------------------------------------------------

_GUARD: list = []


def _install_optimizer_guard() -> None:
    if not _GUARD:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _GUARD.append(register_optimizer_step_pre_hook(_refuse_quantized_params))


def _refuse_quantized_params(optimizer, args, kwargs) -> None:
    if getattr(optimizer, "hybridq_keeps_masters", False):  # (ZeroAdamW: steps fp32 masters, re-quantizes the weights)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = quantized_param_info(p)
            if info is not None:
                raise TypeError(
                    f"hybridq: {type(optimizer).__name__} would step the quantized weight of {info.layer} "
                    f"({info.describe()}) in place; a quantized parameter holds no high-precision values to update. "
                    f"Keep fp32 master weights in the optimizer: hybridq.distributed.ZeroAdamW, or a ZeRO optimizer "
                    f"that calls hybridq.distributed.quantize_master_weights after each step (nothing was stepped)")


# ---- memory -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParameterMemory:
    """Bytes of the model's parameters: `before` as high-precision tensors of their nominal dtype, `after` as
    held (quantized parameters: every stored part, data and scales). `rows`: one per quantized parameter
    (name, format, elements, before, after)."""

    before: int
    after: int
    rows: tuple[tuple[str, str, int, int, int], ...]

    @property
    def saved(self) -> int:
        return self.before - self.after

    def table(self) -> str:
        lines = [f"{'parameter':40s} {'format':36s} {'elements':>10s} {'bytes before':>13s} {'bytes now':>10s} "
                 f"{'B/elem':>6s}"]
        for name, fmt, n, b, a in self.rows:
            lines.append(f"{name:40s} {fmt:36s} {n:>10,d} {b:>13,d} {a:>10,d} {a / max(n, 1):6.3f}")
        lines.append(f"{'all parameters':40s} {'':36s} {'':>10s} {self.before:>13,d} {self.after:>10,d}")
        return "\n".join(lines)


def parameter_memory(model: nn.Module) -> ParameterMemory:
    """Bytes the model's parameters take now vs as high-precision tensors of their nominal dtype."""
    before = after = 0
    rows = []
    for name, p in model.named_parameters():
        hp = p.numel() * p.element_size()
        info = quantized_param_info(p)
        now = p.nbytes_quantized() if info is not None else hp
        before += hp
        after += now
        if info is not None:
            rows.append((name, info.describe(), p.numel(), hp, now))
    return ParameterMemory(before, after, tuple(rows))
