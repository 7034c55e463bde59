"""The dispatch tables: which device implementation runs a quantize, a dequantize, a byte transpose or a GEMM.

This module is the leaf of the package: it imports no other hybridq module, so formats, the GEMM front end and
the kernel backends can all depend on it without an import cycle. Formats hold the pure-PyTorch references (the
numerics contract, docs/numerics.md) and ask these tables for a device implementation first; backends (the CUDA
extension in `hybridq.kernels`) register into them. An implementation runs only for tensors on its device type
and only when its `supports` check accepts the call; otherwise the reference runs. Either way the result is the
same, bit for bit (stochastic rounding aside).

Tables (keyed by type, looked up by the exact type of the quantizer / part):
- quantize:   `run(quantizer, x2d, rowwise, columnwise, **kw) -> (rowwise part | None, columnwise part | None)`
- dequantize: `run(part, undo_transform) -> fp32 [rows, cols]`
- GEMM:       `run(a, b, out_dtype) -> a @ b^T`, keyed by what the parts declare (`QuantizedPart.gemm_kind`: scale
              layout, block shape, scale dtype; or the scale layouts alone), whatever the format class; a user's
              GEMMs for a pair of part types (`register_native_gemm`) are tried first (`gemm_candidates`)
- transpose:  `run(t) -> t.t().contiguous()` for 2-D 1-byte tensors, keyed by device type; and into a given buffer,
              batched: `run(src [G, R, C], dst [G, C, R]) -> bool` (the experts of a grouped weight in one launch)
- jagged FP8 experts: the grouped quantize and GEMMs of per-tensor FP8 experts on device offsets, keyed by device
  type (`hybridq.gemm.JaggedFP8Kernels`)

A quantize implementation declares the quantizer options it implements (`options`); a quantizer with any
other dataclass field (an option added later, or a subclass's own) is sent to the reference, with a one-time
warning, so a kernel can never silently ignore an option.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger("hybridq")


@dataclasses.dataclass
class KernelImpl:
    """A device implementation of a quantize or dequantize. `options`: for quantize, the names of the quantizer
    fields it implements (None: it takes any quantizer of its type, e.g. one with no options)."""

    name: str
    device_type: str
    run: Callable[..., Any]
    supports: Callable[..., bool]
    options: frozenset[str] | None = None


@dataclasses.dataclass
class NativeGemm:
    """A hardware GEMM for a pair of part types: `run(a, b, out_dtype)` when `supports(a, b)`."""

    name: str
    run: Callable[[Any, Any, torch.dtype], torch.Tensor]
    supports: Callable[[Any, Any], bool]


_QUANTIZE: dict[type, list[KernelImpl]] = {}
_DEQUANTIZE: dict[type, list[KernelImpl]] = {}
_GEMM: dict[tuple[type, type], list[NativeGemm]] = {}
# (OperandKind of a, of b) or (ScaleLayout of a, of b) -> GEMMs
_LAYOUT_GEMM: dict[tuple[Any, Any], list[NativeGemm]] = {}
_TRANSPOSE: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {}
_TRANSPOSE_INTO: dict[str, Callable[[torch.Tensor, torch.Tensor], bool]] = {}
_TRANSPOSE_INTO_LIST: dict[str, Callable[[list, list], bool]] = {}
# (quantizer type, device type) -> quantization of consecutive row groups, each as its own tensor (grouped linear)
_ROW_GROUPS: dict[tuple[type, str], Callable] = {}
# (operand kind of every group, device type) -> grouped GEMM of row groups with one scale each (hybridq.gemm)
_GROUPED_GEMM: dict[tuple[Any, str], Callable] = {}
# device type -> the kernels of per-tensor FP8 experts on the jagged token layout (hybridq.gemm.jagged_fp8_kernels)
_JAGGED_FP8: dict[str, Any] = {}
# what the running GEMM is for (e.g. "dgrad of layers.0.fc1"), so a native kernel's warnings can name the layer
_GEMM_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("hybridq_gemm_name", default=None)


# ---- registration ---------------------------------------------------------------------------------------------

def register_quantize(quantizer_type: type, impl: KernelImpl) -> None:
    """Register a device quantize for `quantizer_type` (see the module docstring for the call signatures)."""
    _QUANTIZE.setdefault(quantizer_type, []).append(impl)


def register_dequantize(part_type: type, impl: KernelImpl) -> None:
    """Register a device dequantize for `part_type`."""
    _DEQUANTIZE.setdefault(part_type, []).append(impl)


def register_native_gemm(a_type: type, b_type: type, name: str, run: Callable, supports: Callable) -> None:
    """Register a hardware GEMM for a pair of part types (exactly these types, not subclasses). It is tried before
    the GEMMs registered by the parts' declared kinds (`register_layout_gemm`), so it can replace them for a pair."""
    _GEMM.setdefault((a_type, b_type), []).append(NativeGemm(name, run, supports))


