"""The CUDA kernels of the extension `hybridq._C` as dispatch implementations: what every format's kernel module
shares, and the registration of all of them.

A format with a CUDA kernel has one Python module here, `hybridq/kernels/cuda_<format>.py` (found by its name, like
csrc/quantize_<format>.cu by setup.py): its calls of its `torch.ops.hybridq` ops, their fake implementations and
its dispatch registrations. It defines
- `OPS`: the names of the ops it calls (a build without one of them is reported as out of date and not used);
- `register_fakes()`: the fake (meta) implementations of those ops, so that they trace under FakeTensorMode and
  torch.compile (run once the extension has registered the ops, see `_ext.require`);
- `register()`: its implementations of `quantize_parts` (per quantizer type) and `dequantize_2d` (per part type),
  and any row-group kernel, registered into `hybridq.dispatch`.

Each implementation returns the same parts, bit for bit, as the reference would for the same input (stochastic
rounding aside: it draws from its own Philox stream). Each `supports` returns False for anything it does not handle
(unknown keyword arguments, unsupported dtypes), so the reference runs instead; each registration lists the
quantizer options the kernel implements, and the dispatch sends a quantizer with any other option to the reference.

This module also holds the fakes of the format-independent ops (csrc/ops.cpp):
- rms_norm_forward(x, weight?, eps) -> (y like x, rstd [M] fp32, max|y| [1] fp32);
  rms_norm_backward(dy, x, weight?, rstd, weight_grad) -> (dx like x, dweight like weight | [0] fp32)
- layer_norm_forward(x, weight?, bias?, eps) -> (y like x, mean [M] fp32, rstd [M] fp32, max|y| [1] fp32);
  layer_norm_backward(dy, x, weight?, mean, rstd, weight_grad, bias_grad) -> (dx, dweight | [0], dbias fp32 | [0])
- norm_quantize_forward(x, weight?, bias?, eps, centered, block, dtype, amax_eps, pow2) -> (y, mean [M] | [0], rstd,
  max|y|, data [M, K] of dtype, scales [M, K/block]: fp32 scale_inv for block 128, E8M0 bytes for 32): a norm and the
  rowwise part of its output in a block format along K (hybridq/kernels/norm_quantize.py)
- swiglu_forward(a, b, block, dtype, amax_eps, pow2) -> (y = silu(a) * b like a, max|y|, data | [0], scales | [0]);
  swiglu_backward(dy, a, b) -> (da, db)
- amax(x) -> [1]; transpose_bytes(x) -> x.t().contiguous() for 1-byte elements; transpose_bytes_into(x [G, R, C],
  out [G, C, R]) -> None: the same into a given buffer, all matrices of a batch in one launch
- fp8_delayed_update(histories, scales, fp8_maxes, divisors, most_recent) -> None: the delayed-scaling update of
  many per-tensor FP8 quantizers, in place (see delayed.py)
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType

import torch

from . import _ext

IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# the format-independent ops (csrc/ops.cpp) the Python side uses
SHARED_OPS = ("amax", "rms_norm_forward", "rms_norm_backward", "layer_norm_forward", "layer_norm_backward",
              "norm_quantize_forward", "swiglu_forward", "swiglu_backward", "fp8_delayed_update", "transpose_bytes",
              "transpose_bytes_into", "transpose_bytes_into_list")
FORMAT_MODULE_PREFIX = "cuda_"
_FORMAT_MODULE_API = ("OPS", "register_fakes", "register")


def ops():
    return torch.ops.hybridq


def input_ok(q, x2d: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    """Whether a quantize kernel can take x2d: a non-empty 2-D CUDA tensor of a kernel input dtype, at least one
    direction, the quantizer's shape rule met, and the extension loadable."""
    return (x2d.is_cuda and x2d.dim() == 2 and x2d.dtype in IN_DTYPES and x2d.numel() > 0 and (rowwise or columnwise)
            and q.shape_rule(x2d.shape[0], x2d.shape[1], rowwise, columnwise) is None
            and _ext.available_for(x2d.device))


def plain_kw(kw: dict, allowed=()) -> bool:
    """True when the keyword arguments change nothing these kernels do not implement: None values, a whole-tensor
    `shard` (FSDP sharded quantization of a row shard otherwise), or the names in `allowed`."""
    for name, v in kw.items():
        if v is None or name in allowed:
            continue
        if name == "shard" and getattr(v, "is_whole", False):
            continue
        return False
    return True


