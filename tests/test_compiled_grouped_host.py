"""Host work of the compiled GroupedLinear ops' bodies per call (issue 30: the compiled fp8_tensorwise MoE job is
host-bound), and that what they keep between calls is never stale:

- the token counts' device check and the groups' bounds ([Note: counts checked in the graph]): computed in the
  compiled graph (the check for counts on a GPU) and handed to the forward op, which asserts the check -- one aten op
  per call in the op's groups where a layer's first call issued twelve (an int64 copy of the compiled router's int32
  counts, five ops of the check, the assert, five for the bounds), none in backward (the forward's bounds, saved);
  the rule and the bounds are the groups' own; groups holding a graph's buffers are never kept between calls;
- int32 counts are kept as they are: the groups' bounds are those of the int64 counts."""

from __future__ import annotations

import pytest
import torch

from _dispatch import OpLog
from hybridq.nn.grouped_jagged import TokenGroups, counts_valid, group_bounds

META = torch.device("meta")
# (counts, tokens, valid): empty groups, one group, every row in one group, negative, sums off by one either way
COUNT_CASES = [([5, 0, 17, 42], 64, True), ([0, 0, 0, 0], 0, True), ([64], 64, True), ([0, 64, 0], 64, True),
               ([10, -1, 55], 64, False), ([-5, 69], 64, False), ([10, 1, 1], 64, False), ([33, 32], 64, False),
               ([0, 0], 1, False)]
INT_DTYPES = [torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("counts, tokens, valid", COUNT_CASES, ids=[str(c[:2]) for c in COUNT_CASES])
def test_counts_valid_is_the_host_rule(counts, tokens, valid, dtype):
    got = counts_valid(torch.tensor(counts, dtype=dtype), tokens)
    assert got.dtype == torch.bool and got.dim() == 0, f"counts_valid gave a {got.dim()}-D {got.dtype} tensor"
    assert bool(got) is valid, f"counts {counts} ({dtype}) for {tokens} tokens: counts_valid {bool(got)}, rule {valid}"


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_device_counts_checked_by_the_graph_cost_the_op_one_aten_op(dtype):
    """Counts not on the CPU (meta here, as a GPU's: the host does not read them): with the graph's check given, the
    groups' build issues the assert alone (before: seven ops for the compiled router's int32 counts); without it, the
    check's five ops and the assert, and no copy of int32 or int64 counts."""
    counts = torch.empty(4, dtype=dtype, device=META)
    valid = counts_valid(counts, 64)
    with OpLog() as given:
        TokenGroups._build(counts, 64, META, "moe", valid)
    assert given.ops == ["aten._assert_async.msg"], f"build with the graph's check issued {given.ops}"
    with OpLog() as own:
        TokenGroups._build(counts, 64, META, "moe")
    assert own.ops == ["aten.ge.Scalar", "aten.all.default", "aten.sum.default", "aten.eq.Scalar",
                       "aten.bitwise_and.Tensor", "aten._assert_async.msg"], \
        f"build with its own check issued {own.ops}"


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_device_counts_with_the_graphs_check_and_bounds_cost_the_op_one_aten_op(dtype):
    """With the graph's bounds too, reading the groups' ends, padded ends and rows' groups issues nothing (before:
    cumsum, add, bitwise_and, cumsum, searchsorted on the first quantize of each MoE layer); backward (the forward's
    bounds, no check of its own) issues nothing at all."""
    counts = torch.empty(4, dtype=dtype, device=META)
    valid, bounds = counts_valid(counts, 64), group_bounds(counts, 64)
    for check, want in ((valid, ["aten._assert_async.msg"]), (None, [])):
        with OpLog() as given:
            groups = TokenGroups.with_bounds(counts, 64, META, bounds, check, "moe")
            got = [groups.ends, groups.padded_ends, groups.row_group]
        assert given.ops == want, \
            f"groups with the graph's bounds (check given: {check is not None}) issued {given.ops}"
        assert all(a is b for a, b in zip(got, bounds)), "the groups did not take the graph's bounds"


def test_groups_with_the_graphs_bounds_are_never_kept():
    """A graph's buffers are intact only for the call that gets them (Inductor reuses a buffer once its last reader
    ran): groups holding them are not kept for a later call, unlike `build`'s."""
    from hybridq.nn import grouped_jagged
    counts = torch.empty(4, dtype=torch.int32, device=META)
    before = dict(grouped_jagged._BUILT)
    TokenGroups.with_bounds(counts, 64, META, group_bounds(counts, 64), counts_valid(counts, 64), "moe")
    assert grouped_jagged._BUILT == before, "groups holding the graph's bounds were kept"


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("counts", [c for c, _, ok in COUNT_CASES if ok], ids=str)
def test_group_bounds_are_the_groups_own(counts, dtype):
    t = torch.tensor(counts, dtype=dtype)
    lazy = TokenGroups(t, sum(counts), None)
    want = {"ends": torch.tensor(counts).cumsum(0).int(),
            "padded_ends": ((torch.tensor(counts) + 15) // 16 * 16).cumsum(0).int(),
            "row_group": torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts))}
    for (what, w), g in zip(want.items(), group_bounds(t, sum(counts))):
        assert g.dtype == torch.int32 and torch.equal(g, w), f"{what} of {counts}: graph's {g.tolist()}, want {w}"
        lz = getattr(lazy, what)
        assert lz.dtype == torch.int32 and torch.equal(lz, w), f"{what} of {counts}: groups' {lz.tolist()}, want {w}"


