from .convert import ConversionReport, LayerReport, convert_linears, convert_norms
from .grouped import GroupedLinear, convert_experts, grouped_mm
from .layer_norm import LayerNorm, layer_norm
from .linear import Linear
from .norm import RMSNorm, rms_norm
from .param_conversion import quantize_parameters
from .swiglu import SwiGLU, swiglu
from .quantized_params import ParameterMemory, high_precision_init_value, parameter_memory, quantized_model_init

__all__ = ["Linear", "RMSNorm", "rms_norm", "LayerNorm", "layer_norm", "SwiGLU", "swiglu", "GroupedLinear", "convert_linears", "convert_norms", "convert_experts", "grouped_mm", "ConversionReport",
           "LayerReport", "quantized_model_init", "quantize_parameters", "parameter_memory", "ParameterMemory",
           "high_precision_init_value"]

from . import compiled_amax as _compiled_amax

_compiled_amax.install()  # (Inductor's post-grad pass handing the norms' max|y| to the Linears' casts)
