"""Which hardware GEMMs a pair of parts is offered, selected by what the parts declare (`QuantizedPart.gemm_kind`:
scale layout, block shape, scale dtype), not by their classes. Runs on the CPU: it checks the ordered candidate list
(`hybridq.dispatch.gemm_candidates`, what `find_native_gemm` tries before each GEMM's device / shape check), which
the GPU tests (test_cuda_gemm.py and the others) then exercise."""

from __future__ import annotations

import pathlib

import pytest
import torch

import hybridq
from hybridq import dispatch
from hybridq.formats import MXFP8Part, OperandKind, QuantizedPart, ScaleLayout
from hybridq.formats.float8 import ScaledFP8Values
from hybridq.gemm import emulated_gemm, gemm
from hybridq.recipe import Role

from _compare import assert_bitwise
from _format_cases import CASES

# The GEMMs the table offered each pair of part types (named by their `format_name`, one per part type) before
# selection moved to the declared kinds (hybridq/kernels/native_gemm.py register_all at commit 4239611: keyed by the
# pair of part types; the rowwise pair by ROW x ROW layouts), in the order they were tried. Selection must not
# change, so this is written down rather than derived.
_MICRO_EMULATED = ["triton-dequant-sm90", "cuda-emulated-bf16"]
BEFORE = {
    ("FP8", "FP8"): ["cuda-scaled-mm-tensorwise"],
    ("FP8-block", "FP8-block"): ["cuda-scaled-mm-blockwise"],
    ("FP8-rowwise", "FP8-rowwise"): ["cuda-scaled-mm-rowwise"],
    ("MXFP8", "MXFP8"): ["cuda-scaled-mm-blockscaled", "triton-mxfp8-sm90", *_MICRO_EMULATED],
    ("NVFP4", "NVFP4"): ["cuda-scaled-mm-blockscaled", *_MICRO_EMULATED],
    ("MXFP8", "NVFP4"): _MICRO_EMULATED,
    ("NVFP4", "MXFP8"): _MICRO_EMULATED,
    ("identity", "identity"): ["cuda-bf16"],
}
BUILTIN = {n for names in BEFORE.values() for n in names}


def expected(a, b) -> list[str]:
    names = BEFORE.get((a.format_name, b.format_name), [])
    if names == ["cuda-scaled-mm-blockwise"] and a.block_shape != (1, 128):
        return []  # (the old table listed it for every FP8-block pair; its check refused a 128x128 `a` on any device)
    return names


def offered(a, b) -> list[str]:
    return [g.name for g in dispatch.gemm_candidates(a, b) if g.name in BUILTIN]


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _preset_operands(name: str) -> dict[str, tuple[QuantizedPart, QuantizedPart]]:
    """The three GEMMs of a Linear under preset `name`: fprop x.row @ W.row^T, dgrad dy.row @ W.col^T, wgrad
    dy.col @ x.col^T (hybridq/gemm.py), from each role's quantizer."""
    r = hybridq.recipe(name)
    q = {t: r.quantizer(Role("linear", t)) for t in ("input", "weight", "grad_output")}
    x, w, dy = (q[t].quantize(_x(*s, seed=i), rowwise=True, columnwise=True)
                for i, (t, s) in enumerate([("input", (64, 128)), ("weight", (96, 128)), ("grad_output", (64, 96))]))
    return {"fprop": (x.rowwise, w.rowwise), "dgrad": (dy.rowwise, w.columnwise),
            "wgrad": (dy.columnwise, x.columnwise)}


