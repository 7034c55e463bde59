"""Bytes on the wire: what each rank all-gathers per weight per training step, against bf16 FSDP2."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..enums import BackwardOverride, Phase, SequenceSend
from ..formats.base import Quantizer
from ..recipe import Role
from .payload import gather_bytes_for, rows_of
from .plan import make_plan
from .state import WeightState
from .layout import transport_view

__all__ = ["GatherBytes", "SequenceBytes", "bytes_table", "gather_bytes_per_step", "sequence_bytes_table",
           "sequence_gather_bytes"]


@dataclasses.dataclass(frozen=True)
class GatherBytes:
    """Bytes each rank contributes to the all-gathers of one weight in one training step (`gather_bytes_per_step`),
    transport padding included, against a bf16 FSDP2 all-gather of the same weight."""

    forward: int  # the forward unshard's all-gather input
    forward_sends: tuple[str, ...]  # what it sends: directions, or "high_precision" (the shard in param_dtype)
    backward: int | None  # the backward re-gather's; None: no backward unshard (reshard_after_forward=False)
    backward_sends: tuple[str, ...] | None
    bf16_total: int  # bf16 FSDP2's, over the same unshards

    @property
    def total(self) -> int:
        return self.forward + (self.backward or 0)

    @property
    def ratio(self) -> float:
        """total / bf16_total."""
        return self.total / self.bf16_total


def gather_bytes_per_step(quantizer: Quantizer, shape, world_size: int = 2, *, param_dtype=torch.bfloat16,
                          reshard_after_forward: bool = True, backward_override: str | None = None) -> GatherBytes:
    """Bytes each rank contributes to the all-gathers of one weight in one training step (forward, and backward
    when it re-gathers), against a bf16 FSDP2 all-gather of the same weight. Counts the transport padding
    of unevenly sharded weights; the statistics all-reduce (a few fp32 per weight) is not included."""
    shape = tuple(shape)
    if quantizer.is_stateful:
        raise ValueError(f"{quantizer.describe()}: delayed scaling is rejected under FSDP2")
    derivable = WeightState().is_derivable(quantizer, shape, param_dtype)
    sent = {}
    phases = tuple(Phase) if reshard_after_forward else (Phase.FORWARD,)
    for phase in phases:
        plan = make_plan(phase=phase, reshard_after_forward=reshard_after_forward,
                         backward_override=backward_override, derivable=derivable, known=True)
        b = gather_bytes_for(quantizer, shape, world_size, plan.send, param_dtype)
        payload = torch.empty(b, dtype=torch.uint8, device="meta")
        t = transport_view(payload, shape, world_size)
        sent[phase] = (t.numel() * t.element_size(), tuple(plan.send))
    chunk = -(-shape[0] // world_size) * math.prod(shape[1:])
    backward = sent.get(Phase.BACKWARD, (None, None))
    return GatherBytes(*sent[Phase.FORWARD], *backward, bf16_total=chunk * 2 * len(phases))


def bytes_table(shapes=((4096, 4096), (50257, 4096)), world_size: int = 2, presets=None) -> str:
    """Markdown table of per-step all-gather bytes per element of the weight (per rank, forward + backward with
    reshard_after_forward=True) for each preset's weight format vs bf16."""
    from ..recipe import preset_names, recipe

    presets = presets or preset_names()
    head = "| preset | weight format | " + " | ".join(f"{s[0]}x{s[1]} B/elem (fwd+bwd) | vs bf16" for s in shapes) + " |"
    rows = [head, "|" + "---|" * (2 + 2 * len(shapes))]
    for name in presets:
        q = recipe(name).quantizer(Role("linear", "weight"))
        cells = []
        for shape in shapes:
            if q.is_stateful:
                cells += ["rejected (delayed scaling)", "-"]
                continue
            why = q.shape_rule(rows_of(shape), shape[-1], True, True)
            if why is not None:
                cells += [f"kept in bf16 ({why})", "1.000"]
                continue
            r = gather_bytes_per_step(q, shape, world_size)
            per_elem = r.total / (math.prod(shape) / world_size)
            sends = " / ".join("+".join(s) for s in (r.forward_sends, r.backward_sends))
            cells += [f"{per_elem:.4f} ({sends})", f"{r.ratio:.3f}"]
        rows.append(f"| {name} | {q.describe()} | " + " | ".join(cells) + " |")
    bf = ["4.0000", "1.000"] * len(shapes)
    rows.append("| (bf16 FSDP2) | bfloat16 | " + " | ".join(bf) + " |")
    return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class SequenceBytes:
    """One column-parallel layer's sequence-parallel input per training step (`sequence_gather_bytes`): the bytes
    each rank contributes to its all-gathers in forward and in backward (one of each for all the layers reading
    the input), what it keeps for wgrad from forward to backward, against bf16 sequence parallelism (one bf16
    all-gather in forward, the gathered input kept for wgrad). See [Note: sequence phases], sequence.py."""

    forward: int  # the forward all-gather's payload
    forward_sends: str  # "rowwise", "rowwise+columnwise", or "high_precision" (the rows in the input's dtype)
    backward: int  # the backward all-gather's payload (0: none)
    backward_sends: str  # "columnwise" / "rowwise" (the rank's own form), "high_precision" (its rows), or "" (none)
    quantized_payload: int  # the forward-only quantized payload, sent or not
    kept: int  # activation bytes the layer keeps of its input for wgrad, per rank
    bf16: int  # bf16 SP's bytes per step
    bf16_kept: int  # bf16 SP's kept input (the gathered bf16 rows)

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def ratio(self) -> float:
        """total / bf16."""
        return self.total / self.bf16

    @property
    def saved_vs_bf16(self) -> int:
        """The activation bytes kept fewer than bf16 SP's."""
        return self.bf16_kept - self.kept


