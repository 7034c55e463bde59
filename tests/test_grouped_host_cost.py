"""Host work of the block-format experts' eager path per call (issue 30: the fp8_block MoE job was host-bound), and
that what is kept between calls is never stale:

- the grouped slot quantize (hybridq/kernels/grouped_slots.py) writes both directions of one quantizer in ONE kernel
  launch (a hybrid whose directions differ: one per direction), and keeps its decision per call configuration
  ([Note: the slot quantize's decision cache]): asked again when the quantizer, dtype, K, slot rows or directions
  change;
- FSDP2's stacked block experts are joined into the packed weight's part by views, kept with the weight's state
  ([Note: joined stacked experts]): no dispatcher op on a later call, rebuilt when the stacked views are others; bitwise
  the experts' parts joined by a copy."""

import copy
import types

import pytest
import torch

from _compare import assert_parts_bitwise
from _dispatch import OpLog
from _gpu import extension_ready
from hybridq.enums import COLUMNWISE, ROWWISE
from hybridq.formats import Float8BlockQuantizer, HybridQuantizer, MXFP8Quantizer
from hybridq.kernels import grouped_slots, triton_slot_quantize
from hybridq.nn import grouped_packed_blocks
from hybridq.nn.grouped_packed import TokenLayout

QUANTIZERS = {
    "fp8_block": lambda: Float8BlockQuantizer(block_dim=1),
    "mxfp8": lambda: MXFP8Quantizer(),
    "hybrid_fp8blk_mxfp8": lambda: HybridQuantizer(rowwise=Float8BlockQuantizer(), columnwise=MXFP8Quantizer()),
    "hybrid_equal_directions": lambda: HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=MXFP8Quantizer()),
}
# launches of the grouped slot quantize for rowwise + columnwise: one where one quantizer makes both directions
BOTH_LAUNCHES = {"fp8_block": 1, "mxfp8": 1, "hybrid_fp8blk_mxfp8": 2, "hybrid_equal_directions": 1}


# ---- the grouped slot quantize: launches and the decision cache -----------------------------------------------------

@pytest.mark.parametrize("case", QUANTIZERS)
def test_slot_quantize_launches_once_per_quantizer_of_the_directions(case):
    q = QUANTIZERS[case]()
    launches = grouped_slots._launches(q, True, True)
    assert len(launches) == BOTH_LAUNCHES[case], f"{case}: launches for both directions {launches}"
    assert sorted((r, c) for _, r, c in launches) == sorted(
        [(True, True)] if BOTH_LAUNCHES[case] == 1 else [(False, True), (True, False)]), f"{case}: {launches}"
    for rowwise, columnwise in ((True, False), (False, True)):
        one = grouped_slots._launches(q, rowwise, columnwise)
        assert [(r, c) for _, r, c in one] == [(rowwise, columnwise)], f"{case} ({rowwise}, {columnwise}): {one}"


