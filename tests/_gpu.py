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


def sm90_triton_test(available: bool, what: str):
    """The decorator of a GPU test of an sm_90 Triton kernel (`what` names it in the skip reason): marked `gpu`,
    skipped without a CUDA device, an sm_90 one or Triton (`available`, the kernel module's), run under the module's
    `fixed_config` fixture (`default_config_fixture`)."""
    have_cuda = torch.cuda.is_available()
    sm90 = have_cuda and torch.cuda.get_device_capability() == (9, 0)
    marks = [pytest.mark.gpu,
             pytest.mark.skipif(not have_cuda, reason="needs a CUDA device"),
             pytest.mark.skipif(have_cuda and not sm90, reason=f"{what} is sm_90 only (needs a CUDA sm_90 device)"),
             pytest.mark.skipif(have_cuda and not available, reason="needs Triton (with a CUDA device)")]

    def decorate(test):
        for m in marks:
            test = m(test)
        return pytest.mark.usefixtures("fixed_config")(test)
    return decorate


def default_config_fixture(env: str, why: str):
    """A `fixed_config` fixture: `env`=1 -- the kernel's default config for every call (`why`: one compile per
    pairing instead of autotuning each shape) -- except in the tests named "autotuned", which run the autotuner."""
    @pytest.fixture
    def fixed_config(monkeypatch, request):
        if "autotuned" not in request.node.name:
            monkeypatch.setenv(env, "1")
    fixed_config.__doc__ = f"{env}=1 ({why}) except in the tests named 'autotuned'"
    return fixed_config
