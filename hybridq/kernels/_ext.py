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
from typing import Callable

import torch

log = logging.getLogger("hybridq")

BUILD_HINT = ("build it from the hybridq checkout with `pip install --no-build-isolation -e .` "
              "(or in place: `python setup.py build_ext --inplace`), with a CUDA-enabled torch and nvcc on PATH")
ENV_PATH = "HYBRIDQ_EXT_PATH"  # load this shared library instead of the hybridq._C module
ENV_DISABLE = "HYBRIDQ_DISABLE_CUDA_KERNELS"  # "1": never use the CUDA kernels (references only)

_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "error": None, "warned": False}
# (ops, on_load) of each kernel family that uses the extension, see require()
_required: list[tuple[tuple[str, ...], Callable[[], None]]] = []


def require(ops: tuple[str, ...], on_load: Callable[[], None]) -> None:
    """Declare the `torch.ops.hybridq` ops a kernel module calls (a build without one of them is reported as out of
    date and not used) and what to run once the extension has registered them (their fake implementations).
    Declared when `hybridq.kernels` is imported, before the first load."""
    if (ops, on_load) not in _required:
        _required.append((ops, on_load))


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
                # every op the Python side uses (an older build lacks some: it is reported as out of date, not used)
                required = [op for ops, _ in _required for op in ops]
                missing = [op for op in required if not hasattr(torch.ops.hybridq, op)]
                ok = not missing
                if len(missing) == len(required):
                    err = "the library loaded but registered no hybridq ops"
                elif missing:
                    err = f"the built extension is out of date (no op {', '.join(missing)}); rebuild it"
            except (ImportError, OSError, RuntimeError) as e:
                err = f"{type(e).__name__}: {e}"
        if ok:
            for _, on_load in _required:  # fake implementations for torch.compile / meta tensors
                on_load()
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