def test_the_compiled_graph_hands_each_grouped_op_its_routings_bounds_computed_once():
    """Every grouped op of the compiled graph gets the bounds (CPU counts: no device check), and with Inductor's
    partitioner (its CSE) the projections of one routing share one computation of them."""
    import sys
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_grouped_compile import D, SPLITS, MoEBlock
    from _aot_graphs import recording_backend
    forward, backward = [], []
    torch._dynamo.reset()
    torch.compile(MoEBlock("fp8_tensorwise"), fullgraph=True, backend=recording_backend(forward, backward))(
        torch.randn(sum(SPLITS), D, requires_grad=True), torch.tensor(SPLITS)).sum().backward()
    calls = [n for n in forward[0].graph.nodes if n.target is torch.ops.hybridq.grouped_linear_forward.default]
    inputs = [n for n in forward[0].graph.nodes if n.target is torch.ops.hybridq.jagged_input_quantize.default]
    assert len(calls) == 2 and len(inputs) == 2, \
        f"expected the two GroupedLinears' forward and input quantize ops, got {len(calls)} and {len(inputs)}"
    bounds = [tuple(n.args[6]) for n in calls] + [tuple(n.args[3]) for n in inputs]
    assert all(len(b) == 3 for b in bounds), f"ops without the graph's bounds: {bounds}"
    assert len(set(bounds)) == 1, f"one routing's bounds computed {len(set(bounds))} times: {bounds}"
    assert all(n.args[2] is None for n in inputs), "CPU counts got a device check (the op reads them on the host)"
    ops = [n for n in backward[0].graph.nodes if n.target is torch.ops.hybridq.grouped_linear_backward.default]
    assert len(ops) == 2 and all(len(n.args[2]) == 3 for n in ops), \
        f"the backward ops did not get the forward's bounds: {[n.args[2] for n in ops]}"


def test_int32_counts_are_kept_and_give_the_int64_counts_groups():
    counts = [5, 0, 17, 42, 0, 16]
    c32 = torch.tensor(counts, dtype=torch.int32)
    g32 = TokenGroups._build(c32, sum(counts), torch.device("cpu"), "moe")
    g64 = TokenGroups._build(torch.tensor(counts), sum(counts), torch.device("cpu"), "moe")
    assert g32._counts is c32, "int32 counts were copied"
    for what in ("ends", "padded_ends", "row_group"):
        a, b = getattr(g32, what), getattr(g64, what)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), f"{what}: int32 counts {a}, int64 {b}"
    assert g32.host_sizes() == counts, g32.host_sizes()


def test_small_integer_counts_are_widened():
    """(uint8 counts would overflow the padded bounds' `+ 15`: they are copied to int64 as before.)"""
    g = TokenGroups._build(torch.tensor([250, 3], dtype=torch.uint8), 253, torch.device("cpu"), "moe")
    assert g._counts.dtype == torch.int64 and g.padded_ends.tolist() == [256, 272], (g._counts.dtype, g.padded_ends)


# ---- the gathered ops' weight found through its handle without reading the handle's value ----------------------

class _Owner:
    def __init__(self, weight):
        self.weight = weight