@pytest.mark.parametrize("preset", hybridq.preset_names())
def test_every_preset_gemm_is_offered_the_gemms_the_type_table_offered(preset):
    for which, (a, b) in _preset_operands(preset).items():
        assert offered(a, b) == expected(a, b), (
            f"{preset} {which} {a!r} x {b!r} (kinds {a.gemm_kind} x {b.gemm_kind}): offered {offered(a, b)}, the "
            f"type table offered {expected(a, b)}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_format_case_pairing_is_offered_the_gemms_the_type_table_offered(case):
    q = CASES[case].make()
    x, w = (q.quantize(_x(*s, seed=i), rowwise=True, columnwise=True) for i, s in enumerate([(64, 128), (96, 128)]))
    pairs = {"rowwise x rowwise": (x.rowwise, w.rowwise), "rowwise x columnwise": (x.rowwise, x.columnwise),
             "columnwise x columnwise": (x.columnwise, w.columnwise)}
    for which, (a, b) in pairs.items():
        assert offered(a, b) == expected(a, b), (
            f"{case} {which}: offered {offered(a, b)}, the type table offered {expected(a, b)}")


class _NewTensorPart(ScaledFP8Values, QuantizedPart):
    """A part type no GEMM table names, declaring one fp32 scale per tensor."""

    format_name = "new-fp8"
    tensor_fields = ("data", "scale_inv")
    scale_layout = ScaleLayout.TENSOR


def _new_part(rows: int, cols: int, seed: int) -> _NewTensorPart:
    data = _x(rows, cols, seed).to(torch.float8_e4m3fn)
    return _NewTensorPart(rows=rows, cols=cols, columnwise=False, data=data, scale_inv=torch.tensor([0.5]))


def test_a_part_type_declaring_a_kind_is_offered_that_kinds_gemms():
    a, b = _new_part(32, 64, 0), _new_part(16, 64, 1)
    assert a.gemm_kind == OperandKind(ScaleLayout.TENSOR, None, torch.float32)
    assert offered(a, b) == ["cuda-scaled-mm-tensorwise"], f"offered {offered(a, b)}"


def test_a_gemm_registered_for_a_pair_of_part_types_is_tried_before_the_kinds_gemms():
    q = hybridq.MXFP8Quantizer()
    a, b = q.quantize(_x(32, 64, 0)).rowwise, q.quantize(_x(16, 64, 1)).rowwise
    calls = []

    def run(a, b, out_dtype):
        calls.append(out_dtype)
        return emulated_gemm(a, b, out_dtype)

    hybridq.register_native_gemm(MXFP8Part, MXFP8Part, "user-mxfp8", run, lambda a, b: True)
    try:
        names = [g.name for g in dispatch.gemm_candidates(a, b)]
        y = gemm(a, b, torch.float32)
    finally:
        dispatch.unregister_native_gemm(MXFP8Part, MXFP8Part, "user-mxfp8")
    assert names[0] == "user-mxfp8" and names[1:] == BEFORE[("MXFP8", "MXFP8")], names
    assert calls == [torch.float32], f"the user's GEMM ran {len(calls)} times"
    assert_bitwise(y, a.dequantize_2d() @ b.dequantize_2d().t(), "the user's GEMM result")


def test_the_gemm_selection_modules_name_no_format_class():
    import hybridq.formats as F

    root = pathlib.Path(hybridq.__file__).parent
    parts = [n for n in F.__all__ if isinstance(getattr(F, n), type) and issubclass(getattr(F, n), QuantizedPart)
             and getattr(F, n) is not QuantizedPart]
    quantizers = [n for n in F.__all__ if n.endswith("Quantizer") and n != "Quantizer"]
    for path in ("dispatch.py", "kernels/native_gemm.py"):
        text = (root / path).read_text()
        named = sorted(n for n in parts + quantizers if n in text)
        assert not named, f"hybridq/{path} names format classes {named}: select GEMMs by the parts' declared kinds"


def test_the_grouped_gemm_is_registered_for_the_kind_of_a_per_tensor_fp8_group():
    """GroupedLinear's per-tensor FP8 grouped GEMM is found by the operand kind of each group (one fp32 scale per
    group's tensor), which is the kind the per-tensor FP8 parts of the groups declare."""
    from hybridq.gemm import PER_GROUP_TENSOR, grouped_fp8_gemm_kernel
    from hybridq.kernels import native_gemm

    group = hybridq.Float8Quantizer().quantize(_x(16, 64, 0)).rowwise
    assert group.gemm_kind == PER_GROUP_TENSOR, f"a per-tensor FP8 group declares {group.gemm_kind}"
    assert dispatch.grouped_gemm_kernel(group.gemm_kind, "cuda") is native_gemm._grouped_fp8_run
    assert grouped_fp8_gemm_kernel("cuda") is native_gemm._grouped_fp8_run
    assert grouped_fp8_gemm_kernel("cpu") is None, "the CPU has no grouped GEMM (the per-group loop runs)"


EMPTY = {"K 0 (a wgrad of 0 tokens)": ((64, 0), (96, 0)), "M 0": ((0, 128), (96, 128)), "N 0": ((64, 128), (0, 128))}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("shapes", EMPTY)
@pytest.mark.parametrize("case", CASES)
def test_an_empty_product_is_zeros_without_asking_a_hardware_gemm(case, shapes, monkeypatch):
    """A GEMM with an empty dimension never reaches a hardware kernel: they refuse zero-size operands, and the
    refusal turned the kernel off for the shape with a 'failed in torch; using the emulated GEMM' warning (the
    wgrad of 0 tokens of an FP8 block Linear on the H200)."""
    q = CASES[case].make()
    a, b = (q.quantize(_x(*s, seed=i), rowwise=True, columnwise=False).rowwise
            for i, s in enumerate(EMPTY[shapes]))

    def no_lookup(*args):
        raise AssertionError(f"{case}, {shapes}: gemm looked for a hardware GEMM for an empty product")

    monkeypatch.setattr(hybridq.gemm, "find_native_gemm", no_lookup)
    got = gemm(a, b, torch.float32, "wgrad of fc")
    assert_bitwise(got, emulated_gemm(a, b, torch.float32), f"{case}, {shapes}: the empty product")
