"""What a fresh environment sees: `import hybridq` without torch (or with an old one) is one ImportError saying how
to install PyTorch; numpy is not needed to import hybridq; the package declares its license."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _import_hybridq(prelude: str, extra_path: list[str] | None = None) -> subprocess.CompletedProcess:
    """`import hybridq` in an isolated interpreter without site-packages (-I -S): only the repository and
    `extra_path` are importable, so torch is absent unless a test provides one."""
    paths = [str(REPO)] + (extra_path or [])
    code = f"import sys; sys.path[:0] = {paths!r}; {prelude}; import hybridq"
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)


def test_import_without_torch_says_how_to_install_it():
    r = _import_hybridq("pass")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: hybridq needs PyTorch >= 2.11: install it first"), r.stderr
    assert "pip install torch" in last and "ModuleNotFoundError" not in r.stderr, r.stderr


def test_import_with_an_old_torch_names_its_version(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.10.1+cu128"\n')
    r = _import_hybridq("pass", [str(tmp_path)])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: hybridq needs PyTorch >= 2.11, found torch 2.10.1+cu128"), r.stderr


def test_import_needs_no_numpy():
    # numpy blocked: torch itself warns at its own import ("Failed to initialize NumPy"); hybridq must import and
    # must not import numpy itself
    code = ("import sys; sys.modules['numpy'] = None; import hybridq; "
            "assert [m for m in sys.modules if m.startswith('numpy.')] == [], 'hybridq imported numpy'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_license_is_declared():
    assert (REPO / "LICENSE").read_text().startswith("BSD 3-Clause License")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "BSD-3-Clause"}
