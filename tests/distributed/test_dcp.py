"""torch.distributed.checkpoint from a plain user script on an FSDP2 hybridq model (apply_hybrid_fsdp, then
fully_shard) and its optimizer, with torch's standard helpers (get_state_dict / set_state_dict + dcp.save /
dcp.load), on gloo: saved at world size 2, loaded at 2 (the next step continues bit for bit) and at 1, saved at 1
and loaded at 2; loaded into a plain PyTorch model and into one with quantized parameters; and
`hybridq.export_state_dict`'s single file loads into a plain nn.Module."""

from __future__ import annotations

import pytest

from _harness import spawn
import _dcp_jobs

pytestmark = pytest.mark.distributed


def test_dcp_save_and_load_across_world_sizes_and_into_a_plain_model(tmp_path):
    folder = str(tmp_path)
    saved = spawn(_dcp_jobs.job_save, 2, "gloo", folder=folder)
    assert saved[0]["refused"].endswith("export2.pt exists; pass overwrite=True to replace it"), saved[0]
    assert saved[1]["refused"] == saved[0]["refused"], "every rank refuses the overwrite"

    for r, out in enumerate(saved):  # loaded back at world size 2 into a fresh model in the same job
        assert not out["diffs"], "\n".join(out["diffs"])
        assert out["plain_out_finite"]
        assert out["loss3"] == out["saved_loss3"], f"rank {r}: step 3 after loading at the same world size"

    (one,) = spawn(_dcp_jobs.job_load, 1, "gloo", folder=folder, saved_world=2)
    assert not one["diffs"], "\n".join(one["diffs"])

    back = spawn(_dcp_jobs.job_load, 2, "gloo", folder=folder, saved_world=1)
    for out in back:
        assert not out["diffs"], "\n".join(out["diffs"])
