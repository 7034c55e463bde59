"""hybridq.checkpoint: a manifest (name, size, SHA-256 of every file) written after dcp.save and verified before
dcp.load catches what DCP alone loads silently: a changed byte, a missing file, an added file. The distributed case
(2 gloo ranks, an FSDP2 hybridq model, one byte flipped in one rank's shard file) runs a user script's calls; the
missing / extra / damaged-manifest cases use a one-process DCP save."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hybridq
from hybridq.checkpoint import MANIFEST, CheckpointIntegrityError, verify_manifest, write_manifest

from _harness import spawn
import _manifest_jobs


@pytest.mark.distributed
def test_a_flipped_byte_loads_silently_through_dcp_and_is_refused_by_verify_manifest(tmp_path):
    outs = spawn(_manifest_jobs.job_flipped_byte, 2, "gloo", folder=str(tmp_path))
    for rank, out in enumerate(outs):
        assert out["dcp_load_changed"], f"rank {rank}: dcp.load did not change any value (the flip is not visible)"
        assert out["refused"] is not None, f"rank {rank}: verify_manifest passed a checkpoint with a flipped byte"
        assert out["refused"]["file"] == out["target"] and out["refused"]["problem"] == "content", out["refused"]
        assert out["refused"]["message"] == (
            f"checkpoint {tmp_path / 'ck'} is damaged: {out['target']} has other content than the SHA-256 recorded in "
            "manifest.json says (same size, changed bytes)"), out["refused"]["message"]


@pytest.fixture
def saved(tmp_path) -> pathlib.Path:
    """A one-process DCP checkpoint with its manifest."""
    ck = tmp_path / "ck"
    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "nested": {"b": torch.ones(3)}, "step": 7}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(ck))
    assert write_manifest(ck) == ck / MANIFEST
    return ck


def refusal(ck: pathlib.Path) -> CheckpointIntegrityError:
    with pytest.raises(CheckpointIntegrityError) as e:
        verify_manifest(ck)
    return e.value


def test_the_manifest_lists_every_file_and_verifies(saved):
    listed = json.loads((saved / MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in saved.iterdir() if p.name != MANIFEST)
    assert ".metadata" in listed and any(n.endswith(".distcp") for n in listed)
    assert verify_manifest(saved)["files"] == listed
    assert hybridq.checkpoint.verify_manifest is verify_manifest, "importable as hybridq.checkpoint"


def test_a_missing_file_is_named(saved):
    (saved / ".metadata").unlink()
    e = refusal(saved)
    assert (e.file, e.problem) == (".metadata", "missing")
    assert str(e) == f"checkpoint {saved} is damaged: .metadata is missing (listed in manifest.json)"


def test_an_added_file_is_named(saved):
    (saved / "__9_0.distcp").write_bytes(b"x")
    e = refusal(saved)
    assert (e.file, e.problem) == ("__9_0.distcp", "extra")
    assert str(e) == (f"checkpoint {saved} is damaged: __9_0.distcp is not listed in manifest.json (a file added "
                      "after the save)")


def test_a_truncated_file_is_named_with_both_sizes(saved):
    f = next(saved.glob("*.distcp"))
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:-1])
    e = refusal(saved)
    assert (e.file, e.problem) == (f.name, "size")
    assert str(e) == f"checkpoint {saved} is damaged: {f.name} has {size - 1} bytes, the manifest says {size}"


@pytest.mark.parametrize("damage, problem", [("delete", "missing"), ("garbage", "unreadable"),
                                             ("no files", "unreadable")])
def test_a_missing_or_damaged_manifest_is_refused(saved, damage, problem):
    mf = saved / MANIFEST
    if damage == "delete":
        mf.unlink()
    else:
        mf.write_text("{not json" if damage == "garbage" else json.dumps({"format": 1, "files": {}}))
    e = refusal(saved)
    assert (e.file, e.problem) == (MANIFEST, problem), str(e)
    assert str(saved) in str(e)


def test_write_manifest_refuses_what_is_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        write_manifest(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no file to record"):
        write_manifest(tmp_path / "empty")
