"""`hybridq.nn.Linear`: nn.Linear whose GEMMs read quantized operands chosen by a recipe."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn as nn

from ..formats.base import Quantizer, is_dtensor
from ..errors import RecipeError
from ..recipe import CustomRecipe, Role, check_override_compatible, resolve_recipe
from ..tensor import QuantizedTensor
from ..torch_private import local_tensor
from ..weight_forms import QuantizedGatherShard
from . import compiled_linear, delayed_linear, delayed_state, float8_graph
from .linear_function import (_LinearConfig, apply_linear, cached_quantized_weight,  # noqa: F401 (re-exported)
                              shared_input_quantization)
from .quantized_params import (check_held_weight_format, init_config, quantize_layer, quantized_param_info,
                               weight_for_call)

class Linear(nn.Linear):
    """Drop-in nn.Linear whose three GEMMs use the recipe's quantizers for input, weight and grad_output.

    forward(x, is_first_microbatch=None): with None the weight is quantized on every call. With
    gradient accumulation pass True on the first micro-batch and False on the rest to quantize the
    weight once and reuse it; a cached weight keeps every direction it was ever asked for (usage
    preservation), so an evaluation step under torch.no_grad() never leaves a training step reading a
    stale or missing columnwise form.

    Only what backward reads is quantized: a call no gradient flows through (no_grad, inference_mode, nothing
    requiring grad) quantizes rowwise only and checks only the rowwise shape rules; otherwise the columnwise
    forms are made for the gradients that are needed (input -> dgrad, weight -> wgrad). `recipe` may be
    assigned (see the property).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: CustomRecipe | str, name: str = "", save_original_input: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, name, save_original_input)

    def _setup(self, recipe: CustomRecipe, name: str, save_original_input: bool) -> None:
        self.name = name or f"Linear({self.in_features}->{self.out_features})"
        self._role_name = name  # the module name the recipe's roles carry
        self.save_original_input = save_original_input
        self._weight_cache: tuple[Any, QuantizedTensor] | None = None
        self._cache_columnwise = False
        self._weight_quantized_elsewhere = False  # see mark_weight_quantized_elsewhere
        self._weight_gathered = False
        self.recipe = recipe
        delayed_state.install(self)  # delayed-scaling state in state_dict (nn/delayed_state.py)
        config = init_config()
        if config is not None:  # inside hybridq.quantized_model_init: hold the weight only quantized
            quantize_layer(self, preserve_high_precision_init_val=config["preserve"])

    @property
    def recipe(self) -> CustomRecipe:
        """The recipe this layer quantizes with. Assigning another one validates it against this layer (raises
        RecipeError / FormatShapeError with nothing changed) and then rebuilds the quantizers and drops the
        cached quantized weight."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: CustomRecipe | str) -> None:
        recipe = resolve_recipe(recipe, self.name)
        self.install_recipe(recipe, self.quantizers_for(recipe))

    def install_recipe(self, recipe: CustomRecipe, quantizers: dict[str, Quantizer]) -> None:
        """Use `recipe` with the quantizers `quantizers_for(recipe)` returned (checked: nothing can fail here)."""
        self._recipe = recipe
        self.input_quantizer = quantizers["input"]
        self.weight_quantizer = quantizers["weight"]
        self.grad_output_quantizer = quantizers["grad_output"]
        self._weight_cache = None
        self._cache_columnwise = False
        self.__dict__.pop("_cfg", None)
        self._quantizers_stateful = any(q.is_stateful for q in quantizers.values())
        self._update_configuration_key()

    def quantizers_for(self, recipe: CustomRecipe) -> dict[str, Quantizer]:
        """The quantizers `recipe` gives this layer, after every check that does not need data: the recipe's
        own configuration first (backward override value, override with delayed scaling, the factory:
        RecipeError / TypeError), then the shape rules (FormatShapeError). Changes nothing."""
        recipe = resolve_recipe(recipe, self.name)
        override = recipe.backward_override
        quantizers = {t: recipe.quantizer(Role("linear", t, self._role_name))
                      for t in ("input", "weight", "grad_output")}
        check_override_compatible(override, quantizers, self.name)
        self._check_sharded_weight_format(quantizers["weight"])
        check_held_weight_format(self._parameters.get("weight"), [quantizers["weight"]], self.name)
        self._check_shapes(quantizers, override)
        return quantizers

    def _check_sharded_weight_format(self, weight_q: Quantizer) -> None:
        """Once fully_shard has sharded a weight that FSDP2 all-gathers quantized (apply_hybrid_fsdp), its
        gathered buffers are laid out for the weight format it had then: that format can no longer change."""
        local = local_tensor(self._parameters.get("weight"))
        current = self.__dict__.get("weight_quantizer")
        if isinstance(local, QuantizedGatherShard) and current is not None and weight_q != current:
            raise RecipeError(
                f"{self.name}: its weight is already sharded by fully_shard with quantized all-gathers in "
                f"{self.weight_quantizer.describe()}; a recipe with another weight format ({weight_q.describe()}) "
                f"must be set before fully_shard (convert_linears / apply_hybrid_fsdp, or Linear.recipe)")

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: CustomRecipe, name: str = "",
                    save_original_input: bool = False) -> "Linear":
        """Wrap an existing nn.Linear's parameters (shared, not copied). Raises (nothing changed) if the recipe
        is invalid (RecipeError) or its formats cannot take the layer's shapes (FormatShapeError)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._setup(recipe, name, save_original_input)
        return new

    def quantizers(self) -> dict[str, Quantizer]:
        return {"input": self.input_quantizer, "weight": self.weight_quantizer,
                "grad_output": self.grad_output_quantizer}

    def check_compatible(self) -> None:
        """Check the current recipe again (the backward override may come from the environment)."""
        override = self.recipe.backward_override
        self._check_override(override)
        self._check_shapes(self.quantizers(), override)

    def _check_shapes(self, quantizers: dict[str, Quantizer], override: str | None) -> None:
        """Shape rules known before seeing data: K for input/weight rows, N for weight columns / grad rows."""
        n, k = self.out_features, self.in_features
        quantizers["weight"].validate((n, k), f"weight of {self.name}", rowwise=True, columnwise=override is None)
        # token count M is unknown until forward (checked there); 0 stands for "any"
        quantizers["input"].validate((0, k), f"input of {self.name}", rowwise=True, columnwise=False)
        if override is None:
            quantizers["grad_output"].validate((0, n), f"grad_output of {self.name}", rowwise=True,
                                               columnwise=False)

    def check_override(self) -> None:
        """Raise RecipeError if the backward override in force now (recipe, else environment) cannot be used with
        this layer's quantizers."""
        self._check_override(self.recipe.backward_override)

    def _check_override(self, override: str | None) -> None:
        check_override_compatible(override, self.quantizers(), self.name)

    def describe_formats(self) -> dict[str, str]:
        return {t: q.describe() for t, q in self.quantizers().items()}

    def _cached_weight(self, is_first_microbatch: bool, need_columnwise: bool) -> QuantizedTensor:
        self._weight_cache, self._cache_columnwise, wq = cached_quantized_weight(
            self._weight_cache, self._cache_columnwise, self.weight, self.weight_quantizer,
            is_first_microbatch, need_columnwise, self.name)
        return wq

    def _config(self, override: str | None) -> _LinearConfig:
        """The autograd function's configuration (cached: rebuilt when anything it copies was replaced)."""
        key = (override, self.name, self.save_original_input, self.input_quantizer, self.weight_quantizer,
               self.grad_output_quantizer)
        cached = self.__dict__.get("_cfg")
        if cached is None or not all(map(operator.is_, cached[0], key)):
            cached = self.__dict__["_cfg"] = (key, _LinearConfig(self, override))
        return cached[1]

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        # (in or out features 0: no GEMM to put in a graph; the eager path computes the empty product)
        compiling = torch.compiler.is_compiling()  # (asked once: three Python calls per ask)
        tp = self.__dict__.get("_tensor_parallel")  # (hybridq.distributed's ColwiseParallel / RowwiseParallel)
        if (tp is not None and compiling and self.in_features and self.out_features
                and tp.runs_in_graph(self, x, is_first_microbatch)):
            # this rank's pieces inside the graph as custom ops, the group's collectives in them
            # (distributed/compiled_tp.py)
            override = self.recipe.backward_override
            if override is not None:
                self._check_override(override)
            return tp.compiled_forward(self, x, override)
        if (compiling and self.in_features and self.out_features
                and compiled_linear.runs_in_graph(self, x, is_first_microbatch)):
            override = self.recipe.backward_override
            if override is not None:
                self._check_override(override)
            elif not self._weight_quantized_elsewhere and float8_graph.takes(self._float8_graph_spec, x, self.weight):
                # FP8 (per-tensor or blocks): its kernels and GEMMs themselves in the graph (nn/float8_graph.py)
                return float8_graph.float8_graph_linear(x, self.weight, self.bias, self._float8_graph_spec)
            # any other layer (and a weight FSDP2 gathered quantized or a quantized parameter: its handle): inside
            # the graph as two custom ops (nn/compiled_linear.py)
            return compiled_linear.compiled_linear(self, x, override)
        return self._eager_forward(x, is_first_microbatch)

    # torch.compile, for what compiled_linear does not take: the layer runs eagerly between the compiled regions
    # around it (a graph break), since dynamo cannot trace its quantized tensors and autograd function
    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, is_first_microbatch: bool | None) -> torch.Tensor:
        tp = self.__dict__.get("_tensor_parallel")
        if tp is not None:  # set by hybridq.distributed's ColwiseParallel / RowwiseParallel
            return tp.forward(self, x, is_first_microbatch)
        weight, bias = self.weight, self.bias
        if is_dtensor(x) or is_dtensor(weight):
            # torch's own styles: quantizing a DTensor's local piece as a whole tensor would be silently wrong
            raise NotImplementedError(
                f"{self.name}: a hybridq Linear received DTensor "
                f"{'weight' if is_dtensor(weight) else 'input'}: parallelize it with "
                f"hybridq.distributed.ColwiseParallel / RowwiseParallel / PrepareModuleInput (drop-in replacements "
                f"for torch's styles, same arguments), not torch.distributed.tensor.parallel's")
        override = self.recipe.backward_override  # may come from the environment: checked every call
        if override is not None:
            self._check_override(override)
        cfg = self._config(override)
        cache = None
        if is_first_microbatch is not None and not isinstance(weight, QuantizedTensor):
            cache = _CallCache(self, is_first_microbatch)
        if (override is None and self._float8_graph_spec is not None and quantized_param_info(weight) is None
                and (self._weight_gathered or not isinstance(weight, QuantizedTensor))):
            # FP8 (per-tensor or blocks) on a plain weight, the is_first_microbatch cache's quantization of it or
            # FSDP2's gathered one: the few ops themselves, where they are exactly what the general path below would
            # run (nn/float8_graph.py; None: it must run)
            y = float8_graph.eager_float8_linear(x, weight, bias, self._float8_graph_spec, cfg, cache)
            if y is not None:
                return y
        if (override is None and self._delayed_spec is not None and cache is None
                and not isinstance(weight, QuantizedTensor) and quantized_param_info(weight) is None):
            # per-tensor FP8 with delayed scaling on a plain weight: the general path's casts and GEMMs as the few
            # calls they are (nn/delayed_linear.py; None: it must run)
            y = delayed_linear.eager_delayed_linear(x, weight, bias, self._delayed_spec, cfg)
            if y is not None:
                return y
        if quantized_param_info(weight) is not None:  # the weight is held quantized (quantized_model_init)
            cache = lambda need_columnwise: weight_for_call(weight, need_columnwise)
        return apply_linear(x, weight, bias, cfg, cache)

    # -- torch.compile (nn/compiled_linear.py) ---------------------------------------------------------------
    @property
    def save_original_input(self) -> bool:
        """Save the high-precision input for wgrad instead of its quantized columnwise form (see
        docs/formats-and-recipes.md)."""
        return self._save_original_input

    @save_original_input.setter
    def save_original_input(self, value: bool) -> None:
        self._save_original_input = bool(value)
        self.__dict__.pop("_cfg", None)
        if "_recipe" in self.__dict__:
            self._update_configuration_key()

    def _update_configuration_key(self) -> None:
        # read by compiled code: torch.compile guards on it, so a change traces the layer again
        self._configuration_key = compiled_linear.configuration_key(self.name, self.quantizers(),
                                                                    self._save_original_input)
        self._float8_graph_spec = float8_graph.graph_spec(self.quantizers(), self._save_original_input)
        self._delayed_spec = delayed_linear.delayed_spec(self.quantizers(), self._save_original_input)

    def mark_weight_quantized_elsewhere(self) -> None:
        """The weight this layer receives in forward will be a quantized tensor made elsewhere (FSDP2's quantized
        all-gather, a quantized parameter). Compiled code looks at it only where it is FSDP2's gathered weight (its
        sharded parameter all-gathers quantized), which enters the graph as a handle; a quantized parameter, which
        dynamo cannot wrap, is never looked at (see compiled_linear.runs_in_graph)."""
        self._weight_quantized_elsewhere = True
        w = self._parameters.get("weight")
        self._weight_gathered = any(isinstance(t, QuantizedGatherShard) for t in (w, local_tensor(w)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class _CallCache:
    """One call's `weight_cache(need_columnwise)` on the is_first_microbatch cache (Linear._cached_weight), asked at
    most once per call: where the fast path asked it and then declined, the general path gets the same quantized
    weight rather than a second quantization (is_first_microbatch=True) or a second stale-weight warning."""

    __slots__ = ("layer", "first", "weight")

    def __init__(self, layer: Linear, is_first_microbatch: bool):
        self.layer, self.first, self.weight = layer, is_first_microbatch, None

    def __call__(self, need_columnwise: bool) -> QuantizedTensor:
        if self.weight is None:
            self.weight = self.layer._cached_weight(self.first, need_columnwise)
        return self.weight
