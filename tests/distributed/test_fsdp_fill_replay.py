"""The post-all-gather hook's replayed fill (`UnshardedBuffers.record_fill` / `replay_fill`): an unshard like the
last one of its plan (the same all-gather output storage, payload layout, quantizer and own tensors) re-copies the
replicated tensors and leaves the aliased ones pointing at the output, without rebuilding the parts; anything else
fills as usual. In-process, one simulated rank: FSDP2's part (the output's bytes freed and re-allocated, the inner
tensors freed at reshard and allocated before the hook) is done by hand; the real FSDP2 runs compare every step
bitwise with a single-process replay in test_fsdp.py."""

from __future__ import annotations

import pytest
import torch

from hybridq.distributed.payload import build_payload, quantize_shard
from hybridq.distributed.plan import make_plan
from hybridq.distributed.state import WeightState
from hybridq.distributed.weights import GatherMetadata, HybridWeight
from hybridq.formats._sharding import dim0_chunks
from hybridq.torch_private import storage_id

from _format_cases import FORMATS
from _jobs import assert_parts_equal
from test_fsdp_protocol import QUANTIZERS, _weight

R, C = "rowwise", "columnwise"
SHAPE = (64, 128)
DERIVED_IN_PLACE = ("fp8", "fp8_e5m2_pow2", "fp8block_2d")  # (columnwise derived from rowwise: Quantizer.derive_part)
DTYPE = torch.bfloat16


def _plan(q, phase: str):
    derivable = WeightState().is_derivable(q, SHAPE, DTYPE)
    return make_plan(phase=phase, reshard_after_forward=True, backward_override=None, derivable=derivable, known=True)


class _Unshards:
    """One weight's unshards on one rank as FSDP2 runs them: the all-gather output is one storage whose bytes are
    freed at reshard and allocated again (views of it stay valid), the weight's inner tensors likewise."""

    def __init__(self, q, out_bytes: int | None = None):
        self.q = q
        self.weight = HybridWeight(torch.zeros(SHAPE), WeightState(name="layers.0.w"))
        self.st = self.weight._hq
        self.out = None

    def unshard(self, w: torch.Tensor, plan, out: torch.Tensor | None = None, dtype: torch.dtype = DTYPE) -> dict:
        shard = dim0_chunks(SHAPE, 1)[0]
        parts = quantize_shard(self.q, w, shard, plan.send)
        payload, meta = build_payload(self.q, parts, shard, [shard], SHAPE, w.device, memo=self.st.payload_layouts)
        if out is not None:
            self.out = out
        elif self.out is None or self.out.numel() != payload.numel():  # (FSDP2 allocates new outputs then)
            self.out = torch.empty(payload.numel(), dtype=torch.uint8)
        self.out.untyped_storage().resize_(payload.numel())  # (FSDP2 allocates the output before the gather)
        self.out.copy_(payload)
        for t in self.st.inner:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        self.weight._post_all_gather((self.out,), GatherMetadata(meta, plan, dtype, self.q))
        return {d: self.st.parts[d] for d in plan.materialize}

    def reshard(self) -> None:
        for t in self.st.inner:
            t.untyped_storage().resize_(0)
        self.out.untyped_storage().resize_(0)


def _fresh(q, w, plan) -> dict:
    return _Unshards(q).unshard(w, plan)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_replayed_fills_equal_fresh_fills(name):
    """Forward and backward unshards alternating, the weight's values changing between them: every unshard's parts
    equal those a weight state seeing its first unshard fills; a per-tensor FP8 or 128x128-tile forward (data
    aliasing the output, the scale copied) and backward (columnwise derived into its own buffers) are replayed from
    their second unshard on."""
    q = QUANTIZERS[name]()
    un = _Unshards(q)
    fwd, bwd = _plan(q, "forward"), _plan(q, "backward")
    for step in range(3):
        for plan in (fwd, bwd):
            w = _weight(SHAPE, seed=10 * step + len(plan.materialize[0]))
            got = un.unshard(w, plan)
            want = _fresh(q, w, plan)
            for d in plan.materialize:
                assert_parts_equal(got[d], want[d], f"{name}, step {step}, {d}: a replayed / kept fill")
            un.reshard()
    if name in DERIVED_IN_PLACE:  # (forward unshards 2, 3 and backward unshards 2, 3)
        got = (un.st.counters["fill_replayed"], un.st.counters["derived_in_place"])
        assert got == (4, 2), (f"{name}: (replayed fills, in-place derivations) {got}, not (4, 2): unshards 2 and 3 "
                               f"of each plan were filled as usual: {dict(un.st.counters)}")


