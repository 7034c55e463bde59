"""Compiled blocks (Inductor) whose per-tensor FP8 Linears FSDP2 all-gathers quantized and read hq.RMSNorm / SwiGLU
outputs: the Linears' shared input cast takes the producer's max|y| from the graph instead of reading y again
([Note: known max|y| in the graph], hybridq/nn/compiled_amax.py) -- 3 of each block's 4 input casts (the norms' and
SwiGLU's outputs; wo reads a sum) -- bit for bit the eager model (losses, gradients, parameters after 2 AdamW steps),
with non-finite inputs too. With the switch off, or under aot_eager (no Inductor pass), every cast reads its input."""

from __future__ import annotations

import pytest

from _harness import job_several, nccl_devices, spawn
import _known_amax_jobs as jobs
from _known_amax_jobs import CASTS_PER_BLOCK, KNOWN_PER_BLOCK, LAYERS

pytestmark = pytest.mark.distributed

_JOB = jobs.known_amax_step
# name: (job kwargs, casts handed a max|x| per compiled step)
CASES = {
    "inductor": ({}, KNOWN_PER_BLOCK * LAYERS),
    "inductor, non-finite input": ({"nonfinite": True}, KNOWN_PER_BLOCK * LAYERS),
    "inductor, switch off": ({"switch": False}, 0),
    "aot_eager": ({"compiler": "aot_eager"}, 0),
}


@pytest.fixture(scope="module")
def results() -> dict:
    return spawn(job_several, 1, "gloo", jobs={name: (_JOB, kw) for name, (kw, _) in CASES.items()})[0]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_casts_take_the_producers_max_cpu(results, case):
    r, want = results[case], CASES[case][1]
    assert r["casts"] and all(c == CASTS_PER_BLOCK * LAYERS for c in r["casts"]), \
        f"{case}: input casts per compiled step {r['casts']}, want {CASTS_PER_BLOCK * LAYERS}"
    assert all(k == want for k in r["known"]), f"{case}: casts handed a max|x| per step {r['known']}, want {want}"


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_with_known_max_is_bitwise_eager_cpu(results, case):
    r = results[case]
    assert not r["diffs"], f"{case}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_devices(1), reason="needs a CUDA device + NCCL")
def test_compiled_casts_take_the_kernels_max_gpu():
    """nccl, world size 1, Inductor: the norm / SwiGLU kernels' max|y| handed to the extension's cast
    (`hybridq::fp8_tensor_quantize` with its amax argument), bitwise the eager model (whose casts take it through
    known_amax)."""
    out = spawn(job_several, 1, "nccl", jobs={"inductor": (_JOB, {}), "inductor, non-finite input": (
        _JOB, {"nonfinite": True})})[0]
    for name, r in out.items():
        assert not r["diffs"], f"{name}: compiled differs from eager:\n" + "\n".join(r["diffs"][:20])
        assert r["known"] and all(k == KNOWN_PER_BLOCK * LAYERS for k in r["known"]), \
            f"{name}: casts handed a max|x| per step {r['known']}, want {KNOWN_PER_BLOCK * LAYERS}"
