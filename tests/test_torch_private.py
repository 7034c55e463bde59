"""hybridq.torch_private's current-stream queries (the gather hooks and grouped layers ask at every call): the same
stream as `torch.cuda.current_stream`, on the default stream and inside a side stream's context."""

from __future__ import annotations

import pytest
import torch

from hybridq.torch_private import current_raw_stream, current_stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("where", ["default", "side"])
def test_current_stream_is_torch_current_stream(where):
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side) if where == "side" else torch.cuda.stream(torch.cuda.current_stream(dev)):
        want = torch.cuda.current_stream(dev)
        got = current_stream(dev)
        assert got == want, f"{where}: current_stream gave stream {got.cuda_stream:#x}, torch {want.cuda_stream:#x}"
        assert current_raw_stream(dev) == want.cuda_stream, f"{where}: raw handle differs"
        assert current_stream(torch.device("cuda")) == want, f"{where}: the device without index differs"
