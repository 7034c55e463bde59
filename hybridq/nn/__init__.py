from .convert import ConversionReport, LayerReport, convert_linears
from .grouped import GroupedLinear, convert_experts, grouped_mm
from .linear import Linear

__all__ = ["Linear", "GroupedLinear", "convert_linears", "convert_experts", "grouped_mm", "ConversionReport",
           "LayerReport"]
