from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass
class KernelImpl:
    name: str
    device_type: str
    run: Callable[..., Any]
    supports: Callable[..., bool]


_QUANTIZE: dict[type, list[KernelImpl]] = {}
_DEQUANTIZE: dict[type, list[KernelImpl]] = {}


def register_quantize(quantizer_type: type, impl: KernelImpl) -> None:
    """impl.run(quantizer, x2d, rowwise, columnwise, **kw) -> (rowwise part | None, columnwise part | None);
    impl.supports(quantizer, x2d, rowwise, columnwise, **kw) -> bool."""
    _QUANTIZE.setdefault(quantizer_type, []).append(impl)


def register_dequantize(part_type: type, impl: KernelImpl) -> None:
    """impl.run(part, undo_transform) -> fp32 2-D tensor; impl.supports(part, undo_transform) -> bool."""
    _DEQUANTIZE.setdefault(part_type, []).append(impl)


def _lookup(table, key_type: type, device: torch.device, *args, **kw) -> KernelImpl | None:
    for impl in table.get(key_type, ()):
        if impl.device_type == device.type and impl.supports(*args, **kw):
            return impl
    return None


def lookup_quantize(quantizer, x2d: torch.Tensor, rowwise: bool, columnwise: bool, **kw) -> KernelImpl | None:
    if x2d.device.type == "cpu":
        return None
    return _lookup(_QUANTIZE, type(quantizer), x2d.device, quantizer, x2d, rowwise, columnwise, **kw)


def lookup_dequantize(part, undo_transform: bool) -> KernelImpl | None:
    device = part.device
    if device.type == "cpu":
        return None
    return _lookup(_DEQUANTIZE, type(part), device, part, undo_transform)
