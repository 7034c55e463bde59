"""hybridq build: the pure-Python package always; the CUDA extension `hybridq._C` (csrc/) only when a
CUDA-enabled torch and nvcc are available at build time.

    pip install -e .                           # CPU machine: pure Python (build isolation hides torch: no extension)
    pip install --no-build-isolation -e .      # GPU machine: builds hybridq._C against the installed torch
    python setup.py build_ext --inplace        # GPU machine: (re)build the extension in place, next to the sources

Environment:
    HYBRIDQ_NO_CUDA_EXT=1      skip the extension even where it could be built
    HYBRIDQ_CUDA_ARCHS="90a;100"   targets (default: 90a, plus 100 when nvcc knows sm_100)
    HYBRIDQ_TILE_VARIANTS=1    also compile the alternative tile-kernel configurations (bf16) that
                               benchmarks/bench_kernels.py --tile-cfgs compares (HYBRIDQ_TILE_CFG at run time)
    MAX_JOBS=N                 parallel compile jobs (ninja)

The extension links the shared libstdc++ that torch itself loaded. Some toolchains link libstdc++ statically
into shared objects; a private copy inside hybridq._C then mixes its code with the process's libstdc++ data
(locale facets, the `std::locale::id` registry) and the first integer formatted into an error message
(TORCH_CHECK -> c10::str -> std::ostream) crashed the process with SIGSEGV instead of raising.
"""

import glob
import os
import subprocess
import sys

from setuptools import setup

# ops.cpp: the module and the format-independent ops; linear_fp8.cpp / linear_fp8_block.cpp: the per-tensor / block
# FP8 Linear ops (C++ autograd);
# cublaslt_fp8.cpp: the FP8 GEMM through cuBLASLt with cached plans; grouped_fp8_tensor_gemm.cpp: the per-tensor FP8
# experts' cuBLAS loops; every .cu is one kernel family that registers its own ops (a new format's
# csrc/quantize_<format>.cu is picked up here)
SOURCES = ["csrc/ops.cpp", "csrc/linear_fp8.cpp", "csrc/linear_fp8_block.cpp", "csrc/cublaslt_fp8.cpp",
           "csrc/grouped_fp8_tensor_gemm.cpp"] + sorted(
    glob.glob("csrc/*.cu"))


def _say(msg: str) -> None:
    print(f"hybridq setup: {msg}", file=sys.stderr)


def _nvcc_archs(cuda_home: str) -> set:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {line.strip().replace("compute_", "") for line in out.split()}


def _mapped(prefix: str) -> list:
    """The files of the shared libraries named `prefix`* this process has mapped (torch is imported: its own)."""
    paths = set()
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                f = line.split()
                if len(f) >= 6 and os.path.basename(f[-1]).startswith(prefix):
                    paths.add(f[-1])
    except OSError:
        pass
    return sorted(p for p in paths if os.path.isfile(p))


def _torch_libstdcxx() -> list:
    """Link flags that make hybridq._C use the libstdc++ torch runs with (Linux): that shared library by path,
    and every symbol of a static archive the toolchain still adds kept local (--exclude-libs)."""
    if not sys.platform.startswith("linux"):
        return []
    flags = ["-Wl,--exclude-libs,ALL"]
    paths = _mapped("libstdc++.so")
    flags += [paths[0]] if paths else ["-l:libstdc++.so.6"]
    return flags


def _torch_cublaslt(cuda_home: str) -> tuple:
    """(link flags, C++ flags) for cuBLASLt (csrc/cublaslt_fp8.cpp calls it directly): the libcublasLt torch loaded
    (the same library and version as torch's own GEMMs), by path; its headers from the toolkit, else from the package
    that library came from (pip's nvidia-*-cu13 wheels ship both), searched after every other include directory
    (-idirafter: the toolkit's headers stay first; nvcc's .cu files never see it)."""
    paths = _mapped("libcublasLt.so")
    link = [paths[0]] if paths else ["-lcublasLt"]
    cxx = []
    if not os.path.isfile(os.path.join(cuda_home, "include", "cublasLt.h")) and paths:
        inc = os.path.join(os.path.dirname(os.path.dirname(paths[0])), "include")
        if os.path.isfile(os.path.join(inc, "cublasLt.h")):
            cxx.append(f"-idirafter{inc}")
    return link, cxx


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
    if os.environ.get("HYBRIDQ_TILE_VARIANTS", "") == "1":
        nvcc.append("-DHQ_TILE_VARIANTS")
    lt_link, lt_cxx = _torch_cublaslt(CUDA_HOME)
    link = _torch_libstdcxx() + lt_link
    _say(f"building the CUDA extension hybridq._C for {', '.join('sm_' + a for a in archs)}; link flags {link}")
    ext = CUDAExtension("hybridq._C", SOURCES, include_dirs=[os.path.abspath("csrc")],
                        extra_compile_args={"cxx": ["-O3"] + lt_cxx, "nvcc": nvcc}, extra_link_args=link)
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)}}


setup(**_extension_kwargs())
