"""hybridq/kernels/triton_launch.py: Triton kernels launched through a launcher cached per specialization give the
bytes of Triton's own `kernel[grid](...)`, and the cache key separates every call Triton would compile apart."""

import pytest
import torch

from hybridq.kernels import triton_grouped_fp8 as tg
from hybridq.kernels import triton_launch
from hybridq.kernels.triton_launch import arg_key, launch_key


def _key(*args, device=0, **kwargs):
    return launch_key(args, kwargs, device, (False, None))


def test_launch_key_is_equal_for_calls_triton_specializes_alike():
    """Other runtime values of the same classes (sizes, pointers both 16-byte aligned) share one compiled kernel."""
    a, b = torch.empty(64, dtype=torch.uint8), torch.empty(128, dtype=torch.uint8)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0, "(the allocator aligns storages)"
    assert _key(a, 4096, 7, BLOCK=128, num_warps=8) == _key(b, 2048, 9, BLOCK=128, num_warps=8)


@pytest.mark.parametrize("change", ["dtype", "alignment", "int is 1", "int multiple of 16", "int 64-bit",
                                    "constexpr", "bool", "option", "device", "debug"])
def test_launch_key_separates_what_triton_specializes_on(change):
    """A cached launcher must never run a kernel compiled for another specialization: each thing Triton compiles a
    kernel for (an argument's dtype, 16-byte alignment, an integer's ==1 / %16 / 64-bit class, a constexpr, an
    option, the device, the debug knobs) gives another key."""
    buf = torch.empty(64, dtype=torch.uint8)
    base = dict(args=(buf[:32], 4096, 7), kwargs={"BLOCK": 128, "PRECISE": True, "num_warps": 8}, device=0,
                debug=(False, None))
    other = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    if change == "dtype":
        other["args"] = (buf[:32].view(torch.int8), 4096, 7)
    elif change == "alignment":
        other["args"] = (buf[1:33], 4096, 7)
    elif change == "int is 1":
        other["args"] = (buf[:32], 4096, 1)
    elif change == "int multiple of 16":
        other["args"] = (buf[:32], 4095, 7)
    elif change == "int 64-bit":
        other["args"] = (buf[:32], 4096 << 32, 7)
    elif change == "constexpr":
        other["kwargs"]["BLOCK"] = 64
    elif change == "bool":
        other["kwargs"]["PRECISE"] = False
    elif change == "option":
        other["kwargs"]["num_warps"] = 4
    elif change == "device":
        other["device"] = 1
    else:
        other["debug"] = (True, None)
    keys = [launch_key(d["args"], d["kwargs"], d["device"], d["debug"]) for d in (base, other)]
    assert keys[0] != keys[1], f"a changed {change} kept the cache key: {keys[0]}"


def test_arg_key_tells_bools_from_ints():
    """True and 1 are equal in Python but Triton types them apart (i1 vs a constexpr 1)."""
    assert arg_key(True) != arg_key(1) and arg_key(False) != arg_key(0)


def _jagged_gpu() -> bool:
    return (torch.cuda.is_available() and tg.available() and torch.cuda.get_device_capability() >= (9, 0))


