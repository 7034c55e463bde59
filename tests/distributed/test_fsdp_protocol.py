"""In-process tests of the FSDP buffer protocol and sharded quantization (no process group needed): ranks are
simulated by quantizing each shard, MAX-reducing the statistics and concatenating the payloads, which is
exactly what the all-reduce and all-gather do."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hybridq
from hybridq import Float8Quantizer, HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer
from hybridq.distributed import (HybridWeight, PrecomputedScales, apply_hybrid_fsdp, bytes_table, gather_bytes_per_step,
                                 precompute_scales)
from hybridq.distributed.plan import make_plan
from hybridq.distributed.payload import assemble_parts, build_payload, quantize_shard
from hybridq.formats._sharding import RowShard, dim0_chunks

from _format_cases import FORMATS, hybrid
from _jobs import assert_parts_equal

QUANTIZERS = {  # cases of tests/_format_cases.py
    "fp8": FORMATS["fp8_e4m3"],
    "fp8_e5m2_pow2": FORMATS["fp8_e5m2_pow2"],
    "fp8block_2d": FORMATS["fp8blk_128x128_e4m3"],
    "fp8block_1d": FORMATS["fp8blk_1x128_e4m3"],
    "mxfp8": FORMATS["mxfp8_e4m3"],
    "mxfp8_2d": FORMATS["mxfp8_32x32_e4m3"],
    "nvfp4": FORMATS["nvfp4"],
    "nvfp4_2d": FORMATS["nvfp4_16x16"],
    "identity": FORMATS["identity"],
    "hyb_mxfp8_nvfp4": hybrid("mxfp8_e4m3", "nvfp4"),
    "hyb_fp8block_mxfp8": hybrid("fp8blk_128x128_e4m3", "mxfp8_e4m3"),
    "hyb_fp8_identity": hybrid("fp8_e4m3", "identity"),
    "hyb_nvfp4_2d_mxfp8_2d": hybrid("nvfp4_16x16", "mxfp8_32x32_e4m3"),
}
# multiples of 32 rows whose shards (up to 5 ranks) split 16/32/128-row blocks and tiles
ALIGNED_SHAPES = [(96, 64), (160, 32), (288, 64), (32, 32)]
# any row count: formats with partial blocks
ANY_ROWS = {"fp8", "fp8_e5m2_pow2", "fp8block_2d", "fp8block_1d", "identity", "hyb_fp8_identity"}
ODD_SHAPES = [(1, 32), (3, 130), (257, 200), (801, 64)]


def simulate_gather(q, w, world_size, directions=("rowwise", "columnwise")):
    shards = dim0_chunks(tuple(w.shape), world_size)
    xs = [w[s.offset:s.end] for s in shards]
    stats = None
    if world_size > 1:
        local = [q.shard_stats(x, s) for x, s in zip(xs, shards)]
        stats = None if local[0] is None else torch.stack(local).amax(0)  # the MAX all-reduce
    payloads, metas = [], []
    for x, s in zip(xs, shards):
        p, m = build_payload(q, quantize_shard(q, x, s, directions, stats), s, shards, tuple(w.shape), x.device)
        payloads.append(p)
        metas.append(m)
    assert len({p.numel() for p in payloads}) == 1, "ranks disagree on the payload size"
    return assemble_parts(metas[0], torch.stack(payloads))  # the all-gather


def _weight(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)
    return w.to(dtype)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_simulated_sharding_invariance(name):
    q = QUANTIZERS[name]()
    shapes = ALIGNED_SHAPES + (ODD_SHAPES if name in ANY_ROWS else [])
    for shape in shapes:
        w = _weight(shape)
        r, c = q.quantize_parts(w, True, True)
        for ws in (1, 2, 3, 4, 5):
            got = simulate_gather(q, w, ws)
            assert_parts_equal(got["rowwise"], r, f"{name} {shape} ws={ws} rowwise")
            assert_parts_equal(got["columnwise"], c, f"{name} {shape} ws={ws} columnwise")


def test_simulated_invariance_special_cases():
    cases = [
        (NVFP4Quantizer(rht=True), (64, 32), (2, 4)),  # RHT groups of 16 rows stay within a shard
        (NVFP4Quantizer(), (48, 32), (7,)),  # odd shard lengths (a pad nibble in the shard part)
        (NVFP4Quantizer(block_2d=True), (48, 32), (7,)),
        (MXFP8Quantizer(), (64, 64), (5,)),
        (Float8Quantizer(), (96, 64), (2, 3)),
        (HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise_source="rowwise_dequantized"), (96, 64),
         (1, 2)),
    ]
    for q, shape, sizes in cases:
        for dtype in (torch.bfloat16, torch.float32):
            w = _weight(shape, dtype=dtype)
            r, c = q.quantize_parts(w, True, True)
            for ws in sizes:
                got = simulate_gather(q, w, ws, ("rowwise",))
                assert_parts_equal(got["rowwise"], r, f"{q.describe()} {shape} ws={ws}")
                if q.derive_part(r, "columnwise", dtype) is None:
                    got = simulate_gather(q, w, ws, ("columnwise",))
                    assert_parts_equal(got["columnwise"], c, f"{q.describe()} {shape} ws={ws} columnwise")


def test_rht_rejects_split_groups():
    q = NVFP4Quantizer(rht=True)
    w = _weight((48, 32))
    with pytest.raises(ValueError, match="Hadamard"):
        simulate_gather(q, w, 2, ("columnwise",))  # 24-row shards split a 16-row group


@pytest.mark.parametrize("name", ["fp8", "fp8block_2d", "mxfp8_2d", "nvfp4_2d", "identity"])
def test_derive_part_is_exact(name):
    q = QUANTIZERS[name]()
    w = _weight((96, 64))
    r, c = q.quantize_parts(w, True, True)
    assert_parts_equal(q.derive_part(r, "columnwise", w.dtype), c, f"{name} rowwise -> columnwise")
    assert_parts_equal(q.derive_part(c, "rowwise", w.dtype), r, f"{name} columnwise -> rowwise")


def test_derive_part_double_quantization_and_none():
    q = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), columnwise_source="rowwise_dequantized")
    w = _weight((96, 64))
    r, c = q.quantize_parts(w, True, True)
    assert_parts_equal(q.derive_part(r, "columnwise", w.dtype), c, "double quantization")
    for name in ("mxfp8", "nvfp4", "fp8block_1d", "hyb_mxfp8_nvfp4"):
        q = QUANTIZERS[name]()
        r, _ = q.quantize_parts(w, True, False)
        assert q.derive_part(r, "columnwise", w.dtype) is None, name


def test_row_shards_match_fsdp_chunking():
    shards = dim0_chunks((5, 8), 4)  # torch.chunk: 2, 2, 1, then an empty shard
    assert [(s.offset, s.length) for s in shards] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert shards[0].cuts == (2, 4)
    s = RowShard(300, 150, 150, (150,))
    assert s.cut_blocks(128) == (1,) and s.owned(128) == (2, 3) and s.touched(128) == (1, 3)
    assert dim0_chunks((4, 3, 8), 2)[1] == RowShard(12, 6, 6, (6,))  # N-D: rows = prod(shape[:-1])


def test_plan():
    R, C = "rowwise", "columnwise"
    p = make_plan(phase="forward", reshard_after_forward=True, backward_override=None, derivable=False, known=True)
    assert (p.send, p.materialize, p.deferred, p.derive) == ((R,), (R,), (C,), False)
    p = make_plan(phase="backward", reshard_after_forward=True, backward_override=None, derivable=False, known=True)
    assert (p.send, p.materialize) == ((C,), (C,))
    p = make_plan(phase="backward", reshard_after_forward=True, backward_override=None, derivable=True, known=True)
    assert (p.send, p.materialize, p.derive) == ((R,), (C,), True)  # derived after the gather, not sent
    p = make_plan(phase="forward", reshard_after_forward=False, backward_override=None, derivable=False, known=True)
    assert (p.send, p.materialize) == ((R, C), (R, C))
    p = make_plan(phase="forward", reshard_after_forward=True, backward_override="dequantized", derivable=False,
                  known=True)
    assert (p.send, p.materialize, p.deferred) == ((R,), (R,), ())
    p = make_plan(phase="backward", reshard_after_forward=True, backward_override="dequantized", derivable=False,
                  known=True)
    assert (p.send, p.materialize) == ((R,), (R,))
    # FSDP2 internals unknown: conservative, constant payload
    p1 = make_plan(phase="forward", reshard_after_forward=None, backward_override=None, derivable=False, known=False)
    p2 = make_plan(phase="backward", reshard_after_forward=None, backward_override=None, derivable=False, known=False)
    assert p1.send == p2.send == (R, C) and p1.materialize == (R, C)
    # high_precision: backward gathers the param_dtype shard; gathered in the same unshard as the rowwise form,
    # the rowwise form is quantized from it on every rank instead of being sent too
    H = "high_precision"
    for derivable in (False, True):
        p = make_plan(phase="forward", reshard_after_forward=True, backward_override=H, derivable=derivable,
                      known=True)
        assert (p.send, p.materialize, p.deferred, p.local, p.derive) == ((R,), (R,), (H,), (), False)
        p = make_plan(phase="backward", reshard_after_forward=True, backward_override=H, derivable=derivable,
                      known=True)
        assert (p.send, p.materialize, p.local, p.derive) == ((H,), (H,), (), False)
        p = make_plan(phase="forward", reshard_after_forward=False, backward_override=H, derivable=derivable,
                      known=True)
        assert (p.send, p.materialize, p.local, p.derive) == ((H,), (R, H), (R,), False)
        p = make_plan(phase="backward", reshard_after_forward=True, backward_override=H, derivable=derivable,
                      known=True, backward_extra={R})  # activation recompute / no reshard after backward
        assert (p.send, p.materialize, p.local) == ((H,), (R, H), (R,))
    p1 = make_plan(phase="forward", reshard_after_forward=None, backward_override=H, derivable=False, known=False)
    p2 = make_plan(phase="backward", reshard_after_forward=None, backward_override=H, derivable=False, known=False)
    assert p1.send == p2.send == (H,) and p1.local == (R,)


def test_delayed_scaling_rejected():
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="delayed scaling"):
        apply_hybrid_fsdp(model, hybridq.recipe("fp8_delayed"))
    assert type(model[0]) is nn.Linear  # nothing converted


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "mxfp8_fwd_nvfp4_bwd", "nvfp4"])
def test_unsharded_model_matches_plain_conversion(preset):
    """Without fully_shard the wrapped weights behave like plain parameters and precompute_scales is a no-op."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32), nn.GELU(), nn.Linear(32, 32))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    hybridq.convert_linears(a, hybridq.recipe(preset))
    apply_hybrid_fsdp(b, hybridq.recipe(preset))
    assert isinstance(b[0].weight, HybridWeight)
    x = torch.randn(32, 64)
    for model in (a, b):
        torch.manual_seed(1)
        model(x).float().pow(2).mean().backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), n
    assert precompute_scales(b) == PrecomputedScales(weights=0, values=0, all_reduces=0)
    sd = b.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    for (n, pa) in a.state_dict().items():
        assert torch.equal(pa, sd[n]), n