def sequence_gather_bytes(quantizer: Quantizer, shape, seq_dim: int = 1, world_size: int = 2, *,
                          backward_override: str | None = None, save_original_input: bool = False,
                          dtype=torch.bfloat16) -> SequenceBytes:
    """Bytes each rank sends in the sequence-parallel all-gathers of one column-parallel layer's input of (whole)
    `shape`, sharded along `seq_dim` over `world_size` ranks, per training step, and the activation bytes kept for
    wgrad, against bf16 sequence parallelism, for a layer with `backward_override` ("high_precision",
    "dequantized" or None) and `save_original_input` as the layer has them. Without either (the training default)
    wgrad reads the input's columnwise form, gathered in backward from each rank's own form or in forward, as
    `sequence.gather_plan` chooses; with "high_precision" or save_original_input the backward gathers the input's
    rows again; with "dequantized" wgrad reads the forward's whole rowwise form, kept from forward (nothing gathered
    in backward). Computed on the meta device: no data, no communication."""
    from ..formats.base import as_2d
    from .sequence import SequenceGather, gather_plan

    shape = tuple(shape)
    g = SequenceGather(None, shape, seq_dim % len(shape), None, world_size, 0)
    x2d = as_2d(torch.empty(g.local_shape, dtype=dtype, device="meta"))
    local, k = x2d.shape
    override = None if backward_override is None else BackwardOverride.parse(backward_override, "backward_override")
    columnwise = override is None and not save_original_input
    plan = gather_plan(quantizer, g, local, k, dtype, columnwise)
    high = x2d.numel() * dtype.itemsize
    if override == BackwardOverride.DEQUANTIZED:  # the forward's whole rowwise form, kept for wgrad
        whole = torch.empty(math.prod(shape[:-1]), k, dtype=dtype, device="meta")
        backward, backward_sends, kept = 0, "", quantizer.quantize_parts(whole, True, False)[0].nbytes()
    elif not columnwise:  # the rank's own rows, re-gathered in backward
        backward, backward_sends, kept = high, SequenceSend.HIGH_PRECISION.value, high
    else:
        backward, backward_sends, kept = plan.backward_nbytes, "+".join(plan.backward_send), plan.kept_nbytes
    sends = plan.kind.value if plan.kind == SequenceSend.HIGH_PRECISION else "+".join(plan.send)
    m = math.prod(shape[:-1])
    return SequenceBytes(plan.nbytes, sends, backward, backward_sends, plan.quantized_nbytes, kept,
                         bf16=x2d.numel() * 2, bf16_kept=m * k * 2)


def sequence_bytes_table(shape=(1, 4096, 4096), world_size: int = 2, presets=None) -> str:
    """Markdown table, per preset, of one column-parallel layer's sequence-parallel input (bf16, every layer
    reading the same input sharing its gathers): the bytes each rank sends in forward and in backward per training
    step against bf16 sequence parallelism, and the activation bytes kept for wgrad against bf16 SP's."""
    from ..recipe import preset_names, recipe

    presets = presets or preset_names()
    head = f"{'x'.join(map(str, shape))}, tp={world_size}"
    rows = [f"| preset | input format | sends in forward | forward bytes per rank ({head}) | sends in backward | "
            f"backward bytes | per step vs bf16 | kept for wgrad per rank | activation bytes saved vs bf16 SP |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name in presets:
        q = recipe(name).quantizer(Role("linear", "input"))
        if q.is_stateful:
            rows.append(f"| {name} | {q.describe()} | rejected (delayed scaling) | - | - | - | - | - | - |")
            continue
        r = sequence_gather_bytes(q, shape, 1, world_size, backward_override=recipe(name).backward_override)
        rows.append(f"| {name} | {q.describe()} | {r.forward_sends} | {r.forward:,} | {r.backward_sends or '-'} | "
                    f"{r.backward:,} | {r.ratio:.3f} | {r.kept:,} | {r.saved_vs_bf16:,} |")
    bf = sequence_gather_bytes(recipe("fp8_tensorwise").quantizer(Role("linear", "input")), shape, 1, world_size)
    rows.append(f"| (bf16 SP) | bfloat16 | bfloat16 | {bf.bf16:,} | - | 0 | 1.000 | {bf.bf16_kept:,} | 0 |")
    return "\n".join(rows)
