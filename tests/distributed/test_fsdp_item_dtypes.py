"""A padded all-gather input (an unevenly sharded weight, a Shard(1) expert slot) in 2-byte items is float16 only in a
param group FSDP2 gathers as bytes ([Note: 16-bit items], hybridq/distributed/layout.py): FSDP2's copy-in on CUDA
copies a group whose inputs all share one 16-bit float dtype through fp32, rewriting every NaN bit pattern, which
quantized bytes read as float16 hold. Alone in its group the weight sends int32 items; beside a plain bf16 parameter
(the group's inputs then differ in dtype and FSDP2 copies bytes) float16 ones. Either way the gathered weight is
bitwise the one-device quantization. CPU: gloo world 2; GPU: FSDP2's copy-in op itself, on CUDA."""

from __future__ import annotations

import pytest
import torch

from _harness import spawn
import _item_dtype_jobs as jobs

pytestmark = pytest.mark.distributed

GROUPINGS = {"alone": "torch.int32", "beside a bf16 parameter": "torch.float16"}
KEYS = [f"{case} | {grouping}" for case in jobs.CASES for grouping in GROUPINGS]


@pytest.fixture(scope="module")
def runs() -> dict:
    return spawn(jobs.job_item_dtypes, 2, "gloo")


@pytest.mark.parametrize("key", KEYS)
def test_padded_input_is_float16_only_where_fsdp2_copies_bytes(runs, key):
    want = GROUPINGS[key.split(" | ")[1]]
    for rank, out in enumerate(runs):
        got = out[key]["dtype"]
        assert got == want, f"rank {rank}, {key}: the all-gather input went as {got}, expected {want}"


@pytest.mark.parametrize("key", KEYS)
def test_gathered_weight_is_the_one_device_quantization(runs, key):
    for rank, out in enumerate(runs):
        diffs = out[key]["diffs"]
        assert not diffs, f"rank {rank}, {key}: {len(diffs)} differences, first: {diffs[:3]}"


def test_fsdp2_copies_a_group_of_mixed_dtypes_as_bytes():
    """What the rule relies on (torch 2.11 and 2.13): FSDP2 gathers a group whose inputs differ in dtype as uint8, and
    one whose inputs share a dtype in that dtype."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_all_gather_input_metadatas

    half, bf16 = torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16)
    assert _get_all_gather_input_metadatas([[half], [bf16]])[2] == torch.uint8
    assert _get_all_gather_input_metadatas([[bf16], [half]])[2] == torch.uint8
    assert _get_all_gather_input_metadatas([[half], [half]])[2] == torch.float16


def _every_byte_pair(device) -> torch.Tensor:
    """All 65,536 two-byte patterns, 131,072 bytes."""
    return torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(torch.uint8)


def _copy_in(inp: torch.Tensor) -> torch.Tensor:
    """FSDP2's copy-in op of one rank's single all-gather input, as bytes of its all-gather buffer."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 (registers torch.ops.fsdp)

    n = inp.numel()
    out = torch.empty(2 * n, dtype=inp.dtype, device=inp.device)
    torch.ops.fsdp.all_gather_copy_in([inp], out, [n], n, 0)
    return out[:n].view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_fsdp2_copy_in_keeps_the_bytes_of_integer_items(dtype):
    """uint8 / int32 / int64 items (what a weight alone in its group sends) come through FSDP2's copy-in bit for
    bit (CPU here; the CUDA case below)."""
    b = _every_byte_pair("cpu")
    assert torch.equal(_copy_in(b.view(dtype)), b), f"{dtype}: FSDP2's copy-in changed bytes"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_gpu_fsdp2_copy_in_keeps_the_bytes_of_integer_items(dtype):
    b = _every_byte_pair("cuda")
    got = _copy_in(b.view(dtype))
    assert torch.equal(got, b), f"{dtype}: FSDP2's copy-in on CUDA changed {int((got != b).sum())} bytes"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fsdp2_copy_in_rewrites_16_bit_nan_patterns(dtype):
    """Why a weight alone in its group sends no float16 items: FSDP2's copy-in of a group of one 16-bit float dtype
    on CUDA (`torch._foreach_copy_` through fp32) rewrites NaN bit patterns. Should torch ever copy them bit for bit,
    this fails, and [Note: 16-bit items] can let float16 items back (2 bytes per element less on the wire)."""
    b = _every_byte_pair("cuda")
    got = _copy_in(b.view(dtype))
    nan = torch.isnan(b.view(dtype))
    changed = (got.view(dtype).view(torch.int16) != b.view(torch.int16))
    assert changed.any(), f"{dtype}: FSDP2's copy-in on CUDA kept every NaN pattern: float16 items would be safe"
    assert not changed[~nan].any(), f"{dtype}: FSDP2's copy-in on CUDA changed non-NaN values"