def test_apply_is_idempotent_and_skips_tied_weights():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight = model[0].weight  # tied
    apply_hybrid_fsdp(model, hybridq.recipe("fp8_tensorwise"))
    assert not isinstance(model[0].weight, HybridWeight) and model[0].weight is model[1].weight
    model = nn.Sequential(nn.Linear(32, 32))
    apply_hybrid_fsdp(model, hybridq.recipe("fp8_tensorwise"))
    w = model[0].weight
    apply_hybrid_fsdp(model, hybridq.recipe("fp8_tensorwise"))
    assert model[0].weight is w


def test_bytes_per_step_table(summary_table):
    """Per-rank all-gather bytes of one weight per training step (forward + backward re-gather), each preset
    vs bf16 FSDP2; the table goes to the terminal summary."""
    table = bytes_table(shapes=((4096, 4096), (50257, 4096)), world_size=2)
    summary_table("FSDP2 all-gather bytes per weight element per step (2 ranks, reshard_after_forward=True)", table)
    expected = {"fp8_tensorwise": 0.5, "fp8_block": 0.5, "mxfp8": 0.515625, "nvfp4": 0.251953125,
                "mxfp8_fwd_nvfp4_bwd": 0.3984375, "fp8_block_fwd_mxfp8_bwd": 0.5078125,
                "fp8_fwd_high_precision_bwd": 0.75}
    for preset, ratio in expected.items():
        q = hybridq.recipe(preset).quantizer(hybridq.Role("linear", "weight"))
        r = gather_bytes_per_step(q, (4096, 4096), 2)
        assert r.ratio == pytest.approx(ratio, abs=1e-4), (preset, r)
        assert r.total < r.bf16_total
    # backward_override="high_precision": forward sends the rowwise form, backward the bf16 shard (2 bytes per
    # element); without reshard after forward only the bf16 shard is sent (the rowwise form is quantized from it)
    hp = {"fp8_tensorwise": 0.75, "mxfp8": 0.7578125, "nvfp4": 0.6259765625, "mxfp8_fwd_nvfp4_bwd": 0.7578125}
    for preset, ratio in hp.items():
        q = hybridq.recipe(preset).quantizer(hybridq.Role("linear", "weight"))
        r = gather_bytes_per_step(q, (4096, 4096), 2, backward_override="high_precision")
        assert r.ratio == pytest.approx(ratio, abs=1e-4), (preset, r)
        assert (r.forward_sends, r.backward_sends, r.backward) == (("rowwise",), ("high_precision",), 4096 * 2048 * 2)
        r = gather_bytes_per_step(q, (4096, 4096), 2, backward_override="high_precision", reshard_after_forward=False)
        assert (r.forward_sends, r.backward, r.ratio) == (("high_precision",), None, 1.0), (preset, r)
    # an unevenly sharded vocabulary projection still sends one byte per element for FP8 tensorwise / 128x128
    for preset in ("fp8_tensorwise", "fp8_block"):
        q = hybridq.recipe(preset).quantizer(hybridq.Role("linear", "weight"))
        assert gather_bytes_per_step(q, (50257, 4096), 2).ratio == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_pre_all_gather_hook_signature_is_not_rebuilt_per_call(kind):
    """FSDP2 calls inspect.signature on the weight's fsdp_pre_all_gather at every all-gather: the hook carries its
    five-parameter signature (one object for every call, nothing built per unshard; a bound method would build a
    new Signature each time)."""
    import inspect

    from hybridq.distributed import GroupedHybridWeight

    w = HybridWeight(torch.zeros(8, 4)) if kind == "linear" else GroupedHybridWeight(torch.zeros(2, 8, 4))
    first, second = inspect.signature(w.fsdp_pre_all_gather), inspect.signature(w.fsdp_pre_all_gather)
    assert list(first.parameters) == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"], first
    assert first is second, "inspect.signature built a new Signature for the second call"


