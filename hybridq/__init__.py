"""hybridq: hybrid low-precision training for PyTorch (FSDP2, tensor parallelism).

Each tensor may use one quantization format for its rowwise (forward) use and another for its columnwise
(backward) use. See README.md.
"""


def _require_torch() -> None:
    """torch is not a declared dependency (pip would put its default wheel over a CPU or custom build): say what
    is missing in one message before any submodule fails on `import torch`."""
    import re
    hint = ("e.g. `pip install torch` (CUDA build) or `pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu` (CPU build); see https://pytorch.org/get-started/locally/")
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ImportError(f"hybridq needs PyTorch >= 2.11: install it first, {hint}") from None
    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if m is None or (int(m.group(1)), int(m.group(2))) < (2, 11):
        raise ImportError(f"hybridq needs PyTorch >= 2.11, found torch {torch.__version__}: upgrade it, {hint}")


_require_torch()

from . import dispatch
from .enums import AmaxComputeAlgo, BackwardOverride, ColumnwiseSource, Direction, OnIncompatible, Scaling, TensorType
from .errors import FormatShapeError, RecipeError, StaleWeightError
from .formats import (COLUMNWISE, ROWWISE, Float8BlockQuantizer, Float8Quantizer, HybridQuantizer,
                      IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, QuantizedPart, Quantizer)
from .formats import Float8RowwiseQuantizer
from .gemm import register_native_gemm
from .kernels import extension_available, update_delayed_scaling  # also registers device kernels / GEMMs
from .nn import (ConversionReport, GroupedLinear, LayerNorm, Linear, RMSNorm, SwiGLU, convert_experts,
                 convert_linears, convert_norms, grouped_mm)
from .nn import ParameterMemory, high_precision_init_value, parameter_memory, quantize_parameters, quantized_model_init
from .recipe import CustomRecipe, Role, preset_names, recipe
from .tensor import QuantizedTensor
from .offload import CPUOffload
from .recompute import checkpoint_contexts
from .export import export_state_dict
from .distributed import PrecomputedScales, apply_hybrid_fsdp, precompute_scales
from . import checkpoint  # noqa: E402 hybridq.checkpoint.write_manifest / verify_manifest around dcp.save / dcp.load

__all__ = [
    "ROWWISE", "COLUMNWISE", "Direction", "Scaling", "BackwardOverride", "TensorType", "OnIncompatible",
    "AmaxComputeAlgo", "ColumnwiseSource", "Quantizer", "QuantizedPart", "QuantizedTensor",
    "Float8Quantizer", "Float8BlockQuantizer", "Float8RowwiseQuantizer", "MXFP8Quantizer", "NVFP4Quantizer",
    "IdentityQuantizer",
    "HybridQuantizer", "register_native_gemm", "CustomRecipe", "Role", "recipe", "preset_names",
    "Linear", "GroupedLinear", "RMSNorm", "LayerNorm", "SwiGLU", "convert_linears", "convert_norms", "convert_experts", "grouped_mm", "ConversionReport", "apply_hybrid_fsdp", "precompute_scales",
    "PrecomputedScales",
    "CPUOffload", "checkpoint_contexts", "export_state_dict", "extension_available", "update_delayed_scaling", "FormatShapeError", "RecipeError", "StaleWeightError",
    "quantized_model_init", "quantize_parameters", "parameter_memory", "ParameterMemory", "high_precision_init_value",
]
__version__ = "0.1.0"
