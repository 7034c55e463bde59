"""The suite's terminal output stays short: tables and skip reasons go to a file named in one line
(tests/conftest.py)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

_TESTS = '''
import pytest

def test_table(summary_table):
    summary_table("bytes per element", "preset  bytes\\nmxfp8   1.03")

@pytest.mark.gpu
def test_needs_gpu():
    pytest.skip("needs a CUDA device")

def test_other_skip():
    pytest.skip("torchao is not installed")
'''


def test_tables_and_skips_go_to_a_file_named_in_one_line(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    out = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    after_dots = out[1:]
    assert len(after_dots) <= 3, "terminal summary grew:\n" + r.stdout
    assert "hybridq: 2 skipped (1 need a CUDA device, more GPUs or the built extension; 1 other)" in out, r.stdout
    path_line = next(line for line in out if line.startswith("hybridq: the tests' tables and every skip reason: "))
    report = pathlib.Path(path_line.split(": ", 2)[2]).read_text()
    assert "== bytes per element\npreset  bytes\nmxfp8   1.03" in report
    assert "test_other_skip" in report and "torchao is not installed" in report
    assert "bytes per element" not in r.stdout