def _counting_pytree(monkeypatch) -> list:
    """Count the pytree traversals HybridWeight's dispatch makes (its fallback for arguments nested deeper than the
    aten ops' flat lists)."""
    from hybridq.distributed import weights

    calls = []
    real = weights.pytree.tree_map_only

    class _Pytree:
        def __getattr__(self, name):
            return getattr(torch.utils._pytree, name)

        @staticmethod
        def tree_map_only(*args, **kwargs):
            calls.append(args[0])
            return real(*args, **kwargs)
    monkeypatch.setattr(weights, "pytree", _Pytree())
    return calls


def test_weight_ops_of_the_optimizer_unwrap_without_pytree(monkeypatch):
    """The optimizer's foreach ops over every parameter (lists of sharded HybridWeights and plain tensors) and the
    view / copy ops FSDP2 applies run on the plain tensors with no pytree traversal of their arguments (~0.4 ms per
    foreach op over ~60 parameters), with the results of plain tensors: in-place updates land in the wrapped tensors,
    a view stays a HybridWeight of the same state."""
    calls = _counting_pytree(monkeypatch)
    torch.manual_seed(0)
    plain = [torch.randn(8, 4) for _ in range(6)]
    other = [torch.randn(8, 4) for _ in range(6)]
    ws = [HybridWeight(p.clone()) for p in plain]
    torch._foreach_mul_(ws, 0.5)
    torch._foreach_addcdiv_(ws, other, [o.abs() + 1 for o in other], value=-0.1)
    torch._foreach_mul_(plain, 0.5)
    torch._foreach_addcdiv_(plain, other, [o.abs() + 1 for o in other], value=-0.1)
    for i, (w, p) in enumerate(zip(ws, plain)):
        assert torch.equal(w._data, p), f"weight {i}: foreach update differs from the plain tensors' by " \
                                        f"{(w._data - p).abs().max().item()}"
    v = ws[0].view(4, 8)
    assert isinstance(v, HybridWeight) and v._hq is ws[0]._hq and torch.equal(v._data, plain[0].view(4, 8))
    ws[1].copy_(other[1])
    assert torch.equal(ws[1]._data, other[1])
    assert not calls, f"pytree traversed the arguments of {len(calls)} weight op(s)"


