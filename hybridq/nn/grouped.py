"""`hybridq.nn.GroupedLinear`: the expert GEMMs of a mixture-of-experts layer, each expert computed exactly as a
hybridq Linear on its own token slice."""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..enums import ROWWISE
from ..errors import RecipeError
from ..formats.base import Quantizer
from ..recipe import CustomRecipe, Role, check_override_compatible, resolve_recipe
from ..tensor import QuantizedTensor
from ..torch_private import local_tensor
from ..weight_forms import ExpertsTensor, GroupedGatheredForm, QuantizedGatherShard
from ..gemm import jagged_fp8_kernels, native_row_multiple
from . import compiled_grouped, delayed_state
from .expert_layers import converted_experts, converted_layer, expert_name, set_converted
from .grouped_packed import BLOCKS, FP8_TENSOR, PackedFP8Experts, TokenLayout, packed_quantizers, padded_tokens
from .grouped_device_blocks import DeviceBlockExperts, device_path_runs, slot_layout
from .grouped_packed_blocks import PackedBlockExperts, packed_path_pays, token_multiple
from .grouped_jagged import HeldFP8Experts, JaggedFP8Experts, TokenGroups
from .grouped_high_precision import grouped_mm_high_precision
from .m_splits import check_split_values, checked_m_splits, host_counts
from .linear_function import _LinearConfig, apply_linear, cached_quantized_weight, gradients_needed
from .quantized_experts import check_grouped_layer, expert_weight_for_call, install_grouped, is_quantized_experts
from .quantized_params import check_held_weight_format, init_config, install_quantized_hooks

TENSORS = ("input", "weight", "grad_output")
MODULE_TYPE = "grouped_linear"


class _Expert:
    """What `_LinearConfig` reads from a module, for one expert (plain object, not a module)."""

    __slots__ = ("name", "input_quantizer", "weight_quantizer", "grad_output_quantizer", "save_original_input")

    def __init__(self, name: str, quantizers: dict[str, Quantizer], save_original_input: bool):
        self.name = name
        self.input_quantizer = quantizers["input"]
        self.weight_quantizer = quantizers["weight"]
        self.grad_output_quantizer = quantizers["grad_output"]
        self.save_original_input = save_original_input


def _unbind_experts(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`weight.unbind(0)`; under inference_mode an experts tensor's (quantized parameter, FSDP2-gathered) experts
    as held: unbind is a view op whose outputs get the base's version counter, which inference tensors refuse
    ("Cannot set version_counter for inference tensor"), and no autograd graph is recorded there to need views."""
    if torch.is_inference_mode_enabled() and isinstance(weight, ExpertsTensor):
        return tuple(weight._experts)
    return weight.unbind(0)


_PER_EXPERT = object()  # (GroupedLinear._jagged: take the per-expert path)


class _NoTokens(torch.autograd.Function):
    """The empty product of an expert without tokens whose weight is quantized (gathered by FSDP2): keeps the
    output in the graph; zero gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, out_features: int) -> torch.Tensor:
        ctx.w_meta = (tuple(w.shape), w.dtype)
        return x.new_empty(0, out_features)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        shape, dtype = ctx.w_meta
        dw = dy.new_zeros(shape, dtype=dtype) if ctx.needs_input_grad[1] else None
        return dy.new_zeros(0, shape[1]), dw, None