def _replayable():
    q = FORMATS["fp8_e4m3"]()
    un = _Unshards(q)
    fwd = _plan(q, "forward")
    un.unshard(_weight(SHAPE, seed=1), fwd)
    un.reshard()
    return q, un, fwd


def test_a_new_all_gather_output_is_aliased_again():
    """FSDP2 allocates new all-gather outputs (the payload changed size elsewhere, `renew_all_gather_outputs`): the
    unsharded weight's data points at the new output, not at the one a replay would assume."""
    q, un, fwd = _replayable()
    w = _weight(SHAPE, seed=2)
    new_out = torch.empty_like(un.out)
    got = un.unshard(w, fwd, out=new_out)[R]
    assert got.data.untyped_storage().data_ptr() == new_out.untyped_storage().data_ptr(), \
        "the gathered data still points at the old all-gather output"
    assert_parts_equal(got, _fresh(q, w, fwd)[R], "after a new all-gather output")
    assert un.st.counters["fill_replayed"] == 0


def test_a_re_pointed_own_tensor_is_filled_again():
    """An own tensor given its own storage since (a lazy gather of the direction fills it by copy) no longer aliases
    the output: the next unshard points it there again instead of replaying, and reads the new bytes."""
    q, un, fwd = _replayable()
    st = un.st
    old = _fresh(q, _weight(SHAPE, seed=3), fwd)[R]
    for t in st.inner:
        t.untyped_storage().resize_(t.numel() * t.element_size())
    st.fill(R, old)  # (as state.ensure does: no alias, the aliased tensor gets its own storage)
    w = _weight(SHAPE, seed=4)
    got = un.unshard(w, fwd)[R]
    assert got.data.untyped_storage().data_ptr() == un.out.untyped_storage().data_ptr(), \
        "the re-pointed data tensor was not aliased to the all-gather output again"
    assert_parts_equal(got, _fresh(q, w, fwd)[R], "after a lazy fill re-pointed the own tensor")
    assert st.counters["fill_replayed"] == 0


def test_another_quantizer_is_never_replayed():
    """The same output storage and plan with another quantizer (e5m2 data into an e4m3 weight) fills as usual: the
    mismatch is refused, naming the weight's direction and both dtypes, instead of aliasing the new bytes as e4m3."""
    q, un, fwd = _replayable()
    un.q = FORMATS["fp8_e5m2_pow2"]()
    with pytest.raises(RuntimeError, match=r"gathered rowwise data is \(64, 128\) torch.float8_e5m2"):
        un.unshard(_weight(SHAPE, seed=5), fwd)
    assert un.st.counters["fill_replayed"] == 0


# ---- a derived direction replayed in place (the backward unshard of per-tensor FP8 / 128x128 tiles) -----------

def _derived_replayable(name: str):
    """A weight whose backward unshard (rowwise gathered, columnwise derived) was filled once as usual and recorded."""
    q = QUANTIZERS[name]()
    un = _Unshards(q)
    bwd = _plan(q, "backward")
    assert bwd.derive and bwd.materialize == (C,), f"{name}: the backward plan {bwd} derives no columnwise form"
    un.unshard(_weight(SHAPE, seed=1), bwd)
    un.reshard()
    return q, un, bwd


@pytest.mark.parametrize("name", DERIVED_IN_PLACE)
def test_derived_direction_is_written_into_its_own_storage(name):
    """A replayed backward unshard writes the transpose into the storage the own columnwise tensors already hold
    (FSDP2 allocated it before the hook): no fresh allocation adopted, the storage the same one, its bytes the
    fresh fill's."""
    q, un, bwd = _derived_replayable(name)
    own = [t for t in un.st.parts[C].tensors().values() if t is not None]
    before = [storage_id(t) for t in own]
    adopted = un.st.counters["adopted"]
    w = _weight(SHAPE, seed=2)
    got = un.unshard(w, bwd)[C]
    assert un.st.counters["derived_in_place"] == 1, f"{name}: not replayed: {dict(un.st.counters)}"
    assert un.st.counters["adopted"] == adopted, f"{name}: the replay adopted a fresh allocation"
    assert [storage_id(t) for t in own] == before, f"{name}: an own columnwise tensor was given another storage"
    assert_parts_equal(got, _fresh(q, w, bwd)[C], f"{name}: the columnwise form derived in place")


