"""The extension's C++ code that calls one of its own ops through a typed dispatcher handle
(`findSchemaOrThrow("hybridq::op").typed<Sig>()`) names a C++ signature that must match the op's schema argument for
argument: a mismatch compiles, and fails only at the handle's first call on a GPU (as a schema's new optional
argument once broke every fp8_block Linear). Read from the sources, so CI checks it without a build."""

from __future__ import annotations

import re

import pytest
from _op_schemas import CSRC, arguments, csrc_schemas, split_top

# schema argument type -> the C++ parameter type a typed handle declares for it
CPP_OF = {"Tensor": "const Tensor&", "Tensor?": "const std::optional<Tensor>&", "int": "int64_t", "float": "double",
          "bool": "bool", "ScalarType": "at::ScalarType", "int[]": "at::IntArrayRef", "float[]": "at::ArrayRef<double>",
          "Tensor[]": "at::TensorList"}


def _sources() -> str:
    return "\n".join(p.read_text() for p in sorted(CSRC.rglob("*")) if p.suffix in (".cpp", ".cu", ".h", ".cuh"))


def _handles(src: str) -> list[tuple[str, str, list[str]]]:
    """(op, signature alias, its C++ parameter types) of every typed handle of a hybridq op."""
    aliases = {m.group(1): split_top(m.group(2)) for m in
               re.finditer(r"using (\w+)\s*=\s*[^;]*?\(((?:[^()]|\([^()]*\))*)\)\s*;", src)}
    found = []
    for m in re.finditer(r'findSchemaOrThrow\("hybridq::(\w+)",\s*""\)\s*\.typed<(\w+)>', src):
        found.append((m.group(1), m.group(2), [" ".join(t.split()) for t in aliases[m.group(2)]]))
    return found


HANDLES = _handles(_sources())


def test_the_sources_hold_typed_handles_to_check():
    assert HANDLES, "no typed dispatcher handle of a hybridq op found in csrc/: the pattern no longer matches"


@pytest.mark.parametrize("op,alias,params", HANDLES, ids=[f"{op}-{alias}" for op, alias, _ in HANDLES])
def test_typed_handle_matches_its_ops_schema(op, alias, params):
    schemas = csrc_schemas()
    assert op in schemas, f"hybridq::{op} has a typed handle ({alias}) but no m.def schema in csrc/"
    want = [CPP_OF[t] for t, _, _ in arguments(schemas[op])]
    assert params == want, f"hybridq::{op}: the typed handle {alias} declares {params}, the schema needs {want}"
