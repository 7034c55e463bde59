"""hybridq build: the pure-Python package always; the CUDA extension `hybridq._C` (csrc/) only when a
CUDA-enabled torch and nvcc are available at build time.

    pip install -e .                           # CPU machine: pure Python (build isolation hides torch: no extension)
    pip install --no-build-isolation -e .      # GPU machine: builds hybridq._C against the installed torch
    python setup.py build_ext --inplace        # GPU machine: (re)build the extension in place, next to the sources

Environment:
    HYBRIDQ_NO_CUDA_EXT=1      skip the extension even where it could be built
    HYBRIDQ_CUDA_ARCHS="90a;100"   targets (default: 90a, plus 100 when nvcc knows sm_100)
    MAX_JOBS=N                 parallel compile jobs (ninja)
"""

import os
import subprocess
import sys

from setuptools import setup

SOURCES = ["csrc/ops.cpp", "csrc/quantize_fp8.cu", "csrc/quantize_mxfp8.cu", "csrc/quantize_nvfp4.cu",
           "csrc/amax.cu", "csrc/dequantize.cu"]


def _say(msg: str) -> None:
    print(f"hybridq setup: {msg}", file=sys.stderr)


def _nvcc_archs(cuda_home: str) -> set:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {line.strip().replace("compute_", "") for line in out.split()}


def _gencode(archs) -> list:
    flags = []
    for a in archs:
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    return flags


def _extension_kwargs() -> dict:
    if os.environ.get("HYBRIDQ_NO_CUDA_EXT", "") == "1":
        _say("HYBRIDQ_NO_CUDA_EXT=1: not building the CUDA extension")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as e:  # torch missing at build time (e.g. pip's build isolation): pure Python
        _say(f"torch is not importable at build time ({type(e).__name__}); not building the CUDA extension "
             f"(on a GPU machine use `pip install --no-build-isolation -e .`)")
        return {}
    if torch.version.cuda is None or CUDA_HOME is None:
        _say("no CUDA-enabled torch or no CUDA toolkit; not building the CUDA extension (pure PyTorch references)")
        return {}
    env = os.environ.get("HYBRIDQ_CUDA_ARCHS")
    if env:
        archs = [a for a in env.replace(",", ";").split(";") if a]
    else:
        known = _nvcc_archs(CUDA_HOME)
        archs = ["90a"] + (["100"] if "100" in known else [])
    nvcc = ["-O3", "-std=c++17", "--fmad=false", "-lineinfo", "--expt-relaxed-constexpr"] + _gencode(archs)
    _say(f"building the CUDA extension hybridq._C for {', '.join('sm_' + a for a in archs)}")
    ext = CUDAExtension("hybridq._C", SOURCES, include_dirs=[os.path.abspath("csrc")],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)}}


setup(**_extension_kwargs())
