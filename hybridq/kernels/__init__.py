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


def transpose_bytes_into(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """`dst[g] = src[g].t()` for CUDA tensors of 1-byte elements, `src [G, R, C]` and `dst [G, C, R]` (or 2-D),
    each matrix row-major with rows of its own length and any batch stride (the stacked buffers of gathered
    experts), in one launch of the extension's tiled transpose. False (nothing written) where it does not apply:
    CPU, no extension (or one built without this op), other element sizes or layouts, > 4M rows or 65535
    matrices."""
    if not (src.is_cuda and dst.device == src.device and src.dim() in (2, 3) and dst.dim() == src.dim()
            and src.element_size() == 1 and dst.element_size() == 1):
        return False
    r, c = src.shape[-2], src.shape[-1]
    if not (src.stride(-1) == 1 and src.stride(-2) == c and dst.stride(-1) == 1 and dst.stride(-2) == r
            and r < (1 << 22) and (src.dim() == 2 or src.shape[0] <= 65535) and _ext.available_for(src.device)
            and hasattr(torch.ops.hybridq, "transpose_bytes_into")):
        return False
    torch.ops.hybridq.transpose_bytes_into(src, dst)
    return True


def transpose_bytes_into_list(srcs: list, dsts: list) -> bool:
    """`transpose_bytes_into(srcs[i], dsts[i])` for every pair, 2-D CUDA tensors of 1-byte elements, in one call of the
    extension (one dispatch, a launch each). False (nothing written) where it does not apply to every pair (then the
    caller transposes them one by one)."""
    if not srcs or not (_ext.available_for(srcs[0].device) and hasattr(torch.ops.hybridq, "transpose_bytes_into_list")):
        return False
    device = srcs[0].device
    for src, dst in zip(srcs, dsts):
        if not (src.is_cuda and src.device == device and dst.device == device and src.dim() == 2 and dst.dim() == 2
                and src.element_size() == 1 and dst.element_size() == 1 and src.shape[0] < (1 << 22)
                and src.stride(-1) == 1 and src.stride(-2) == src.shape[1] and dst.stride(-1) == 1
                and dst.stride(-2) == src.shape[0]):
            return False
    torch.ops.hybridq.transpose_bytes_into_list(srcs, dsts)
    return True


def _register_builtin() -> None:
    from . import cuda, grouped_fp8, native_gemm

    cuda.register_all()
    native_gemm.register_all()
    dispatch.register_transpose("cuda", transpose_bytes)
    dispatch.register_transpose_into("cuda", transpose_bytes_into)
    dispatch.register_transpose_into_list("cuda", transpose_bytes_into_list)
    dispatch.register_jagged_fp8("cuda", grouped_fp8.CudaJaggedFP8())


_register_builtin()

__all__ = ["KernelImpl", "register_quantize", "register_dequantize", "lookup_quantize", "lookup_dequantize",
           "extension_available", "update_delayed_scaling", "transpose_bytes"]
