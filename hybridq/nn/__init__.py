from .convert import ConversionReport, LayerReport, convert_linears
from .linear import Linear

__all__ = ["Linear", "convert_linears", "ConversionReport", "LayerReport"]
