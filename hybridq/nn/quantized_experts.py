"""Quantized parameters of a `GroupedLinear`: its `[E, out, in]` weight held as E quantized experts, each exactly
the quantized parameter a hybridq Linear with that expert's weight quantizer would hold (quantized_params.py).

`QuantizedExpertWeights` is the parameter: a tensor of the nominal shape and dtype whose `experts` are the E
quantized weights (every direction the recipe's backward reads and the format cannot derive, as for Linear).
Autograd sees `unbind(0)` (each expert's weight, the op the layer's per-expert GEMMs read), so the gradient is a
plain `[E, out, in]` tensor; `copy_` from a high-precision tensor quantizes each expert into its own buffers
(load_state_dict, DCP's set_state_dict), and state_dict gives the dequantized `[E, out, in]` weight. Other ops
raise: the parameter holds no high-precision values.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..tensor import QuantizedTensor
from ..weight_forms import ExpertsTensor
from .expert_layers import expert_name
from .quantized_params import (INFO_ATTR, INIT_ATTR, QuantizedParamInfo, columnwise_plan, copy_into,
                               install_quantized_hooks, quantized_param_info, register_requantize)

__all__ = ["QuantizedExpertWeights", "QuantizedExpertsInfo", "check_grouped_layer", "install_grouped",
           "expert_weight_for_call", "is_quantized_experts"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class QuantizedExpertsInfo:
    """What a quantized grouped weight is: its layer and each expert's `QuantizedParamInfo`."""

    layer: str
    experts: tuple[QuantizedParamInfo, ...]

    def describe(self) -> str:
        return " | ".join(dict.fromkeys(i.describe() for i in self.experts))


class QuantizedExpertWeights(ExpertsTensor):
    """The quantized `[E, out, in]` weight of a GroupedLinear (see the module docstring)."""

    @staticmethod
    def __new__(cls, experts: list[QuantizedTensor], *, requires_grad: bool = False):
        first = experts[0]
        self = torch.Tensor._make_wrapper_subclass(cls, (len(experts), *first.shape), dtype=first.dtype,
                                                   device=first.device, requires_grad=requires_grad)
        self._experts = list(experts)
        return self

    @property
    def experts(self) -> list[QuantizedTensor]:
        """Each expert's quantized weight (a quantized parameter's form: `quantized_param_info` describes it)."""
        return list(self._experts)

    def _alias(self) -> "QuantizedExpertWeights":
        out = QuantizedExpertWeights(self._experts)
        if hasattr(self, INFO_ATTR):
            setattr(out, INFO_ATTR, getattr(self, INFO_ATTR))
        return out

    # a traceable wrapper subclass: nn.Module._apply (model.to / .cuda) then swaps the parameter in place
    # (torch.utils.swap_tensors) instead of setting .data, which would leave the experts where they were
    def __tensor_flatten__(self):
        return [f"e{i}" for i in range(len(self._experts))], {"n": len(self._experts)}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return QuantizedExpertWeights([inner[f"e{i}"] for i in range(ctx["n"])])

    def __getattr__(self, name: str):
        if name.startswith("e") and name[1:].isdigit() and "_experts" in self.__dict__:
            return self.__dict__["_experts"][int(name[1:])]  # (the inner tensors __tensor_flatten__ names)
        raise AttributeError(name)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The `[E, out, in]` weight from each expert's rowwise form."""
        return torch.stack([e.dequantize(dtype) for e in self._experts])

    def nbytes_quantized(self) -> int:
        return sum(e.nbytes_quantized() for e in self._experts)

    def _other_op(self, func, args, kwargs):
        if func is aten.copy_.default:
            src = args[1]
            if tuple(src.shape) != tuple(self.shape):
                raise ValueError(f"hybridq: cannot copy a tensor of shape {tuple(src.shape)} into the quantized "
                                 f"weight of {getattr(self, INFO_ATTR).layer} {tuple(self.shape)}")
            for e, s in zip(self._experts, src.unbind(0)):
                copy_into(e, s)
            return self
        if func is aten.clone.default:  # (copy.deepcopy of a model)
            return _with_info(self, [e.map_parts(lambda x: x.clone()) for e in self._experts])
        if func is aten._to_copy.default and kwargs.get("dtype", self.dtype) == self.dtype:
            move = lambda x: x.to(device=kwargs.get("device"), non_blocking=kwargs.get("non_blocking", False),
                                  copy=True)  # (aten._to_copy never aliases)
            return _with_info(self, [e.map_parts(move) for e in self._experts])
        info = getattr(self, INFO_ATTR, None)
        raise NotImplementedError(
            f"hybridq: {func} on the quantized weight of {info.layer if info else 'a GroupedLinear'}: it is held as "
            f"quantized experts (quantized_model_init / quantize_parameters) and supports only unbind(0), copy_ "
            f"(quantizes), clone, detach and .to(device); call .dequantize() for its values. Optimizers keep fp32 masters "
            f"(hybridq.distributed.ZeroAdamW or quantize_master_weights); FSDP2's fully_shard takes the high-precision "
            f"model (hybridq.apply_hybrid_fsdp all-gathers weights quantized)")

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"QuantizedExpertWeights(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"formats={self._experts[0].formats})")