class GroupedLinear(nn.Module):
    """E experts' linear layers in one module: `weight [E, out, in]` (+ `bias [E, out]`), the layout of
    `torch._grouped_mm` and torchtitan-style MoE code.

    forward(x, m_splits, is_first_microbatch=None): `x [T, in]` holds the tokens sorted by expert, `m_splits`
    (a list or 1-D integer tensor of length E, zeros allowed, summing to T) the token count of each expert;
    returns `[T, out]`. Expert e's three GEMMs are those of a hybridq Linear with expert e's quantizers
    (`recipe.quantizer(Role("grouped_linear", t, f"{name}.experts.{e}"))`) on its slice: the same backward
    overrides, save_original_input, is_first_microbatch caching with usage preservation and rowwise-only
    forward when no gradient flows. A slice whose token count a format's shape rule cannot take (e.g. 17 rows
    for MXFP8's 32-row columnwise blocks) is zero-padded to the next count it can take inside the op, and the
    padded rows are dropped from the output: the result is bitwise that of the Linear on the zero-padded
    slice. An expert with no tokens runs no quantized GEMM; its weight and bias gradients are zero.
    """

    # the same quantizers for every expert, all per-tensor FP8 with current scaling, all block formats without
    # tensor-wide statistics (FP8 blocks, MXFP8, hybrids of them) or all NVFP4 / its hybrids (per-expert global
    # amaxes; a weight without stochastic rounding), and no bias, override, weight cache, quantized weight or
    # save_original_input: quantize all experts in one call per tensor -- a weight FSDP2 gathered quantized is read as
    # gathered (block formats; per-tensor FP8 on the jagged path; NVFP4: the per-expert path)
    # (hybridq/nn/grouped_packed.py, grouped_packed_blocks.py; `packed_quantizers` decides; with m_splits a CUDA
    # tensor, FP8 blocks and MXFP8 without a host sync where the grouped GEMMs take every phase:
    # grouped_device_blocks.py). False: always the per-expert path (what the packed paths are tested against).
    packed_path: bool = True
    # per-tensor FP8 (the FP8_TENSOR packed path) takes the jagged layout (hybridq/nn/grouped_jagged.py: tokens as
    # routed, group bounds on the device, no host sync) where its kernels run here (the CPU reference; CUDA sm_90
    # with Triton and the extension), else the padded packed layout. None: the jagged layout unless its kernels
    # measure the per-expert path faster at these token counts (`prefers_per_expert_path`: none of today's kernels
    # do); True: the jagged layout wherever its kernels run; False: never (benchmarks, tests).
    jagged_path: bool | None = None

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype=None, *, recipe: CustomRecipe | str, name: str = "", save_original_input: bool = False):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"GroupedLinear {name!r}: num_experts must be >= 1, got {num_experts}")
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, device=device, dtype=dtype))
                     if bias else None)
        self.reset_parameters()
        self._setup(recipe, name, save_original_input)

    def reset_parameters(self) -> None:
        # each expert initialised as nn.Linear initialises its weight and bias
        with torch.no_grad():
            for w in self.weight:
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_parameters(cls, weight: nn.Parameter, bias: nn.Parameter | None = None, *, recipe: CustomRecipe,
                        name: str = "", save_original_input: bool = False) -> "GroupedLinear":
        """Wrap an existing `[E, out, in]` weight (and `[E, out]` bias) parameter (shared, not copied). Raises
        (nothing changed) on a wrong shape, an invalid recipe or shapes its formats cannot take."""
        if not isinstance(weight, nn.Parameter) or weight.dim() != 3:
            raise ValueError(f"GroupedLinear {name!r}: weight must be an nn.Parameter of shape [E, out, in], got "
                             f"{type(weight).__name__} of shape {tuple(weight.shape)}")
        e, n, k = weight.shape
        if bias is not None and tuple(bias.shape) != (e, n):
            raise ValueError(f"GroupedLinear {name!r}: bias must have shape {(e, n)}, got {tuple(bias.shape)}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts, new.out_features, new.in_features = e, n, k
        new.weight, new.bias = weight, bias
        new._setup(recipe, name, save_original_input)
        return new

    def _setup(self, recipe: CustomRecipe, name: str, save_original_input: bool) -> None:
        self.name = name or f"GroupedLinear({self.num_experts}x{self.in_features}->{self.out_features})"
        self._role_name = name
        self.save_original_input = save_original_input
        self._weight_caches: list[tuple[Any, QuantizedTensor] | None] = [None] * self.num_experts
        self._cache_columnwise = [False] * self.num_experts
        self.recipe = recipe
        delayed_state.install(self)  # each expert's delayed-scaling state in state_dict (nn/delayed_state.py)
        config = init_config()
        if config is not None:  # inside hybridq.quantized_model_init: hold the experts' weights only quantized
            install_grouped(self, check_grouped_layer(self), config["preserve"])

    @property
    def recipe(self) -> CustomRecipe:
        """The recipe the experts quantize with; assigning validates it first (nothing changes on error), then
        rebuilds every expert's quantizers and drops the cached quantized weights."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: CustomRecipe | str) -> None:
        recipe = resolve_recipe(recipe, self.name)
        self.install_recipe(recipe, self.quantizers_for(recipe))

    def install_recipe(self, recipe: CustomRecipe, quantizers: list[dict[str, Quantizer]]) -> None:
        self._recipe = recipe
        self.expert_quantizers = quantizers
        self._graph_key = compiled_grouped.graph_key(self)  # (read by compiled code: a change traces again)
        self._weight_caches = [None] * self.num_experts
        self._cache_columnwise = [False] * self.num_experts
        self.__dict__.pop("_cfgs", None)

    def quantizers_for(self, recipe: CustomRecipe) -> list[dict[str, Quantizer]]:
        """Every expert's quantizers from `recipe`, after the checks that need no data (as Linear.quantizers_for:
        recipe configuration, then the shape rules on in/out features). Changes nothing."""
        recipe = resolve_recipe(recipe, self.name)
        override = recipe.backward_override
        out = []
        for e in range(self.num_experts):
            qs = {t: recipe.quantizer(Role(MODULE_TYPE, t, expert_name(self._role_name, e))) for t in TENSORS}
            label = f"expert {e} of {self.name}"
            check_override_compatible(override, qs, label)
            n, k = self.out_features, self.in_features
            qs["weight"].validate((n, k), f"weight of {label}", rowwise=True, columnwise=override is None)
            qs["input"].validate((0, k), f"input of {label}", rowwise=True, columnwise=False)
            if override is None:
                qs["grad_output"].validate((0, n), f"grad_output of {label}", rowwise=True, columnwise=False)
            out.append(qs)
        self._check_sharded_weight_format(out)
        check_held_weight_format(self._parameters.get("weight"), [qs["weight"] for qs in out], self.name)
        return out

    def _check_sharded_weight_format(self, quantizers: list[dict[str, Quantizer]]) -> None:
        """Once fully_shard has sharded the weight with quantized all-gathers (apply_hybrid_fsdp), its gathered
        buffers are laid out for the experts' weight formats it had then: those can no longer change."""
        local = local_tensor(self._parameters.get("weight"))
        current = self.__dict__.get("expert_quantizers")
        if isinstance(local, QuantizedGatherShard) and current is not None and any(
                a["weight"] != b["weight"] for a, b in zip(quantizers, current)):
            raise RecipeError(
                f"{self.name}: its weight is already sharded by fully_shard with quantized all-gathers in "
                f"{current[0]['weight'].describe()}; a recipe with another weight format "
                f"({quantizers[0]['weight'].describe()}) must be set before fully_shard")

    def check_override(self) -> None:
        """Raise RecipeError if the backward override in force now cannot be used with the experts' quantizers."""
        override = self.recipe.backward_override
        for e, qs in enumerate(self.expert_quantizers):
            check_override_compatible(override, qs, f"expert {e} of {self.name}")

    def weight_quantizers(self) -> tuple[Quantizer, ...]:
        """Every expert's weight quantizer, one tuple per recipe (FSDP2's gather hooks ask at every unshard)."""
        hit = self.__dict__.get("_weight_qs")
        if hit is None or hit[0] is not self.expert_quantizers:
            hit = self.__dict__["_weight_qs"] = (self.expert_quantizers,
                                                 tuple(qs["weight"] for qs in self.expert_quantizers))
        return hit[1]

    def _packed_kind(self):
        """`packed_quantizers` of the experts' quantizers, once per recipe (it compares every expert's quantizers:
        E x 3 dataclass comparisons per call otherwise)."""
        hit = self.__dict__.get("_packed")
        if hit is None or hit[0] is not self.expert_quantizers:
            hit = self.__dict__["_packed"] = (self.expert_quantizers, packed_quantizers(self.expert_quantizers))
        return hit[1]

    def describe_formats(self) -> dict[str, str]:
        """tensor type -> format, with the experts' descriptions joined where they differ."""
        return {t: " | ".join(dict.fromkeys(qs[t].describe() for qs in self.expert_quantizers)) for t in TENSORS}

    def _configs(self, override: str | None) -> list[_LinearConfig]:
        key = (override, self.name, self.save_original_input, self.expert_quantizers)
        cached = self.__dict__.get("_cfgs")
        if cached is None or not all(map(operator.is_, cached[0], key)):
            cfgs = [_LinearConfig(_Expert(expert_name(self.name, e), qs, self.save_original_input), override)
                    for e, qs in enumerate(self.expert_quantizers)]
            cached = self.__dict__["_cfgs"] = (key, cfgs)
        return cached[1]

    def _splits(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> list[int] | torch.Tensor:
        """m_splits after the checks that need no host sync (raised before anything is quantized or cached): a list
        of ints, or a device tensor whose values only the device reads (the jagged path) or `_host_splits` reads."""
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input must have shape [tokens, {self.in_features}] (in_features), got "
                             f"{tuple(x.shape)}")
        return checked_m_splits(m_splits, self.num_experts, x.shape[0], self.name)  # (m_splits.py: shared rules)

    def _host_splits(self, splits: list[int] | torch.Tensor, tokens: int) -> list[int]:
        if isinstance(splits, torch.Tensor):  # (one host sync: the per-expert and padded paths slice on the host)
            return check_split_values(host_counts(splits), self.num_experts, tokens, self.name)
        return splits

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if torch.compiler.is_compiling() and compiled_grouped.runs_in_graph(self, x, m_splits, is_first_microbatch):
            # tensor counts, per-tensor FP8 on the jagged layout or block formats on the device-count packed path:
            # two custom ops in the graph (compiled_grouped.py, compiled_grouped_blocks.py)
            return compiled_grouped.grouped_in_graph(self, x, m_splits)
        return self._eager_forward(x, m_splits, is_first_microbatch)

    @torch.compiler.disable  # what the graph's ops do not take runs eagerly between compiled regions, as Linear's
    def _eager_forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                       is_first_microbatch: bool | None) -> torch.Tensor:
        splits = self._splits(x, m_splits)
        override = self.recipe.backward_override  # may come from the environment: checked every call
        if override is not None:
            self.check_override()
        cfgs = self._configs(override)
        need_dgrad, need_wgrad = gradients_needed(x, self.weight)
        quantized_bwd = override is None and (need_dgrad or need_wgrad)
        gathered = isinstance(self.weight, GroupedGatheredForm)  # FSDP2 gathered the experts quantized
        held_quantized = is_quantized_experts(self.weight)  # quantized_model_init / quantize_parameters
        if gathered:  # a direction gathered lazily is a collective: every rank asks, whatever its token counts
            self.weight.ensure_direction(ROWWISE)
        # a router's per-expert counts are rarely multiples of 16: without padding the hardware GEMMs refuse them
        # (wgrad contracts over the tokens) and the fp32 emulated GEMM runs
        multiple = native_row_multiple(x.device)
        kind = (self._packed_kind()
                if (self.packed_path and override is None and not held_quantized and is_first_microbatch is None
                    and self.bias is None and not self.save_original_input) else None)
        if gathered and kind is not None and kind.kind != BLOCKS:
            # block formats read the gathered experts (GatheredExpertWeights); per-tensor FP8 reads them on the
            # jagged path (`_jagged`); the other packed paths quantize the weight themselves
            kind = None
        y = self._jagged(x, splits, kind, gathered, held_quantized, override, is_first_microbatch, need_dgrad,
                         need_wgrad)
        if y is _PER_EXPERT:
            kind = None
        elif y is not None:
            return y
        if (kind is not None and kind.kind == BLOCKS and isinstance(splits, torch.Tensor)
                and device_path_runs(kind.quantizers, x.device, *self.weight.shape)):
            # counts on the device: the slot layout computed there, grouped GEMMs on its bounds, no host sync
            # (grouped_device_blocks.py); the host-count path below would read them
            return self._device_blocks(x, splits, kind.quantizers, need_dgrad, need_wgrad)
        splits = self._host_splits(splits, x.shape[0])
        if kind is not None and not packed_path_pays(kind.kind, splits, self.in_features, self.out_features,
                                                     x.device, kind.quantizers):
            kind = None
        if kind is not None:  # (override is None: the backward GEMMs are quantized)
            qs = kind.quantizers
            padded = [padded_tokens(m, self.in_features, self.out_features, qs, need_dgrad, need_wgrad, multiple)
                      if m else 0 for m in splits]
            if kind.kind == FP8_TENSOR:
                layout = TokenLayout.build(splits, padded, x.device)
                return PackedFP8Experts.apply(x, self.weight, layout, qs, self.name)
            # BLOCKS / ROW_GROUPS: each expert's slot padded on to whole scaling blocks along the tokens (on the CPU
            # padded_tokens leaves FP8 blocks' counts as they are: their edge blocks may be partial)
            layout = TokenLayout.build(splits, padded, x.device, token_multiple(qs, need_dgrad, need_wgrad))
            return PackedBlockExperts.apply(x, self.weight, layout, qs, self.name, need_dgrad, need_wgrad)
        weights = _unbind_experts(self.weight)  # views: their gradients stack exactly into weight.grad
        biases = self.bias.unbind(0) if self.bias is not None else [None] * self.num_experts
        outs = []
        for e, (x_e, m) in enumerate(zip(x.split(splits, 0), splits)):
            if m == 0:  # no GEMM to quantize; an empty product keeps the output in the graph (zero gradients)
                y_e = (_NoTokens.apply(x_e, weights[e], self.out_features) if gathered or held_quantized
                       else x_e.mm(weights[e].t().to(x.dtype)))
                outs.append(y_e if biases[e] is None else y_e + biases[e].to(x.dtype))
                continue
            qs = self.expert_quantizers[e]
            n = padded_tokens(m, self.in_features, self.out_features, qs, quantized_bwd and need_dgrad,
                              quantized_bwd and need_wgrad, multiple)
            if n != m:
                x_e = F.pad(x_e, (0, 0, 0, n - m))
            cache = None
            if held_quantized:  # the expert's quantized parameter form (+ its derived columnwise form)
                cache = lambda need_columnwise, e=e: expert_weight_for_call(self.weight, e, need_columnwise)
            elif is_first_microbatch is not None and not gathered:
                cache = self._expert_cache(e, weights[e], is_first_microbatch)
            y_e = apply_linear(x_e, weights[e], biases[e], cfgs[e], cache)
            outs.append(y_e[:m] if n != m else y_e)
        return torch.cat(outs, 0)

    def _device_blocks(self, x: torch.Tensor, m_splits: torch.Tensor, quantizers: dict[str, Quantizer],
                       need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
        """The packed block path on the device's counts (grouped_device_blocks.py)."""
        layout = slot_layout(m_splits, x, self.in_features, self.out_features, quantizers, need_dgrad, need_wgrad,
                             self.name)
        return DeviceBlockExperts.apply(x, self.weight, layout, quantizers, self.name, need_dgrad, need_wgrad)

    def _jagged(self, x, splits, kind, gathered, held_quantized, override, is_first_microbatch, need_dgrad,
                need_wgrad) -> torch.Tensor | None:
        """Per-tensor FP8 on the jagged layout (grouped_jagged.py) where its kernels run here, its weight quantized
        in the op or gathered so by FSDP2 (the experts' rowwise parts); None: another path runs; _PER_EXPERT: the
        per-expert path, measured faster here (see `jagged_path`)."""
        if not (self.packed_path and self.jagged_path is not False and override is None and not held_quantized
                and is_first_microbatch is None and self.bias is None and not self.save_original_input):
            return None
        if gathered:  # (kind is None for a gathered per-tensor FP8 weight: PackedFP8Experts quantizes the weight)
            kind = self._packed_kind()
        if kind is None or kind.kind != FP8_TENSOR:
            return None
        kernels = jagged_fp8_kernels(x.device, self.in_features, self.out_features, kind.quantizers)
        if kernels is None:
            return None
        if (self.jagged_path is None and isinstance(splits, list)
                and kernels.prefers_per_expert_path(splits, self.in_features, self.out_features)):
            return _PER_EXPERT
        held = HeldFP8Experts.of(self.weight, lambda: _unbind_experts(self.weight)) if gathered else None
        if gathered and held is None:
            return None
        groups = TokenGroups.build(splits, x.shape[0], x.device, self.name)
        return JaggedFP8Experts.apply(x, self.weight, groups, kind.quantizers, self.name, need_dgrad, need_wgrad,
                                      kernels, held)

    def _expert_cache(self, e: int, w: torch.Tensor, is_first_microbatch: bool):
        def get(need_columnwise: bool) -> QuantizedTensor:
            self._weight_caches[e], self._cache_columnwise[e], wq = cached_quantized_weight(
                self._weight_caches[e], self._cache_columnwise[e], w, self.expert_quantizers[e]["weight"],
                is_first_microbatch, need_columnwise, expert_name(self.name, e))
            return wq
        return get

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, recipe={self.recipe.name}")


# ---- expert modules: the conversion protocol -------------------------------------------------------------------

PROTOCOL_ATTR = "hybridq_grouped_weights"
def grouped_mm(module: nn.Module, weight_name: str, x: torch.Tensor,
               m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """`y[rows of expert e] = x[rows of expert e] @ W[e]^T` for the `[E, out, in]` parameter `weight_name` of an
    expert module (one listing it in `hybridq_grouped_weights`). After `convert_experts` this is the module's
    GroupedLinear for that weight (quantized per the recipe); before, the same product in high precision (one
    `torch._grouped_mm` on CUDA sm_90+ with a bf16 input, as torchtitan's experts: grouped_high_precision.py)."""
    weight = getattr(module, weight_name)
    converted = converted_layer(module, weight_name)
    if converted is None:  # (the same m_splits rules as the converted GroupedLinear's)
        return grouped_mm_high_precision(x, weight, m_splits, f"grouped_mm of {weight_name}")
    # the parameter may have been replaced (e.g. by FSDP2's unsharded one): the layer reads the current one. Traced,
    # the old one is not looked at (dynamo would guard on it: a sharded weight whose metadata does not compare equal)
    if torch.compiler.is_compiling() or converted.weight is not weight:
        converted._parameters["weight"] = weight
    return converted(x, m_splits)


def expert_weight_names(module: nn.Module) -> tuple[str, ...] | None:
    """The weight names an expert module declares (`hybridq_grouped_weights`: a tuple of attribute names of
    `[E, out, in]` parameters), or None if it does not implement the protocol."""
    names = getattr(type(module), PROTOCOL_ATTR, None)
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{type(module).__name__}.{PROTOCOL_ATTR} must be a tuple of parameter names, got {names!r}")
    return tuple(names)


def convert_experts(model: nn.Module, recipe: CustomRecipe | str, *, save_original_input: bool = False
                    ) -> dict[str, dict[str, str]]:
    """Make every expert module of `model` compute its grouped GEMMs with `recipe`, without changing the model's
    structure, parameters or state_dict keys.

    An expert module opts in with a class attribute `hybridq_grouped_weights = ("w1", "w2", "w3")` naming its
    `[E, out, in]` parameters, and computes each grouped product with `hybridq.nn.grouped_mm(self, "w1", x,
    m_splits)` (high precision until converted). Each listed parameter is wrapped (shared, not copied) by a
    GroupedLinear named `"{module fqn}.{weight name}"`, whose expert e's roles are
    `Role("grouped_linear", t, "{module fqn}.{weight name}.experts.{e}")`. Every weight is checked before any
    module changes (RecipeError / FormatShapeError / ValueError, nothing changed); converting again replaces the
    recipe. Returns `{fqn.weight_name: formats}`."""
    recipe = resolve_recipe(recipe, "convert_experts")
    planned = [(mod, plan_expert_module(fqn, mod, recipe, save_original_input=save_original_input))
               for fqn, mod in model.named_modules() if expert_weight_names(mod) is not None]
    report = {}
    for mod, wrapped in planned:
        install_expert_module(mod, wrapped)
        report.update({g.name: g.describe_formats() for g in wrapped.values()})
    return report


def plan_expert_module(fqn: str, mod: nn.Module, recipe: CustomRecipe, *, save_original_input: bool = False
                       ) -> dict[str, GroupedLinear]:
    """The GroupedLinear of each weight an expert module lists, checked against `recipe` (raises with nothing
    changed); `install_expert_module` makes the module use them."""
    wrapped = {}
    for n in expert_weight_names(mod):
        full = f"{fqn}.{n}" if fqn else n
        param = getattr(mod, n, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"convert_experts: {full} is listed in {PROTOCOL_ATTR} but is not a parameter "
                             f"(got {type(param).__name__})")
        old = converted_experts(mod).get(n)
        if old is not None:
            old._parameters["weight"] = param  # (the module's current parameter, e.g. FSDP2's sharded one)
            old.quantizers_for(recipe)  # (refuses a new weight format once FSDP2 gathers this weight quantized)
        wrapped[n] = GroupedLinear.from_parameters(param, recipe=recipe, name=full,
                                                   save_original_input=save_original_input)
    return wrapped


def install_expert_module(mod: nn.Module, wrapped: dict[str, GroupedLinear]) -> None:
    for n, g in wrapped.items():  # (a weight quantized by quantized_model_init is the module's parameter too)
        if getattr(mod, n) is not g.weight:
            setattr(mod, n, g.weight)
        if is_quantized_experts(g.weight):  # the module's state_dict gives it dequantized
            install_quantized_hooks(mod)
    set_converted(mod, wrapped)  # not a submodule: parameters and state_dict stay as they were
    # ...so the module itself carries its GroupedLinears' delayed-scaling state (keys only with delayed scaling)
    delayed_state.install(mod)
