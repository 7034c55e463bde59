"""NVFP4 (docs/numerics.md "NVFP4"): E2M1 values in blocks of 16 with an E4M3 block scale and an fp32 global
amax per direction; optional 16x16 weight tiles, random Hadamard transform (columnwise only) and
stochastic rounding. Row groups (docs/numerics.md "Row groups and grouped GEMMs"): consecutive row groups of one
buffer quantized in one call, each with its own global amaxes (`NVFP4Quantizer.quantize_groups`), the experts of
GroupedLinear's packed path."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import torch

from .. import dispatch
from ..tensor import QuantizedTensor
from ._numerics import (FLT_MAX, block_amax, e2m1_codes, e2m1_codes_stochastic, e2m1_decode, expand_blocks,
                        pack_nibbles, rht16, rht16_inverse, satfinite_fp8, tile_amax, unpack_nibbles)
from ._sharding import StatsLayout, col_block_amax, cut_stats, expand_rows, merge_cut, tile_amax_rows
from .base import check_row_groups, draw_sequence
from .block import BlockScaledPart, BlockScaledQuantizer, tile_scale_columnwise

BLOCK = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = (448 * 6) / A, clamped to FLT_MAX (fminf semantics: a NaN quotient becomes FLT_MAX);
    1 when A == 0 or S_enc == 0."""
    s = torch.fmin(torch.full_like(amax, E4M3_MAX * FP4_MAX) / amax, torch.full_like(amax, FLT_MAX))
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


# Above this global amax, (q * s) * A can overflow fp32 (q * s reaches 6 * 448 = 2688).
LARGE_AMAX = FLT_MAX / (FP4_MAX * E4M3_MAX)


