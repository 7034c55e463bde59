"""The per-expert token counts (`m_splits`) of a grouped GEMM, checked once for every caller: `GroupedLinear` and
`grouped_mm` on an expert module that was not converted take exactly the same forms and refuse the same ones."""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = ["checked_m_splits", "check_split_values", "host_counts", "host_m_splits"]


def _is_bool_dtype(t: Any) -> bool:
    dtype = getattr(t, "dtype", None)
    return dtype is torch.bool or getattr(dtype, "kind", None) == "b"  # (a torch or a numpy boolean)


def _count(v: Any, name: str, m_splits: Any) -> int:
    """One count as a Python int: an int, a numpy integer, or a one-element integer tensor. bools (Python, numpy,
    torch) are refused: True is no token count, and a mask passed by mistake must not be read as counts."""
    if isinstance(v, torch.Tensor):
        ok = v.numel() == 1 and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype is torch.bool)
    else:
        ok = not isinstance(v, bool) and not _is_bool_dtype(v)
    if ok:
        try:
            return operator.index(v)  # (int, numpy integers, integer tensors; floats raise TypeError)
        except TypeError:
            pass
    raise ValueError(f"{name}: m_splits must hold integer token counts (ints, numpy integers or a 1-D integer "
                     f"tensor; not bools or floats), got {m_splits!r}")


def check_split_values(splits: list[int], num_experts: int, tokens: int, name: str) -> list[int]:
    """The value rules on host counts: one per expert, none negative, summing to the input's token count."""
    if len(splits) != num_experts:
        raise ValueError(f"{name}: m_splits must have one count per expert ({num_experts}), got {len(splits)}")
    if any(v < 0 for v in splits):
        raise ValueError(f"{name}: m_splits must be >= 0, got {splits}")
    if sum(splits) != tokens:
        raise ValueError(f"{name}: m_splits sum to {sum(splits)} but the input has {tokens} tokens")
    return splits


def checked_m_splits(m_splits: Any, num_experts: int, tokens: int, name: str) -> list[int] | torch.Tensor:
    """`m_splits` after every check that needs no device-to-host copy (ValueError naming `name` otherwise).

    Accepted: a sequence of integer-likes (Python ints, numpy integers, one-element integer tensors), a 1-D numpy
    integer array, a 1-D integer tensor; bools and floats are refused. Host forms come back as a list of ints with
    the value rules checked (one count per expert, >= 0, summing to `tokens`). A tensor on a device (CUDA) comes
    back as it is, checked for dtype and length only: reading its values here would be a host sync on every call,
    which the device-side grouped path exists to avoid; a caller that needs host counts reads them and calls
    `check_split_values`."""
    if not isinstance(m_splits, torch.Tensor) and hasattr(m_splits, "__array__") and hasattr(m_splits, "ndim"):
        if _is_bool_dtype(m_splits) or getattr(m_splits.dtype, "kind", None) not in ("i", "u"):
            raise ValueError(f"{name}: m_splits must be integer token counts, got a numpy array of "
                             f"{m_splits.dtype}")
        m_splits = torch.as_tensor(m_splits)  # (numpy integer array: its host values, as a CPU tensor)
    if isinstance(m_splits, torch.Tensor):
        if (m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex
                or m_splits.dtype is torch.bool):
            raise ValueError(f"{name}: m_splits must be a 1-D integer tensor or a list of ints, got a "
                             f"{m_splits.dim()}-D {m_splits.dtype} tensor")
        if m_splits.device.type != "cpu":  # dtype and shape only: no host sync (see the docstring)
            if m_splits.shape[0] != num_experts:
                raise ValueError(f"{name}: m_splits must have one count per expert ({num_experts}), got "
                                 f"{m_splits.shape[0]}")
            return m_splits
        splits = [int(v) for v in m_splits.tolist()]
    else:
        if isinstance(m_splits, (str, bytes)) or not hasattr(m_splits, "__iter__"):
            raise ValueError(f"{name}: m_splits must be a list of ints or a 1-D integer tensor, got "
                             f"{type(m_splits).__name__}")
        splits = [_count(v, name, m_splits) for v in m_splits]
    return check_split_values(splits, num_experts, tokens, name)


def host_m_splits(m_splits: Any, num_experts: int, tokens: int, name: str) -> list[int]:
    """`checked_m_splits` for a caller that needs the counts on the host (per-expert loops, `Tensor.split`): a
    device tensor is read (one sync, `host_counts`) and its values checked too."""
    splits = checked_m_splits(m_splits, num_experts, tokens, name)
    if isinstance(splits, torch.Tensor):
        splits = check_split_values(host_counts(splits), num_experts, tokens, name)
    return splits


def host_counts(counts: torch.Tensor) -> list[int]:
    """A device counts tensor's values on the host, read once per tensor: the projections of one MoE layer share the
    router's counts, so a layer syncs once, not once per projection (read again after an in-place change)."""
    last = _LAST_READ[0]
    if last is not None and last[0] is counts and last[1] == counts._version:
        return list(last[2])
    values = [int(v) for v in counts.tolist()]
    _LAST_READ[0] = (counts, counts._version, values)
    return list(values)


_LAST_READ: list = [None]  # ((counts tensor, its version, its values) of the last read)
