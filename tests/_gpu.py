"""The GPU tests' condition: a CUDA device and the built hybridq extension (without them the tests skip cleanly)."""

from __future__ import annotations

import contextlib

import pytest
import torch


def extension_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hybridq.kernels import extension_available
    return extension_available()


def gpu(test):
    """Mark a test `gpu` and skip it without a CUDA device and the built extension."""
    return pytest.mark.gpu(pytest.mark.skipif(not extension_ready(),
                                              reason="needs a CUDA device and the built extension")(test))


@contextlib.contextmanager
def no_host_sync():
    """Inside, a CUDA host sync raises (torch's sync debug mode "error"); the work issued before is waited for first."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
