"""Every Python call of one of the extension's ops (`torch.ops.hybridq.<op>(...)`, `.default(...)`, `ops().<op>(...)`
or through a local `ops = torch.ops.hybridq`) in the package, the benchmarks, the training job and the tests passes
arguments its op's schema takes: no more positional arguments than it has, only its keyword names, every argument
without a default given; and a call unpacked into names (`a, b = torch.ops.hybridq.<op>(...)`) unpacks as many
values as the op returns in a tuple (a single tensor would unpack along its first dim). A call behind a changed
schema fails -- or, unpacked, silently misreads -- only when it runs on a GPU; read from the sources, so CI checks it
without a build."""

from __future__ import annotations

import ast

import pytest
from _op_schemas import ROOT, arguments, csrc_schemas, returns

SCHEMAS = {op: arguments(s) for op, s in csrc_schemas().items()}
RETURNS = {op: returns(s) for op, s in csrc_schemas().items()}
FOLDERS = ("hybridq", "benchmarks", "launch", "tests")


def _op_of(func: ast.expr, aliases: set[str]) -> str | None:
    """The op a call's callee names, or None."""
    if isinstance(func, ast.Attribute) and func.attr == "default":
        func = func.value
    if not isinstance(func, ast.Attribute) or func.attr not in SCHEMAS:
        return None
    owner = func.value
    if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id in ("ops", "_ops"):
        return func.attr
    if isinstance(owner, ast.Name) and owner.id in aliases:
        return func.attr
    return func.attr if ast.unparse(owner) == "torch.ops.hybridq" else None


def _call_sites() -> tuple[list[tuple[str, str, ast.Call]], list[tuple[str, str, int]]]:
    """(every op call, every op call unpacked into names: where, op, how many names)."""
    sites, unpacked = [], []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                       and ast.unparse(node.value) == "torch.ops.hybridq" for t in node.targets
                       if isinstance(t, ast.Name)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and (op := _op_of(node.func, aliases)) is not None:
                    sites.append((f"{path.relative_to(ROOT)}:{node.lineno}", op, node))
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1
                        and isinstance(node.targets[0], (ast.Tuple, ast.List))
                        and not any(isinstance(e, ast.Starred) for e in node.targets[0].elts)
                        and (op := _op_of(node.value.func, aliases)) is not None):
                    unpacked.append((f"{path.relative_to(ROOT)}:{node.lineno}", op, len(node.targets[0].elts)))
    return sites, unpacked


SITES, UNPACKED = _call_sites()


def test_the_sources_hold_op_calls_to_check():
    assert len(SITES) > 40, f"only {len(SITES)} op calls found: the patterns no longer match the sources"


@pytest.mark.parametrize("where,op,call", SITES, ids=[w for w, _, _ in SITES])
def test_op_call_passes_what_its_schema_takes(where, op, call):
    args = SCHEMAS[op]
    names = [name for _, name, _ in args]
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return  # (*args / **kwargs: their length is not in the source)
    positional, keywords = len(call.args), [k.arg for k in call.keywords]
    assert positional <= len(args), f"{where}: hybridq::{op} takes {len(args)} arguments, the call passes {positional}"
    unknown = [k for k in keywords if k not in names]
    assert not unknown, f"{where}: hybridq::{op} has no argument {unknown} (its arguments: {names})"
    given = set(names[:positional]) | set(keywords)
    missing = [name for _, name, has_default in args if not has_default and name not in given]
    assert not missing, f"{where}: hybridq::{op} needs {missing}, the call does not pass them"


@pytest.mark.parametrize("where,op,names", UNPACKED, ids=[w for w, _, _ in UNPACKED])
def test_unpacked_op_call_takes_as_many_values_as_its_op_returns(where, op, names):
    assert RETURNS[op] is not None, f"{where}: hybridq::{op} returns one value, the call unpacks it into {names} names"
    assert names == RETURNS[op], f"{where}: hybridq::{op} returns {RETURNS[op]} values, the call unpacks {names}"
