"""The training job (launch/train.py) on CPU: argument checks, the per-layer report, the data and model, and
three torchrun launches (2 processes, gloo) of a tiny model:

    full     8 steps of mxfp8_fwd_nvfp4_bwd with --compare bf16 (metrics JSON lines)
    part     the same flags with --checkpoint-dir --save-every 4 --stop-after 6 (an interrupted run)
    resumed  --resume from part's step-4 checkpoint to step 8

Resume bound (same world size): bitwise. The resumed run's losses at steps 5..8 equal the uninterrupted run's
exactly (weights and AdamW state come back exactly through DCP; batches, learning rate and the
stochastic-rounding stream depend only on seed, step and rank). Across world sizes (2 -> 1 and 1 -> 2): see
the section after, which adds six short launches. The last section checks what a resume may change (a longer
run, a finished one) and the refusals of the job as a user meets them: once, from rank 0, before training,
and from run.sh before torchrun starts. The checkpoint logic itself is tested in-process in test_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import config  # noqa: E402
import convert  # noqa: E402
import data as job_data  # noqa: E402
import model as job_model  # noqa: E402
import train  # noqa: E402
from metrics import read_metrics, runs_of  # noqa: E402

RECIPE = "mxfp8_fwd_nvfp4_bwd"
TINY = ["--d-model", "64", "--n-layers", "1", "--n-heads", "2", "--seq", "64", "--batch", "2", "--steps", "8",
        "--eval-batches", "1", "--no-progress", "--timeout", "120", "--recipe", RECIPE, "--device", "cpu"]


def args_for(*extra: str):
    return config.parse_args(TINY + list(extra))


# ---- in-process checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--tp", "2", "--n-heads", "3", "--d-model", "96"], "n_heads=3 must be a multiple of the tensor-parallel size"),
    (["--tp", "2", "--moe", "4"], "MoE layers are not tensor-parallelized yet"),
    (["--seq", "40", "--batch", "1"], "must be a multiple of 32"),
    (["--d-model", "80", "--n-heads", "2"], "d_model=80 must be a multiple of 32"),
    (["--dp", "3"], "must equal the number of processes"),
    (["--resume"], "need --checkpoint-dir"),
    (["--keep-last", "2"], "need --checkpoint-dir"),
    (["--overwrite"], "need --checkpoint-dir"),
    (["--compare", RECIPE], "same as --recipe"),
    (["--checkpoint-dir", "c", "--save-every", "-1"], "--save-every -1: must be >= 0"),
    (["--checkpoint-dir", "c", "--keep-last", "-2"], "--keep-last -2: must be >= 0"),
    (["--log-every", "0"], "--log-every 0: must be >= 1"),
    (["--log-every", "-3"], "--log-every -3: must be >= 1"),
    (["--sync-every", "0"], "--sync-every 0: must be >= 1"),
    (["--sync-every", "-1"], "--sync-every -1: must be >= 1"),
    (["--corpus-bytes", "-1"], "--corpus-bytes must be >= 0"),
    (["--weight-gather", "high_precision", "--moe", "4"], "--weight-gather high_precision: not with --moe"),
    (["--compile-mode", "reduce-overhead"], "--compile-mode reduce-overhead: needs --compile"),
    (["--stop-after", "0"], "--stop-after 0: must be >= 1"),
    (["--checkpoint-dir", "c", "--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["--checkpoint-dir", "c", "--resume", "--init-state", "s.pt"], "--resume and --init-state both set"),
    (["--grad-reduce", "bf16", "--weight-gather", "high_precision"], "--grad-reduce bf16: needs --weight-gather quantized"),
    (["--recipe", "bf16", "--grad-reduce", "mxfp8"], "--grad-reduce mxfp8: applies to hybridq recipes only"),
])
def test_bad_arguments_are_rejected_before_any_collective(flags, needle):
    with pytest.raises(config.ConfigError) as e:
        config.check_args(args_for(*flags), world=2)
    assert needle in str(e.value)


@pytest.mark.parametrize("recipe", ["mxfp8_fwd_nvfp4_bwd", "fp8_block", "nvfp4", "fp8_tensorwise"])
def test_a_quantized_recipe_that_converts_no_layer_is_refused(recipe):
    """Only the output head is a Linear and it stays in high precision: 0 layers would be quantized."""
    head_only = torch.nn.Module()
    head_only.output = torch.nn.Linear(64, 64)
    with pytest.raises(config.ConfigError, match=rf"recipe {recipe}: no Linear layer was converted \(output: output "
                                                 r"head kept in high precision.*refusing to run it"):
        convert.convert(head_only, recipe, args_for("--recipe", recipe))


def test_check_only_validates_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ck = tmp_path / "ck"
    assert train.main(TINY + ["--compare", "bf16", "--checkpoint-dir", str(ck), "--save-every", "4",
                              "--check-only"]) == 0
    out = capsys.readouterr().out
    assert "the flags are valid for 2 process(es) (dp=2, tp=1)" in out
    assert f"[{RECIPE}] would start at step 0, checkpoints to {ck / RECIPE}" in out and "[bf16] would start" in out
    assert not ck.exists(), "a check writes nothing"
    assert train.main(TINY + ["--checkpoint-dir", str(ck), "--resume", "--check-only"]) == 1
    assert capsys.readouterr().err == f"train.py: --resume: no checkpoint in {ck / RECIPE} (drop --resume to start " \
                                      "a fresh run)\n"


# ---- the pre-flight: answered before torch is imported, before training, before any collective ---------------

def test_the_presets_listed_without_torch_are_hybridqs():
    import hybridq
    assert config.PRESETS == tuple(hybridq.preset_names()), "config.PRESETS must list hybridq.preset_names()"


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--recipe", "nope"], 2), (["--steps", "0"], 1),
                                        (["--tp", "3"], 1)])
def test_help_and_refused_flags_are_answered_before_torch_is_imported(argv, code):
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import train\n"
             "try:\n    code = train.main(sys.argv[2:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('exit', code, 'torch imported:', 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.run([sys.executable, "-c", probe, str(ROOT / "launch"), *argv], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.stdout.splitlines()[-1] == f"exit {code} torch imported: False", p.stdout[-2000:] + p.stderr[-2000:]


def test_plot_without_matplotlib_is_refused_before_training(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # Python's mark for a module that cannot be imported
    with pytest.raises(config.ConfigError) as e:
        config.check_args(args_for("--plot", "out.png"), world=2)
    assert str(e.value).splitlines()[1:] == [
        "  --plot out.png needs matplotlib, which is not installed here: pip install matplotlib (or pip install -e "
        "'.[launch]'), or drop --plot (--metrics FILE.jsonl keeps the numbers)"], str(e.value)


def default_args(*flags: str):
    """The job's default model and recipes (run.sh's), on the CPU."""
    return config.parse_args(["--device", "cpu", "--compare", "bf16", *flags])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("recipe", [r for r in config.PRESETS if r not in ("fp8_delayed", "fp8_block",
                                                                           "fp8_block_fwd_mxfp8_bwd")])
def test_the_default_model_splits_for_tensor_parallelism(recipe, tp):
    """Every preset but delayed scaling (no tensor parallelism) and FP8-block's 128-wide tiles (d_model 128 cannot
    split into 128-wide pieces) runs the default model at --tp 2 and 4: the pre-flight finds no layout problem."""
    import trainer
    plan = trainer.preflight(default_args("--recipe", recipe, "--tp", str(tp)), world=tp)
    assert list(plan) == [recipe, "bf16"]


def test_a_size_that_does_not_split_is_refused_in_the_pre_flight_naming_the_flag():
    import trainer
    with pytest.raises(config.ConfigError) as e:
        trainer.preflight(default_args("--tp", "2", "--hidden", "352"), world=2)
    assert str(e.value).splitlines() == [
        "invalid layout:",
        f"  --tp 2, recipe {RECIPE}: change --hidden (352): hybrid[MXFP8 E4M3 / NVFP4] cannot split weight of "
        "layers.0.feed_forward.w2 along K across 2 tensor-parallel ranks: its blocks span 32 columns, so every "
        "rank's first column must be a multiple of 32; K=352 splits at 176 (choose K a multiple of 64)"]


def test_delayed_scaling_under_tensor_parallelism_is_refused_as_a_recipe_not_a_size():
    """No size makes delayed scaling tensor-parallel: one line naming the recipe, no advice to change a size."""
    import trainer
    with pytest.raises(config.ConfigError) as e:
        trainer.preflight(default_args("--recipe", "fp8_delayed", "--tp", "2", "--weight-gather", "high_precision"),
                          world=2)
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid layout:" and len(lines) == 2, lines
    assert lines[1].startswith("  --tp 2, recipe fp8_delayed: choose another recipe: "), lines[1]
    assert "delayed scaling" in lines[1], lines[1]


def test_every_recipe_of_the_invocation_and_sequence_parallelism_are_checked():
    """--compare's recipe too; FP8-block's 1x128 input blocks span 128 tokens, so each rank's sequence piece must be
    a multiple of 128 (sequence parallelism); one line per flag, the first layer that breaks it."""
    import trainer
    with pytest.raises(config.ConfigError) as e:
        trainer.preflight(config.parse_args(["--device", "cpu", "--recipe", "bf16", "--compare", "fp8_block",
                                             "--tp", "2"]), world=2)
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[1].startswith("  --tp 2, recipe fp8_block: change --d-model (128): FP8-block E4M3 "), lines[1]
    assert "layers.0.attention.wq" in lines[1] and lines[1].endswith(("splits at 64 (choose K a multiple of 256)",
                                                                      "splits at 64 (choose M a multiple of 256)")), \
        lines[1]
    assert lines[2].startswith("  --tp 2, recipe fp8_block: change --seq (128): FP8-block E4M3 1x128 cannot quantize "
                               "input of layers.0.attention.wq sequence-parallel: each rank holds 8 runs of 64 rows"), \
        lines[2]


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write into: mode 0555 for a normal user; root writes through modes, so for root
    a read-only tmpfs mounted on it (skipped where root may not mount)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d, "Permission denied"
        d.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("running as root without the right to mount: no way to make a read-only folder here")
    try:
        yield d, "Read-only file system"
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_a_read_only_checkpoint_dir_is_refused_by_the_check(read_only_dir, capsys, monkeypatch):
    ro, why = read_only_dir
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(TINY + ["--checkpoint-dir", str(ro / "ck"), "--save-every", "4", "--check-only"]) == 1
    assert capsys.readouterr().err == (
        f"train.py: cannot write checkpoints to {ro / 'ck' / RECIPE}: creating a file in {ro} failed ({why}); pick a "
        "writable --checkpoint-dir (or drop --save-every)\n")
    assert train.main(TINY + ["--checkpoint-dir", str(ro / "ck"), "--check-only"]) == 0, "no save: nothing to write"


# ---- one job per checkpoint folder -----------------------------------------------------------------

def lock_holder(folder: pathlib.Path) -> subprocess.Popen:
    """Another process that takes `folder`'s lock (lock.acquire, as a job's rank 0 does) and holds it until killed."""
    code = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); import lock; "
            "lock.acquire(pathlib.Path(sys.argv[2]), command='holder'); print('locked', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT / "launch"), str(folder)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_folder_lock_admits_one_job_and_a_dead_jobs_lock_is_taken_over(tmp_path):
    import lock
    d = tmp_path / "run"
    other = lock_holder(d)
    try:
        msg = lock.refusal(d)
        assert msg is not None and msg.startswith(f"{d} is in use by another training job (pid {other.pid} on host "
                                                  f"{socket.gethostname()} since "), msg
        with pytest.raises(lock.LockError, match="is in use by another training job"):
            lock.acquire(d)
    finally:
        other.kill()
        other.wait()
    assert lock.refusal(d) is None, "the holder is dead: its lock is stale"
    note = lock.acquire(d)
    assert note is not None and note.startswith(f"took over the stale lock {d / lock.LOCK} of a job that is no longer "
                                                f"running (pid {other.pid} "), note
    assert lock.holder(d)["pid"] == os.getpid()
    lock.release(d)
    assert not (d / lock.LOCK).exists()
    assert lock.acquire(d) is None, "a free folder: no note"
    lock.release(d)


def test_a_lock_of_another_host_is_refused_with_the_file_to_delete(tmp_path):
    import json
    import lock
    d = tmp_path / "run"
    d.mkdir()
    (d / lock.LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00"}))
    assert lock.refusal(d).endswith(f"(if that job is no longer running, delete {d / lock.LOCK})")
    with pytest.raises(lock.LockError):
        lock.acquire(d)


def test_a_locked_checkpoint_folder_is_refused_by_the_check(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ck = tmp_path / "ck"
    other = lock_holder(ck / RECIPE)
    try:
        assert train.main(TINY + ["--checkpoint-dir", str(ck), "--save-every", "4", "--check-only"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"train.py: {ck / RECIPE} is in use by another training job (pid {other.pid} on "
                              "host "), err
        assert len(err.splitlines()) == 1, err
    finally:
        other.kill()
        other.wait()


def _report(recipe: str, *flags: str) -> dict[str, list[str]]:
    args = args_for(*flags)
    torch.manual_seed(0)
    m = job_model.Transformer(config.model_config(args))
    rows, summary = convert.convert(m, recipe, args)
    assert rows[0][:5] == ["layer", "status", "input (row / col)", "weight (row / col)", "grad_output (row / col)"]
    return {r[0]: r[1:] for r in rows[1:]}


LINEARS = ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv", "layers.0.attention.wo",
           "layers.0.feed_forward.w1", "layers.0.feed_forward.w3", "layers.0.feed_forward.w2"]
NORMS = ["norm", "layers.0.attention_norm", "layers.0.ffn_norm"]
FEED_FORWARDS = ["layers.0.feed_forward"]  # (swapped for hybridq.nn.SwiGLU with the norms)


@pytest.mark.parametrize("recipe, expect", [
    # (input, weight, grad_output): substrings each cell must contain, in order (rowwise before columnwise)
    ("mxfp8_fwd_nvfp4_bwd", (("hybrid[MXFP8", "/ NVFP4 (RHT)]"), ("hybrid[MXFP8", "/ NVFP4]"), ("NVFP4 (RHT, SR)",))),
    ("fp8_block_fwd_mxfp8_bwd", (("hybrid[FP8-block E4M3 1x128", "/ MXFP8"), ("hybrid[FP8-block E4M3 128x128",
                                                                            "/ MXFP8"), ("MXFP8",))),
    ("fp8_fwd_high_precision_bwd", (("hybrid[FP8 E4M3", "/ identity]"), ("hybrid[FP8 E4M3", "/ identity]"),
                                    ("identity",))),
    ("fp8_tensorwise", (("FP8 E4M3",), ("FP8 E4M3",), ("FP8 E5M2",))),
    ("fp8_block", (("FP8-block E4M3 1x128",), ("FP8-block E4M3 128x128",), ("FP8-block E4M3 1x128",))),
    ("mxfp8", (("MXFP8 E4M3",), ("MXFP8 E4M3",), ("MXFP8 E4M3",))),
    ("nvfp4", (("NVFP4",), ("NVFP4 (16x16)",), ("NVFP4 (RHT, SR)",))),
])
def test_per_layer_report_lists_each_directions_format(recipe, expect):
    rep = _report(recipe)
    assert list(rep) == LINEARS + ["output"] + NORMS + FEED_FORWARDS, \
        "every Linear, in model order, then the RMSNorms and the feed-forwards"
    for name in LINEARS:
        status, *cells, why = rep[name]
        assert status == "converted", (name, why)
        for cell, needles in zip(cells, expect):
            pos = [cell.find(n) for n in needles]
            assert all(p >= 0 for p in pos) and pos == sorted(pos), (recipe, name, cell, needles)
    assert rep["output"][0] == "skipped" and "high precision" in rep["output"][-1]
    assert all(rep[n][0] == "hybridq.nn.RMSNorm" for n in NORMS), [rep[n] for n in NORMS]
    assert all(rep[n][0] == "hybridq.nn.SwiGLU" for n in FEED_FORWARDS), [rep[n] for n in FEED_FORWARDS]


def test_norms_model_keeps_the_models_rms_norms():
    rep = _report("fp8_tensorwise", "--norms", "model")
    assert list(rep) == LINEARS + ["output"], "--norms model still swapped norms"


def test_report_head_options():
    rep = _report("mxfp8", "--quantize-head")
    assert rep["output"][0] == "converted"
    rep = _report("mxfp8", "--tie-embeddings")
    assert "output" not in rep and rep["output (tied)"][0] == "skipped"


def test_garbage_collection_is_off_during_training_and_restored_after(monkeypatch):
    import gc

    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    collector = train.GarbageCollection(every=3)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0, "automatic collection off, set-up objects frozen"
        for n in range(7):
            collector.step(n)
        assert collected == [2, 1, 1, 1], f"a full collection at set-up, then generation 1 at steps 0, 3, 6: {collected}"
    finally:
        collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    train.GarbageCollection(every=0).close()
    assert gc.isenabled(), "--gc-every 0 leaves Python's automatic collection alone"


def test_data_is_a_pure_function_of_step_and_rank():
    toks = job_data.load_tokens()
    assert job_data.CORPUS.exists() and len(toks) > 100_000 and int(toks.max()) < job_data.VOCAB_SIZE
    whole = job_data.ByteBatches(toks, 32, 4, dp_rank=0, dp_size=1, seed=3)
    halves = [job_data.ByteBatches(toks, 32, 2, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for step in (0, 7):
        x, y = whole.get(step)
        assert torch.equal(torch.cat([h.get(step)[0] for h in halves]), x)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(whole.get(0)[0], whole.get(1)[0])
    val = halves[0].val_batches(2)
    assert len(val) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(val, halves[0].val_batches(2)))


def test_generated_corpus_extends_the_shipped_one():
    shipped = job_data.load_tokens()
    big = job_data.load_tokens(corpus_bytes=3 * len(shipped))
    assert len(big) == 3 * len(shipped) + 1, "the generator's N bytes plus its closing newline"
    assert torch.equal(big[:len(shipped) - 1], shipped[:-1]), "same grammar and seed: corpus.txt is its prefix"


def test_model_shapes_gqa_and_tied_head():
    cfg = job_model.ModelConfig(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, tie_embeddings=True)
    m = job_model.Transformer(cfg)
    assert m.output is None and cfg.hidden % 32 == 0
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    logits = m(torch.randint(0, 256, (2, 32)))
    assert logits.shape == (2, 32, 256) and torch.isfinite(logits).all()
    # causal: a later token does not change earlier logits
    t = torch.randint(0, 256, (1, 16))
    t2 = t.clone()
    t2[0, -1] = (t2[0, -1] + 1) % 256
    assert torch.allclose(m(t)[0, :-1], m(t2)[0, :-1])


# ---- torchrun launches ---------------------------------------------------------------------------

def torchrun(*flags: str, cwd: pathlib.Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "train.py"), *TINY, *flags]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_job")
    out = {}
    out["full"] = torchrun("--compare", "bf16", "--metrics", str(d / "full.jsonl"), cwd=d)
    ck = d / "ckpt"
    out["part"] = torchrun("--checkpoint-dir", str(ck), "--save-every", "4", "--stop-after", "6",
                           "--dump-state", str(d / "dumps" / "s21"), "--metrics", str(d / "part.jsonl"), cwd=d)
    shutil.copytree(ck, d / "ck21")  # its step-4 checkpoint, for the 2 -> 1 resume below
    shutil.copytree(ck, d / "ck2t")  # and for the dp 2 x tp 1 -> dp 1 x tp 2 resume
    out["resumed"] = torchrun("--checkpoint-dir", str(ck), "--resume", "--metrics", str(d / "resumed.jsonl"), cwd=d)
    js = {k: metrics_of(d / f"{k}.jsonl") for k in ("full", "part", "resumed")}
    return out, js, d


def metrics_of(path: pathlib.Path) -> dict:
    """A metrics file as {"runs": {recipe: summary}, "gap": gap record or None, "steps": step records}."""
    records = read_metrics(path)
    return {"runs": runs_of(records), "gap": next((r for r in records if r["kind"] == "gap"), None),
            "steps": [r for r in records if r["kind"] == "step"]}


@pytest.mark.distributed
def test_cpu_job_trains_and_compares(runs):
    out, js, _ = runs
    text = out["full"]
    assert "2 process(es), gloo on cpu, FSDP2 dp=2 tp=1" in text
    for run in (RECIPE, "bf16"):
        r = js["full"]["runs"][run]
        losses = r["losses"]
        assert len(losses) == 8 and all(map(lambda v: v == v, losses))
        assert losses[0] > 5.0, "starts near ln(256) = 5.55"
        assert r["final_loss"] < losses[0] - 0.8, f"{run}: loss did not fall: {losses}"
        assert sum(losses[-3:]) < sum(losses[:3]) and r["val_loss"] < losses[0] - 0.5
        assert f"[{run}] step 8/8 | loss {losses[-1]:.4f}" in text
    gap = js["full"]["gap"]
    assert abs(gap["final_loss"]) < 0.3, gap
    assert f"loss gap {RECIPE} - bf16: final {gap['final_loss']:+.4f}" in text
    assert gap["speed_ratio"] > 0
    logged = [(s["recipe"], s["step"]) for s in js["full"]["steps"]]
    assert logged == [(RECIPE, n) for n in range(1, 9)] + [("bf16", n) for n in range(1, 9)], "one record per step"
    assert "summary (" in text and "loss curve:" in text
    # bytes per step on each wire (launch/comm.py): both runs gather weights and reduce-scatter fp32 gradients of
    # the same parameters (the same bytes); no tensor parallelism, so no TP bytes
    q, b = js["full"]["runs"][RECIPE], js["full"]["runs"]["bf16"]
    assert 0 < q["allgather_bytes_per_step"] < b["allgather_bytes_per_step"], (q, b)
    assert q["reduce_scatter_bytes_per_step"] == b["reduce_scatter_bytes_per_step"] > 0, (q, b)
    assert q["tp_bytes_per_step"] is None and q["grad_reduce"] == b["grad_reduce"] == "fp32"
    assert all(s["reduce_scatter_bytes"] > 0 and "tp_bytes" not in s for s in js["full"]["steps"])


@pytest.mark.distributed
def test_grad_reduce_wire_sends_its_bytes_and_trains(runs, tmp_path):
    """--grad-reduce mxfp8: the hybridq recipe's gradients go through hybridq's wire (~0.26x of the fp32
    reduce-scatter's bytes, counted per step: 33/32 bytes per element against 4), the bf16 baseline keeps fp32, and
    the recipe still trains like the fp32-reduce run of the same flags (the loss within 2% at every step). (The bf16
    wire's numerics and bytes: tests/distributed/test_grad_reduce.py.)"""
    _, js, _ = runs
    fp32 = js["full"]["runs"][RECIPE]
    for wire, lo, hi in (("mxfp8", 0.25, 0.27),):
        out = torchrun("--grad-reduce", wire, "--compare", "bf16", "--stop-after", "3",
                       "--metrics", str(tmp_path / f"{wire}.jsonl"), cwd=tmp_path)
        assert f"gradients reduce-scattered as {wire}" in out, out[-3000:]
        got = metrics_of(tmp_path / f"{wire}.jsonl")["runs"]
        q, b = got[RECIPE], got["bf16"]
        assert q["grad_reduce"] == wire and b["grad_reduce"] == "fp32", (q["grad_reduce"], b["grad_reduce"])
        assert b["reduce_scatter_bytes_per_step"] == fp32["reduce_scatter_bytes_per_step"]
        ratio = q["reduce_scatter_bytes_per_step"] / fp32["reduce_scatter_bytes_per_step"]
        assert lo <= round(ratio, 3) <= hi, f"{wire}: reduce-scatter bytes {ratio:.4f} x fp32's"
        assert q["allgather_bytes_per_step"] == fp32["allgather_bytes_per_step"], "the weights' wire is unchanged"
        assert all(abs(a - w) < 0.02 * w for a, w in zip(q["losses"], fp32["losses"][:3])), (wire, q["losses"])


@pytest.mark.distributed
def test_compiled_blocks_train_like_eager(runs, tmp_path):
    """--compile (each block torch.compiled before fully_shard; the hybridq Linears in the graph, their weights
    entering it as the quantized gather's handles): the first steps'
    losses are the eager run's up to the compiled norms' and activations' rounding."""
    _, js, _ = runs
    out = torchrun("--compile", "--stop-after", "3", "--metrics", str(tmp_path / "c.jsonl"), cwd=tmp_path)
    run = metrics_of(tmp_path / "c.jsonl")["runs"][RECIPE]
    got, want = run["losses"], js["full"]["runs"][RECIPE]["losses"][:3]
    assert len(got) == 3 and all(abs(a - b) < 1e-2 * abs(b) for a, b in zip(got, want)), f"{got} vs eager {want}"
    assert run["compiled_graphs"] >= 1 and run["graph_breaks"] == 0, \
        f"the blocks should compile whole: {run['compiled_graphs']} graphs, {run['graph_break_reasons']}"
    assert f"[{RECIPE}] torch.compile: {run['compiled_graphs']} graph(s), 0 graph break(s)" in out, out[-2000:]


@pytest.mark.distributed
def test_compiled_job_reports_its_graph_breaks(tmp_path):
    """A compiled block that breaks is printed and recorded, not silent: the bf16 MoE baseline's high-precision
    experts run eagerly by design (torch.compiler.disable inside each block), so each block breaks."""
    out = torchrun("--recipe", "bf16", "--moe", "4", "--top-k", "2", "--compile", "--stop-after", "1",
                   "--metrics", str(tmp_path / "c.jsonl"), cwd=tmp_path)
    run = metrics_of(tmp_path / "c.jsonl")["runs"]["bf16"]
    assert run["graph_breaks"] >= 1 and run["graph_break_reasons"], f"no graph break recorded: {run}"
    assert f"[bf16] torch.compile: {run['compiled_graphs']} graph(s), {run['graph_breaks']} graph break(s)" in out


@pytest.mark.distributed
def test_compiled_blocks_with_high_precision_gather_train_like_eager(runs, tmp_path):
    """--compile --weight-gather high_precision (and reduce-overhead's graph steps, which on the CPU compile
    without CUDA graphs): FSDP2 gathers bf16 weights, each hybridq Linear compiles into its block's graph and quantizes its weight itself, which is bitwise what the quantized all-gather gives (sharding
    invariance); the losses are the eager run's up to the compiled norms' and activations' rounding."""
    _, js, _ = runs
    out = torchrun("--compile", "--compile-mode", "reduce-overhead", "--weight-gather", "high_precision",
                   "--stop-after", "3", "--metrics", str(tmp_path / "c.jsonl"), cwd=tmp_path)
    assert "converted by hybridq.convert_linears" in out, out[-2000:]
    got = metrics_of(tmp_path / "c.jsonl")["runs"][RECIPE]["losses"]
    want = js["full"]["runs"][RECIPE]["losses"][:3]
    assert len(got) == 3 and all(abs(a - b) < 1e-2 * abs(b) for a, b in zip(got, want)), f"{got} vs eager {want}"


@pytest.mark.distributed
def test_traced_fp8_layers_in_compiled_fsdp2_blocks_train_like_eager(tmp_path):
    """FSDP2 on 2 gloo ranks, each block compiled, bf16-gathered weights: the FP8 layers (per-tensor and block
    scaling) run traced into the blocks' graphs (nn/float8_graph.py); the first losses are the eager run's up to the
    compiled norms' rounding."""
    common = ("--recipe", "fp8_tensorwise", "--compare", "fp8_block", "--weight-gather", "high_precision",
              "--stop-after", "3")
    torchrun(*common, "--metrics", str(tmp_path / "eager.jsonl"), cwd=tmp_path)
    torchrun(*common, "--compile", "--metrics", str(tmp_path / "compiled.jsonl"), cwd=tmp_path)
    for recipe in ("fp8_tensorwise", "fp8_block"):
        want, got = (metrics_of(tmp_path / f"{k}.jsonl")["runs"][recipe]["losses"] for k in ("eager", "compiled"))
        assert len(got) == 3 and all(abs(a - b) < 1e-2 * abs(b) for a, b in zip(got, want)), \
            f"{recipe}: {got} vs eager {want}"


@pytest.mark.distributed
def test_cpu_job_prints_the_per_layer_report(runs):
    out, _, _ = runs
    lines = out["full"].splitlines()
    start = lines.index(f"per-layer report, recipe {RECIPE}:")
    body = lines[start + 2:start + 2 + len(LINEARS) + 1]
    expect = _report(RECIPE)
    for line, name in zip(body, LINEARS + ["output"]):
        assert line.split()[0] == name
        status, inp, w, g, why = expect[name]
        assert status in line and inp in line and w in line and g in line and why in line
    assert "7 of 8 Linear layers converted" in out["full"]


@pytest.mark.distributed
def test_cpu_job_resumes_bitwise(runs):
    out, js, d = runs
    ck = d / "ckpt" / RECIPE
    assert (ck / "latest").read_text().strip() == "step_000004"
    for f in (".metadata", "train_state.json", "meta.json", "manifest.json"):
        assert (ck / "step_000004" / f).exists(), f
    assert not list(ck.glob("*.tmp")), "no temporary folder is left"
    full = js["full"]["runs"][RECIPE]["losses"]
    part = js["part"]["runs"][RECIPE]
    resumed = js["resumed"]["runs"][RECIPE]
    assert part["losses"] == full[:6] and part["steps_run"] == 6
    assert f"resumed from {ck / 'step_000004'} at step 4" in out["resumed"]
    assert resumed["start_step"] == 4 and resumed["steps_run"] == 4
    assert resumed["losses"] == full, f"resumed {resumed['losses']} vs uninterrupted {full}"
    assert resumed["val_loss"] == js["full"]["runs"][RECIPE]["val_loss"]


# ---- resume across world sizes -------------------------------------------------------------------
#
# What "continues" means when the world size changes: the global batch is dp x --batch sequences, so the
# losses after a 2 -> 1 resume cannot equal those of the uninterrupted 2-process run. What holds, and is
# tested bitwise:
#   1. the parameters and the AdamW state after loading equal those saved (gathered full state dicts,
#      compared tensor by tensor with torch.equal, dtypes included), and the loss history carries over;
#   2. the resumed run's next steps equal those of a fresh run of the new world size started from the same
#      state through another path (--init-state: the gathered full state dict, set with
#      set_state_dict(full_state_dict=True), no DCP resharding). Given 1, the steps after a resume are a
#      pure function of (state, seed, step, rank, dp), so 2 isolates anything DCP or the job's resume path
#      leaves behind (a stale buffer, a lost optimizer field, the wrong step or data position).

def torchrun_n(n: int, *flags: str, cwd: pathlib.Path, ok: bool = True) -> subprocess.CompletedProcess:
    """The job on `n` processes: torchrun for n > 1; for n == 1 train.py itself, which makes the same world of one
    (README: `python launch/train.py`) without torchrun's agent process (~3 s of CPU per job: it imports torch too)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)] if n > 1
                else [sys.executable])
    cmd = [*launcher, str(ROOT / "launch" / "train.py"), *TINY, *flags]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    if ok:
        assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}"
    return p


def assert_state_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max |diff| {(a.float() - b.float()).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def reshard_runs(runs):
    """2 -> 1 for RECIPE (from a copy of `part`'s step-4 checkpoint) and 1 -> 2 for bf16, each with its
    --init-state twin."""
    d = runs[2]
    dumps = d / "dumps"
    res = {}
    # 2 -> 1, RECIPE
    ck = d / "ck21"
    res["r21"] = torchrun_n(1, "--checkpoint-dir", str(ck), "--resume", "--stop-after", "6",
                            "--dump-state", str(dumps / "r21"), "--metrics", str(d / "r21.jsonl"), cwd=d).stdout
    torchrun_n(1, "--init-state", str(dumps / "s21" / f"{RECIPE}_saved_step_000004.pt"), "--stop-after", "6",
               "--metrics", str(d / "o21.jsonl"), cwd=d)
    # 1 -> 2, bf16
    ck12 = d / "ck12"
    torchrun_n(1, "--recipe", "bf16", "--checkpoint-dir", str(ck12), "--save-every", "4", "--stop-after", "4",
               "--dump-state", str(dumps / "s12"), "--metrics", str(d / "s12.jsonl"), cwd=d)
    res["r12"] = torchrun_n(2, "--recipe", "bf16", "--checkpoint-dir", str(ck12), "--resume", "--stop-after", "6",
                            "--dump-state", str(dumps / "r12"), "--metrics", str(d / "r12.jsonl"), cwd=d).stdout
    torchrun_n(2, "--recipe", "bf16", "--init-state", str(dumps / "s12" / "bf16_saved_step_000004.pt"),
               "--stop-after", "6", "--metrics", str(d / "o12.jsonl"), cwd=d)
    # dp 2 x tp 1 -> dp 1 x tp 2, RECIPE: DCP reshards the FSDP2 shards into tensor-parallel pieces
    res["r2t"] = torchrun_n(2, "--tp", "2", "--checkpoint-dir", str(d / "ck2t"), "--resume", "--stop-after", "6",
                            "--dump-state", str(dumps / "r2t"), "--metrics", str(d / "r2t.jsonl"), cwd=d).stdout
    torchrun_n(2, "--tp", "2", "--init-state", str(dumps / "s21" / f"{RECIPE}_saved_step_000004.pt"),
               "--stop-after", "6", "--metrics", str(d / "o2t.jsonl"), cwd=d)
    # a recipe mismatch, against the 2 -> 1 checkpoint (1 process: it fails before training)
    res["bad_recipe"] = torchrun_n(1, "--checkpoint-dir", str(ck), "--resume", "--recipe", "fp8_block", cwd=d,
                                   ok=False)
    js = {k: metrics_of(d / f"{k}.jsonl") for k in ("r21", "o21", "s12", "r12", "o12", "r2t", "o2t")}
    js["s21"] = runs[1]["part"]
    return res, js, d


@pytest.mark.distributed
@pytest.mark.parametrize("case, recipe, saved_world, new_world", [("21", RECIPE, 2, 1), ("12", "bf16", 1, 2)])
def test_resume_across_world_sizes(reshard_runs, case, recipe, saved_world, new_world):
    res, js, d = reshard_runs
    ck = d / f"ck{case}" / recipe / "step_000004"
    assert (ck / "train_state.json").exists() and not list(ck.glob("extra_rank*"))
    assert f"resumed from {ck} at step 4 (saved with dp={saved_world}, now dp={new_world})" in res[f"r{case}"]
    saved = torch.load(d / "dumps" / f"s{case}" / f"{recipe}_saved_step_000004.pt", weights_only=False)
    loaded = torch.load(d / "dumps" / f"r{case}" / f"{recipe}_loaded_step_000004.pt", weights_only=False)
    assert (saved["world"], loaded["world"]) == (saved_world, new_world)
    assert saved["optim"]["state"], "AdamW state is present"
    assert_state_equal(saved["model"], loaded["model"], "model")
    assert_state_equal(saved["optim"], loaded["optim"], "optim")
    before = js[f"s{case}"]["runs"][recipe]
    resumed = js[f"r{case}"]["runs"][recipe]
    oracle = js[f"o{case}"]["runs"][recipe]
    assert resumed["start_step"] == 4 and resumed["steps_run"] == 2 and oracle["start_step"] == 4
    assert resumed["losses"][:4] == before["losses"][:4] == saved["losses"], "the loss history carries over"
    assert resumed["losses"] == oracle["losses"], (resumed["losses"], oracle["losses"])


@pytest.mark.distributed
def test_resume_from_data_parallel_into_tensor_parallel(reshard_runs):
    """Saved with dp=2 x tp=1 (FSDP2 shards), resumed with dp=1 x tp=2 (tensor-parallel pieces): the loaded state
    is the saved one, and the next steps equal a tp=2 run started from that state without DCP."""
    res, js, d = reshard_runs
    ck = d / "ck2t" / RECIPE / "step_000004"
    assert f"resumed from {ck} at step 4 (saved with dp=2 x tp=1, now dp=1 x tp=2)" in res["r2t"]
    saved = torch.load(d / "dumps" / "s21" / f"{RECIPE}_saved_step_000004.pt", weights_only=False)
    loaded = torch.load(d / "dumps" / "r2t" / f"{RECIPE}_loaded_step_000004.pt", weights_only=False)
    assert_state_equal(saved["model"], loaded["model"], "model")
    assert_state_equal(saved["optim"], loaded["optim"], "optim")
    resumed, oracle = js["r2t"]["runs"][RECIPE], js["o2t"]["runs"][RECIPE]
    assert resumed["start_step"] == 4 and resumed["steps_run"] == 2
    assert resumed["losses"] == oracle["losses"], (resumed["losses"], oracle["losses"])


@pytest.mark.distributed
def test_tensor_parallel_job_trains_like_the_single_process_job(tmp_path):
    """--tp 2 (sequence parallelism, quantized all-gathers) against one process on the same data: the losses agree
    within 1e-2 (the row-parallel layers sum partial products in another order, in bf16), and the start-up report
    states the sequence-parallel bytes."""
    flags = ("--recipe", "mxfp8", "--stop-after", "4")
    tp = torchrun_n(2, "--tp", "2", *flags, "--metrics", str(tmp_path / "tp.jsonl"), cwd=tmp_path).stdout
    torchrun_n(1, *flags, "--metrics", str(tmp_path / "one.jsonl"), cwd=tmp_path)
    # (MXFP8 sends its rows in bf16 and quantizes after the gather, the same bits: 1.000x bf16's bytes, issue 35)
    assert "sequence-parallel all-gathers per step and rank (forward + backward)" in tp and "(1.000x)" in tp, tp[-2000:]
    a = metrics_of(tmp_path / "tp.jsonl")["runs"]["mxfp8"]["losses"]
    b = metrics_of(tmp_path / "one.jsonl")["runs"]["mxfp8"]["losses"]
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-2, (a, b)


@pytest.mark.distributed
def test_resume_with_another_recipe_is_one_clear_refusal(reshard_runs):
    p = reshard_runs[0]["bad_recipe"]
    assert p.returncode == 1
    msg = f"--resume with recipe fp8_block, but {reshard_runs[2] / 'ck21'} holds checkpoints of recipe(s) {RECIPE} " \
          "only (recipe mismatch"
    assert p.stderr.count(msg) == 1, p.stderr[-3000:]


# ---- what a resume may change; the refusals as a user meets them ---------------------------------

def python_job(*flags: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """train.py as a plain process (a world of one, no torchrun): its own exit code and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *TINY, *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def tree(d: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.distributed
def test_resume_extends_a_run_with_a_recomputed_schedule(reshard_runs):
    _, _, d = reshard_runs
    p = python_job("--checkpoint-dir", str(d / "ck21"), "--resume", "--steps", "10", "--stop-after", "6",
                   "--metrics", str(d / "ext.jsonl"), cwd=d)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"[{RECIPE}] changed since the checkpoint: steps: saved 8, now 10" in p.stdout
    assert "learning-rate schedule is recomputed" in p.stdout
    steps = metrics_of(d / "ext.jsonl")["steps"]
    assert [s["step"] for s in steps] == [5, 6] and all(s["steps"] == 10 for s in steps)
    longer = args_for("--steps", "10")
    assert [s["lr"] for s in steps] == [train.lr_at(4, longer), train.lr_at(5, longer)], "the schedule of --steps 10"


@pytest.mark.distributed
def test_resume_at_the_final_step_has_nothing_to_do(reshard_runs):
    _, js, d = reshard_runs
    p = python_job("--recipe", "bf16", "--checkpoint-dir", str(d / "ck12"), "--resume", "--steps", "4",
                   "--metrics", str(d / "done.jsonl"), cwd=d)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[bf16] nothing to do: the run is at step 4, --steps is 4" in p.stdout
    assert "nan" not in p.stdout, p.stdout
    summary = metrics_of(d / "done.jsonl")["runs"]["bf16"]
    assert summary["steps_run"] == 0 and summary["median_tokens_per_s"] is None
    assert summary["losses"] == js["s12"]["runs"]["bf16"]["losses"], "the saved loss history"


@pytest.mark.distributed
def test_worker_refusals_are_one_line_and_write_nothing(reshard_runs, tmp_path):
    _, _, d = reshard_runs
    # a damaged checkpoint: bytes changed, same size
    bad = tmp_path / "bad"
    shutil.copytree(d / "ck21", bad)
    f = next((bad / RECIPE / "step_000004").glob("__0_*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = bytes(8)
    f.write_bytes(bytes(data))
    before = tree(bad)
    p = python_job("--checkpoint-dir", str(bad), "--resume", "--save-every", "4", cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr.splitlines() == [f"train.py: checkpoint {bad / RECIPE / 'step_000004'} is damaged: {f.name} has "
                                     "other content than the SHA-256 recorded in manifest.json says (same size, "
                                     "changed bytes)"], p.stderr
    # a fresh run into a folder with checkpoints: refused, nothing deleted
    p = python_job("--checkpoint-dir", str(bad), "--save-every", "4", cwd=tmp_path)
    assert p.returncode == 1 and "holds checkpoints of an earlier run: pass --resume" in p.stderr
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert tree(bad) == before, "the refused runs left the checkpoint folder as it was"


@pytest.mark.distributed
def test_run_sh_refuses_before_torchrun_starts(reshard_runs, tmp_path):
    _, _, d = reshard_runs
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHON=sys.executable)
    before = tree(d / "ck21")
    p = subprocess.run(["bash", str(ROOT / "launch" / "run.sh"), *TINY, "--checkpoint-dir", str(d / "ck21"),
                        "--save-every", "4"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.count("holds checkpoints of an earlier run") == 1, p.stderr
    assert "ChildFailedError" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "torchrun" not in p.stdout, "the pre-flight refused before torchrun started"
    assert tree(d / "ck21") == before


def test_plain_single_process_runs_take_a_free_port_each(monkeypatch):
    """`python launch/train.py` (no torchrun) makes a world of one: its rendezvous port must be free, not a fixed
    one, so runs side by side (pytest -n, two jobs on one machine) do not collide."""
    import socket

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert train.world_from_environment() == 1
    first = int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:  # the first run still holds its port
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", first))
        busy.listen()
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name, raising=False)
        train.world_from_environment()
        second = int(os.environ["MASTER_PORT"])
    assert second != first, f"two single-process runs got the same rendezvous port {first}"


# ---- the job on a faulty disk, a wrong layout, a busy folder ----------------------------------------

@pytest.mark.distributed
def test_the_readme_tensor_parallel_command_trains_the_default_model(tmp_path):
    """`torchrun --nproc-per-node 2 launch/train.py --tp 2` on the default model (its hidden size splits)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "train.py"), "--tp", "2", "--steps", "2", "--eval-batches", "1", "--no-progress",
           "--device", "cpu", "--timeout", "120", "--metrics", str(tmp_path / "m.jsonl")]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "FSDP2 dp=1 tp=2" in p.stdout and "hidden 512" in p.stdout, p.stdout[-3000:]
    warned = [line for line in (p.stdout + p.stderr).splitlines() if "Warning" in line or "_NormPartial" in line]
    assert not warned, f"the TP run printed warnings (hybridq's calls or DTensor's norm reduction):\n" + "\n".join(warned)
    run = metrics_of(tmp_path / "m.jsonl")["runs"][RECIPE]
    losses = run["losses"]
    assert len(losses) == 2 and all(map(lambda v: 0 < v < 10, losses)), losses
    # dp=1: FSDP2 gathers and reduces nothing; the sequence-parallel gathers and reduce-scatters are the TP bytes
    assert run["tp_bytes_per_step"] > 0 and run["reduce_scatter_bytes_per_step"] == 0, run


@pytest.mark.distributed
def test_a_read_only_checkpoint_dir_is_refused_before_training(read_only_dir, tmp_path):
    ro, why = read_only_dir
    p = python_job("--checkpoint-dir", str(ro / "ck"), "--save-every", "4", cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr.splitlines() == [f"train.py: cannot write checkpoints to {ro / 'ck' / RECIPE}: creating a file in "
                                     f"{ro} failed ({why}); pick a writable --checkpoint-dir (or drop --save-every)"], \
        p.stderr[-3000:]
    assert "step 1/" not in p.stdout, "it trained before refusing"


def file_pages(d: pathlib.Path) -> int:
    """Bytes `d`'s files take on a tmpfs (whole 4 KiB pages each)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in d.rglob("*") if p.is_file())


@contextlib.contextmanager
def small_tmpfs(where: pathlib.Path, size: int):
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root with the right to mount (the RLIMIT_FSIZE case runs anywhere)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def set_file_size_limit(limit: int):
    """preexec_fn: RLIMIT_FSIZE for torchrun and its workers (Python ignores SIGXFSZ: a write past it fails with
    EFBIG)."""
    import resource
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["full disk", "file size limit"])
def test_a_save_that_fails_is_one_message_keeps_the_older_checkpoints_and_ends_every_rank(runs, tmp_path, fault):
    """The run resumes part's step-4 checkpoint and saves step 8: on a tmpfs with room for one checkpoint and a
    half (ENOSPC), or under a file size limit smaller than a rank's DCP file (EFBIG). Both ranks end (no rank
    waits for a failed one), rank 0 says what was not written and why, step 4 is intact, nothing partial stays."""
    saved = runs[2] / "ckpt"
    step4 = saved / RECIPE / "step_000004"
    with contextlib.ExitStack() as stack:
        if fault == "full disk":
            ck = stack.enter_context(small_tmpfs(tmp_path / "fs", file_pages(saved) * 3 // 2 + 8 * 4096)) / "ck"
            preexec, cause = None, "no space left on device"
        else:
            ck = tmp_path / "ck"
            preexec = set_file_size_limit(max(p.stat().st_size for p in step4.glob("*.distcp")) // 2)
            cause = "file too large (a limit on the size of one file: ulimit -f, or the filesystem's)"
        shutil.copytree(saved, ck)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "launch" / "train.py"), *TINY, "--checkpoint-dir", str(ck), "--resume", "--save-every", "4"]
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                           preexec_fn=preexec)
        run_dir = ck / RECIPE
        assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-4000:]
        assert f"[{RECIPE}] step 8/8" in p.stdout, "it trained up to the failed save"
        lines = [l for l in p.stderr.splitlines() if l.startswith("train.py:")]
        assert len(lines) == 1 and lines[0].startswith(f"train.py: checkpoint step_000008 not written: {cause} "
                                                       "(needs ~"), p.stderr[-4000:]
        assert lines[0].endswith(f"the older checkpoints are kept (step_000004): "
                                 f"{'free space' if fault == 'full disk' else 'lift that'} (or pick another "
                                 "--checkpoint-dir) and --resume to continue from step_000004"), lines[0]
        assert "[rank0]" not in p.stderr and "[rank1]" not in p.stderr, "a rank printed a traceback"
        assert sorted(q.name for q in run_dir.iterdir()) == ["latest", "step_000004"], "partial files or a lock stay"
        import hybridq.checkpoint
        hybridq.checkpoint.verify_manifest(run_dir / "step_000004")


@pytest.mark.distributed
def test_a_second_job_on_a_busy_checkpoint_folder_is_refused_up_front(runs, tmp_path):
    """A job left a stale lock (killed); job A takes it over and trains; job B, resuming into the same folder while
    A runs, is refused before it trains; A ends normally and releases the lock."""
    import lock
    ck = tmp_path / "ck"
    shutil.copytree(runs[2] / "ckpt", ck)
    run_dir = ck / RECIPE
    dead = lock_holder(run_dir)
    dead.kill()
    dead.wait()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    a = subprocess.Popen([sys.executable, str(ROOT / "launch" / "train.py"), *TINY, "--steps", "60", "--checkpoint-dir",
                          str(ck), "--resume", "--save-every", "30", "--keep-last", "1"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # A holds the lock once its own check passed
            if (lock.holder(run_dir) or {}).get("pid") == a.pid or a.poll() is not None:
                break
            time.sleep(0.2)
        assert (lock.holder(run_dir) or {}).get("pid") == a.pid, "job A did not take the lock"
        b = python_job("--checkpoint-dir", str(ck), "--resume", "--save-every", "4", cwd=tmp_path)
        a_running = a.poll() is None
        out, err = a.communicate(timeout=400)
    finally:
        a.kill()
    assert a_running, "job A ended before job B's check: the test did not overlap them"
    assert b.returncode == 1 and "step 1" not in b.stdout and "step 5/" not in b.stdout
    refusals = [l for l in b.stderr.splitlines() if l.startswith("train.py:")]
    assert len(refusals) == 1 and "Traceback" not in b.stderr, b.stderr
    line = refusals[0]
    assert line.startswith(f"train.py: {run_dir} is in use by another training job (pid {a.pid} on host "
                           f"{socket.gethostname()} since "), line
    assert line.endswith("two jobs writing one checkpoint folder would overwrite and prune each other's checkpoints; "
                         "wait for it, or pick another --checkpoint-dir"), line
    assert a.returncode == 0, err[-3000:]
    assert f"took over the stale lock {run_dir / lock.LOCK} of a job that is no longer running (pid {dead.pid} " in out
    assert sorted(q.name for q in run_dir.iterdir()) == ["latest", "step_000060"], "A's lock is released"


def test_peak_memory_restarts_for_each_run():
    import trainer
    mem = trainer.PeakMemory(trainer.Env(0, 1, torch.device("cpu"), "gloo", None))
    mem.reset()
    if mem.label != "peak RSS":
        pytest.skip("this OS cannot reset a process's peak RSS: the summary labels it 'peak RSS (process)'")
    base = mem.read()
    x = torch.ones(64 * 2**20)  # 256 MiB, written
    high = mem.read()
    del x
    mem.reset()
    low = mem.read()
    assert high - base > 200 * 2**20, (base, high)
    assert high - low > 200 * 2**20, f"after a reset the peak still includes the freed 256 MiB: {high} -> {low}"


def test_adamw_is_fused_by_default_and_foreach_on_request():
    """--adamw-impl: fused (one kernel per group of tensors, torchtitan's default) unless foreach is asked for."""
    import trainer
    assert config.parse_args(["--device", "cpu"]).adamw_impl == "fused"
    p = torch.nn.Parameter(torch.zeros(2))
    for impl in ("fused", "foreach"):
        opt = torch.optim.AdamW([p], **trainer.adamw_impl(config.parse_args(["--adamw-impl", impl]).adamw_impl))
        other = {"fused": "foreach", "foreach": "fused"}[impl]
        assert opt.defaults[impl] is True and not opt.defaults[other], f"--adamw-impl {impl}: {opt.defaults}"


# ---- the host runs ahead: --sync-every (trainer.StepWindow) ----------------------------------------

@pytest.mark.parametrize("start,end,every,want", [
    (0, 8, 10, [1, 8]),               # the first step (compile / warm-up on its own) and the last
    (0, 25, 10, [1, 10, 20, 25]),
    (4, 12, 3, [5, 6, 9, 12]),        # a resumed run: its first step, multiples of N, its last
    (0, 4, 1, [1, 2, 3, 4]),          # --sync-every 1: every step
])
def test_the_host_waits_on_the_first_and_last_step_and_every_n(start, end, every, want):
    import trainer
    got = [n for n in range(start + 1, end + 1) if trainer.StepWindow.due(n, start, end, every)]
    assert got == want, f"steps {start + 1}..{end}, --sync-every {every}: waits at {got}, expected {want}"


@pytest.fixture
def world_of_one():
    """A real gloo process group of this process alone (the window all-reduces its losses)."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_window_is_read_once_the_next_step_is_issued_in_step_order(world_of_one):
    """A closed window's losses are read when the next step has been issued (the device keeps that step queued),
    in step order with their lr and bytes and each step's own time; read_now (a checkpoint, the last step) reads
    the window it closes at once."""
    import trainer
    w = trainer.StepWindow(trainer.Env(0, 1, torch.device("cpu"), "gloo", None))
    p = torch.nn.Parameter(torch.tensor(1.0))
    values = {1: 5.5, 2: 2.5, 3: float("nan"), 4: 0.25, 5: 1.0}
    got = {}
    for n, close, now, want in ((1, True, False, []), (2, False, False, [1]), (3, True, False, []),
                                (4, False, False, [2, 3]), (5, False, True, [4, 5])):
        rows = w.step_issued(n, p * values[n], lr=0.1 * n, sent={"allgather": n}, close=close, read_now=now)
        assert [r[0] for r in rows] == want, f"after issuing step {n}: read {[r[0] for r in rows]}, expected {want}"
        got.update({r[0]: r for r in rows})
    for n, (step, loss, lr, sent, dt) in got.items():
        assert (loss == values[n] or math.isnan(loss) and math.isnan(values[n])) and lr == 0.1 * n, (n, got[n])
        assert sent == {"allgather": n} and dt > 0, got[n]
    assert w.steps == [] and w.closed is None, "everything issued has been read"


@pytest.mark.distributed
def test_a_run_that_waits_every_step_trains_bitwise_like_the_windowed_one(runs, tmp_path):
    """--sync-every changes only when the host reads the losses: the losses of a run that waits for every step are
    bitwise those of the default run (windows of 10), with one logged record per step in both."""
    _, js, _ = runs
    torchrun("--sync-every", "1", "--metrics", str(tmp_path / "s1.jsonl"), cwd=tmp_path)
    got = metrics_of(tmp_path / "s1.jsonl")
    want = js["full"]["runs"][RECIPE]["losses"]
    assert got["runs"][RECIPE]["losses"] == want, f"--sync-every 1 {got['runs'][RECIPE]['losses']} vs default {want}"
    assert [s["step"] for s in got["steps"]] == list(range(1, 9))


@pytest.mark.distributed
def test_a_non_finite_loss_inside_a_window_stops_the_job_naming_its_step(tmp_path):
    """A step whose loss is not finite ends the job with its step number whether the host waited for it alone
    (--sync-every 1) or read it at the end of a window (steps 2-6 here): the same message, the same step, and the
    finite steps before it are logged."""
    bad = ("--recipe", "fp8_tensorwise", "--lr", "1e30", "--warmup", "0", "--steps", "6")
    outs = {}
    for every in ("1", "10"):
        p = torchrun_n(2, *bad, "--sync-every", every, cwd=tmp_path, ok=False)
        assert p.returncode != 0, f"--sync-every {every}: a run with lr 1e30 should fail:\n{p.stdout[-2000:]}"
        line = [l for l in (p.stdout + p.stderr).splitlines() if "loss is" in l]
        assert line, f"--sync-every {every}: no 'loss is ...' message:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        outs[every] = (line[0].split("train.py: ")[-1], [l for l in p.stdout.splitlines() if "] step " in l])
    assert outs["1"][0] == outs["10"][0], f"waiting every step: {outs['1'][0]!r}; windowed: {outs['10'][0]!r}"
    assert [l.split(" | ")[:2] for l in outs["1"][1]] == [l.split(" | ")[:2] for l in outs["10"][1]], outs


@pytest.mark.parametrize("policy,mode,want", [
    ("default", None, [True, True, False]),                # torchtitan's: the last block stays gathered
    ("default", "reduce-overhead", [True, True, True]),    # CUDA graphs: a kept block re-records every step
    ("always", None, [True, True, True]),
    ("never", None, [False, False, False]),
])
def test_reshard_after_forward_policy_per_block(policy, mode, want):
    import trainer
    flags = ["--reshard-after-forward", policy] + (["--compile", "--compile-mode", mode] if mode else [])
    args = args_for(*flags)
    got = [trainer.reshard_after_forward(args, i, 3) for i in range(3)]
    assert got == want, f"--reshard-after-forward {policy} (compile mode {mode}): {got}, expected {want}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_steps_time_is_the_devices_and_the_host_runs_ahead(world_of_one):
    """On CUDA a step's time is the device's (end of the previous step's work to the end of its own): three steps
    of ~20 ms of device work each, issued in well under that, measure ~20 ms each, and the host did not wait for
    them until the window was read."""
    import trainer
    w = trainer.StepWindow(trainer.Env(0, 1, torch.device("cuda", torch.cuda.current_device()), "gloo", None))
    torch.cuda._sleep(1000)  # (the sleep kernel loaded)
    torch.cuda.synchronize()
    cycles_per_ms = 2.1e6  # an upper bound on H100 / H200 SM clocks (<= 2 GHz): each sleep lasts >= 20 ms
    ms = 20
    p = torch.ones((), device="cuda", requires_grad=True)
    rows, issued = [], []
    t0 = time.perf_counter()
    for n in (1, 2, 3):
        torch.cuda._sleep(int(ms * cycles_per_ms))
        issued.append(time.perf_counter() - t0)
        rows += w.step_issued(n, p * n, lr=0.0, sent={}, close=n == 3, read_now=n == 3)
    assert issued[-1] < ms / 1e3, f"the host waited for the device while issuing: {issued}"
    times = [r[4] * 1e3 for r in rows]
    assert [r[0] for r in rows] == [1, 2, 3] and all(t >= 0.9 * ms for t in times), \
        f"each step's device time should be >= ~{ms} ms: {times}"