@pytest.mark.parametrize("name", DERIVED_IN_PLACE)
def test_derived_storage_given_elsewhere_is_not_written(name):
    """The own columnwise data given another storage since the recorded fill (as an adopting fill or a caller's
    `set_` does): the replay, which would write into the recorded storage, is refused; the unshard fills as usual and
    the part holds this unshard's bytes."""
    q, un, bwd = _derived_replayable(name)
    data = un.st.parts[C].data
    old = data.untyped_storage()
    data.set_(torch.empty_like(data))
    un.st.inner[:] = [t for t in un.st.inner]  # (FSDP2 allocates whatever storage its inner tensors hold)
    w = _weight(SHAPE, seed=3)
    got = un.unshard(w, bwd)[C]
    assert un.st.counters["derived_in_place"] == 0, f"{name}: replayed into a storage given elsewhere"
    assert old.nbytes() == 0, f"{name}: the storage the record named was written ({old.nbytes()} bytes allocated)"
    assert_parts_equal(got, _fresh(q, w, bwd)[C], f"{name}: after the own storage changed")


@pytest.mark.parametrize("name", DERIVED_IN_PLACE)
def test_derived_storage_not_allocated_is_not_written(name):
    """The own columnwise storage freed and not allocated again before the hook (FSDP2 did not list it as an inner
    tensor of this unshard): no replay writes into the freed storage; the unshard fills as usual."""
    q, un, bwd = _derived_replayable(name)
    w = _weight(SHAPE, seed=4)
    un.st.inner[:] = []  # (so `_Unshards.unshard` allocates nothing before the hook)
    un.st._inner_of.clear()
    real_set_inner = un.st.set_inner
    un.st.set_inner = lambda dirs: None  # (the hook lists nothing either)
    try:
        got = un.unshard(w, bwd)[C]
    finally:
        un.st.set_inner = real_set_inner
    assert un.st.counters["derived_in_place"] == 0, f"{name}: replayed into freed storage"
    assert_parts_equal(got, _fresh(q, w, bwd)[C], f"{name}: with its storage not allocated")


@pytest.mark.parametrize("name", DERIVED_IN_PLACE)
def test_derived_direction_from_a_new_all_gather_output(name):
    """FSDP2 allocates new all-gather outputs: the backward unshard derives from the new output's bytes, not by a
    replay that assumes the old one."""
    q, un, bwd = _derived_replayable(name)
    w = _weight(SHAPE, seed=5)
    got = un.unshard(w, bwd, out=torch.empty_like(un.out))[C]
    assert un.st.counters["fill_replayed"] == 0 and un.st.counters["derived_in_place"] == 0
    assert_parts_equal(got, _fresh(q, w, bwd)[C], f"{name}: after a new all-gather output")


@pytest.mark.parametrize("name", DERIVED_IN_PLACE)
def test_derived_direction_keeps_non_finite_values(name):
    """inf / NaN in the weight: the columnwise form derived in place is bitwise the fresh fill's (NaN kept)."""
    q, un, bwd = _derived_replayable(name)
    w = _weight(SHAPE, seed=6)
    w[3, 5], w[10, 7], w[40, 100] = float("nan"), float("inf"), float("-inf")
    got = un.unshard(w, bwd)[C]
    assert un.st.counters["derived_in_place"] == 1, f"{name}: not replayed: {dict(un.st.counters)}"
    want = _fresh(q, w, bwd)[C]
    assert_parts_equal(got, want, f"{name}: non-finite weight")
    assert torch.isnan(got.data.float()).any(), f"{name}: the NaN did not survive"


def test_another_gather_dtype_is_not_derived_by_replay():
    """The same output, layout and plan with another gather dtype in the metadata: filled as usual."""
    q, un, bwd = _derived_replayable("fp8")
    w = _weight(SHAPE, seed=7)
    got = un.unshard(w, bwd, dtype=torch.float16)[C]
    assert un.st.counters["derived_in_place"] == 0, "replayed a derivation recorded for another gather dtype"
    assert_parts_equal(got, _fresh(q, w, bwd)[C], "fp8: after the gather dtype changed")