class _LookupSpy:
    """The real `lookup_quantize`, its calls counted."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.fixture
def decision_spy(monkeypatch):
    """A fresh decision cache, `_triton()` answering as if Triton were there (its absence is decided before any
    lookup), and a count of the extension lookups the decision makes."""
    monkeypatch.setattr(grouped_slots, "_DECISIONS", {})
    monkeypatch.setattr(grouped_slots, "_triton", lambda: triton_slot_quantize)
    spy = _LookupSpy(grouped_slots.lookup_quantize)
    monkeypatch.setattr(grouped_slots, "lookup_quantize", spy)
    return spy


@pytest.mark.parametrize("case", ["fp8_block", "mxfp8"])
def test_slot_quantize_decision_is_kept_per_call_configuration(decision_spy, case):
    q = QUANTIZERS[case]()
    x = torch.zeros(10, 256, dtype=torch.bfloat16)
    first = grouped_slots._kernel_takes(q, x, 128, True, False)
    asked = decision_spy.calls
    assert asked > 0, f"{case}: the first call of a configuration must ask the extension's lookup"
    assert grouped_slots._kernel_takes(q, x, 128, True, False) == first
    assert decision_spy.calls == asked, f"{case}: the same configuration asked the lookup again"
    # every part of the configuration is its own decision
    for what, call in {"another slot count": lambda: grouped_slots._kernel_takes(q, x, 256, True, False),
                       "another K": lambda: grouped_slots._kernel_takes(q, x[:, :128], 128, True, False),
                       "another dtype": lambda: grouped_slots._kernel_takes(q, x.float(), 128, True, False),
                       "other directions": lambda: grouped_slots._kernel_takes(q, x, 128, True, True),
                       "another quantizer": lambda: grouped_slots._kernel_takes(QUANTIZERS[case](), x, 128, True,
                                                                                False)}.items():
        before = decision_spy.calls
        call()
        assert decision_spy.calls > before, f"{case}: {what} reused a kept decision"


def test_slot_quantize_decision_is_asked_again_for_a_quantizer_changed_in_place(decision_spy):
    q = Float8BlockQuantizer(block_dim=1)
    x = torch.zeros(10, 256, dtype=torch.bfloat16)
    grouped_slots._kernel_takes(q, x, 128, True, False)
    asked = decision_spy.calls
    q.amax_epsilon = 1e-3  # (the same object, another configuration)
    grouped_slots._kernel_takes(q, x, 128, True, False)
    assert decision_spy.calls > asked, "a quantizer changed in place reused the decision kept for its old fields"


def test_slot_quantize_decision_is_not_kept_for_formats_it_does_not_implement(decision_spy):
    """NVFP4 (and hybrids with it) never reach the lookup nor the cache (their quantizers may hold tensors)."""
    from hybridq.formats import NVFP4Quantizer
    x = torch.zeros(10, 256, dtype=torch.bfloat16)
    for q in (NVFP4Quantizer(), HybridQuantizer(rowwise=NVFP4Quantizer(), columnwise=MXFP8Quantizer())):
        assert grouped_slots._kernel_takes(q, x, 128, True, True) is False, q.describe()
    assert decision_spy.calls == 0 and grouped_slots._DECISIONS == {}, "an unimplemented format was looked up / kept"


def test_slot_quantize_decision_cache_is_bounded(decision_spy):
    q = Float8BlockQuantizer(block_dim=1)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    for rows in range(4, 4 * (grouped_slots._MAX_DECISIONS + 10), 4):
        grouped_slots._kernel_takes(q, x, rows, True, False)
    assert len(grouped_slots._DECISIONS) <= grouped_slots._MAX_DECISIONS


GPU = [pytest.mark.gpu, pytest.mark.skipif(not (extension_ready() and triton_slot_quantize.available()),
                                           reason="needs CUDA, the extension and Triton")]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=GPU) for c in QUANTIZERS])
def test_gpu_slot_quantize_of_both_directions_launches_once_per_quantizer_bitwise_the_packed_quantization(
        case, backend, monkeypatch):
    monkeypatch.setitem(grouped_slots.BACKEND, "name", backend)
    q = QUANTIZERS[case]()
    splits = [5, 0, 130, 1, 40]
    dev = torch.device("cuda")
    x = torch.randn(sum(splits), 256, generator=torch.Generator().manual_seed(4)).to(dev, torch.bfloat16)
    layout = TokenLayout.build(splits, [-(-m // 16) * 16 if m else 0 for m in splits], dev, 128)
    launches = []
    real = grouped_slots._launch

    def counted(*args, **kwargs):
        launches.append(args[3:5])
        return real(*args, **kwargs)
    monkeypatch.setattr(grouped_slots, "_launch", counted)
    got = grouped_slots.quantize(q, x, layout.source_rows(dev), True, True)
    assert got is not None, f"{case} ({backend}): the grouped quantize did not take the call"
    assert len(launches) == BOTH_LAUNCHES[case], f"{case} ({backend}): launches (rowwise, columnwise) {launches}"
    want = q.quantize_groups(layout.pack(x), layout.slots, rowwise=True, columnwise=True, name="x")
    for d in (ROWWISE, COLUMNWISE):
        assert_parts_bitwise(got.part(d), want.part(d),
                             f"{case} {d} ({backend}): one launch vs the packed quantization")


# ---- FSDP2's stacked experts joined by views ------------------------------------------------------------------------

E, N, K = 4, 128, 256
WEIGHT_QUANTIZERS = {"fp8_block_tiles": lambda: Float8BlockQuantizer(block_dim=2),
                     "fp8_block_rows": lambda: Float8BlockQuantizer(block_dim=1), "mxfp8": lambda: MXFP8Quantizer()}


def _stacked(case, direction, seed=0):
    """(experts' parts, (expert 0's part, {field: `[E, ...]` view}), the joined buffers): each expert quantized alone,
    its tensors copied into one buffer per field laid out as the packed weight's part (rowwise: experts' rows one
    after another; columnwise: their columns), as FSDP2's stacked gather leaves them."""
    q = WEIGHT_QUANTIZERS[case]()
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed)) * 4.0 ** torch.arange(E)[:, None, None]
    parts = [q.quantize(w[g], rowwise=True, columnwise=True, name=f"w{g}").part(direction) for g in range(E)]
    buffers = grouped_packed_blocks._joined(None, parts)  # (the join by a copy: contiguous buffers)
    views = {}
    for name, t in buffers.tensors().items():
        if t is None:
            continue
        a, b = t.shape
        views[name] = t.view(a, E, b // E).permute(1, 0, 2) if parts[0].columnwise else t.view(E, a // E, b)
    return parts, (parts[0], views), buffers


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("case", WEIGHT_QUANTIZERS)
def test_stacked_experts_joined_by_views_are_bitwise_joined_by_a_copy(case, direction):
    parts, stacked, buffers = _stacked(case, direction)
    got = grouped_packed_blocks._joined_stacked(stacked, E, direction, types.SimpleNamespace())
    assert_parts_bitwise(got, grouped_packed_blocks._joined(None, parts), f"{case} {direction}: views vs copy")
    for name, t in got.tensors().items():
        if t is not None:
            assert t.data_ptr() == buffers.tensors()[name].data_ptr(), f"{case} {direction}: {name} was copied"


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("case", WEIGHT_QUANTIZERS)
def test_stacked_experts_joined_part_is_kept_with_the_weight_state_no_op_on_a_later_call(case, direction):
    _, stacked, _ = _stacked(case, direction)
    owner = types.SimpleNamespace()
    with OpLog() as first:
        joined = grouped_packed_blocks._joined_stacked(stacked, E, direction, owner)
    with OpLog() as later:
        again = grouped_packed_blocks._joined_stacked(stacked, E, direction, owner)
    assert again is joined, f"{case} {direction}: the joined part was rebuilt for the same stacked views"
    # before: every call joined the views (and read every expert's part); now the first only
    assert first.ops, f"{case} {direction}: the first join issued no op (nothing was joined?)"
    assert later.ops == [], f"{case} {direction}: a later call issued {later.ops}"


@pytest.mark.parametrize("case", WEIGHT_QUANTIZERS)
def test_stacked_experts_joined_anew_for_other_views_or_directions(case):
    owner = types.SimpleNamespace()
    _, stacked, _ = _stacked(case, ROWWISE, seed=0)
    old = grouped_packed_blocks._joined_stacked(stacked, E, ROWWISE, owner)
    parts, other, buffers = _stacked(case, ROWWISE, seed=1)  # (the state's views rebuilt: other tensors)
    got = grouped_packed_blocks._joined_stacked(other, E, ROWWISE, owner)
    assert got is not old, f"{case}: other stacked views reused the part joined from the old ones"
    assert_parts_bitwise(got, grouped_packed_blocks._joined(None, parts), f"{case}: joined from the new views")
    cparts, col, _ = _stacked(case, COLUMNWISE)
    got_col = grouped_packed_blocks._joined_stacked(col, E, COLUMNWISE, owner)
    assert got_col.columnwise, f"{case}: the columnwise join returned a rowwise part"
    assert_parts_bitwise(got_col, grouped_packed_blocks._joined(None, cparts), f"{case}: columnwise join")
    assert grouped_packed_blocks._joined_stacked(other, E, ROWWISE, owner) is got, \
        f"{case}: the rowwise part kept for the weight was dropped by its columnwise one"


def test_stacked_experts_without_a_state_are_joined_each_call():
    _, stacked, _ = _stacked("fp8_block_tiles", ROWWISE)
    a = grouped_packed_blocks._joined_stacked(stacked, E, ROWWISE, None)
    b = grouped_packed_blocks._joined_stacked(stacked, E, ROWWISE, None)
    assert a is not b, "a weight without an FSDP2 state (traced) must not keep a joined part"


# ---- the device layout's bounds: made once per routing ---------------------------------------------------------------

def _slot_layout(splits, device):
    from hybridq.nn.grouped_packed import SlotLayout
    dev = torch.device(device)
    return SlotLayout.build(torch.tensor(splits, device=dev), sum(splits), dev, 128, lambda m: m, "moe")


@pytest.mark.parametrize("splits", [[5, 0, 130, 1], [0, 0, 0, 0]], ids=str)
def test_layout_bounds_and_their_table_rows_are_made_once_bitwise_the_table(splits):
    layout = _slot_layout(splits, "cpu")
    bounds = layout.bounds()
    assert layout.bounds() is bounds, "the layout made its bounds again"
    with OpLog() as first:
        gemm_rows, slot_rows = bounds.gemm_rows, bounds.slot_rows
    with OpLog() as later:
        again = bounds.gemm_rows, bounds.slot_rows
    assert first.ops, "the first read of the rows sliced nothing"
    assert later.ops == [], f"a later read of the bounds' rows issued {later.ops}"
    assert again[0] is gemm_rows and again[1] is slot_rows
    assert torch.equal(gemm_rows, layout.table[:3]), f"{splits}: gemm rows {gemm_rows} vs table {layout.table}"
    assert torch.equal(slot_rows[0], layout.table[0]) and torch.equal(slot_rows[1], layout.table[3]), \
        f"{splits}: slot rows {slot_rows} vs table {layout.table}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_projections_of_one_routing_share_the_layout_bounds_until_the_counts_change():
    from hybridq.nn.grouped_packed import SlotLayout
    dev = torch.device("cuda")
    counts = torch.tensor([5, 0, 130, 1], device=dev)
    first = SlotLayout.build(counts, 136, dev, 128, lambda m: m, "moe")
    second = SlotLayout.build(counts, 136, dev, 128, lambda m: m, "moe")
    assert second.bounds() is first.bounds(), "a projection of the same routing made the bounds again"
    counts.copy_(torch.tensor([0, 6, 130, 0], device=dev))  # (in place: another version, another routing)
    third = SlotLayout.build(counts, 136, dev, 128, lambda m: m, "moe")
    assert third.bounds() is not first.bounds(), "changed counts reused the old routing's bounds"
    assert torch.equal(third.bounds().gemm_rows, third.table[:3]), "bounds' rows differ from the new table"
    assert third.table[2].tolist() == [0, 6, 130, 0], third.table


# ---- the device-count path's choice: the device's capability asked once per device ---------------------------------

def test_device_path_choice_asks_the_capability_once_per_device(monkeypatch):
    """`device_path_runs` runs on every GroupedLinear call: the capability of a device with an index is kept (the
    properties lookup behind `get_device_capability` is host time per call); "cuda" alone -- the current device,
    which may change -- is asked every time; another index has its own. The answer is unchanged. (fails before: the
    capability asked at every call)"""
    import hybridq as hq
    from hybridq.kernels import grouped_blocks, native_gemm, triton_grouped_blocks
    from hybridq.nn import grouped_device_blocks
    from hybridq.nn.grouped_packed import packed_quantizers
    asked = []

    def capability(device):
        asked.append(device)
        return (9, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(native_gemm, "native_enabled", lambda: True)
    monkeypatch.setattr(grouped_blocks, "_triton", lambda: triton_grouped_blocks)
    monkeypatch.setattr(grouped_device_blocks, "_CAPABILITIES", {})
    qs = packed_quantizers(hq.GroupedLinear(4, 256, 128, recipe="fp8_block").expert_quantizers).quantizers
    for device, want in ((torch.device("cuda", 0), 1), (torch.device("cuda", 1), 1), (torch.device("cuda"), 3)):
        asked.clear()
        runs = [grouped_device_blocks.device_path_runs(qs, device, 4, 128, 256) for _ in range(3)]
        assert runs == [True] * 3, f"{device}: device_path_runs {runs}"
        assert len(asked) == want, f"{device}: the capability asked {len(asked)} times in 3 calls, expected {want}"
    assert grouped_device_blocks.device_path_runs(qs, torch.device("cuda", 0), 4, 96, 256) is False, \
        "a weight whose experts' rows are no whole 128-row blocks took the device path"


# ---- the layer on a GPU: kernel launches per call --------------------------------------------------------------------

def _device_path_here(preset) -> bool:
    import hybridq as hq
    from hybridq.nn.grouped_device_blocks import device_path_runs
    from hybridq.nn.grouped_packed import packed_quantizers
    if not torch.cuda.is_available():
        return False
    qs = packed_quantizers(hq.GroupedLinear(4, 256, 128, recipe=preset).expert_quantizers).quantizers
    return device_path_runs(qs, torch.device("cuda"), 4, 128, 256)


# Launches of one forward / backward on the device-count path: the slot quantize once per tensor (both directions in
# one launch; before: one per direction), FP8 blocks' grouped GEMMs one per phase (MXFP8's grouped emulation is no
# Triton kernel)
LAUNCHES = {"fp8_block": {"forward": {"_launch": 1, "grouped_block_mm": 1},
                          "backward": {"_launch": 1, "grouped_block_mm": 1, "grouped_block_wgrad": 1}},
            "mxfp8": {"forward": {"_launch": 1}, "backward": {"_launch": 1}}}


@pytest.mark.parametrize("preset", [pytest.param(p, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _device_path_here(p), reason="needs CUDA sm_90 with the grouped kernels (Triton, the built extension)")])
    for p in LAUNCHES])
