"""Every benchmark script that starts a process group leaves through `fsdp_setup.exit_without_finalization` (as
launch/train.py leaves through `os._exit`): DTensors and FSDP2 state outliving `main()` keep gloo's worker threads
alive past `destroy_process_group`, and the interpreter's finalization then aborted bench_tp's TP=4 smoke run once
("terminate called without an active exception", 2026-11-29). The helper exits with the given code, output
flushed."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
STARTS_A_GROUP = {"init_process_group", "init_world", "init_distributed"}  # (the last: the job's)


def _called_names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return node
    return None


SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py")
                 if p.name != "fsdp_setup.py" and _called_names(ast.parse(p.read_text())) & STARTS_A_GROUP)


def test_the_scripts_that_start_a_process_group_are_found():
    assert {"bench_tp.py", "bench_fsdp.py", "profile_step.py"} <= {p.name for p in SCRIPTS}, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_that_starts_a_process_group_leaves_without_finalization(script):
    main = _main_block(ast.parse(script.read_text()))
    assert main is not None, f"{script.name}: no `if __name__ == '__main__':` block"
    last = main.body[-1]
    assert isinstance(last, ast.Expr) and "exit_without_finalization" in _called_names(last), \
        f"{script.name}: its main block ends with {ast.unparse(last)!r}, not exit_without_finalization(...)"


def test_exit_without_finalization_exits_with_the_code_and_flushed_output():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fsdp_setup import exit_without_finalization; "
            "print('before exit', end=''); sys.stderr.write('err'); exit_without_finalization(3)")
    r = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout, r.stderr) == (3, "before exit", "err"), (r.returncode, r.stdout, r.stderr[-2000:])
