"""The extension's op schemas as csrc/ declares them (`m.def("...")`, adjacent string literals joined), read from the
sources: what the tests that check the Python and C++ sides against the ops need, without a build."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
_DEF = re.compile(r'\bm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)')
_LIT = re.compile(r'"((?:[^"\\]|\\.)*)"')


def schemas(path: pathlib.Path) -> dict[str, str]:
    """The op schemas a C++ file declares, by op name."""
    out = {}
    for m in _DEF.finditer(path.read_text()):
        schema = "".join(_LIT.findall(m.group(1)))
        out[schema.split("(", 1)[0]] = schema
    return out


def csrc_schemas() -> dict[str, str]:
    """Every op schema of csrc/'s .cu / .cpp files, by op name."""
    out = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cu", ".cpp"):
            out.update(schemas(path))
    return out


def split_top(text: str) -> list[str]:
    """`text` split at the commas outside <...>, (...) and [...]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "<([") - (ch in ">)]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def arguments(schema: str) -> list[tuple[str, str, bool]]:
    """(type as declared, name, has a default) of each argument of `schema`."""
    inner = schema.split("(", 1)[1].rsplit(") ->", 1)[0]
    out = []
    for arg in split_top(inner):
        decl = arg.split("=", 1)[0].split()
        out.append((decl[0], decl[-1], "=" in arg))
    return out


def returns(schema: str) -> int | None:
    """How many values `schema` returns as a tuple; None for a single value (or none)."""
    ret = schema.rsplit("->", 1)[1].strip()
    return len(split_top(ret[1:-1])) if ret.startswith("(") else None
