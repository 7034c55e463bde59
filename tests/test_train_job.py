"""The training job (launch/train.py) on CPU: argument checks, the per-layer report, the data and model, and
three torchrun launches (2 processes, gloo) of a tiny model:

    full     8 steps of mxfp8_fwd_nvfp4_bwd with --compare bf16 and --plot (metrics JSON beside it)
    part     the same flags with --checkpoint-dir --save-every 4 --stop-after 6 (an interrupted run)
    resumed  --resume from part's step-4 checkpoint to step 8

Resume bound (same world size): bitwise. The resumed run's losses at steps 5..8 equal the uninterrupted run's
exactly (weights and AdamW state come back exactly through DCP; batches, learning rate and the
stochastic-rounding stream depend only on seed, step and rank). Across world sizes (2 -> 1 and 1 -> 2): see
the section at the end, which adds six short launches.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import data as job_data  # noqa: E402
import model as job_model  # noqa: E402
import train  # noqa: E402

RECIPE = "mxfp8_fwd_nvfp4_bwd"
TINY = ["--d-model", "64", "--n-layers", "1", "--n-heads", "2", "--seq", "64", "--batch", "2", "--steps", "8",
        "--eval-batches", "1", "--no-progress", "--timeout", "120", "--recipe", RECIPE, "--device", "cpu"]


def args_for(*extra: str):
    return train.parse_args(TINY + list(extra))


# ---- in-process checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--tp", "2"], "tensor parallelism needs hybridq's tensor-parallel support"),
    (["--seq", "40", "--batch", "1"], "must be a multiple of 32"),
    (["--d-model", "80", "--n-heads", "2"], "d_model=80 must be a multiple of 32"),
    (["--dp", "3"], "must equal the number of processes"),
    (["--resume"], "need --checkpoint-dir"),
    (["--compare", RECIPE], "same as --recipe"),
])
def test_bad_arguments_are_rejected_before_any_collective(flags, needle):
    with pytest.raises(SystemExit) as e:
        train.check_args(args_for(*flags), world=2)
    assert needle in str(e.value)


def _report(recipe: str, *flags: str) -> dict[str, list[str]]:
    args = args_for(*flags)
    torch.manual_seed(0)
    m = job_model.Transformer(train.model_config(args))
    rows, summary = train.convert(m, recipe, args)
    assert rows[0][:5] == ["layer", "status", "input (row / col)", "weight (row / col)", "grad_output (row / col)"]
    return {r[0]: r[1:] for r in rows[1:]}


LINEARS = ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv", "layers.0.attention.wo",
           "layers.0.feed_forward.w1", "layers.0.feed_forward.w3", "layers.0.feed_forward.w2"]


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
    assert list(rep) == LINEARS + ["output"], "every Linear, in model order"
    for name in LINEARS:
        status, *cells, why = rep[name]
        assert status == "converted", (name, why)
        for cell, needles in zip(cells, expect):
            pos = [cell.find(n) for n in needles]
            assert all(p >= 0 for p in pos) and pos == sorted(pos), (recipe, name, cell, needles)
    assert rep["output"][0] == "skipped" and "high precision" in rep["output"][-1]


def test_report_head_options():
    rep = _report("mxfp8", "--quantize-head")
    assert rep["output"][0] == "converted"
    rep = _report("mxfp8", "--tie-embeddings")
    assert "output" not in rep and rep["output (tied)"][0] == "skipped"


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
    out["full"] = torchrun("--compare", "bf16", "--plot", str(d / "full.png"), cwd=d)
    ck = d / "ckpt"
    out["part"] = torchrun("--checkpoint-dir", str(ck), "--save-every", "4", "--stop-after", "6",
                           "--dump-state", str(d / "dumps" / "s21"), "--plot", str(d / "part.png"), cwd=d)
    shutil.copytree(ck, d / "ck21")  # its step-4 checkpoint, for the 2 -> 1 resume below
    out["resumed"] = torchrun("--checkpoint-dir", str(ck), "--resume", "--plot", str(d / "resumed.png"), cwd=d)
    js = {k: json.loads((d / f"{k}.json").read_text()) for k in ("full", "part", "resumed")}
    return out, js, d


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
    assert "summary (" in text and "loss curve:" in text


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
    assert (ck / "step_000004" / ".metadata").exists() and (ck / "step_000004" / "train_state.json").exists()
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
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           str(ROOT / "launch" / "train.py"), *TINY, *flags]
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
                            "--dump-state", str(dumps / "r21"), "--plot", str(d / "r21.png"), cwd=d).stdout
    torchrun_n(1, "--init-state", str(dumps / "s21" / f"{RECIPE}_saved_step_000004.pt"), "--stop-after", "6",
               "--plot", str(d / "o21.png"), cwd=d)
    # 1 -> 2, bf16
    ck12 = d / "ck12"
    torchrun_n(1, "--recipe", "bf16", "--checkpoint-dir", str(ck12), "--save-every", "4", "--stop-after", "4",
               "--dump-state", str(dumps / "s12"), "--plot", str(d / "s12.png"), cwd=d)
    res["r12"] = torchrun_n(2, "--recipe", "bf16", "--checkpoint-dir", str(ck12), "--resume", "--stop-after", "6",
                            "--dump-state", str(dumps / "r12"), "--plot", str(d / "r12.png"), cwd=d).stdout
    torchrun_n(2, "--recipe", "bf16", "--init-state", str(dumps / "s12" / "bf16_saved_step_000004.pt"),
               "--stop-after", "6", "--plot", str(d / "o12.png"), cwd=d)
    # a recipe mismatch, against the 2 -> 1 checkpoint (1 process: it fails before training)
    res["bad_recipe"] = torchrun_n(1, "--checkpoint-dir", str(ck), "--resume", "--recipe", "fp8_block", cwd=d,
                                   ok=False)
    js = {k: json.loads((d / f"{k}.json").read_text()) for k in ("r21", "o21", "s12", "r12", "o12")}
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
def test_resume_with_another_configuration_names_the_mismatch(reshard_runs):
    res, _, d = reshard_runs
    ck = d / "ck21" / RECIPE / "step_000004"
    saved = json.loads((ck / "meta.json").read_text())
    meta = dict(saved, model=dict(saved["model"], d_model=96), dp=1)  # the dp differs freely
    with pytest.raises(SystemExit) as e:
        train.check_meta(ck, saved, meta)
    assert "written by a different configuration" in str(e.value) and "model d_model: saved 64, now 96" in str(e.value)
    train.check_meta(ck, saved, dict(saved, dp=1))
    with pytest.raises(SystemExit, match="recipe: saved 'mxfp8_fwd_nvfp4_bwd', now 'bf16'"):
        train.check_meta(ck, saved, dict(saved, recipe="bf16"))
    p = res["bad_recipe"]
    assert p.returncode != 0
    assert "--resume with recipe fp8_block" in p.stderr and f"recipe(s) {RECIPE} only (recipe mismatch" in p.stderr, \
        p.stderr[-3000:]
