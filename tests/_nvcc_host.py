"""A C++ driver over a csrc/ header compiled for the host with nvcc: the kernels' device functions checked on the CPU
(tests skip where nvcc is missing)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

NVCC = shutil.which("nvcc")
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def build_host_driver(directory: pathlib.Path, source: str, header: str, flags: tuple[str, ...] = ()) -> str:
    """Compile `source` (a driver including csrc/`header`) in `directory`; the executable's path."""
    src, exe = directory / "driver.cu", directory / "driver"
    src.write_text(source)
    r = subprocess.run([NVCC, "-O2", "-std=c++17", *flags, "-I", CSRC, str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"nvcc failed to compile csrc/{header} for the host:\n{r.stderr[-3000:]}"
    return str(exe)