def _with_info(old: QuantizedExpertWeights, experts: list[QuantizedTensor]) -> QuantizedExpertWeights:
    for new, prev in zip(experts, old._experts):
        setattr(new, INFO_ATTR, getattr(prev, INFO_ATTR))
    out = QuantizedExpertWeights(experts)
    setattr(out, INFO_ATTR, getattr(old, INFO_ATTR))
    return out


def check_grouped_layer(layer: nn.Module) -> list[tuple]:
    """Each expert's (weight quantizer, store columnwise, derive columnwise) of a GroupedLinear, after every check
    (as `check_layer` for Linear); changes nothing."""
    from ..formats.base import is_dtensor
    from ..torch_private import local_tensor
    from ..weight_forms import QuantizedGatherShard

    w = layer.weight
    if is_dtensor(w) or isinstance(w, QuantizedGatherShard) or isinstance(local_tensor(w), QuantizedGatherShard):
        raise NotImplementedError(
            f"hybridq: the weight of {layer.name} is sharded (FSDP2); quantized parameters are for unsharded models "
            f"(FSDP2 already all-gathers expert weights quantized: apply_hybrid_fsdp). Quantize the parameters of "
            f"an unsharded model and use hybridq.distributed.ZeroAdamW for data parallelism")
    columnwise = layer.recipe.backward_override is None
    plans = []
    for e, qs in enumerate(layer.expert_quantizers):
        q = qs["weight"]
        name = f"weight of expert {e} of {layer.name}"
        if q.is_stateful:
            raise ValueError(f"hybridq: {name} uses {q.describe()}: a quantized parameter is re-quantized from its "
                             f"master once per optimizer step, which delayed scaling's scale state does not follow; "
                             f"use current scaling (e.g. the 'fp8_tensorwise' preset)")
        shape = (layer.out_features, layer.in_features)
        q.validate(shape, name, rowwise=True, columnwise=columnwise)
        plans.append((q, *columnwise_plan(q, shape, w.dtype, columnwise)))
    return plans


def quantized_experts_parameter(info: QuantizedExpertsInfo, value: torch.Tensor, requires_grad: bool
                                ) -> nn.Parameter:
    """`value` (`[E, out, in]`, the nominal dtype) as the quantized experts `info` describes."""
    experts = []
    with torch.no_grad():
        for i, v in zip(info.experts, value.detach().unbind(0)):
            qt = i.quantizer.quantize(v, rowwise=True, columnwise=i.columnwise_stored, name=f"weight of {i.layer}")
            setattr(qt, INFO_ATTR, i)
            experts.append(qt)
    p = nn.Parameter(QuantizedExpertWeights(experts), requires_grad=requires_grad)
    setattr(p, INFO_ATTR, info)
    return p


def install_grouped(layer: nn.Module, plans: list[tuple], preserve: bool) -> None:
    """Make a GroupedLinear's weight a `QuantizedExpertWeights` parameter (plans from `check_grouped_layer`)."""
    w = layer.weight
    info = QuantizedExpertsInfo(layer.name, tuple(QuantizedParamInfo(expert_name(layer.name, e), q, store, derive)
                                                  for e, (q, store, derive) in enumerate(plans)))
    p = quantized_experts_parameter(info, w, w.requires_grad)
    if preserve:
        setattr(p, INIT_ATTR, w.detach().to("cpu", copy=True))
    layer._parameters["weight"] = p
    install_quantized_hooks(layer)


def _requantize_experts(p: QuantizedExpertWeights, value: torch.Tensor) -> nn.Parameter:
    """A new quantized-experts parameter holding `value` (load_state_dict(assign=True))."""
    return quantized_experts_parameter(getattr(p, INFO_ATTR), value.to(dtype=p.dtype), p.requires_grad)


register_requantize(QuantizedExpertWeights, _requantize_experts)


def expert_weight_for_call(p: QuantizedExpertWeights, expert: int, need_columnwise: bool) -> QuantizedTensor:
    """Expert `expert`'s quantized weight for one call (as `weight_for_call` for a Linear's)."""
    from .quantized_params import weight_for_call

    return weight_for_call(p._experts[expert], need_columnwise)


def is_quantized_experts(t: object) -> bool:
    return isinstance(t, QuantizedExpertWeights) and quantized_param_info(t) is not None
