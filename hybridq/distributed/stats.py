"""The statistics a sharded weight's shards share, reduced across ranks before any rank quantizes (see
[Note: sharding invariance], formats/shardable.py): mixins of the weight states (`state.py`), which keep the reduced
values under a key of the shard values they came from (`transport.stats_key`; `precompute_scales` fills them
ahead), with the fingerprint of those values (`stats_fp`): a reuse under the same key is checked against a write
through `.data` since ([Note: data-write check], hybridq/data_writes.py; world > 1: reported by the next
precompute_scales on every rank)."""

from __future__ import annotations

import torch

from ..data_writes import LEDGER, fingerprint
from ..enums import Cut
from ..formats._reduce import amax_all_reduce_
from .layout import ExpertLayout
from .payload import AxisStats

__all__ = ["GroupedStats", "WeightStats", "pack_stats"]


class WeightStats:
    """A Linear weight's statistics: its shard's (FSDP2), and a tensor-parallel piece's (`tp_group`, `tp_cut`)."""

    def reduced_stats(self, q, x2d, shard, key, group, values: torch.Tensor | None = None):
        """The statistics of this shard reduced across ranks (the ones kept for `key` where it matches). `values`:
        the shard's master values (fingerprinted, for the data-write check; a tensor-parallel piece's are not)."""
        if key is not None and self.stats_key == key:
            self.counters["stats_precomputed"] += 1
            if self.stats is not None and values is not None and self.tp_group is None:
                LEDGER.reused(self.name, values, self.stats_fp, self.data_checks, False, "reduced statistics")
            return self.stats
        self.stats_fp = None
        if self.tp_group is not None and getattr(q, "stats_per_axis", False):
            local = self._axis_stats(q, x2d, group)
            self.stats_key, self.stats = key, local
            return local
        if self.tp_group is not None and shard.is_whole:  # a whole TP piece: only per-tensor statistics
            local = self._tp_global(q, x2d, group)
            self.stats_key, self.stats = key, local
            return local
        local = q.shard_stats(x2d, shard)
        if local is not None and group is not None:
            amax_all_reduce_(local, group)
            self.counters["stats_allreduce"] += 1
        if self.tp_group is not None:  # per-tensor statistics span the TP pieces too
            g = self._tp_global(q, x2d, group)
            if g is not None:
                local = q.with_global_stats(local, shard, x2d.shape[1], g)
        elif local is not None and values is not None:
            self.stats_fp = fingerprint(values)
        self.stats_key, self.stats = key, local
        return local

    def _axis_stats(self, q, x2d, group) -> AxisStats:
        """A per-axis format's row shard of a TP piece: the columns' statistics (`piece_stats` of a row piece)
        reduce over the FSDP group, and over the TP group too when TP cuts rows; the rows' (`piece_stats` of a
        column piece) over the TP group when TP cuts columns (the FSDP group holds other rows)."""
        cols = q.piece_stats(x2d, True, True, Cut.ROWS)
        if cols is not None:
            cols = cols.contiguous()
            for g in (group, self.tp_group if self.tp_cut == Cut.ROWS else None):
                if g is not None:
                    amax_all_reduce_(cols, g)
        rows = q.piece_stats(x2d, True, True, Cut.COLUMNS) if self.tp_cut == Cut.COLUMNS else None
        if rows is not None:
            rows = rows.contiguous()
            amax_all_reduce_(rows, self.tp_group)
        self.counters["stats_allreduce"] += 1
        return AxisStats(rows, cols)

    def _tp_global(self, q, x2d, group):
        """The whole weight's per-tensor statistics: MAX over this rank's rows, the dp group, the TP group."""
        g = q.global_stats(x2d, True, True)
        if g is not None:
            if group is not None:
                amax_all_reduce_(g, group)
            amax_all_reduce_(g, self.tp_group)
            self.counters["stats_allreduce"] += 1
        return g


class GroupedStats:
    """A grouped weight's statistics: every expert's, in one all-reduce."""

    def reduced_stats(self, qs, pieces, layout: ExpertLayout, key, group, values: torch.Tensor | None = None
                      ) -> list[torch.Tensor | None]:
        """Each expert's statistics reduced across ranks: one MAX all-reduce for all experts (or the values
        precompute_scales reduced for these shard values). `values`: the local experts' master values."""
        local = [q.shard_stats(x, layout.stats_shard(e)) for e, (q, x) in enumerate(zip(qs, pieces))]
        if key is not None and self.stats_key == key:
            self.counters["stats_precomputed"] += 1
            flat = self.stats
            if flat is not None and values is not None:
                LEDGER.reused(self.name, values, self.stats_fp, self.data_checks, False, "reduced statistics")
        else:
            self.stats_fp = fingerprint(values) if values is not None else None
            flat = pack_stats(local)
            if flat is not None:
                amax_all_reduce_(flat, group)
                self.counters["stats_allreduce"] += 1
            self.stats_key, self.stats = key, flat
        out, i = [], 0
        for s in local:
            if s is None:
                out.append(None)
                continue
            out.append(flat[i:i + s.numel()].view(s.shape))
            i += s.numel()
        return out

    def reduced_vector(self, local, key, group, values: torch.Tensor | None = None) -> torch.Tensor:
        """`reduced_stats` for experts whose statistics are one value each: `local()` gives this rank's `[E]`
        vector (computed only when the values are not the ones already reduced for `key`)."""
        if key is not None and self.stats_key == key:
            self.counters["stats_precomputed"] += 1
            if self.stats is not None and values is not None:
                LEDGER.reused(self.name, values, self.stats_fp, self.data_checks, False, "reduced statistics")
            return self.stats
        self.stats_fp = fingerprint(values) if values is not None else None
        flat = local()
        amax_all_reduce_(flat, group)
        self.counters["stats_allreduce"] += 1
        self.stats_key, self.stats = key, flat
        return flat


def pack_stats(stats) -> torch.Tensor | None:
    """The experts' statistics (None where a format has none) as one fp32 vector (layout the same on every rank)."""
    present = [s.reshape(-1).float() for s in stats if s is not None]
    return torch.cat(present) if present else None
