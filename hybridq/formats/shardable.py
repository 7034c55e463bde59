"""The sharding side of a format, kept out of the format contract (`base.py`): mixins that a format adds so
that FSDP2 (`hybridq.distributed`) can quantize a row shard and all-gather the quantized bytes.

- `GatherablePart` (for parts): the buffer protocol, `extract_buffers` / `assign_gathered`. The distributed
  code talks to parts only through these two.
- `ShardableQuantizer` (for quantizers): the statistics that must be reduced across shards (`shard_stats`), the
  exact derivation of one direction from the other after a gather (`derive_part`), the buffer layout hints
  (`buffer_hints`), and whether plainly quantizing a shard is exact (`shard_is_plain`).

The defaults describe a format whose blocks never leave a row: nothing to reduce, nothing to derive. Row shards
and the helpers the formats use to implement these hooks are in `_sharding.py`.
"""

from __future__ import annotations

from typing import ClassVar

import torch


# [Note: sharding invariance]
# Whatever the world size, shard layout or parallelism, the quantized tensor hybridq gathers (or a GEMM reads) is
# bitwise the quantization of the whole tensor on one device. Every statistic a cut crosses (a per-tensor amax, the
# amax of a block that a shard boundary splits, NVFP4's global amax, a row's amax when columns are cut) is reduced
# across the ranks before any rank quantizes (`shard_stats` / `global_stats` / `piece_stats`: one MAX all-reduce,
# NaN-preserving, formats/_reduce.py), and each rank then quantizes its piece with the reduced values (see
# [Note: piece]). A layout that cannot keep it (a cut through an NVFP4 Hadamard group) is refused before anything is
# quantized, never approximated. The distributed tests check this oracle for every format at several world sizes.
class GatherablePart:
    """Mixin for a `QuantizedPart` that FSDP2 can all-gather (the buffer protocol)."""

    def extract_buffers(self, shard=None, *, tile_rows: int | None = None
                        ) -> tuple[list[tuple[str, torch.Tensor, int]], dict[str, torch.Tensor]]:
        """This part in dim-0-gatherable form: `(buffers, replicated)`.

        `buffers` is a list of `(name, tensor, row_block)`: the tensor's dim 0 runs over the block rows (of
        `row_block` rows of the full `[M, K]` tensor) that `shard` (a `RowShard`; None = the whole tensor)
        owns, in the original (rowwise) orientation, with scale padding stripped, so the buffers of all
        shards concatenate along dim 0 into the full tensor's buffers. A columnwise part is turned back
        (its transposed `[K, M]` layout becomes `[M, K]`). `replicated` holds tensors that every shard
        computes identically (a per-tensor scale, a global amax): they are not gathered. `tile_rows` says
        that a per-row scale repeats one tile scale on `tile_rows` consecutive rows (2-D weight tiles): it is
        then sent once per tile row. The part may be a shard part (see `_sharding.py`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the FSDP buffer protocol")

    @classmethod
    def assign_gathered(cls, buffers: dict[str, torch.Tensor], replicated: dict[str, torch.Tensor], *,
                        rows: int, cols: int, columnwise: bool, meta: dict,
                        tile_rows: int | None = None) -> "GatherablePart":
        """Rebuild the full part (stored orientation `[rows, cols]`) from the gathered buffers (each the dim-0
        concatenation over all shards of what `extract_buffers` returned) and the replicated tensors:
        re-transposes columnwise layouts and re-expands tile scales."""
        raise NotImplementedError(f"{cls.__name__} does not implement the FSDP buffer protocol")


class ShardableQuantizer:
    """Mixin for a `Quantizer` whose tensors can be quantized shard by shard under FSDP2, bitwise as the whole
    tensor would be (sharding invariance)."""

    def shard_stats(self, x2d: torch.Tensor, shard) -> torch.Tensor | None:
        """Statistics that must be reduced across shards, for both directions: a flat fp32 tensor whose length
        depends only on the full shape and `shard`'s layout (same on every rank), such that an elementwise MAX
        over all shards (one all-reduce) gives what `reference_parts(x2d, ..., shard=shard, stats=...)` needs
        to quantize `x2d` (rows `[shard.offset, shard.end)` of the full tensor) exactly as the full tensor
        would be quantized. None when nothing has to be reduced (the default: every block lies in one row)."""
        return None

    def derive_part(self, part: GatherablePart, direction: str, dtype: torch.dtype | None = None
                    ) -> GatherablePart | None:
        """The `direction` part of a tensor computed from its other part (both produced by this quantizer from
        the same full tensor of `dtype`) when that is an exact transform (per-tensor FP8 transpose, 2-D tile
        transpose, ...), else None. FSDP gathers one direction and derives the other after the gather."""
        return None

    def derive_part_into(self, part: GatherablePart, into: GatherablePart, dtype: torch.dtype | None = None) -> bool:
        """Write `derive_part(part, into.direction, dtype)` into the tensors of `into` (a part of that direction and
        shape that already holds its storage: the unsharded weight's own part, whose buffers FSDP2 allocated),
        bitwise, without allocating the derived part. False, nothing written: this quantizer derives no part in
        place (the default; then `derive_part` and a fill). A quantizer that can tells on meta tensors too."""
        return False

    def derive_experts_into(self, rows: dict[str, torch.Tensor], cols: dict[str, torch.Tensor],
                            dtype: torch.dtype | None = None) -> bool:
        """`derive_part_into` of E experts at once: `rows` {tensor name: `[E, ...]`} the experts' rowwise parts'
        tensors stacked (`[g]` expert g's tensor as its part holds it; any expert stride), `cols` likewise the
        columnwise parts' own tensors (buffers that hold their storage, e.g. FSDP2's stacked ones); bitwise
        `derive_part_into` expert by expert. False, nothing written: not done at once for this quantizer (the default;
        then the experts are derived another way). A quantizer that can tells on meta tensors too."""
        return False

    def buffer_hints(self, direction: str) -> dict:
        """Keyword arguments for the part's `extract_buffers` / `assign_gathered` (e.g. `tile_rows`)."""
        return {}

    # -- pieces cut along both dims (tensor parallelism: a weight's columns, an activation's features) ---------
    def split_granularity(self, rowwise: bool, columnwise: bool) -> tuple[int, int]:
        """(rows, cols): cutting a tensor only at multiples of these along M and along K keeps every scaling
        block, tile and transform group of the requested directions inside one piece. Such a piece, quantized
        with the whole tensor's `global_stats`, is bitwise the corresponding piece of the whole tensor's
        quantization. Default: blocks that never span rows or columns (per-tensor scaling)."""
        return 1, 1

    def global_stats(self, x2d: torch.Tensor, rowwise: bool, columnwise: bool) -> torch.Tensor | None:
        """Statistics that span the whole tensor (per-tensor / global amaxes) of the requested directions, as a
        flat fp32 vector whose length depends only on the quantizer and the directions: an elementwise MAX over
        the pieces of a tensor cut at `split_granularity` gives the whole tensor's. The pieces are then
        quantized with `quantize_parts(piece, ..., global_stats=reduced)`. None: nothing spans the tensor (the
        default; no keyword is then passed)."""
        return None

    # Statistics per axis: a scale may span one axis of the tensor (per-row scales span the row's columns), so a
    # piece cut along that axis shares it with the other pieces while a piece cut along the other axis does not.
    # `piece_stats` says what a piece cut along `cut` shares, `quantize_piece` quantizes it with the reduced values.
    # The defaults are the per-tensor statistics above (the same whatever the cut).
    def piece_stats(self, x2d: torch.Tensor, rowwise: bool, columnwise: bool, cut: str) -> torch.Tensor | None:
        """Statistics a tensor-parallel piece cut along `cut` ("M": a row piece, "K": a column piece) shares with
        the other pieces: a flat fp32 vector of the same length on every piece (the uncut axis's length, or the
        quantizer's), such that an elementwise MAX over the pieces (`amax_all_reduce_`) gives the whole tensor's.
        None: nothing to share. Default: `global_stats`."""
        return self.global_stats(x2d, rowwise, columnwise)

    def quantize_piece(self, x2d: torch.Tensor, rowwise: bool, columnwise: bool, stats: torch.Tensor | None,
                       cut: str):
        """(rowwise part, columnwise part) of the piece `x2d` cut along `cut`, quantized with the MAX-reduced
        `piece_stats`: bitwise that piece of the whole tensor's quantization."""
        return self.quantize_parts(x2d, rowwise, columnwise, **({} if stats is None else {"global_stats": stats}))

    # A format whose scales each span one axis (a row's amax, a column's amax) has no per-tensor statistic at all:
    # `global_stats` does not exist for it (it raises), and a path that splits a tensor says which axis it cuts
    # (`piece_stats`), which rows x columns one statistic covers (`fragment_block`), or both (`quantize_axes`).
    stats_per_axis: ClassVar[bool] = False

    def fragment_block(self, m: int, k: int, rowwise: bool, columnwise: bool) -> tuple[int, int]:
        """(rows, cols) of the region of an `m x k` tensor that one statistic of the requested direction covers,
        aligned to row 0 and column 0: flat fragments (ZeRO master weights) reduce the partial amaxes of the
        regions they share. (1, 1): nothing but per-tensor statistics. Default: `split_granularity`."""
        return self.split_granularity(rowwise, columnwise)

    def quantize_axes(self, x2d: torch.Tensor, rowwise: bool, columnwise: bool, row_stats: torch.Tensor | None,
                      col_stats: torch.Tensor | None):
        """(rowwise part, columnwise part) of a piece cut along both dims (an FSDP2 row shard of a tensor-parallel
        column piece) of a `stats_per_axis` format: `col_stats` the MAX-reduced `piece_stats(..., "M")` (over the
        pieces holding other rows of its columns), `row_stats` the MAX-reduced `piece_stats(..., "K")` (over those
        holding other columns of its rows; None: its rows are whole). Formats with per-tensor statistics take the
        `shard_stats` / `with_global_stats` path instead."""
        raise NotImplementedError(f"{self.describe()}: no quantization of a piece cut along both dims "
                                  f"(quantize_axes); supported for formats with per-axis statistics only")

    def with_global_stats(self, stats: torch.Tensor | None, shard, k: int,
                          global_stats: torch.Tensor | None) -> torch.Tensor | None:
        """`stats` (reduced `shard_stats` of a row shard of a piece of a tensor) with its per-tensor entries
        replaced by the whole tensor's `global_stats(x, True, True)` (2-D meshes: FSDP2 row shards of a
        tensor-parallel piece). Default: no per-tensor entries."""
        return stats

    def shard_is_plain(self, shard, rowwise: bool, columnwise: bool) -> bool:
        """True when plainly quantizing the shard's rows gives its rows of the full tensor's quantization (no
        cross-shard statistics, no split block): the plain path, device kernels included, can then be used."""
        return shard.is_whole


def check_shardable(q, shape, dtype: torch.dtype, name: str, caller: str) -> None:
    """Raise NotImplementedError naming `name` (a weight), the format and the missing hooks unless FSDP2 can gather
    `q`'s quantization of a `shape` tensor: every plain quantizer a `ShardableQuantizer` and its parts
    `GatherablePart`s. Checked when the weight is prepared (`apply_hybrid_fsdp`), not at its first all-gather."""
    for plain in q.quantizers():
        why = None
        if not isinstance(plain, ShardableQuantizer):
            why = "its quantizer is not a ShardableQuantizer (shard_stats, derive_part, ...)"
        else:
            try:  # the part type, from a quantization on the meta device (no data, no kernels)
                m = 1
                for d in tuple(shape)[:-1]:
                    m *= d
                parts = plain.quantize_parts(torch.empty(m, tuple(shape)[-1], dtype=dtype, device="meta"), True, True)
            except Exception:  # noqa: BLE001 - a reference that cannot run on meta: its parts are checked at gather
                parts = ()
            bad = [type(p).__name__ for p in parts if p is not None and not isinstance(p, GatherablePart)]
            if bad:
                why = f"its part {bad[0]} is not a GatherablePart (extract_buffers / assign_gathered)"
        if why is not None:
            raise NotImplementedError(
                f"{caller}: {name} uses {plain.describe()}, which FSDP2 cannot all-gather quantized: {why}. Add the "
                f"FSDP hooks to the format (hybridq/formats/shardable.py), or keep this weight out of "
                f"apply_hybrid_fsdp (module_filter_fn) so that FSDP2 gathers it in high precision")