def test_weight_op_arguments_unwrap_as_pytree_does():
    """The flat unwrap of HybridWeight's dispatch gives exactly what a pytree traversal gives (same tensors in the same
    places, the first weight met first) for the argument forms aten ops take, and declines anything nested deeper
    (then the pytree traversal runs)."""
    from torch.utils import _pytree as pytree

    from hybridq.distributed.weights import _unwrap_shallow

    ws = [HybridWeight(torch.randn(4, 4)) for _ in range(3)]
    t = torch.randn(4, 4)
    cases = [((ws, [t, t], 0.5), {}), ((ws[0], [2, 8]), {}), ((ws[0], (1, 2), None), {"dim": 0, "other": ws[1]}),
             ((ws[2], t), {"alpha": 2})]
    for args, kwargs in cases:
        seen_fast, seen_tree = [], []
        fast = _unwrap_shallow(args, kwargs, lambda w: seen_fast.append(w) or w._data)
        tree = pytree.tree_map_only(HybridWeight, lambda w: seen_tree.append(w) or w._data, (args, kwargs))
        assert fast is not None, f"flat arguments {args}, {kwargs} were declined"
        flat_fast, flat_tree = pytree.tree_leaves(fast), pytree.tree_leaves(tree)
        assert len(flat_fast) == len(flat_tree) and all(a is b for a, b in zip(flat_fast, flat_tree)), \
            f"unwrapped arguments differ for {args}, {kwargs}"
        assert [id(w) for w in seen_fast] == [id(w) for w in seen_tree], "weights met in another order"
    for nested in (((ws[0], [[1, 2]]), {}), ((t,), {"x": [ws[0], 3]}), ((ws[0], {"a": ws[1]}), {})):
        assert _unwrap_shallow(*nested, lambda w: w._data) is None, f"nested arguments {nested} were not declined"


def test_grouped_deferred_directions_reach_every_expert():
    """The directions a grouped weight's unshard defers to backward are every expert's (each expert's lazy gather
    reads them), also when an unshard repeats the previous directions and after the experts' states are made anew."""
    from hybridq.distributed.state import GroupedWeightState
    from hybridq.formats import COLUMNWISE

    q = FORMATS["fp8_e4m3"]()
    st = GroupedWeightState(name="moe.w1")
    st.is_derivable((q,) * 3, (8, 32), torch.bfloat16)  # (makes the experts' states)
    for dirs in [(COLUMNWISE,), (COLUMNWISE,), (), (COLUMNWISE,)]:
        st.set_deferred(dirs)
        got = [set(e.deferred) for e in st.experts]
        assert got == [set(dirs)] * 3 and set(st.deferred) == set(dirs), f"deferred {dirs}: experts hold {got}"
    st.experts = []
    st.is_derivable((q,) * 3, (8, 32), torch.bfloat16)  # new expert states, same directions as the last unshard
    st.set_deferred((COLUMNWISE,))
    got = [set(e.deferred) for e in st.experts]
    assert got == [{COLUMNWISE}] * 3, f"new expert states hold {got}"