def test_a_handle_finds_its_weight_without_an_aten_op():
    """The compiled ops get the handle tensor `weight_handle` made at every call: its entry is kept on it (before:
    `handle.item()`, an aten op per gathered op call)."""
    from hybridq.nn.weight_handle import weight_handle, weight_of
    w = torch.randn(2, 3)
    owner = _Owner(w)
    handle = weight_handle(owner, lambda o: o.weight)
    with OpLog() as found:
        got = weight_of(handle)
    assert got is w, "the handle named another weight"
    assert found.ops == [], f"finding the weight issued {found.ops}"
    owner.weight = w2 = torch.randn(2, 3)
    assert weight_of(handle) is w2, "the handle served the weight it gave before, not the owner's current one"


def test_a_handle_changed_in_place_or_copied_names_what_its_value_names():
    from hybridq.nn.weight_handle import weight_handle, weight_of
    a, b = _Owner(torch.randn(1)), _Owner(torch.randn(1))
    ha, hb = weight_handle(a, lambda o: o.weight), weight_handle(b, lambda o: o.weight)
    assert weight_of(ha.clone()) is a.weight and weight_of(hb.clone()) is b.weight, "a copy of a handle named another"
    ha.copy_(hb)  # (its value now names b: the kept entry is not served)
    assert weight_of(ha) is b.weight, "a handle changed in place still named its first weight"


def test_a_handle_whose_owner_is_gone_raises():
    from hybridq.nn.weight_handle import weight_handle, weight_of
    owner = _Owner(torch.randn(1))
    handle = weight_handle(owner, lambda o: o.weight)
    del owner
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="is gone"):
        weight_of(handle)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_ops_take_the_graphs_check_and_bounds(device, monkeypatch):
    """Counts on the device (an H100/H200 under Inductor; on the CPU the device-count branch forced, aot_eager): a
    new routing's groups are made by the ops with the graph's bounds in place, the input quantize op's with the
    assert alone, the GEMM op's (which follows it) with nothing; the result is bitwise eager's. (The CPU case runs
    the CUDA branch's Python where CI sees it.)"""
    import sys
    from hybridq.gemm import jagged_fp8_kernels
    from hybridq.nn import compiled_grouped, grouped_jagged
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _compare import assert_bitwise
    from test_grouped_compile import D, SPLITS, MoEBlock
    import hybridq as hq
    backend = "inductor"
    if device == "cpu":
        monkeypatch.setattr(compiled_grouped, "_device_counts", lambda d: True)
        backend = "aot_eager"
    else:
        q = hq.GroupedLinear(1, 64, 64, recipe="fp8_tensorwise").expert_quantizers[0]
        if not torch.cuda.is_available() or jagged_fp8_kernels(torch.device("cuda"), 64, 96, q) is None:
            pytest.skip("needs the CUDA jagged kernels (sm_90, Triton, the built extension)")
    torch.manual_seed(0)
    model = MoEBlock("fp8_tensorwise").to(device, torch.bfloat16)
    x = torch.randn(sum(SPLITS), D, device=device, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        compiled(x, torch.tensor(SPLITS, device=device))  # (compiles)
    made = {"with_bounds": [], "_build": []}

    def recorded(kind):
        real = getattr(grouped_jagged.TokenGroups, kind).__func__

        def make(cls, *args, **kwargs):
            with OpLog() as ops:
                groups = real(cls, *args, **kwargs)
            made[kind].append((ops.ops, [groups._ends, groups._padded_ends, groups._row_group]))
            return groups
        return classmethod(make)

    for kind in made:
        monkeypatch.setattr(grouped_jagged.TokenGroups, kind, recorded(kind))
    counts = torch.tensor([40, 7, 17], device=device)
    with torch.no_grad():
        got = compiled(x, counts)
    monkeypatch.undo()
    assert len(made["with_bounds"]) == 4 and not made["_build"], \
        f"the four forward ops' groups: {len(made['with_bounds'])} with the graph's bounds, {len(made['_build'])} built"
    issued = sorted(ops for ops, _ in made["with_bounds"])
    assert issued == [[], [], ["aten._assert_async.msg"], ["aten._assert_async.msg"]], \
        f"the ops' groups issued {issued} (want the assert in each input quantize op, nothing in the GEMM ops)"
    for _, bounds in made["with_bounds"]:
        assert all(b is not None for b in bounds), "the op's groups did not take the graph's bounds"
    if device == "cuda":
        torch.cuda.synchronize()
    with torch.no_grad():
        assert_bitwise(got, model(x, counts), "compiled with the graph's check and bounds vs eager")
