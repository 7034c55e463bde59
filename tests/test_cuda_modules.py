"""The CUDA backend's layout (docs/architecture.md "Extension points"): a format's kernel lives in its own three
files -- csrc/tile/policy_<format>.cuh, csrc/quantize_<format>.cu (its ops' schemas and registration) and
hybridq/kernels/cuda_<format>.py (the calls, fakes and dispatch registrations) -- and what they share names no
format. Read from the sources and checked against the op schemas they declare; no GPU or build needed."""

from __future__ import annotations

import re
import subprocess
import sys

import hybridq
from _op_schemas import CSRC, ROOT, csrc_schemas, schemas
from hybridq.kernels import cuda



def format_names() -> set[str]:
    return {m.__name__.rsplit(".", 1)[1][len(cuda.FORMAT_MODULE_PREFIX):] for m in cuda.format_modules()}


def test_every_format_kernel_has_its_three_files():
    bindings = {p.stem[len("quantize_"):] for p in CSRC.glob("quantize_*.cu")} - {"nvfp4_2d"}
    assert format_names() == bindings, (f"kernel modules hybridq/kernels/cuda_<format>.py {sorted(format_names())} "
                                        f"vs binding files csrc/quantize_<format>.cu {sorted(bindings)}")
    for fmt in format_names():
        assert (CSRC / "tile" / f"policy_{fmt}.cuh").exists(), f"{fmt}: no csrc/tile/policy_{fmt}.cuh"


def test_each_format_declares_exactly_its_modules_ops():
    """A format's ops are declared in its own binding file (TORCH_LIBRARY_FRAGMENT), and its Python module calls
    exactly those."""
    for mod in cuda.format_modules():
        fmt = mod.__name__.rsplit(".", 1)[1][len(cuda.FORMAT_MODULE_PREFIX):]
        declared = set(schemas(CSRC / f"quantize_{fmt}.cu"))
        assert set(mod.OPS) == declared, f"{mod.__name__}.OPS {sorted(mod.OPS)} vs quantize_{fmt}.cu {sorted(declared)}"


def test_shared_registration_declares_only_shared_ops():
    declared = set(schemas(CSRC / "ops.cpp"))
    assert declared == set(cuda.SHARED_OPS), f"csrc/ops.cpp declares {sorted(declared)}, expected {cuda.SHARED_OPS}"
    for path in CSRC.rglob("*"):
        if path.suffix in (".cu", ".cpp", ".h", ".cuh") and not path.name.startswith("quantize_"):
            assert set(schemas(path)) <= set(cuda.SHARED_OPS), f"{path.name} declares a format's op"


def test_shared_kernel_module_names_no_format():
    src = (ROOT / "hybridq" / "kernels" / "cuda.py").read_text()
    types = [n for n in hybridq.formats.__all__ if n.endswith(("Quantizer", "Part"))]
    named = [n for n in types if re.search(rf"\b{n}\b", src)]
    assert not named, f"hybridq/kernels/cuda.py names format types {named}: they belong in cuda_<format>.py"


_FAKES = r"""
import sys, torch
from hybridq.kernels import cuda
defs = eval(sys.argv[1])
lib = torch.library.Library("hybridq", "DEF")
for schema in defs.values():
    lib.define(schema)
from torch._library.simple_registry import singleton
cuda._register_shared_fakes()
for mod in cuda.format_modules():
    mod.register_fakes()
missing = [op for op in defs if singleton.find("hybridq::" + op).fake_impl.kernel is None]
print("MISSING", missing)
"""


def test_every_declared_op_gets_a_fake():
    """With the schemas of csrc/ declared (as the extension declares them), the kernel modules register a fake for
    every op (in a subprocess: the `hybridq` namespace stays free in this one)."""
    defs = csrc_schemas()
    assert set(cuda.SHARED_OPS) | {op for m in cuda.format_modules() for op in m.OPS} == set(defs)
    r = subprocess.run([sys.executable, "-c", _FAKES, repr(defs)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MISSING []" in r.stdout, f"ops without a fake implementation: {r.stdout}"


_FAKE_SIGNATURES = r"""
import inspect, sys, torch
recorded = {}
original = torch.library.register_fake


def recording(op, *args, **kwargs):
    register = original(op, *args, **kwargs)

    def keep(fn):
        recorded[op.split("::")[-1]] = fn
        return register(fn)
    return keep


torch.library.register_fake = recording
""" + _FAKES + r"""
bad = []
for op, schema in defs.items():
    args = torch._C.parse_schema("hybridq::" + schema).arguments
    want = [(a.name, a.has_default_value()) for a in args]
    params = list(inspect.signature(recorded[op]).parameters.values())
    rest = [i for i, p in enumerate(params) if p.kind is p.VAR_POSITIONAL]  # (`*rest`: the schema's remaining ones)
    if rest:
        params, want = params[:rest[0]], want[:rest[0]]
    got = [(p.name, p.default is not inspect.Parameter.empty) for p in params]
    if got != want:
        bad.append(f"{op}: fake {got}, schema {want}")
print("MISMATCHED", bad)
"""


def test_every_fake_takes_its_ops_schema_arguments():
    """Each fake's parameters are its op's schema arguments: the same names in the same order, defaults where the
    schema has them, up to a `*rest` that takes the remaining ones (a fake behind its op's schema -- a new argument
    -- fails only when torch.compile traces the op on a GPU)."""
    defs = csrc_schemas()
    r = subprocess.run([sys.executable, "-c", _FAKE_SIGNATURES, repr(defs)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MISMATCHED []" in r.stdout, f"fakes whose parameters are not their op's schema: {r.stdout[-3000:]}"


def test_every_declared_op_has_an_implementation():
    """Each op csrc/ declares (`m.def`) is implemented there (`m.impl`) and nothing else is: an op declared without
    a kernel fails only when it is called on a GPU."""
    src = "\n".join(p.read_text() for p in CSRC.rglob("*") if p.suffix in (".cu", ".cpp", ".h", ".cuh"))
    implemented = set(re.findall(r'\bm\.impl\(\s*"(\w+)"', src))
    declared = set(csrc_schemas())
    assert declared == implemented, (f"declared without an implementation: {sorted(declared - implemented)}; "
                                     f"implemented without a declaration: {sorted(implemented - declared)}")
