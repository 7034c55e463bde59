"""What FSDP2's gather hooks remember between unshards (to keep their host cost low) is never stale: each cache is
reused only for the inputs it was made for, and anything else is built again. In-process (no process group): ranks
are simulated as in test_fsdp_protocol.py; the real FSDP2 runs (optimizer updates, resharding, checkpoints, other
world sizes) compare every step bitwise with a single-process replay in test_fsdp.py / test_large_world.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridq.distributed.payload import (GatheredViews, assemble_output, assemble_parts, build_payload,
                                         quantize_shard)
from hybridq.distributed.plan import make_plan, setup_of
from hybridq.distributed.state import WeightState
from hybridq.distributed.weights import _shard_layout
from hybridq.enums import BackwardOverride, Phase
from hybridq.formats._sharding import dim0_chunks

from _format_cases import FORMATS
from _jobs import assert_parts_equal
from test_fsdp_protocol import QUANTIZERS, _weight

R, C, H = "rowwise", "columnwise", "high_precision"
SHAPE = (96, 64)  # 5 ranks: 20-row shards that split 32-row blocks (uneven block counts: concatenated rows)


def _reduced_stats(q, w, shards):
    if len(shards) == 1:
        return None
    local = [q.shard_stats(w[s.offset:s.end], s) for s in shards]
    return None if local[0] is None else torch.stack(local).amax(0)


def _payloads(q, w, world_size, directions, memos=None):
    """Every rank's (payload, metadata) for `directions` of `w`, each rank with its own layout memo (a weight's state
    on that rank) where `memos` is given."""
    shards = dim0_chunks(tuple(w.shape), world_size)
    stats = _reduced_stats(q, w, shards)
    out = []
    for r, s in enumerate(shards):
        x = w[s.offset:s.end]
        parts = quantize_shard(q, x, s, directions, stats)
        out.append(build_payload(q, parts, s, shards, tuple(w.shape), x.device,
                                 memo=memos[r] if memos is not None else None))
    return out


@pytest.mark.parametrize("world_size", [2, 5])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_payload_layout_is_reused_only_for_the_parts_it_was_made_for(name, world_size):
    """`build_payload(memo=)` remembers a layout per quantizer, shard and shape; parts of other directions under the
    same key get their own layout, and a repeat of the first directions reuses the first layout's objects."""
    q = QUANTIZERS[name]()
    w = _weight(SHAPE)
    memos = [{} for _ in range(world_size)]
    first = None
    for directions in ((R,), (C,), (R, C), (H,), (R,)):
        got = _payloads(q, w, world_size, directions, memos)
        want = _payloads(q, w, world_size, directions)
        for rank, ((p, m), (pw, mw)) in enumerate(zip(got, want)):
            where = f"{name}, {directions}, rank {rank} of {world_size}"
            assert (m.buffers, m.parts, m.nbytes) == (mw.buffers, mw.parts, mw.nbytes), \
                f"{where}: the remembered layout is not the one these parts need:\n{m.buffers}\n!=\n{mw.buffers}"
            assert torch.equal(p, pw), f"{where}: payload bytes differ from a build without the memo"
        if first is None:
            first = [m.buffers for _, m in got]
    assert all(m.buffers is b for (_, m), b in zip(got, first)), \
        f"{name}: the rowwise parts' layout was built again instead of reused"


def _gather_into(out: torch.Tensor, payloads) -> None:
    out.view(len(payloads), -1).copy_(torch.stack(payloads))


@pytest.mark.parametrize("directions", [(R,), (R, C)])
@pytest.mark.parametrize("world_size", [2, 5])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_gathered_views_follow_the_all_gather_output(name, world_size, directions):
    """`assemble_output(memo=)` keeps the buffers' views of FSDP2's all-gather output: new bytes in the same storage
    (the next unshard) are read through them, another storage (FSDP2 allocated new outputs) is sliced anew, and a
    buffer that is a copy (concatenated from uneven ranks, or one of several buffers of each rank's payload) is never
    kept."""
    q = QUANTIZERS[name]()
    w1, w2 = _weight(SHAPE, seed=1), _weight(SHAPE, seed=2)
    memos = [{} for _ in range(world_size)]
    views = GatheredViews()
    out_a = torch.empty(world_size * _payloads(q, w1, world_size, directions, memos)[0][0].numel(),
                        dtype=torch.uint8)
    out_b = torch.empty_like(out_a)
    for step, (w, out) in enumerate(((w1, out_a), (w2, out_a), (w1, out_b), (w2, out_a))):
        sent = _payloads(q, w, world_size, directions, memos)
        _gather_into(out, [p for p, _ in sent])
        meta = sent[0][1]
        got = assemble_output(meta, out, views)
        want = assemble_parts(meta, out.view(world_size, -1).clone())
        for d in want:
            assert_parts_equal(got[d], want[d], f"{name}, step {step} ({d}, world {world_size}): gathered parts "
                                                f"read through the kept views")
    one_buffer = len(meta.buffers) == 1 and all(c == meta.buffers[0].capacity for c in meta.buffers[0].counts[:-1])
    if one_buffer:  # (the per-tensor FP8 weight's payload: what FSDP2's unshards gather most)
        assert views.value is not None, f"{name}: a payload of one evenly sharded buffer kept no views"


