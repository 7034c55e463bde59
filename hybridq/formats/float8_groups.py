"""Per-tensor FP8 (current scaling) of equal row groups with given or own amaxes: the experts of a grouped weight
`[G, n, K]`, each quantized exactly as `Float8Quantizer.quantize_parts` quantizes it alone, in one amax pass and
one cast for all groups (the CUDA grouped kernel where it applies; elsewhere, and with given -- e.g. MAX-reduced --
amaxes, the reference on the whole `[G, n, K]` at once, bitwise the per-group loop: the fp32 operations are
elementwise and each group's scale broadcasts over its rows only).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ._stacking import stacked_view
from ..enums import Scaling
from ._numerics import FP8_MAX, rcp, satfinite_fp8, scale_from_amax
from .float8 import Float8Quantizer, Float8TensorPart, aligned_scales

__all__ = ["derive_columnwise_groups", "equal_groups_apply", "group_amax", "group_parts", "quantize_equal_groups", "scale_inv_from_amax",
           "transpose_groups"]


def equal_groups_apply(qs) -> bool:
    """Whether every quantizer of `qs` is the same per-tensor FP8 with current scaling (one batched quantization
    for all groups gives each group's own). A tuple is answered once (a layer's weight quantizers are asked at every
    unshard; quantizers are not changed in place, a new recipe makes new ones)."""
    hit = _EQUAL.get(id(qs)) if type(qs) is tuple else None
    if hit is not None and hit[0] is qs:
        return hit[1]
    ok = bool(qs) and type(qs[0]) is Float8Quantizer and qs[0].scaling == Scaling.CURRENT and \
        all(q is qs[0] or q == qs[0] for q in qs[1:])
    if type(qs) is tuple:
        if len(_EQUAL) >= 256:
            _EQUAL.clear()
        _EQUAL[id(qs)] = (qs, ok)  # (holds the tuple: its id is not reused while cached)
    return ok


_EQUAL: dict[int, tuple] = {}


def group_amax(x3d: torch.Tensor) -> torch.Tensor:
    """max|x| of each group `[G]` fp32 (0 for an empty group), NaN propagated: `shard_stats` of each group."""
    g = x3d.shape[0]
    if x3d.numel() == 0:
        return torch.zeros(g, dtype=torch.float32, device=x3d.device)
    return x3d.float().abs().amax(dim=(1, 2))


def scale_inv_from_amax(q: Float8Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Each group's scale_inv `[G]` from its amax (the current-scaling rule, elementwise)."""
    return rcp(scale_from_amax(amax.float(), FP8_MAX[q.dtype], q.amax_epsilon, q.power_2_scale))


def quantize_equal_groups(q: Float8Quantizer, x3d: torch.Tensor, amax: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data `[G, n, K]`, scale_inv `[G]`): group g quantized as `q.quantize_parts(x3d[g])` would (its own
    max|x|), or with `amax[g]` as `quantize_parts(..., stats=amax[g])` would. One amax pass and one cast."""
    g, n, k = x3d.shape
    if amax is None and g and n:
        run = dispatch.row_groups_kernel(Float8Quantizer, x3d.device.type)
        out = run(q, x3d.reshape(g * n, k), (n,) * g) if run is not None else None
        if out is not None:
            data, scale_inv = out
            return data.view(g, n, k), scale_inv
    if amax is None:
        amax = group_amax(x3d)
    scale = scale_from_amax(amax.to(x3d.device).float(), FP8_MAX[q.dtype], q.amax_epsilon, q.power_2_scale)
    data = satfinite_fp8(x3d.float() * scale.view(g, 1, 1), q.dtype)
    return data, rcp(scale)


def group_parts(data: torch.Tensor, scale_inv: torch.Tensor, first: int, groups: int) -> list[Float8TensorPart]:
    """The rowwise parts of `groups` groups whose scale_inv is `scale_inv [groups]`, of which groups
    `[first, first + data.shape[0])` hold the rows of `data [G', n, K]` (views) and the others none (empty parts: a
    receiver's metadata of groups another rank holds). Each scale_inv a 16-byte aligned view of one `[groups, 4]`
    tensor (cuBLASLt's scale pointers)."""
    held, n, k = data.shape
    scales = aligned_scales(scale_inv)
    empty = data.new_empty(0, k)
    out = []
    for e in range(groups):
        d = data[e - first] if first <= e < first + held else empty
        out.append(Float8TensorPart(rows=d.shape[0], cols=k, columnwise=False, data=d, scale_inv=scales[e, :1]))
    return out


def transpose_groups(rowwise: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The columnwise data of every group, `out [G, K, n]` <- the byte transpose of `rowwise [G, n, K]` (the
    derivation of `Float8Quantizer.derive_part`, for all groups in one launch of the device's tiled transpose; a
    strided copy elsewhere -- on an H200 that copy moves ~0.36 TB/s, the tiled kernel several times more)."""
    src, dst = rowwise.view(torch.uint8), out.view(torch.uint8)
    if not dispatch.transpose_bytes_into(src, dst):
        dst.copy_(src.transpose(1, 2))
    return dst


def derive_columnwise_groups(rows, cols) -> bool:
    """Fill the columnwise parts `cols` (own buffers) with the byte transposes of the rowwise parts `rows`, all
    groups in one copy (and their scale_inv in one more where they are other tensors than the rows'). False (nothing
    written): the parts' tensors are not equally spaced views of one storage each."""
    src = stacked_view([p.data for p in rows])
    dst = stacked_view([p.data for p in cols])
    if src is None or dst is None:
        return False
    own = [c.scale_inv for r, c in zip(rows, cols) if c.scale_inv is not r.scale_inv]
    if own:
        s_src, s_dst = stacked_view([p.scale_inv for p in rows]), stacked_view(own)
        if s_src is None or s_dst is None or len(own) != len(rows):
            return False
        s_dst.copy_(s_src)
    transpose_groups(src, dst)
    return True
