"""The package's import structure: the dispatch leaf, no import cycle, formats depending only on the leaves.

Imports are read from the source (module level and inside functions, which run at call time; `if
TYPE_CHECKING:` blocks are skipped), so a lazy import that closes a cycle is caught too.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hybridq"
LEAVES = ("hybridq.dispatch", "hybridq.enums", "hybridq.errors", "hybridq.switches", "hybridq.torch_private",
          "hybridq.weight_forms")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str) -> set[str]:
    """The hybridq modules `name` imports at run time."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for c in child.orelse:
                    visit(c)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name.startswith("hybridq"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if not target.startswith("hybridq"):
                    continue
                for a in child.names:  # `from pkg import submodule` depends on the submodule only
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in MODULES else target)
            visit(child)

    visit(ast.parse(path.read_text()))
    out.discard(name)
    return {m for m in out if m in MODULES}


GRAPH = {m: _imports(m) for m in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_no_import_cycle_in_the_package():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_no_other_hybridq_module(leaf):
    assert GRAPH[leaf] == set(), f"{leaf} imports {sorted(GRAPH[leaf])}"


def test_formats_depend_only_on_the_leaves_the_tensor_and_each_other():
    allowed = set(LEAVES) | {"hybridq.tensor"}
    for m, deps in GRAPH.items():
        if m.startswith("hybridq.formats"):
            outside = {d for d in deps if not d.startswith("hybridq.formats") and d not in allowed}
            assert not outside, f"{m} imports {sorted(outside)} (formats may use {sorted(allowed)} only)"


def test_tensor_module_does_not_import_formats():
    assert not {d for d in GRAPH["hybridq.tensor"] if d not in LEAVES}, GRAPH["hybridq.tensor"]


# torch's private state: read only through the adapters, so that a torch upgrade touches these files only
TORCH_ADAPTERS = {"hybridq.torch_private", "hybridq.distributed.fsdp_adapter"}
TORCH_PRIVATE = {
    "_local_tensor", "_storage_Use_Count", "_current_graph_task_id",  # DTensor's local tensor, a storage's use
    # count, the autograd graph task
    # FSDP2's state: its param groups, their training state and reduce-scatter, an FSDPParam's module and outputs
    "_get_fsdp_state", "_fsdp_param_group", "_fsdp_param_groups", "_training_state", "_module_info",
    "_reduce_scatter_comm", "all_gather_outputs", "post_forward_mesh_info",
}


def _private_reads(path: pathlib.Path) -> list[str]:
    """`line: name` of every read of a TORCH_PRIVATE attribute (attribute access or a getattr / setattr / hasattr
    string) and every import of FSDP2's private modules in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in TORCH_PRIVATE:
            out.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in TORCH_PRIVATE:
            out.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.fsdp._"):
            out.append(f"{node.lineno}: from {node.module} import ...")
    return out


def test_torch_private_state_is_read_only_through_the_adapters():
    found = {m: _private_reads(p) for m, p in MODULES.items() if m not in TORCH_ADAPTERS}
    found = {m: r for m, r in found.items() if r}
    assert not found, ("torch private state read outside " + ", ".join(sorted(TORCH_ADAPTERS)) + " (use "
                       "hybridq.torch_private.local_tensor / storage_use_count or distributed.fsdp_adapter): "
                       + "; ".join(f"{m} {r}" for m, r in sorted(found.items())))


# ---- a format lives in one module (docs/architecture.md "Extension points"; fp8_rowwise is the worked example) ----

REPO = ROOT.parent
# where the rowwise FP8 format may be named: its module, the export lines, its documentation and its tests, the
# training job's torch-free preset list and the Linear benchmark's rows; nothing else in the package
FORMAT_EXAMPLE_FILES = {
    "hybridq/formats/float8_rowwise.py", "hybridq/formats/__init__.py", "hybridq/__init__.py",
    "docs/numerics.md", "docs/architecture.md", "tests/_format_cases.py", "tests/test_format_float8_rowwise.py",
    "tests/distributed/test_rowwise_preset.py", "tests/test_architecture.py", "launch/config.py",
    "docs/training-job.md", "README.md", "docs/formats-and-recipes.md",  # (the user guide's format / preset tables)
    "BENCHMARKS.md",  # (measurements name the presets they ran)
    # its CUDA kernel (docs/architecture.md "a CUDA kernel for a format": the policy header and the binding file name
    # it by their file names only) and that kernel's GPU tests
    "hybridq/kernels/cuda_fp8_rowwise.py", "tests/test_cuda_fp8_rowwise.py",
    # a test that pins each preset's expected behaviour by name (a specification table, not a derivation)
    "tests/distributed/test_sequence_plan.py",
}


def test_the_rowwise_format_is_named_only_in_the_documented_files():
    names = re.compile(r"\b(float8_rowwise|Float8Rowwise\w*|fp8_rowwise|fp8rw_\w+)\b")
    found = set()
    for path in REPO.rglob("*"):
        if path.suffix not in (".py", ".md", ".cu", ".cuh", ".h", ".cpp", ".sh") or not path.is_file():
            continue
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith((".", "build/")) or "/." in rel:
            continue
        if names.search(path.read_text(errors="replace")):
            found.add(rel)
    extra = sorted(found - FORMAT_EXAMPLE_FILES)
    assert not extra, f"the rowwise FP8 format is named outside the files a format touches: {extra}"
    package = sorted(f for f in found if f.startswith("hybridq/"))
    assert package == ["hybridq/__init__.py", "hybridq/formats/__init__.py", "hybridq/formats/float8_rowwise.py",
                       "hybridq/kernels/cuda_fp8_rowwise.py"], \
        f"a format is one module (+ its CUDA kernel module) and its export lines; in the package it is named in {package}"


# closed sets (hybridq.enums): members inside the package, strings only at the API boundary (parsed there)
def _closed_values() -> set[str]:
    import enum

    import hybridq.enums as enums

    return {m.value for e in vars(enums).values()
            if isinstance(e, type) and issubclass(e, enum.Enum) and e.__module__ == enums.__name__ for m in e}


DIRECTION_METHODS = {"part", "has", "only", "_only", "ensure_direction", "derive_part"}
# a literal that is not a member of the closed set it spells: (module, value) -> what it is
NOT_CLOSED = {("hybridq.nn.replaceable", "weight"): "a parameter's name"}


def _closed_literals(name: str, path: pathlib.Path, values: set[str]) -> list[str]:
    """`line: what` of every comparison against a closed-set string (==, !=, in a tuple / set / list of them) and
    every direction string passed to a method taking a direction."""
    out = []

    def strings(node) -> list[str]:
        elts = node.elts if isinstance(node, (ast.Tuple, ast.Set, ast.List)) else [node]
        return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for s in (s for operand in [node.left, *node.comparators] for s in strings(operand)):
                if s in values and (name, s) not in NOT_CLOSED:
                    out.append(f"{node.lineno}: compared with {s!r}")
        elif isinstance(node, ast.Call):
            method = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if method in DIRECTION_METHODS:
                for s in (s for a in node.args for s in strings(a)):
                    if s in ("rowwise", "columnwise"):
                        out.append(f"{node.lineno}: {method}({s!r})")
    return out


def test_closed_sets_are_enum_members_inside_the_package():
    values = _closed_values()
    found = {m: _closed_literals(m, p, values) for m, p in MODULES.items() if m != "hybridq.enums"}
    found = {m: r for m, r in found.items() if r}
    assert not found, ("string literals of hybridq.enums' closed sets inside the package (use the members; parse a "
                       "user's string at the API boundary with `Enum.parse`): "
                       + "; ".join(f"{m} {r}" for m, r in sorted(found.items())))


def test_test_files_have_unique_basenames():
    """tests/ and its subfolders are not packages (no __init__.py), so pytest imports each test file by its basename:
    two files of one name make the whole run stop at collection ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT.parent / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    dupes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not dupes, f"test files sharing a basename: {dupes}"
