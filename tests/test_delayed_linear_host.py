"""hybridq::fp8_linear_delayed's C++ autograd node (csrc/linear_fp8.cpp: the one-op path of an fp8_delayed Linear on
CUDA) on the CPU: built for the host with tests/_linear_host_shim.cpp, its casts and GEMM given the CPU code the
general path runs for them, nn/delayed_linear.py's one-op path (the Python state steps, the op, the node's pre-hook)
is bit for bit the general path over four steps -- outputs, gradients, every quantizer's amax history, scale and
pending flag -- for two delayed recipes x fp32 / bf16 x bias x which of x / weight need gradients x plain, a layer
called twice, activation recompute (replayed casts), batched updates, a state loaded between forward and backward
(tests/_delayed_linear_host.py, in a process of its own). What this cannot see, the CUDA kernels and GEMMs and the
in-place update of dy's state, is tests/test_delayed_fast_path.py's GPU tests."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from torch.utils.cpp_extension import CUDA_HOME

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (the op's source includes CUDA runtime headers: the host build needs them, not the CUDA libraries)
CUDA_HEADERS = [d for d in (os.path.join(CUDA_HOME or "/usr/local/cuda", "include"), "/usr/local/cuda/include")
                if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
@pytest.mark.skipif(not CUDA_HEADERS, reason="needs the CUDA toolkit's headers (cuda_runtime_api.h)")
@pytest.mark.skipif(importlib.util.find_spec("hybridq._C") is not None,
                    reason="a built extension defines the ops the host check defines (the GPU tests cover the op)")
def test_the_delayed_op_path_is_bitwise_the_general_path_on_the_host(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "_delayed_linear_host.py"), str(tmp_path),
                        CUDA_HEADERS[0]],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
                           "PYTHONPATH")]))})
    assert r.returncode == 0, f"the host check failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip().endswith("bitwise: 120 runs of 4 steps; create_graph refused"), r.stdout