def part_ok(part, fields) -> bool:
    """Whether a dequantize kernel can read the part's tensors `fields`: all contiguous CUDA tensors, and the
    extension loadable."""
    ts = [getattr(part, f) for f in fields]
    return (all(t is not None and t.is_cuda and t.is_contiguous() for t in ts)
            and _ext.available_for(part.device))


def format_modules() -> list[ModuleType]:
    """Every format's kernel module, `hybridq.kernels.cuda_<format>`, imported (sorted by name)."""
    mods = []
    for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda i: i.name):
        if not info.name.startswith(FORMAT_MODULE_PREFIX):
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}")
        missing = [n for n in _FORMAT_MODULE_API if not hasattr(mod, n)]
        if missing:
            raise TypeError(f"{mod.__name__}: a format's CUDA kernel module must define {', '.join(_FORMAT_MODULE_API)}"
                            f" (see hybridq/kernels/cuda.py); it lacks {', '.join(missing)}")
        mods.append(mod)
    return mods


def _register_shared_fakes() -> None:
    from torch.library import register_fake

    f32 = torch.float32

    @register_fake("hybridq::rms_norm_forward")
    def _rms_norm_forward(x, weight, eps):
        return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=f32), x.new_empty((1,), dtype=f32)

    @register_fake("hybridq::rms_norm_backward")
    def _rms_norm_backward(dy, x, weight, rstd, weight_grad):
        on = weight_grad and weight is not None
        return torch.empty_like(x), (weight.new_empty(weight.shape) if on else x.new_empty((0,), dtype=f32))

    @register_fake("hybridq::layer_norm_forward")
    def _layer_norm_forward(x, weight, bias, eps):
        m = x.shape[0]
        return (torch.empty_like(x), x.new_empty((m,), dtype=f32), x.new_empty((m,), dtype=f32),
                x.new_empty((1,), dtype=f32))

    @register_fake("hybridq::layer_norm_backward")
    def _layer_norm_backward(dy, x, weight, mean, rstd, weight_grad, bias_grad):
        on = weight_grad and weight is not None
        return (torch.empty_like(x), (weight.new_empty(weight.shape) if on else x.new_empty((0,), dtype=f32)),
                x.new_empty((x.shape[1] if bias_grad else 0,), dtype=f32))

    @register_fake("hybridq::norm_quantize_forward")
    def _norm_quantize_forward(x, weight, bias, eps, centered, block, dtype, amax_eps, pow2):
        m, k = x.shape
        return (torch.empty_like(x), x.new_empty((m if centered else 0,), dtype=f32), x.new_empty((m,), dtype=f32),
                x.new_empty((1,), dtype=f32), x.new_empty((m, k), dtype=dtype),
                x.new_empty((m, k // block), dtype=f32 if block == 128 else torch.uint8))

    @register_fake("hybridq::swiglu_forward")
    def _swiglu_forward(a, b, block, dtype, amax_eps, pow2):
        m, k = a.shape
        q = a.new_empty((m, k) if block else (0,), dtype=dtype if block else torch.uint8)
        s = a.new_empty((m, k // block) if block else (0,), dtype=f32 if block in (0, 128) else torch.uint8)
        return torch.empty_like(a), a.new_empty((1,), dtype=f32), q, s

    @register_fake("hybridq::swiglu_backward")
    def _swiglu_backward(dy, a, b):
        return torch.empty_like(a), torch.empty_like(a)

    @register_fake("hybridq::amax")
    def _amax(x):
        return x.new_empty((1,), dtype=f32)

    @register_fake("hybridq::transpose_bytes")
    def _transpose_bytes(x):
        return x.new_empty((x.shape[1], x.shape[0]))

    @register_fake("hybridq::transpose_bytes_into")
    def _transpose_bytes_into(x, out):
        return None

    @register_fake("hybridq::transpose_bytes_into_list")
    def _transpose_bytes_into_list(x, out):
        return None

    @register_fake("hybridq::fp8_delayed_update")
    def _fp8_delayed_update(histories, scales, fp8_maxes, divisors, most_recent):
        return None


def or_empty(x: torch.Tensor, shape, dtype, on: bool) -> torch.Tensor:
    """A fake output: `shape` of `dtype` when the op returns that part (`on`), else the empty `[0]` tensor it
    returns for a direction not asked for."""
    return x.new_empty(shape if on else (0,), dtype=dtype)


def register_all() -> None:
    """Every format module's kernels into the dispatch tables, and every op the Python side calls (with its fakes)
    into the extension's requirements (`_ext.require`)."""
    _ext.require(SHARED_OPS, _register_shared_fakes)
    for mod in format_modules():
        _ext.require(tuple(mod.OPS), mod.register_fakes)
        mod.register()