def test_gpu_device_count_path_launches_per_call(preset, monkeypatch):
    import hybridq as hq
    from hybridq.kernels import triton_grouped_blocks
    launches = {}

    def counted(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            launches[name] = launches.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)
    counted(grouped_slots, "_launch")
    counted(triton_grouped_blocks, "grouped_block_mm")
    counted(triton_grouped_blocks, "grouped_block_wgrad")
    torch.manual_seed(0)
    m = hq.GroupedLinear(4, 256, 128, recipe=preset, device="cuda", dtype=torch.bfloat16, name="moe")
    route = torch.tensor([5, 0, 130, 40], device="cuda")
    x = torch.randn(175, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(175, 128, device="cuda", dtype=torch.bfloat16)
    m(x, route).backward(dy)  # (first call: Triton compiles, the extension loads)
    got = {}
    for phase in ("forward", "backward"):
        launches.clear()
        if phase == "forward":
            # a new input tensor: the first call's quantization of `x` on this routing would be shared ([Note:
            # shared slot input]), which is not the launches of a call
            y = m(x.detach().clone().requires_grad_(), route)
        else:
            y.backward(dy)
        got[phase] = dict(launches)
    assert got == LAUNCHES[preset], f"{preset}: launches per call {got}, expected {LAUNCHES[preset]}"


# ---- the Triton launches: plans kept per arguments, the cached launcher ---------------------------------------------

# each kind's plan arguments (base) and, per argument, another value that changes the plan
_BLOCK_PLAN_CASES = {
    "mm": ((32768, 1024, 2048, 16, 128, None), (16384, 512, 200, 8, 1, (128, 128, 8, 8, 4))),
    "wgrad": ((1024, 2048, 16, True, None), (512, 1024, 8, False, (128, 128, 8, 8, 4))),
}


@pytest.mark.parametrize("kind", sorted(_BLOCK_PLAN_CASES))
def test_block_gemm_launch_plans_are_reused_only_for_their_arguments(kind, monkeypatch):
    """A grouped block kernel's grid and launch keywords, derived once per (kind, sizes, options): the same arguments
    reuse the plan, a call that differs in any one argument gets the plan derived from its own arguments."""
    from hybridq.kernels import triton_grouped_blocks as t
    monkeypatch.setattr(t, "_PLANS", {})
    base, others = _BLOCK_PLAN_CASES[kind]
    make = t._PLAN_MAKERS[kind]
    first = t.launch_plan(kind, *base)
    assert t.launch_plan(kind, *base) is first, f"{kind}: the same arguments derived the plan again"
    assert first == make(*base), f"{kind}: the kept plan differs from the arguments' own"
    for i, v in enumerate(others):
        args = list(base)
        args[i] = v
        got = t.launch_plan(kind, *args)
        assert got == make(*args) and got != first, f"{kind}: argument {i} -> {v} got the plan {got}"


def test_block_gemm_plan_keywords_are_the_kernels_launch_keywords():
    """The plans hold what each launch passed before they were kept (the kernels' constexprs and options)."""
    from hybridq.kernels import triton_grouped_blocks as t
    grid, kw = t._mm_plan(1000, 256, 200, 4, 128, None)
    bm, bn, gm, w, st = t.CONFIGS["mm"]
    assert grid == ((-(-1000 // bm) + 4) * -(-256 // bn),), grid
    assert kw == dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=gm, EP=16, B_ROW_BLOCK=128, EVEN_K=False,
                      SB_SCALAR=128 % bn == 0, num_warps=w, num_stages=st), kw
    grid, kw = t._wgrad_plan(256, 200, 4, True, None)
    bm, bn, gm, w, st = t.CONFIGS["wgrad"]
    assert grid == (-(-256 // bm) * -(-200 // bn), 4), grid
    assert kw == dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=gm, EVEN=True, num_warps=w, num_stages=st), kw


# (mode, fp8, rowwise, columnwise, slot rows, K, input dtype, fp8_max, eps, pow2, device, config)
_SLOT_PLAN_BASE = (triton_slot_quantize.MODE_FP8_BLOCK, torch.float8_e4m3fn, True, True, 4096, 2048, torch.bfloat16,
                   448.0, 0.0, True, torch.device("cpu"), None)
_SLOT_PLAN_OTHERS = (triton_slot_quantize.MODE_MXFP8, torch.float8_e5m2, False, False, 4224, 2176, torch.float32,
                     57344.0, 1e-6, False, torch.device("meta"), (256, 4, 0, 0, 0))


def test_slot_quantize_launch_plan_is_reused_only_for_its_arguments(monkeypatch):
    """[Note: slot quantize launch plans]: the same arguments reuse the plan, with no aten op (before: fp32(1 /
    fp8_max) took three CPU tensor ops per call); any one argument changed gets a plan of its own."""
    t = triton_slot_quantize
    monkeypatch.setattr(t, "_PLANS", {})
    first = t._plan(*_SLOT_PLAN_BASE)
    with OpLog() as later:
        again = t._plan(*_SLOT_PLAN_BASE)
    assert again is first, "the same arguments derived the slot quantize plan again"
    assert later.ops == [], f"a kept slot quantize plan issued {later.ops}"
    for i, v in enumerate(_SLOT_PLAN_OTHERS):
        args = list(_SLOT_PLAN_BASE)
        args[i] = v
        got = t._plan(*args)
        kept = t._PLANS
        monkeypatch.setattr(t, "_PLANS", {})
        own = t._plan(*args)  # (derived from these arguments alone)
        monkeypatch.setattr(t, "_PLANS", kept)
        assert got is not first and got == own, f"argument {i} -> {v} got the plan {got}, its own is {own}"
    monkeypatch.setenv("TRITON_INTERPRET", "0" if t._interpreting() else "1")
    assert t._plan(*_SLOT_PLAN_BASE) != first, "the interpreter's plan was served to a compiled launch (or back)"


@pytest.mark.parametrize("mode", ["fp8_block", "mxfp8"])
def test_slot_quantize_plan_holds_the_launch_arguments(mode, monkeypatch):
    """What the plan passes: the scale shapes, the grid, the tile counts, fp32(1 / fp8_max) and the constexprs."""
    t = triton_slot_quantize
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = t.MODE_FP8_BLOCK if mode == "fp8_block" else t.MODE_MXFP8
    s, k, blk = 384, 320, t._BLOCKS[m]
    c = t.CONFIGS[m]
    (rs_cols, cs_cols, s_dtype), grid, head, kw = t._plan(m, torch.float8_e4m3fn, True, True, s, k, torch.bfloat16,
                                                          448.0, 0.0, True, torch.device("cpu"), None)
    n_cb, tiles = -(-k // c.cols), -(-s // blk) * -(-k // c.cols)
    want_scales = ((-(-k // blk), -(-s // blk), torch.float32) if m == t.MODE_FP8_BLOCK
                   else (k // blk, s // blk, torch.uint8))
    assert (rs_cols, cs_cols, s_dtype) == want_scales
    assert grid == ((-(-s // blk), n_cb) if not c.stages else (t._grid(c, tiles, torch.device("cpu")),)), grid
    rcp = float(torch.tensor(1.0) / torch.tensor(448.0, dtype=torch.float32))
    assert head == (rs_cols, cs_cols, tiles, n_cb, t._grid(c, tiles, torch.device("cpu")), 448.0, rcp, 0.0), head
    assert kw["ROWWISE"] and kw["COLUMNWISE"] and kw["MODE"] == m and kw["BLK"] == blk and kw["BLOCK_C"] == c.cols
    assert kw["EVEN"] == (s % blk == 0 and k % c.cols == 0) and kw["USE_ASM"] and kw["num_warps"] == c.warps


def _block_kernel_outputs(seed: int) -> dict[str, torch.Tensor]:
    """The slot quantize's (FP8 blocks, MXFP8) and the grouped block GEMMs' (fprop, dgrad, wgrad) outputs on one set
    of CUDA operands (`seed`: other values and routings)."""
    from hybridq.kernels.grouped_blocks import GroupBounds, mm, wgrad
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    splits = [5, 0, 130, 1 + 40 * seed]
    x = torch.randn(sum(splits), 256, generator=gen).to(dev, torch.bfloat16)
    dy = torch.randn(sum(splits), 128, generator=gen).to(dev, torch.bfloat16)
    layout = TokenLayout.build(splits, [-(-m // 16) * 16 if m else 0 for m in splits], dev, 128)
    src = layout.source_rows(dev)
    out = {}
    for fmt, q in (("fp8_block", Float8BlockQuantizer(block_dim=1)), ("mxfp8", MXFP8Quantizer())):
        got = grouped_slots.quantize(q, x, src, True, True)
        assert got is not None, f"{fmt}: the grouped slot quantize did not take the call"
        for d in (ROWWISE, COLUMNWISE):
            for name, t in got.part(d).tensors().items():
                if isinstance(t, torch.Tensor):
                    out[f"slot quantize {fmt} {d} {name}"] = t
    q = Float8BlockQuantizer(block_dim=1)
    xq, dyq = (grouped_slots.quantize(q, t, src, True, True) for t in (x, dy))
    w = Float8BlockQuantizer(block_dim=2).quantize_groups((torch.randn(4 * 128, 256, generator=gen)).to(dev),
                                                          [128] * 4, rowwise=True, columnwise=True, name="w")
    bounds = GroupBounds(layout.offsets, layout.splits, layout.slots, dev)
    out["fprop"] = mm(xq.part(ROWWISE), w.part(ROWWISE), 4, bounds, torch.bfloat16)
    out["dgrad"] = mm(dyq.part(ROWWISE), w.part(COLUMNWISE), 4, bounds, torch.bfloat16)
    out["wgrad"] = wgrad(dyq.part(COLUMNWISE), xq.part(COLUMNWISE), bounds, torch.bfloat16)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not (_device_path_here("fp8_block") and extension_ready()
                         and triton_slot_quantize.triton is not None),
                    reason="needs CUDA sm_90 with the grouped kernels (Triton, the built extension)")
def test_gpu_block_kernels_through_the_cached_launcher_are_bitwise_tritons_launch(monkeypatch):
    """The slot quantize and the grouped block GEMMs launched through the cached launcher (the first call of a
    specialization fills it, the next ones read it; another routing included) write the bytes of Triton's own
    `kernel[grid](...)`, and the launcher kept their kernels."""
    from hybridq.kernels import triton_launch
    assert triton_launch.SUPPORTED, "the cached launcher is off for this Triton"
    for seed in (0, 0, 1):
        fast = _block_kernel_outputs(seed)
        monkeypatch.setattr(triton_launch.ENABLED, "on", False)
        ref = _block_kernel_outputs(seed)
        monkeypatch.setattr(triton_launch.ENABLED, "on", True)
        for name, t in ref.items():
            assert torch.equal(fast[name].view(torch.uint8), t.view(torch.uint8)), \
                f"{name}: the cached launch differs from Triton's launch (seed {seed})"
    kept = {id(k[0]) for k in triton_launch._CACHE.values()}
    from hybridq.kernels import triton_grouped_blocks as tgb
    for fn in (triton_slot_quantize._slot_quantize_kernel, tgb._grouped_block_mm_kernel,
               tgb._grouped_block_wgrad_kernel):
        assert id(fn) in kept, f"{fn.fn.__name__} was not launched through the cached launcher"


@pytest.mark.parametrize("case", QUANTIZERS)
def test_slot_quantize_launches_are_kept_with_the_decision(decision_spy, case):
    """The launches a call makes (quantizer, directions, mode, scaling arguments) are kept with the decision: the same
    object for the same configuration, made again for a quantizer changed in place (its scaling arguments follow)."""
    from hybridq.formats._numerics import FP8_MAX
    q = QUANTIZERS[case]()
    x = torch.zeros(10, 256, dtype=torch.bfloat16)
    grouped_slots._DECISIONS.clear()
    key = (id(q), x.dtype, x.device, 256, 128, True, True, grouped_slots.BACKEND["name"])
    # (kept as a CUDA call's decision keeps them: on the CPU the extension's lookup declines)
    grouped_slots._DECISIONS[key] = (q, copy.deepcopy(q), tuple(grouped_slots._launch_args(d, r, c)
                                                                for d, r, c in grouped_slots._launches(q, True, True)))
    kept = grouped_slots._kept_launches(q, x, 128, True, True)
    assert kept is grouped_slots._DECISIONS[key][2] and decision_spy.calls == 0, "the kept launches were not used"
    assert len(kept) == BOTH_LAUNCHES[case], kept
    for d, row, col, mode, kw in kept:
        assert kw["fp8_max"] == FP8_MAX[d.dtype], kw
        if type(d) is Float8BlockQuantizer:
            assert mode == triton_slot_quantize.MODE_FP8_BLOCK and kw["eps"] == d.amax_epsilon \
                and kw["pow2"] == d.power_2_scale, kw
        else:
            assert mode == triton_slot_quantize.MODE_MXFP8 and set(kw) == {"fp8_max"}, kw
    if type(q) is Float8BlockQuantizer:
        q.amax_epsilon = 1e-3  # (in place: asked again, the new epsilon in the launch)
        grouped_slots._kept_launches(q, x, 128, True, True)
        assert decision_spy.calls > 0, "a quantizer changed in place reused the kept launches"
