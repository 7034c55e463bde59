"""Device backends: the CUDA kernels of every format and the hardware GEMMs, registered into `hybridq.dispatch`.

The format modules hold the pure-PyTorch references (the numerics contract, docs/numerics.md). Importing this
package registers the CUDA implementations (per quantizer / part type) into the dispatch tables; they are used
for tensors on a CUDA device when their `supports` check accepts the call, and the reference runs otherwise.
Either way the call signature and the result (bit for bit) are the same.

CUDA: `cuda` registers the kernels of the optional extension `hybridq._C` (loaded on first use with a CUDA
tensor, see `_ext`), one module per format (`cuda_<format>.py`); `native_gemm` registers the hardware GEMMs
(FP8 tensorwise and blockwise through torch's scaled_mm) and the bf16 emulation of the block-scaled formats.
`extension_available()` says whether the extension is built and loadable. `update_delayed_scaling(quantizers)`
runs the delayed-scaling update of many per-tensor FP8 quantizers in one launch (the Python update on the CPU).
"""

import torch

from .. import dispatch
from ..dispatch import KernelImpl, lookup_dequantize, lookup_quantize, register_dequantize, register_quantize
from . import _ext
from .delayed import update_delayed_scaling


def extension_available() -> bool:
    """True when the CUDA extension hybridq._C is built and loadable (loads it)."""
    return _ext.load()


def transpose_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """`t.t().contiguous()` of a contiguous 2-D CUDA tensor of 1-byte elements through the extension's tiled
    transpose kernel, or None where it does not apply (CPU, no extension, other element sizes)."""
    if not (t.is_cuda and t.dim() == 2 and t.element_size() == 1 and t.is_contiguous()
            and t.shape[0] < (1 << 22) and _ext.available_for(t.device)):
        return None
    return torch.ops.hybridq.transpose_bytes(t)


def _register_builtin() -> None:
    from . import cuda, grouped_fp8, native_gemm

    cuda.register_all()
    native_gemm.register_all()
    dispatch.register_transpose("cuda", transpose_bytes)
    dispatch.register_jagged_fp8("cuda", grouped_fp8.CudaJaggedFP8())


_register_builtin()

__all__ = ["KernelImpl", "register_quantize", "register_dequantize", "lookup_quantize", "lookup_dequantize",
           "extension_available", "update_delayed_scaling", "transpose_bytes"]
