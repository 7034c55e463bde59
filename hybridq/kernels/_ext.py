"""Loading the optional CUDA extension `hybridq._C` (csrc/), which registers the `torch.ops.hybridq.*` ops.

The extension is loaded on first use with a CUDA tensor. On a machine without CUDA nothing is loaded and
nothing is said; on a CUDA machine without a (working) build, one warning says how to build it and the
pure-PyTorch references run instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings

import torch

log = logging.getLogger("hybridq")

BUILD_HINT = ("build it from the hybridq checkout with `pip install --no-build-isolation -e .` "
              "(or in place: `python setup.py build_ext --inplace`), with a CUDA-enabled torch and nvcc on PATH")
ENV_PATH = "HYBRIDQ_EXT_PATH"  # load this shared library instead of the hybridq._C module
ENV_DISABLE = "HYBRIDQ_DISABLE_CUDA_KERNELS"  # "1": never use the CUDA kernels (references only)

# every op the Python side uses (an older build lacks some: it is reported as out of date, not used)
REQUIRED_OPS = ("fp8_tensor_quantize", "fp8_tensor_quantize_delayed", "fp8_tensor_quantize_grouped",
                "fp8_block_quantize", "mxfp8_quantize", "nvfp4_quantize", "nvfp4_quantize_grouped", "amax",
                "rms_norm_forward", "rms_norm_backward", "dequantize_fp8", "dequantize_nvfp4", "fp8_delayed_update",
                "transpose_bytes")

_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "error": None, "warned": False}


def load() -> bool:
    """Load the extension once; True when its ops are registered."""
    if _state["tried"]:
        return _state["ok"]
    with _lock:
        if _state["tried"]:
            return _state["ok"]
        ok, err = False, None
        if os.environ.get(ENV_DISABLE, "") == "1":
            err = f"{ENV_DISABLE}=1"
        else:
            try:
                path = os.environ.get(ENV_PATH)
                if path:
                    torch.ops.load_library(path)
                else:
                    importlib.import_module("hybridq._C")
                missing = [op for op in REQUIRED_OPS if not hasattr(torch.ops.hybridq, op)]
                ok = not missing
                if len(missing) == len(REQUIRED_OPS):
                    err = "the library loaded but registered no hybridq ops"
                elif missing:
                    err = f"the built extension is out of date (no op {', '.join(missing)}); rebuild it"
            except (ImportError, OSError, RuntimeError) as e:
                err = f"{type(e).__name__}: {e}"
        if ok:
            from . import cuda_ops  # noqa: F401  (fake implementations for torch.compile / meta tensors)
        _state.update(tried=True, ok=ok, error=err)
        return ok


def error() -> str | None:
    """Why the extension is not available (None when it is, or was never needed)."""
    return _state["error"]


def available_for(device: torch.device) -> bool:
    """True when the CUDA kernels can run on `device`. Loads the extension on first use; on a CUDA device
    without it, warns once (clearly, with the build command) and returns False."""
    if device.type != "cuda":
        return False
    if load():
        return True
    if not _state["warned"] and os.environ.get(ENV_DISABLE, "") != "1":
        _state["warned"] = True
        msg = (f"hybridq: the CUDA extension hybridq._C is not available ({_state['error']}); quantizing CUDA "
               f"tensors falls back to the slow pure-PyTorch references. To use the CUDA kernels, {BUILD_HINT}.")
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return False