def test_shard_layout_is_checked_again_for_a_new_quantizer_and_world_size():
    """A weight's checked layout is kept per quantizer, sharding, dtype and override: a quantizer the layout breaks
    (NVFP4 with the Hadamard transform over 24-row shards) is refused even after another quantizer passed with the
    same shape, and each world size and rank gets its own shard."""
    st = WeightState(name="layers.0.w")
    shape = torch.Size((48, 64))
    fp8, rht = FORMATS["fp8_e4m3"](), FORMATS["nvfp4_rht"]()
    for ws, rank in ((2, 1), (4, 3), (2, 0), (1, 0)):
        lay = _shard_layout(st, fp8, shape, ws, rank, torch.bfloat16, None)
        assert lay.shard == dim0_chunks(tuple(shape), ws)[rank], (ws, rank, lay.shard)
        assert lay.quantizer is fp8
    with pytest.raises(ValueError, match="cannot be sharded over 2 ranks"):
        _shard_layout(st, rht, shape, 2, 0, torch.bfloat16, None)
    lay = _shard_layout(st, rht, shape, 1, 0, torch.bfloat16, None)  # (one rank: the whole weight)
    assert lay.quantizer is rht and lay.shard.is_whole


OVERRIDES = (None, BackwardOverride.DEQUANTIZED, BackwardOverride.HIGH_PRECISION)


def test_unshard_setup_is_the_plan_of_its_settings():
    """`setup_of` (remembered per settings) gives the plan `make_plan` gives for every combination of phase,
    reshard_after_forward / _backward, override, derivability, FSDP2 internals found and earlier backward extras,
    asked twice in a row (the second time from the memo), and keeps a forward payload exactly when the backward
    unshard sends the same directions."""
    combos = list(itertools.product(Phase, (True, False, None), (True, False), OVERRIDES, (True, False),
                                    (True, False), (frozenset(), frozenset({R}))))
    for _ in range(2):
        for phase, ra, rab, override, derivable, known, extra in combos:
            got = setup_of(phase, ra, rab, override, derivable, known, extra)
            extra_now = set(extra) | (set() if rab else {R})
            plan = make_plan(phase=phase, reshard_after_forward=ra, backward_override=override, derivable=derivable,
                             known=known, backward_extra=extra_now)
            backward = make_plan(phase=Phase.BACKWARD, reshard_after_forward=ra, backward_override=override,
                                 derivable=derivable, known=True, backward_extra=extra_now)
            keeps = phase == Phase.FORWARD and bool(plan.deferred) and backward.send == plan.send
            where = (phase, ra, rab, override, derivable, known, set(extra))
            assert got.plan == plan, f"{where}: {got.plan} != {plan}"
            assert got.keeps == keeps, f"{where}: keeps the forward payload {got.keeps}, expected {keeps}"
            assert (got.phase, got.reshard_after_forward, set(got.backward_extra)) == (phase, ra, extra_now), where


def _model_with_shared_modules() -> torch.nn.Module:
    shared = torch.nn.Linear(2, 2)
    inner = torch.nn.Sequential(shared, torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(2, 2), shared))
    model = torch.nn.Sequential(inner, shared, torch.nn.ModuleList([torch.nn.Linear(1, 1), inner]))
    model.register_module("absent", None)
    return model


WALK_CASES = {
    "one module": lambda: torch.nn.Linear(2, 2),
    "nested, shared and absent children": _model_with_shared_modules,
}


@pytest.mark.parametrize("case", list(WALK_CASES))
def test_precompute_scales_walks_the_modules_of_model_modules_in_its_order(case):
    """`precompute_scales` walks the model without `named_modules`' generators: the same modules, each once, in the
    same order (the order of the fused all-reduce's values)."""
    from hybridq.distributed.scales import _modules
    model = WALK_CASES[case]()
    got, want = _modules(model), list(model.modules())
    assert [id(m) for m in got] == [id(m) for m in want], (
        f"walked {[type(m).__name__ for m in got]}, model.modules() gives {[type(m).__name__ for m in want]}")