def register_layout_gemm(a_layout: Any, b_layout: Any, name: str, run: Callable, supports: Callable) -> None:
    """Register a hardware GEMM for every pair of parts that declare these operand kinds (`hybridq.formats.OperandKind`:
    scale layout, block shape, scale dtype, e.g. 1x32 E8M0 blocks) or, given a bare `hybridq.formats.ScaleLayout`
    on both sides, these scale layouts whatever their blocks (e.g. ROW x ROW: `torch._scaled_mm` with per-row
    scales); a new format whose parts declare them gets the GEMM without being named here. `supports(a, b)` checks
    the rest (element dtypes, transform, device, shapes)."""
    _LAYOUT_GEMM.setdefault((a_layout, b_layout), []).append(NativeGemm(name, run, supports))


def unregister_native_gemm(a_type: type, b_type: type, name: str) -> None:
    """Remove the GEMMs registered under `name` for the pair (tests, or a user replacing a kernel)."""
    kept = [g for g in _GEMM.get((a_type, b_type), ()) if g.name != name]
    if kept:
        _GEMM[(a_type, b_type)] = kept
    else:
        _GEMM.pop((a_type, b_type), None)


def register_transpose(device_type: str, run: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Register a byte transpose for tensors on `device_type`; `run` may return None to decline a tensor."""
    _TRANSPOSE[device_type] = run


def register_transpose_into(device_type: str, run: Callable[[torch.Tensor, torch.Tensor], bool]) -> None:
    """Register a batched byte transpose into a given buffer for tensors on `device_type`; `run(src, dst)` returns
    False to decline a call (nothing written)."""
    _TRANSPOSE_INTO[device_type] = run


def register_transpose_into_list(device_type: str, run: Callable[[list, list], bool]) -> None:
    """Register a byte transpose of several 2-D tensors into given buffers in one call for tensors on `device_type`;
    `run(srcs, dsts)` returns False to decline a call (nothing written)."""
    _TRANSPOSE_INTO_LIST[device_type] = run


def register_row_groups(quantizer_type: type, device_type: str, run: Callable) -> None:
    """Register a device quantization of row groups for `quantizer_type` (the call signature is the quantizer's own:
    see its `quantize_row_groups` / `quantize_groups`); `run` may return None to decline a call (the reference runs
    then)."""
    _ROW_GROUPS[(quantizer_type, device_type)] = run


def row_groups_kernel(quantizer_type: type, device_type: str) -> Callable | None:
    return _ROW_GROUPS.get((quantizer_type, device_type))


def register_grouped_gemm(kind: Any, device_type: str, run: Callable) -> None:
    """Register the grouped GEMM of `device_type` for row groups whose every group is an operand of `kind` (a
    `hybridq.formats.OperandKind`, e.g. one fp32 scale per group's tensor: see `hybridq.gemm.grouped_gemm_fp8`)."""
    _GROUPED_GEMM[(kind, device_type)] = run


def grouped_gemm_kernel(kind: Any, device_type: str) -> Callable | None:
    return _GROUPED_GEMM.get((kind, device_type))


def register_jagged_fp8(device_type: str, kernels: Any) -> None:
    """Register the kernels of per-tensor FP8 experts on the jagged token layout for `device_type`: an object with
    `supports(device, in_features, out_features, quantizers) -> bool`, `quantize`, `mm` and `wgrad` (see
    `hybridq.gemm.JaggedFP8Kernels`)."""
    _JAGGED_FP8[device_type] = kernels


def jagged_fp8_kernels(device_type: str) -> Any | None:
    return _JAGGED_FP8.get(device_type)


# ---- lookup ---------------------------------------------------------------------------------------------------

_unknown_options: dict[tuple[type, str], frozenset[str]] = {}


def _implements_options(impl: KernelImpl, quantizer) -> bool:
    if impl.options is None:
        return True
    key = (type(quantizer), impl.name)
    extra = _unknown_options.get(key)
    if extra is None:
        fields = {f.name for f in dataclasses.fields(quantizer)} if dataclasses.is_dataclass(quantizer) else set()
        extra = _unknown_options[key] = frozenset(fields - impl.options)
        if extra:
            log.warning("hybridq: %s has options %s that the %s kernel does not implement; using the reference "
                        "implementation", type(quantizer).__name__, sorted(extra), impl.name)
    return not extra


def lookup_quantize(quantizer, x2d: torch.Tensor, rowwise: bool, columnwise: bool, **kw) -> KernelImpl | None:
    """The device quantize that takes this call, or None (then the quantizer's reference runs)."""
    device_type = x2d.device.type
    if device_type == "cpu":
        return None
    for impl in _QUANTIZE.get(type(quantizer), ()):
        if (impl.device_type == device_type and _implements_options(impl, quantizer)
                and impl.supports(quantizer, x2d, rowwise, columnwise, **kw)):
            return impl
    return None


def lookup_dequantize(part, undo_transform: bool) -> KernelImpl | None:
    """The device dequantize that takes this part, or None (then the part's reference runs)."""
    device_type = part.device.type
    if device_type == "cpu":
        return None
    for impl in _DEQUANTIZE.get(type(part), ()):
        if impl.device_type == device_type and impl.supports(part, undo_transform):
            return impl
    return None


def quantize_options(quantizer_type: type) -> frozenset[str] | None:
    """The options the first registered device quantize of `quantizer_type` implements (None: none registered
    or it takes any). Other device code that reads a quantizer (e.g. a batched delayed-scaling update) uses it
    to accept exactly the quantizers the kernels accept."""
    impls = _QUANTIZE.get(quantizer_type)
    return impls[0].options if impls else None


def gemm_candidates(a, b) -> Iterator[NativeGemm]:
    """The GEMMs registered for `a @ b^T`, in the order `find_native_gemm` tries them (before their `supports`
    checks): those of the pair of part types, then those of the parts' operand kinds, then of their scale layouts."""
    yield from _GEMM.get((type(a), type(b)), ())
    ka, kb = getattr(a, "gemm_kind", None), getattr(b, "gemm_kind", None)
    if ka is None or kb is None:
        return
    yield from _LAYOUT_GEMM.get((ka, kb), ())
    yield from _LAYOUT_GEMM.get((ka.layout, kb.layout), ())


def find_native_gemm(a, b) -> NativeGemm | None:
    """The registered hardware GEMM that takes `a @ b^T`, or None (then the GEMM is emulated)."""
    for g in gemm_candidates(a, b):
        if g.supports(a, b):
            return g
    return None


def transpose_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """`t.t().contiguous()` by the device's registered byte transpose, or None where none applies."""
    run = _TRANSPOSE.get(t.device.type)
    return None if run is None else run(t)


def transpose_bytes_into(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """`dst[g] = src[g].t()` for 1-byte `src [G, R, C]` / `dst [G, C, R]` (or 2-D) by the device's registered
    transpose; False (nothing written) where none applies."""
    run = _TRANSPOSE_INTO.get(src.device.type)
    return run is not None and run(src, dst)


def transpose_bytes_into_list(srcs: list, dsts: list) -> bool:
    """`dsts[i] = srcs[i].t()` for 1-byte 2-D `srcs` / contiguous `dsts` on one device, by the device's registered
    list transpose; False (nothing written) where none applies."""
    run = _TRANSPOSE_INTO_LIST.get(srcs[0].device.type) if srcs else None
    return run is not None and run(srcs, dsts)


def current_gemm_name() -> str | None:
    """What the running GEMM is for (e.g. "dgrad of fc1"), or None."""
    return _GEMM_NAME.get()


def set_gemm_name(name: str | None) -> contextvars.Token:
    return _GEMM_NAME.set(name)


def reset_gemm_name(token: contextvars.Token) -> None:
    _GEMM_NAME.reset(token)
