"""launch/checkpoint.py in-process: the layout a save leaves, the manifest that catches damaged bytes, the choice
of the checkpoint a resume continues from, the refusals (no checkpoint, damaged, malformed, foreign, another
configuration, a fresh run over an earlier one) and pruning. The checkpoints are real DCP checkpoints of a small
state dict written by this one process (no process group: DCP's single-process mode), finished by the same
functions rank 0 runs in the job."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import checkpoint as ck  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

META = {"recipe": "mxfp8", "model": {"d_model": 64, "n_layers": 1}, "seq": 64, "batch": 2, "seed": 0,
        "param_dtype": "bf16", "quantize_head": False, "steps": 8, "lr": 3e-3, "min_lr_ratio": 0.1, "warmup": 1,
        "weight_decay": 0.1, "grad_clip": 1.0, "dp": 2}


def save_step(run_dir: pathlib.Path, step: int, meta: dict = META, train_state: dict | None = None) -> pathlib.Path:
    """What checkpoint.save does on one rank: begin, DCP-write into step_N.tmp, finish (manifest, rename)."""
    import torch.distributed.checkpoint as dcp
    tmp = ck.begin_save(run_dir, step)
    torch.manual_seed(step)
    state = {"model": {"w": torch.randn(32, 32), "b": torch.randn(32)}, "optim": {"step": torch.tensor(float(step))}}
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    st = train_state if train_state is not None else {"step": step, "losses": [5.0 - 0.1 * i for i in range(step)]}
    return ck.finish_save(run_dir, step, st, meta)


def dcp_file(folder: pathlib.Path) -> pathlib.Path:
    return next(p for p in folder.iterdir() if p.suffix == ".distcp")


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "ckpt" / "mxfp8"
    save_step(d, 4)
    save_step(d, 8)
    return d


# ---- what a save leaves --------------------------------------------------------------------------

def test_save_leaves_a_complete_folder_with_a_manifest_and_latest(run_dir):
    folder = run_dir / "step_000008"
    manifest = json.loads((folder / ck.MANIFEST).read_text())
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {ck.MANIFEST}
    assert set(manifest["files"]) == on_disk, "the manifest lists every file of the checkpoint"
    assert {".metadata", ck.META, ck.TRAIN_STATE} <= on_disk
    for name, entry in manifest["files"].items():
        assert entry["size"] == (folder / name).stat().st_size and len(entry["sha256"]) == 64
    assert (run_dir / ck.LATEST).read_text() == "step_000008"
    assert not list(run_dir.glob("*.tmp")), "no temporary folder or pointer is left behind"


def test_an_interrupted_save_is_never_a_checkpoint(run_dir):
    ck.begin_save(run_dir, 12)  # the ranks would write here; the job dies before the rename
    folder, state, _ = ck.choose_resume(run_dir, META)
    assert folder.name == "step_000008" and state["step"] == 8
    save_step(run_dir, 12)  # the next save of that step replaces the leftover
    assert ck.choose_resume(run_dir, META)[0].name == "step_000012"


def test_save_refuses_to_write_over_a_checkpoint(run_dir):
    with pytest.raises(CheckpointError, match="step_000008 exists already"):
        ck.begin_save(run_dir, 8)


# ---- choosing and verifying the checkpoint to resume ---------------------------------------------

@pytest.mark.parametrize("latest", ["missing", "deleted folder", "older"])
def test_resume_takes_the_newest_complete_checkpoint_whatever_latest_says(run_dir, latest):
    if latest == "missing":
        (run_dir / ck.LATEST).unlink()
    elif latest == "deleted folder":
        (run_dir / ck.LATEST).write_text("step_000016")
    else:
        (run_dir / ck.LATEST).write_text("step_000004")
    folder, state, notes = ck.choose_resume(run_dir, META)
    assert folder == run_dir / "step_000008" and state["step"] == 8 and len(state["losses"]) == 8 and notes == []


def test_resume_without_any_checkpoint_is_refused(tmp_path):
    for d in (tmp_path / "absent", tmp_path / "empty"):
        if d.name == "empty":
            d.mkdir()
        with pytest.raises(CheckpointError, match=r"--resume: no checkpoint in .*drop --resume"):
            ck.choose_resume(d, META)


@pytest.mark.parametrize("damage", ["same-size bytes", "truncated", "deleted"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(run_dir, damage):
    f = dcp_file(run_dir / "step_000008")
    data = bytearray(f.read_bytes())
    if damage == "same-size bytes":
        data[len(data) // 2:len(data) // 2 + 16] = bytes(16)  # weight bytes zeroed: DCP itself loads this silently
        f.write_bytes(bytes(data))
    elif damage == "truncated":
        f.write_bytes(bytes(data[:-7]))
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match=rf"step_000008 is damaged: {f.name} "):
        ck.choose_resume(run_dir, META)


def test_a_folder_without_a_manifest_is_refused(run_dir):
    (run_dir / "step_000008" / ck.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"step_000008 has no manifest.json: it is incomplete"):
        ck.choose_resume(run_dir, META)


@pytest.mark.parametrize("fault, needle", [
    ("train_state not json", r"train_state.json is not valid JSON"),
    ("train_state wrong step", r"train_state.json is malformed: 'step' is 7, the folder is step 8"),
    ("train_state short losses", r"train_state.json is malformed: 'losses' must be a list of 8 numbers"),
    ("meta missing", r"meta.json is missing"),
    ("meta not an object", r"meta.json is malformed"),
])
def test_malformed_json_files_are_refused_before_training(run_dir, fault, needle):
    folder = run_dir / "step_000008"
    if fault == "train_state not json":
        (folder / ck.TRAIN_STATE).write_text("{step: 8")
    elif fault == "train_state wrong step":
        (folder / ck.TRAIN_STATE).write_text(json.dumps({"step": 7, "losses": [1.0] * 7}))
    elif fault == "train_state short losses":
        (folder / ck.TRAIN_STATE).write_text(json.dumps({"step": 8, "losses": [1.0] * 3}))
    elif fault == "meta missing":
        (folder / ck.META).unlink()
    else:
        (folder / ck.META).write_text("[1, 2]")
    # re-hash, as if written so: the manifest then passes and the content checks must catch it
    (folder / ck.MANIFEST).unlink()
    ck.write_manifest(folder)
    with pytest.raises(CheckpointError, match=needle):
        ck.choose_resume(run_dir, META)


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("not a folder")
    for resume in (False, True):
        with pytest.raises(CheckpointError, match=rf"--checkpoint-dir {f} is a file, not a folder"):
            ck.plan(str(f), ["mxfp8"], resume=resume, overwrite=False, meta_for=lambda r: META)


# ---- configuration changes on resume -------------------------------------------------------------

@pytest.mark.parametrize("change, noted", [
    ({"steps": 30}, "steps: saved 8, now 30"),
    ({"lr": 1e-3}, "lr: saved 0.003, now 0.001"),
    ({"warmup": 3}, "warmup: saved 1, now 3"),
    ({"dp": 1}, None),  # free: DCP reshards
])
def test_resume_continues_under_a_new_schedule_and_says_what_changed(run_dir, change, noted):
    _, _, notes = ck.choose_resume(run_dir, dict(META, **change))
    if noted is None:
        assert notes == []
    else:
        assert noted in notes and any("schedule is recomputed" in n for n in notes), notes


@pytest.mark.parametrize("change, needle", [
    ({"recipe": "bf16"}, "recipe: saved 'mxfp8', now 'bf16'"),
    ({"model": {"d_model": 96, "n_layers": 1}}, "model d_model: saved 64, now 96"),
    ({"seq": 128}, "seq: saved 64, now 128"),
    ({"batch": 4}, "batch: saved 2, now 4"),
    ({"seed": 1}, "seed: saved 0, now 1"),
    ({"param_dtype": "fp32"}, "param_dtype: saved 'bf16', now 'fp32'"),
])
def test_resume_refuses_what_the_saved_state_cannot_continue_under(run_dir, change, needle):
    with pytest.raises(CheckpointError, match="written by a different configuration") as e:
        ck.choose_resume(run_dir, dict(META, **change))
    assert needle in str(e.value)


# ---- fresh runs, --overwrite, --keep-last --------------------------------------------------------

def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_without_overwrite(run_dir):
    root = run_dir.parent
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(CheckpointError, match=r"holds checkpoints of an earlier run: pass --resume .* or --overwrite"):
        ck.plan(str(root), ["mxfp8"], resume=False, overwrite=False, meta_for=lambda r: META)
    assert sorted(p.name for p in run_dir.iterdir()) == before, "nothing was deleted"
    plan = ck.plan(str(root), ["mxfp8"], resume=False, overwrite=True, meta_for=lambda r: META)
    assert plan["mxfp8"]["resume_from"] is None and sorted(p.name for p in run_dir.iterdir()) == before
    ck.clear_for_fresh_run(run_dir)
    assert list(run_dir.iterdir()) == []


def test_resume_with_another_recipes_checkpoints_names_the_mismatch(run_dir):
    with pytest.raises(CheckpointError, match=r"--resume with recipe nvfp4, but .* holds checkpoints of recipe\(s\) "
                                              r"mxfp8 only \(recipe mismatch"):
        ck.plan(str(run_dir.parent), ["nvfp4"], resume=True, overwrite=False,
                meta_for=lambda r: dict(META, recipe=r))


@pytest.mark.parametrize("keep", [0, 1, 2, 5])
def test_keep_last_prunes_the_oldest_complete_checkpoints(run_dir, keep):
    save_step(run_dir, 12)
    foreign = run_dir / "step_000002"  # no manifest: not this job's, left alone
    foreign.mkdir()
    removed = ck.prune(run_dir, keep)
    complete = ["step_000004", "step_000008", "step_000012"]
    kept = complete if keep == 0 else complete[-keep:]
    assert [p.name for p in removed] == [c for c in complete if c not in kept]
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000002"] + kept


def test_copied_checkpoint_still_verifies(run_dir, tmp_path):
    """The manifest names files relative to the folder: a moved or copied checkpoint verifies."""
    dst = tmp_path / "elsewhere" / "mxfp8"
    shutil.copytree(run_dir, dst)
    assert ck.choose_resume(dst, META)[0] == dst / "step_000008"
