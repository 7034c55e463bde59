"""The GPU tests' condition: a CUDA device and the built hybridq extension (without them the tests skip cleanly)."""

from __future__ import annotations

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
