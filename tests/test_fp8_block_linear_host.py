"""hybridq::fp8_block_linear's C++ autograd node (csrc/linear_fp8_block.cpp) on the CPU: built for the host, with the
quantize and GEMM ops it calls given the CPU code the Python node runs for them, its output and gradients are bit for
bit those of float8_graph's Python node (`_Float8GraphLinear`) for every variant the op distinguishes -- three block
casts x save_original_input x which of x / weight / bias need gradients x bf16 / fp32 x x quantized before the call
or by the op x saved-tensor hooks x a plain weight or one handed over quantized (FSDP2's gathered weight, its
columnwise tensors refilled in place before backward), non-finite values, inference mode -- and its saved tensors are
the node's; and the same build's gathered phase ops (hybridq::fp8_block_linear_fprop / fp8_block_linear_grads) as
the compiled Linear's gathered ops call them, bit for bit float8_graph's Python phases -- three block casts x
save_original_input x dgrad / wgrad x bias x bf16 / fp32, non-finite values -- results and strides
(tests/_block_linear_host.py, in a process of its own). What this cannot see, the CUDA kernels and GEMMs themselves,
is tests/test_fp8_block_linear_op.py (GPU)."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
@pytest.mark.skipif(importlib.util.find_spec("hybridq._C") is not None,
                    reason="a built extension defines the ops the host check defines (the GPU tests cover the op)")
def test_the_cpp_node_is_bitwise_the_python_node_on_the_host(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "_block_linear_host.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"the host check failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip().endswith("bitwise: 775 variants, 75 phase variants; 5 refusals"), r.stdout