needs_triton_gpu = pytest.mark.skipif(not _jagged_gpu(), reason="needs Triton and a CUDA sm_90 device")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8(rows: int, cols: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """Random fp8 `[rows, cols]`, its storage `offset` bytes into a buffer (offset 1: not 16-byte aligned)."""
    buf = torch.empty(rows * cols + offset, dtype=torch.uint8, device="cuda")
    out = buf[offset:].view(dtype).view(rows, cols)
    out.copy_((torch.randn(rows, cols, device="cuda") * 8).to(dtype))
    return out


def _padded_columns(row: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    """The columnwise form of `row [T, K]` in the padded group layout (group g's tokens from a 16-aligned column,
    zeros elsewhere; the grouped cast's layout, built here from its definition)."""
    out = torch.zeros(row.shape[1], width, dtype=torch.uint8, device=row.device)
    o = p = 0
    for m in sizes:
        out[:, p:p + m] = row.view(torch.uint8)[o:o + m].t()
        o, p = o + m, p + -(-m // 16) * 16
    return out.view(row.dtype)


def _ops(offset: int, tokens: int, fp8: torch.dtype):
    """The grouped kernels' calls on one set of operands: name -> (call returning (output, compiled kernel))."""
    e, n, k = 4, 64, 128
    sizes = [tokens // 4, 0, tokens // 2, tokens - tokens // 4 - tokens // 2]
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    padded_ends = torch.tensor([-(-m // 16) * 16 for m in sizes], device="cuda").cumsum(0).to(torch.int32)
    width = int(padded_ends[-1])
    a, b = _fp8(tokens, k, fp8, offset), _fp8(e * n, k, fp8)
    sa, sb = torch.rand(e, device="cuda") + 0.5, torch.rand(e, device="cuda") + 0.5
    a_t = _padded_columns(_fp8(tokens, n, fp8), sizes, width)
    b_t = _padded_columns(a, sizes, width)

    def mm(precise):
        out = tg.jagged_mm(a, sa, b, n * k, k, n, sb, ends, torch.bfloat16, precise)
        return out, tg.LAST_COMPILED["mm"]

    def wgrad():
        out = tg.jagged_wgrad(a_t, sa, b_t, sb, padded_ends, torch.bfloat16, precise=True, aligned=True)
        return out, tg.LAST_COMPILED["wgrad"]

    return {"fprop": lambda: mm(False), "dgrad": lambda: mm(True), "wgrad": wgrad}


@pytest.mark.gpu
@needs_triton_gpu
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_cached_launch_is_bitwise_tritons_launch(op, fp8, monkeypatch):
    """Each grouped kernel, launched through the cached launcher (its first call fills the cache, the next ones read
    it; other sizes and a misaligned operand included) gives the bytes of Triton's own launch."""
    assert triton_launch.SUPPORTED, f"the cached launcher is off for Triton {tg.triton.__version__}"
    for offset, tokens in ((0, 200), (0, 200), (0, 328), (1, 200), (1, 200)):
        torch.manual_seed(tokens)
        fast = _ops(offset, tokens, fp8)[op]()[0]
        monkeypatch.setattr(triton_launch.ENABLED, "on", False)
        torch.manual_seed(tokens)
        ref = _ops(offset, tokens, fp8)[op]()[0]
        monkeypatch.setattr(triton_launch.ENABLED, "on", True)
        assert torch.equal(fast.view(torch.uint8), ref.view(torch.uint8)), \
            f"{op}: cached launch differs from Triton's launch at {tokens} tokens, operand offset {offset}"


@pytest.mark.gpu
@needs_triton_gpu
def test_a_misaligned_operand_gets_its_own_compiled_kernel():
    """An operand not 16-byte aligned must not run the kernel Triton compiled assuming alignment."""
    torch.manual_seed(0)
    aligned = _ops(0, 200, FP8[0])["fprop"]()[1]
    misaligned = _ops(1, 200, FP8[0])["fprop"]()[1]
    again = _ops(0, 328, FP8[0])["fprop"]()[1]
    assert misaligned is not aligned, "the misaligned operand ran the kernel specialized for an aligned one"
    assert again is aligned, "an aligned call of another size did not reuse the cached kernel"


# each kind's plan arguments (base) and, per argument, another value that changes the plan
_PLAN_CASES = {
    "mm": ((32768, 1024, 2048, 16, False, None), (16384, 512, 96, 64, True, (64, 64, 64, 4, 4, 2))),
    "wgrad": ((1024, 2048, 16, True, True, None), (512, 1024, 8, False, False, (64, 64, 64, 4, 4, 2))),
}


@pytest.mark.parametrize("kind", sorted(_PLAN_CASES))
def test_launch_plans_are_reused_only_for_their_arguments(kind):
    """A grouped kernel's grid and launch keywords, derived once per (kind, sizes, options): a call that differs in
    any one argument gets the plan derived from its own arguments, never another call's."""
    base, others = _PLAN_CASES[kind]
    make = tg._PLAN_MAKERS[kind]
    tg._PLANS.clear()
    first = tg.launch_plan(kind, *base)
    assert tg.launch_plan(kind, *base) is first, f"{kind}: the same arguments derived the plan again"
    for i, value in enumerate(others):
        args = base[:i] + (value,) + base[i + 1:]
        want = make(*args)
        assert want != make(*base), f"(test case: {kind} argument {i} must change the plan)"
        assert tg.launch_plan(kind, *args) == want, f"{kind}: argument {i} changed to {value} reused another plan"


def test_launch_plans_are_the_kernels_parameters():
    """The plans are what the wrappers launched with before: the tile configuration (BLOCK_K halved until it divides
    K), the grid as an upper bound of the tiles, EP the groups rounded up to a power of two (at least 16)."""
    grid, kw = tg.launch_plan("mm", 1000, 256, 96, 5, True, None)
    bm, bn, bk, gm, w, st = tg.CONFIGS[("mm", True)]
    assert kw == dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=32, GROUP_M=gm, EP=16, PRECISE=True, num_warps=w,
                      num_stages=st), kw
    assert grid == ((-(-1000 // bm) + 5) * -(-256 // bn),), grid
    grid, kw = tg.launch_plan("wgrad", 300, 200, 7, False, True, None)
    bm, bn, bk, gm, w, st = tg.CONFIGS[("wgrad", False)]
    assert grid == (-(-300 // bm) * -(-200 // bn), 7) and kw["ALIGNED"] is True and kw["PRECISE"] is False, (grid, kw)


@pytest.mark.gpu
@needs_triton_gpu
def test_grouped_kernels_launch_through_the_launchers_c_function():
    """The grouped kernels need no scratch memory: their cached launches call the compiled launcher's C function
    directly (not its Python wrapper, which would allocate no scratch for them either)."""
    assert triton_launch.SUPPORTED, f"the cached launcher is off for Triton {tg.triton.__version__}"
    triton_launch._CACHE.clear()
    for call in _ops(0, 200, FP8[0]).values():
        call()
    kernels = {}
    for fn, kernel, run, head, consts in triton_launch._CACHE.values():
        kernels[fn.fn.__name__] = run is kernel.run.launch and head[0] == kernel.function
    assert kernels == {"_jagged_mm_kernel": True, "_jagged_wgrad_kernel": True}, \
        f"kernel -> launched through the C function: {kernels}"