def dequantize_values(q: torch.Tensor, s: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """q * fp32(s) * A / (6 * 448) (docs/numerics.md, "NVFP4"): ((q * s) * A) / 2688 evaluated left to right,
    or (q * s) * (A / 2688) when A > FLT_MAX / 2688, where the left-to-right product would overflow. The branch
    is one per tensor (on A), so every A that did not overflow keeps its bits."""
    qs = q * s
    d = torch.tensor(FP4_MAX * E4M3_MAX, dtype=torch.float32, device=q.device)
    return torch.where(amax > LARGE_AMAX, qs * (amax / d), (qs * amax) / d)


def block_scale_e4m3(blk_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """s = e4m3_satfinite(min(block_amax * (S_enc * (1/6)), FLT_MAX))."""
    v = blk_amax * (s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    return satfinite_fp8(torch.fmin(v, torch.full_like(v, FLT_MAX)), torch.float8_e4m3fn)


def element_multiplier(s: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """enc = min(1 / (fp32(s) * S_dec), FLT_MAX), S_dec = 1 / S_enc."""
    s_dec = torch.ones_like(s_enc) / s_enc
    enc = torch.ones_like(s, dtype=torch.float32) / (s.float() * s_dec)
    return torch.fmin(enc, torch.full_like(enc, FLT_MAX))


class NVFP4Part(BlockScaledPart):
    """data: packed E2M1 codes, uint8 `[rows, cols/2]` (element 2i low nibble); scale: E4M3 `[rows, cols/16]`
    (a 16x16 tile's scale repeated on each of its rows); amax: fp32 `[1]`, the global amax of this
    direction. rht: the values are in the Hadamard domain along the contracted dim.

    A part of G row groups (`NVFP4Quantizer.quantize_groups`) holds amax `[G]`, one global amax per group: it is
    only read through `row_slice(start, stop, group=g)`, which gives group g's rows with its amax `[1]`."""

    format_name = "NVFP4"
    tensor_fields = ("data", "scale", "amax")
    block = BLOCK
    meta_fields = ("rht",)
    values_per_byte = 2
    scale_dtype = torch.float8_e4m3fn

    @property
    def transform(self) -> str | None:
        return "rht16" if self.rht else None

    @property
    def element_dtype(self) -> torch.dtype:
        return getattr(torch, "float4_e2m1fn_x2", torch.uint8)  # (E2M1 pairs; uint8 where torch cannot name them)

    @property
    def global_decode_scale(self) -> torch.Tensor:
        return self.amax / (FP4_MAX * E4M3_MAX)  # (amax / 2688: fp32, as dequantize_values applies it)

    def element_values(self) -> torch.Tensor:
        return unpack_nibbles(self.data)

    def element_scales(self) -> torch.Tensor:
        return expand_blocks(self.scale.float(), BLOCK, self.cols) * self.amax

    def reference_dequantize_2d(self, undo_transform: bool = True) -> torch.Tensor:
        vals = e2m1_decode(unpack_nibbles(self.data))
        x = dequantize_values(vals, expand_blocks(self.scale.float(), BLOCK, self.cols), self.amax)
        return rht16_inverse(x) if (self.rht and undo_transform) else x

    # FSDP buffer protocol: packed codes travel in row order (a columnwise part's codes are re-packed along K);
    # the global amax is replicated (all-reduced before quantizing).
    def data_in_row_order(self) -> torch.Tensor:
        return pack_nibbles(unpack_nibbles(self.data)[:, :self.cols].t()) if self.columnwise else self.data

    @classmethod
    def data_from_row_order(cls, data: torch.Tensor, columnwise: bool) -> torch.Tensor:
        return pack_nibbles(unpack_nibbles(data).t()) if columnwise else data

    def replicated(self) -> dict[str, torch.Tensor]:
        return {"amax": self.amax}

    def group_tensors(self, group: int | None) -> dict[str, torch.Tensor]:
        if self.amax.numel() == 1:  # one global amax: the part's rows are one group
            return {}
        if group is None or not 0 <= group < self.amax.numel():
            raise ValueError(f"{self!r} holds {self.amax.numel()} row groups (one global amax each): a row slice "
                             f"must name its group in [0, {self.amax.numel()}), got group={group}")
        return {"amax": self.amax[group:group + 1]}


@dataclasses.dataclass
class NVFP4Quantizer(BlockScaledQuantizer):
    """`NVFP4Quantizer()` is 1-D blocks of 16 without RHT or stochastic rounding.

    block_2d: 16x16 tiles sharing one scale (weights); one global amax for both directions, so the
    columnwise form is the exact transpose of the rowwise one.
    rht: random Hadamard transform of the columnwise form (inputs, gradients; not with block_2d).
    stochastic_rounding: unbiased rounding of the values (gradients), drawn from `generator` (torch's
    default generator when None).
    """

    block_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False
    generator: torch.Generator | None = dataclasses.field(default=None, repr=False, compare=False)

    format_name: ClassVar[str] = "NVFP4"
    block: ClassVar[int] = BLOCK
    global_statistic: ClassVar[bool] = True  # the global amax (per direction) enters every scale

    def __post_init__(self):
        if self.block_2d and self.rht:
            raise ValueError("NVFP4Quantizer: the Hadamard transform (rht=True) applies to 1-D blocks of "
                             "inputs and gradients, not to 16x16 weight tiles (block_2d=True)")

    def describe(self) -> str:
        extras = [n for n, on in (("16x16", self.block_2d), ("RHT", self.rht), ("SR", self.stochastic_rounding))
                  if on]
        return "NVFP4" + (f" ({', '.join(extras)})" if extras else "")

    @property
    def round_trip_bound(self) -> float:
        if self.stochastic_rounding:
            return 0.150  # unbiased rounding: larger errors than round-to-nearest
        return 0.125 if self.block_2d else 0.105  # a 16x16 tile's scale fits its largest of 16 rows

    def storage_bytes(self, m, k, rowwise, columnwise, dtype=torch.float32):
        # E2M1 nibbles, an E4M3 scale per 16 (a tile's repeated on its rows), one fp32 global amax
        return (rowwise + columnwise) * (m * k // 2 + m * k // BLOCK + 4)

    @property
    def columnwise_is_transpose(self) -> bool:
        return self.block_2d

    @property
    def is_deterministic(self) -> bool:
        return not self.stochastic_rounding  # stochastic rounding draws new random numbers on every cast

    def _codes(self, v: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
        """E2M1 codes of the scaled values; with stochastic rounding from `rand` (uniform draws of v's shape) or
        from new draws of `generator`."""
        if not self.stochastic_rounding:
            return e2m1_codes(v)
        if rand is None:
            rand = self._draw(v.shape, v.device)
        return e2m1_codes_stochastic(v, rand)

    def _draw(self, shape, device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=device, dtype=torch.float32)

    @staticmethod
    def _amax(x: torch.Tensor) -> torch.Tensor:
        return x.abs().amax().reshape(1) if x.numel() else torch.zeros(1, device=x.device)

    def _part(self, x2d: torch.Tensor, columnwise: bool, rht: bool, amax: torch.Tensor | None = None) -> NVFP4Part:
        x = rht16(x2d) if rht else x2d.float()
        amax = self._amax(x) if amax is None else amax.reshape(1).to(x.device)
        s_enc = global_encode_scale(amax)
        s = block_scale_e4m3(block_amax(x, BLOCK), s_enc)
        codes = self._codes(x * expand_blocks(element_multiplier(s, s_enc), BLOCK, x.shape[1]))
        m, k = x2d.shape
        return NVFP4Part(rows=m, cols=k, columnwise=columnwise, data=pack_nibbles(codes), scale=s, amax=amax,
                         rht=rht)

    def reference_parts(self, x2d, rowwise, columnwise, *, shard=None, stats=None, global_stats=None):
        """`shard` / `stats`: quantize the row shard `x2d` with the MAX-reduced `shard_stats` (see _sharding).
        `global_stats`: `x2d` is a piece of a tensor and this its MAX-reduced `global_stats` (the amaxes)."""
        if shard is not None and not shard.is_whole:
            return self._shard_parts(x2d, rowwise, columnwise, shard, stats)
        amaxes = (None, None) if global_stats is None else tuple(global_stats.reshape(-1)[:2].unbind())
        if not self.block_2d:
            return (self._part(x2d, False, False, amaxes[0]) if rowwise else None,
                    self._part(x2d.t(), True, self.rht, amaxes[-1]) if columnwise else None)
        m, k = x2d.shape
        x = x2d.float()
        amax = self._amax(x) if global_stats is None else amaxes[0].reshape(1).to(x.device)
        s_enc = global_encode_scale(amax)
        return self._tile_parts(x, amax, s_enc, s_enc, rowwise, columnwise)

    def _tile_parts(self, x: torch.Tensor, amax: torch.Tensor, s_enc_tiles: torch.Tensor, s_enc: torch.Tensor,
                    rowwise: bool, columnwise: bool, rand: torch.Tensor | None = None
                    ) -> tuple[NVFP4Part | None, NVFP4Part | None]:
        """16x16-tile parts of fp32 `x [M, K]`: one E4M3 scale per tile, encoded with `s_enc_tiles` (per tile
        row) and applied with `s_enc` (per element row); both directions share the codes."""
        m, k = x.shape
        s_tile = block_scale_e4m3(tile_amax(x, BLOCK), s_enc_tiles)  # [M/16, K/16]
        s_row = s_tile.repeat_interleave(BLOCK, dim=0)
        codes = self._codes(x * expand_blocks(element_multiplier(s_row, s_enc), BLOCK, k), rand)
        row = NVFP4Part(rows=m, cols=k, columnwise=False, data=pack_nibbles(codes), scale=s_row, amax=amax,
                        rht=False) if rowwise else None
        col = NVFP4Part(rows=k, cols=m, columnwise=True, data=pack_nibbles(codes.t()),
                        scale=tile_scale_columnwise(s_tile, BLOCK), amax=amax.clone(),
                        rht=False) if columnwise else None
        return row, col

    # -- row groups (GroupedLinear's packed path) --------------------------------------------------------
    @property
    def packs_row_groups(self) -> bool:
        return True  # the global amaxes are kept per group; stochastic rounding draws per group (draw_order)

    def quantize_groups(self, x2d: torch.Tensor, sizes: Sequence[int], *, rowwise: bool = True,
                        columnwise: bool = False, name: str = "tensor",
                        draw_order: Sequence[int] | None = None) -> QuantizedTensor:
        """Consecutive row groups of `x2d` (group g: the next `sizes[g]` rows) in one call, each quantized exactly as
        `quantize_parts` quantizes it alone: its own global amax per direction (after the transform with rht; one
        for both directions with 16x16 tiles), hence its own global encode scale. Every group must satisfy the
        shape rule on its own (M % 16 == 0 columnwise or with tiles), so no 1x16 / 16x1 block, 16x16 tile or
        16-row Hadamard group holds rows of two groups. The parts hold amax `[G]`; cut them apart with
        `row_slice(start, stop, group=g)`.

        Stochastic rounding: the groups draw from `generator` one after another in `draw_order` (default first
        to last; empty groups draw nothing), each group as its own call would (rowwise then columnwise; once for
        both with tiles), so the draws are those of the per-group calls made in that order. On a CUDA device with
        the extension: one amax pass for all groups and one quantize launch, whose draws are keyed like the
        per-group launches' (one Philox offset step per group, in draw order)."""
        sizes = check_row_groups(self, x2d, sizes, name)
        for g, n in enumerate(sizes):
            self.validate((n, x2d.shape[1]), f"row group {g} of {name}", rowwise=rowwise, columnwise=columnwise)
        order = draw_sequence(sizes, draw_order, f"{self.describe()}: row groups of {name}")
        run = dispatch.row_groups_kernel(type(self), x2d.device.type)
        parts = run(self, x2d, sizes, rowwise, columnwise, order) if run is not None else None
        if parts is None:
            parts = self.reference_groups(x2d, sizes, rowwise, columnwise, order)
        return QuantizedTensor(*parts, shape=x2d.shape, dtype=x2d.dtype)

    def reference_groups(self, x2d: torch.Tensor, sizes: tuple[int, ...], rowwise: bool, columnwise: bool,
                         order: list[int]) -> tuple[NVFP4Part | None, NVFP4Part | None]:
        """The pure-PyTorch `quantize_groups` (the contract the CUDA kernel matches): the quantize_parts formulas
        with the global encode scale taken per row from the row's group (the fp32 operations are elementwise, so
        each group's values are bitwise its own quantization's)."""
        m, k = x2d.shape
        x = x2d.float()
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        group_of_row = torch.repeat_interleave(torch.arange(len(sizes), device=x.device),
                                               torch.tensor(sizes, dtype=torch.long, device=x.device), output_size=m)

        def group_amax(t: torch.Tensor, along_cols: bool) -> torch.Tensor:  # [G]: max|t| over each group's rows
            pieces = [self._amax(t[:, o:o + n] if along_cols else t[o:o + n]) for o, n in zip(starts, sizes)]
            return torch.cat(pieces) if pieces else torch.zeros(0, device=t.device)

        rand_row, rand_col = self._group_draws(sizes, starts, order, m, k, rowwise, columnwise, x.device)
        if self.block_2d:
            amax = group_amax(x, False)
            s_enc = global_encode_scale(amax)[group_of_row][:, None]  # [M, 1]: each row's group's
            # groups are whole 16-row tiles
            return self._tile_parts(x, amax, s_enc[::BLOCK], s_enc, rowwise, columnwise, rand_row)
        row = col = None
        if rowwise:
            amax = group_amax(x, False)
            s_enc = global_encode_scale(amax)[group_of_row][:, None]  # [M, 1]
            s = block_scale_e4m3(block_amax(x, BLOCK), s_enc)
            codes = self._codes(x * expand_blocks(element_multiplier(s, s_enc), BLOCK, k), rand_row)
            row = NVFP4Part(rows=m, cols=k, columnwise=False, data=pack_nibbles(codes), scale=s, amax=amax, rht=False)
        if columnwise:
            # the transform mixes 16 consecutive rows; groups are whole 16-row groups, so it never mixes two
            xt = rht16(x2d.t()) if self.rht else x.t()
            amax = group_amax(xt, True)
            s_enc = global_encode_scale(amax)[group_of_row][None, ::BLOCK]  # [1, M/16]: each block's group's
            s = block_scale_e4m3(block_amax(xt, BLOCK), s_enc)
            codes = self._codes(xt * expand_blocks(element_multiplier(s, s_enc), BLOCK, m), rand_col)
            col = NVFP4Part(rows=k, cols=m, columnwise=True, data=pack_nibbles(codes), scale=s, amax=amax,
                            rht=self.rht)
        return row, col

    def _group_draws(self, sizes, starts, order, m, k, rowwise, columnwise, device):
        """Stochastic rounding: the uniform draws of the rowwise `[M, K]` and columnwise `[K, M]` values, each
        group's drawn as its own quantize_parts call draws them (rowwise, then columnwise; once with tiles), the
        groups in `order`. (None, None) without stochastic rounding."""
        if not self.stochastic_rounding:
            return None, None
        rand_row = torch.empty(m, k, device=device) if (rowwise or self.block_2d) else None
        rand_col = torch.empty(k, m, device=device) if (columnwise and not self.block_2d) else None
        for g in order:
            o, n = starts[g], sizes[g]
            if rand_row is not None:
                rand_row[o:o + n] = self._draw((n, k), device)
            if rand_col is not None:
                rand_col[:, o:o + n] = self._draw((k, n), device)
        return rand_row, rand_col

    def stats_from_amax(self, amax, rowwise, columnwise):
        """`global_stats` from max|x|: all of them except the columnwise amax with rht (that of the transform)."""
        a = amax.reshape(1).float()
        if self.block_2d:
            return a
        if columnwise and self.rht:
            return None
        zero = torch.zeros_like(a)
        return torch.cat([a if rowwise else zero, a if columnwise else zero])

    def global_stats(self, x2d, rowwise, columnwise):
        """The global amax: one for both directions with 16x16 tiles; else [rowwise, columnwise] (the columnwise
        one after the transform with rht; 0 for a direction not asked)."""
        x = x2d.float()
        if self.block_2d:
            return self._amax(x)
        zero = torch.zeros(1, device=x.device)
        row = self._amax(x) if rowwise else zero
        col = (self._amax(rht16(x.t())) if self.rht else (row if rowwise else self._amax(x))) if columnwise else zero
        return torch.cat([row, col])

    # -- sharded quantization (FSDP) -------------------------------------------------------------
    def _stats_layout(self, shard, k: int) -> StatsLayout:
        n_cut = len(shard.cut_blocks(BLOCK))
        if self.block_2d:  # one global amax for both directions, plus the split 16x16 tiles
            return StatsLayout(("amax", (1,)), ("cut", (n_cut, k // BLOCK)))
        # a global amax per direction, plus the split 16x1 columnwise blocks (none can be used with RHT)
        return StatsLayout(("amax_r", (1,)), ("amax_c", (1,)), ("cut", (0 if self.rht else n_cut, k)))

    def _rht_aligned(self, shard) -> bool:
        return shard.offset % BLOCK == 0 and shard.length % BLOCK == 0

    def shard_stats(self, x2d, shard):
        """Global amax(es), and partial amaxes of the 16x16 tiles / 16x1 columnwise blocks split by shard
        boundaries."""
        layout = self._stats_layout(shard, x2d.shape[1])
        x = x2d.float()
        cut = bool(shard.cut_blocks(BLOCK))
        if self.block_2d:
            vals = {"amax": self._amax(x)}
            if cut:
                vals["cut"] = cut_stats(tile_amax_rows(x, shard, BLOCK), shard, BLOCK)
            return layout.pack(vals, x2d.device)
        vals = {"amax_r": self._amax(x)}
        if not self.rht:
            vals["amax_c"] = vals["amax_r"]
            if cut:
                vals["cut"] = cut_stats(col_block_amax(x, shard, BLOCK), shard, BLOCK)
        else:  # the columnwise amax is taken after the transform, over whole 16-row groups of this shard
            vals["amax_c"] = self._amax(rht16(x.t())) if self._rht_aligned(shard) else torch.zeros(1, device=x.device)
        return layout.pack(vals, x2d.device)

    def with_global_stats(self, stats, shard, k, global_stats):
        if stats is None or global_stats is None:
            return stats
        layout = self._stats_layout(shard, k)
        vals = layout.unpack(stats)
        g = global_stats.reshape(-1).to(stats.device)
        if self.block_2d:
            vals["amax"] = g[:1]
        else:
            vals["amax_r"], vals["amax_c"] = g[:1], g[1:2]
        return layout.pack(vals, stats.device)

    def plain_shard_amaxes(self, shard, k: int, stats) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rowwise amax, columnwise amax) from the MAX-reduced `stats` when no block or tile of the row shard is
        split by its boundaries: quantizing the shard is then plain quantization with these global amaxes (the
        columnwise one after the transform with rht), which is what a device kernel needs to match
        `reference_parts(..., shard=shard, stats=stats)`. None otherwise (or without stats)."""
        if stats is None or shard.cut_blocks(BLOCK) or (self.rht and not self.block_2d and not self._rht_aligned(shard)):
            return None
        st = self._stats_layout(shard, k).unpack(stats)
        if self.block_2d:
            return st["amax"], st["amax"]
        return st["amax_r"], st["amax_c"]

    def _shard_parts(self, x2d, rowwise, columnwise, shard, stats):
        st = self._stats_layout(shard, x2d.shape[1]).unpack(stats)
        l, k = x2d.shape
        x = x2d.float()

        def pack_t(codes):  # columnwise codes packed along the shard's rows (an odd shard gets a pad nibble)
            return pack_nibbles(torch.nn.functional.pad(codes.t(), (0, l % 2)))
        if self.block_2d:
            amax = st["amax"].reshape(1).to(x.device)
            s_enc = global_encode_scale(amax)
            tiles = tile_amax_rows(x, shard, BLOCK)
            if "cut" in st:
                tiles = merge_cut(tiles, shard, BLOCK, st["cut"])
            s_tile = block_scale_e4m3(tiles, s_enc)  # [n_touched, K/16]
            s_row = expand_rows(s_tile, shard, BLOCK)
            codes = self._codes(x * expand_blocks(element_multiplier(s_row, s_enc), BLOCK, k))
            row = NVFP4Part(rows=l, cols=k, columnwise=False, data=pack_nibbles(codes), scale=s_row, amax=amax,
                            rht=False) if rowwise else None
            col = NVFP4Part(rows=k, cols=l, columnwise=True, data=pack_t(codes),
                            scale=tile_scale_columnwise(s_tile, BLOCK), amax=amax.clone(),
                            rht=False) if columnwise else None
            return row, col
        row = col = None
        if rowwise:  # 1x16 blocks lie within a row: only the global amax is shared
            amax = st["amax_r"].reshape(1).to(x.device)
            s_enc = global_encode_scale(amax)
            s = block_scale_e4m3(block_amax(x, BLOCK), s_enc)
            codes = self._codes(x * expand_blocks(element_multiplier(s, s_enc), BLOCK, k))
            row = NVFP4Part(rows=l, cols=k, columnwise=False, data=pack_nibbles(codes), scale=s, amax=amax, rht=False)
        if columnwise:
            amax = st["amax_c"].reshape(1).to(x.device)
            s_enc = global_encode_scale(amax)
            if self.rht:
                if not self._rht_aligned(shard):
                    raise ValueError(f"{self.describe()}: the Hadamard transform mixes 16 consecutive rows, so a "
                                     f"columnwise shard must start and end on a multiple of 16 rows; got rows "
                                     f"[{shard.offset}, {shard.end}) of {shard.rows}")
                xt = rht16(x.t())  # [K, L]: whole groups of 16 rows
                s = block_scale_e4m3(block_amax(xt, BLOCK), s_enc)
                codes_t = self._codes(xt * expand_blocks(element_multiplier(s, s_enc), BLOCK, l))
                col = NVFP4Part(rows=k, cols=l, columnwise=True, data=pack_nibbles(codes_t), scale=s, amax=amax,
                                rht=True)
            else:
                blocks = col_block_amax(x, shard, BLOCK)
                if "cut" in st:
                    blocks = merge_cut(blocks, shard, BLOCK, st["cut"])
                s = block_scale_e4m3(blocks, s_enc)  # [n_touched, K]
                codes = self._codes(x * expand_rows(element_multiplier(s, s_enc), shard, BLOCK))
                col = NVFP4Part(rows=k, cols=l, columnwise=True, data=pack_t(codes),
                                scale=s.t().contiguous(), amax=amax, rht=False)
        return row, col

    def derive_part(self, part, direction, dtype=None):
        """16x16 tiles with one global amax: each direction is the exact transpose of the other."""
        if not self.block_2d or part.direction == direction:
            return None
        codes = unpack_nibbles(part.data)[:, :part.cols]
        s_tile = part.scale[::BLOCK]
        return NVFP4Part(rows=part.cols, cols=part.rows, columnwise=not part.columnwise,
                         data=pack_nibbles(codes.t()), scale=tile_scale_columnwise(s_tile, BLOCK),
                         amax=part.amax.clone(), rht=False)


NVFP4Part.quantizer_type = NVFP4Quantizer
