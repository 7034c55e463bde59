"""benchmarks/e2e_report.py on CPU: reading train.py's metrics file and the budget rows in-process, the torchao_float8 error path of
launch/train.py, and one tiny end-to-end report (2 gloo processes, bf16 + fp8_tensorwise launched; fp8_delayed
skipped as apply_hybrid_fsdp rejects it; torchao_float8 a "not installed" row where torchao does not import, a run
where it does)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "launch")]  # the reports, the job

import config  # noqa: E402
import e2e_report  # noqa: E402
import e2e_runs  # noqa: E402
from metrics import MetricsFile  # noqa: E402


def _torchao_missing() -> bool:
    return e2e_report.torchao_status() is not None


def test_step_records_come_from_the_metrics_file_of_a_killed_run(tmp_path):
    """A run killed by its time limit leaves its step records; a last line cut short is ignored."""
    m = MetricsFile(str(tmp_path / "nvfp4.jsonl"), main=True)
    m.write("config", args={})
    for n, loss, tps in ((1, 5.53, 12345.0), (2, 5.0, 30000.0), (3, 4.5, 31000.0)):
        m.write("step", recipe="nvfp4", step=n, steps=30, loss=loss, lr=1e-4, tokens_per_s=tps, step_ms=1.0,
                peak_memory_bytes=41.5 * 2**30, peak_memory_kind="peak GPU mem")
    m.write("step", recipe="bf16", step=1, steps=30, loss=9.0, lr=1e-4, tokens_per_s=1.0, step_ms=1.0,
            peak_memory_bytes=1.0, peak_memory_kind="peak GPU mem")
    m.close()
    with open(tmp_path / "nvfp4.jsonl", "a") as f:
        f.write('{"kind": "step", "recipe": "nvfp4", "st')
    steps = e2e_report.step_records(tmp_path / "nvfp4.jsonl", "nvfp4")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["loss"] for s in steps] == [5.53, 5.0, 4.5]
    assert steps[1]["tokens_per_s"] == 30000 and steps[1]["peak_memory_bytes"] == 41.5 * 2**30
    assert e2e_report.step_records(tmp_path / "absent.jsonl", "nvfp4") == []


def test_gap_is_taken_over_the_steps_both_runs_did():
    ref = {"recipe": "bf16", "losses": [5.0] * 20 + [3.0] * 10, "tokens_per_s": 100.0, "status": "ok"}
    cut = {"recipe": "nvfp4", "losses": [5.5] * 20, "tokens_per_s": 40.0, "status": "time limit"}
    rows = {r["recipe"]: r for r in e2e_report.rows_for([ref, cut, {"recipe": "fp8_delayed", "skip": "why"}])}
    assert rows["nvfp4"]["gap_at"] == 20 and rows["nvfp4"]["gap"] == pytest.approx(0.5)
    assert rows["nvfp4"]["speed_vs_bf16"] == pytest.approx(0.4)
    assert rows["bf16"]["loss"] == pytest.approx(3.0) and "gap" not in rows["bf16"]


def test_plan_skips_fp8_delayed_and_puts_bf16_first():
    a = e2e_report.parse_args(["--tiny", "--recipes", "fp8_delayed,fp8_tensorwise,torchao_float8"])
    todo = {t["recipe"]: t["skip"] for t in e2e_report.plan(a)}
    assert list(todo)[0] == "bf16"
    assert "apply_hybrid_fsdp" in todo["fp8_delayed"] and "delayed scaling" in todo["fp8_delayed"]
    assert todo["fp8_tensorwise"] is None
    assert (todo["torchao_float8"] is not None) == _torchao_missing()
    alone = e2e_report.parse_args(["--tiny", "--recipes", "fp8_tensorwise", "--no-baseline"])
    assert [t["recipe"] for t in e2e_report.plan(alone)] == ["fp8_tensorwise"], "--no-baseline runs no bf16"
    with pytest.raises(SystemExit, match="unknown recipe"):
        e2e_report.plan(e2e_report.parse_args(["--recipes", "nope"]))


@pytest.mark.parametrize("flags", ["--weight-gather high_precision", "--compile --weight-gather=high_precision"])
def test_plan_runs_fp8_delayed_when_train_gathers_high_precision_weights(flags):
    """train.py --weight-gather high_precision converts with convert_linears, which takes delayed scaling: only
    apply_hybrid_fsdp's refusals (the quantized gather) are known in advance."""
    a = e2e_report.parse_args(["--tiny", "--recipes", "fp8_delayed", "--train-args", flags])
    todo = {t["recipe"]: t["skip"] for t in e2e_report.plan(a)}
    assert todo["fp8_delayed"] is None, f"fp8_delayed skipped with train args {flags!r}: {todo['fp8_delayed']}"


@pytest.mark.skipif(not _torchao_missing(), reason="torchao is installed: the error path does not apply")
def test_train_torchao_recipe_without_torchao_is_a_clear_error():
    args = config.parse_args(["--recipe", "torchao_float8", "--device", "cpu"])
    with pytest.raises(config.ConfigError, match="needs torchao"):
        config.check_args(args, world=2)


@pytest.mark.distributed
def test_tiny_report_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e_report.py"), "--device", "cpu", "--tiny", "--nproc", "2",
           "--recipes", "bf16,fp8_tensorwise,fp8_delayed,torchao_float8", "--out-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "report.md").read_text()
    rows = {r["recipe"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    for name in ("bf16", "fp8_tensorwise"):
        r = rows[name]
        assert r["status"] == "ok" and r["steps_done"] == 4 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert f"train.py --recipe {name} " in r["command"] and f"| {name} | ok | 4 |" in md
        assert (tmp_path / f"{name}.jsonl").exists()
    assert abs(rows["fp8_tensorwise"]["gap"]) < 0.2 and rows["fp8_tensorwise"]["gap_at"] == 4
    # the quantized all-gather sends FP8 bytes (plus scales) where bf16 sends 2 bytes per weight
    sent = {n: rows[n]["allgather_bytes"] for n in ("bf16", "fp8_tensorwise")}
    assert 0 < sent["fp8_tensorwise"] < sent["bf16"], f"all-gather bytes per rank per step: {sent}"
    # both reduce their gradients in fp32 (the same parameters: the same bytes); no TP, no TP column
    reduced = {n: rows[n]["reduce_scatter_bytes"] for n in ("bf16", "fp8_tensorwise")}
    assert reduced["bf16"] > 0 and reduced["bf16"] == reduced["fp8_tensorwise"], f"reduce-scatter bytes: {reduced}"
    assert rows["bf16"]["tp_bytes"] is None
    assert "| all-gather/rank/step | reduce-scatter/rank/step | TP gathers/rank/step |" in md
    assert rows["fp8_delayed"]["skip"] and "| fp8_delayed | skipped: rejected by hybridq.apply_hybrid_fsdp" in md
    if _torchao_missing():
        assert "| torchao_float8 | skipped: torchao not installed" in md
    else:  # the baseline runs on the CPU too (torchao 0.18 with torch 2.13): float8 all-gathers, like fp8_tensorwise
        ao = rows["torchao_float8"]
        assert ao["status"] == "ok" and ao["steps_done"] == 4, ao
        assert 0 < ao["allgather_bytes"] < rows["bf16"]["allgather_bytes"], ao["allgather_bytes"]


def test_compile_adds_compiled_runs_compared_with_bf16_compiled(tmp_path):
    """--compile adds the compiled rows (both weight gathers unless one is picked); --compiled-only drops eager's."""
    a = e2e_report.parse_args(["--tiny", "--recipes", "bf16,fp8_tensorwise", "--compile"])
    todo = e2e_report.plan(a)
    hp = "fp8_tensorwise" + e2e_report.HIGH_PRECISION_GATHER  # compiled with both weight gathers
    assert [e2e_report.label(t["recipe"], t["compiled"]) for t in todo] == [
        "bf16", "fp8_tensorwise", "bf16.compiled", "fp8_tensorwise.compiled", f"{hp}.compiled"]
    cmd = e2e_report.command(a, hp, 2, tmp_path, compiled=True)
    assert cmd[cmd.index("--recipe") + 1] == "fp8_tensorwise" and "--compile" in cmd, cmd
    assert cmd[cmd.index("--weight-gather") + 1] == "high_precision", cmd
    assert "--weight-gather" not in e2e_report.command(a, "fp8_tensorwise", 2, tmp_path, compiled=True)
    picked = e2e_report.parse_args(["--tiny", "--recipes", "fp8_tensorwise", "--compile", "--train-args",
                                    "--weight-gather quantized"])
    assert [t["recipe"] for t in e2e_report.plan(picked)].count(hp) == 0, "a weight gather picked: one mode"
    assert "--compile" in e2e_report.command(a, "fp8_tensorwise", 2, tmp_path, compiled=True)
    assert "--compile" not in e2e_report.command(a, "fp8_tensorwise", 2, tmp_path)
    only = e2e_report.parse_args(["--tiny", "--recipes", "bf16,fp8_tensorwise", "--compile", "--compiled-only"])
    assert [e2e_report.label(t["recipe"], t["compiled"]) for t in e2e_report.plan(only)] == [
        "bf16.compiled", "fp8_tensorwise.compiled", f"{hp}.compiled"], "--compiled-only: the compiled rows only"
    run = lambda base, compiled, tps: {"recipe": e2e_report.label(base, compiled), "base": base, "compiled": compiled,
                                       "losses": [2.0] * 4, "tokens_per_s": tps}
    rows = e2e_report.rows_for([run("bf16", False, 100.0), run("fp8_tensorwise", False, 110.0),
                                run("bf16", True, 200.0), run("fp8_tensorwise", True, 300.0)])
    assert [r.get("speed_vs_bf16") for r in rows] == [1.0, 1.1, 1.0, 1.5], "each mode against its own bf16"


def test_a_compiled_run_with_graph_breaks_says_so_in_its_status():
    """The row of a compiled run whose blocks broke (partly eager) is not a plain "ok"."""
    assert e2e_runs.finished_status({"graph_breaks": 3, "compiled_graphs": 5}) == "ok, 3 graph break(s)"
    assert e2e_runs.finished_status({"graph_breaks": 0, "compiled_graphs": 1}) == "ok"
    assert e2e_runs.finished_status({}) == "ok", "an eager run's summary has no compile counts"


def test_norm_baseline_runs_bf16_with_the_norm_kernel_compared_with_plain_bf16(tmp_path):
    a = e2e_report.parse_args(["--tiny", "--recipes", "fp8_tensorwise", "--norm-baseline"])
    names = [t["recipe"] for t in e2e_report.plan(a)]
    assert names == ["bf16", e2e_report.NORM_BASELINE, "fp8_tensorwise"], names
    cmd = e2e_report.command(a, e2e_report.NORM_BASELINE, 2, tmp_path)
    i = cmd.index("--recipe")
    assert cmd[i + 1:i + 4] == ["bf16", "--norms", "hybridq"], cmd
    assert cmd[-1].endswith(f"{e2e_report.NORM_BASELINE}.jsonl")
    run = lambda name, tps: {"recipe": name, "base": name, "compiled": False, "losses": [2.0] * 4,
                             "tokens_per_s": tps}
    rows = e2e_report.rows_for([run("bf16", 100.0), run(e2e_report.NORM_BASELINE, 115.0), run("fp8_tensorwise", 130.0)])
    assert [r.get("speed_vs_bf16") for r in rows] == [1.0, 1.15, 1.3], "the norm row is not the bf16 reference"


def test_compile_mode_goes_to_the_compiled_runs_only(tmp_path):
    a = e2e_report.parse_args(["--tiny", "--recipes", "bf16", "--compile", "--compile-mode", "reduce-overhead"])
    compiled = e2e_report.command(a, "bf16", 2, tmp_path, compiled=True)
    assert compiled[compiled.index("--compile-mode") + 1] == "reduce-overhead", compiled
    assert "--compile-mode" not in e2e_report.command(a, "bf16", 2, tmp_path), "an eager run got --compile-mode"


def test_parity_sizes_limits_and_plot(tmp_path):
    a = e2e_report.parse_args(["--parity", "--recipes", "bf16,fp8_tensorwise"])
    assert (a.steps, a.seq, a.time_limit_s) == (600, 1024, 420.0), "parity sizes and a longer per-run limit"
    assert "--corpus-bytes" in e2e_report.command(a, "bf16", 1, tmp_path), "parity trains on more than corpus.txt"
    assert "--corpus-bytes" not in e2e_report.command(e2e_report.parse_args(["--tiny"]), "bf16", 1, tmp_path)
    assert e2e_report.parse_args(["--parity", "--steps", "50"]).steps == 50, "sizes still override"
    with pytest.raises(SystemExit):
        e2e_report.parse_args(["--parity", "--tiny"])
    run = lambda name, losses, val: {"recipe": name, "base": name, "compiled": False, "losses": losses,
                                     "tokens_per_s": 1.0, "val_loss": val}
    rows = e2e_report.rows_for([run("bf16", [3.0, 2.0], 2.0), run("nvfp4", [3.0, 2.1], 2.02)])
    assert abs(rows[1]["val_gap_rel"] - 0.01) < 1e-12 and "val_gap_rel" not in rows[0]
    assert "(+1.00%)" in e2e_report.markdown([dict(r, status="ok", steps_done=2, peak_memory_bytes=None,
                                                     command="c") for r in rows], [])
    said = e2e_report.write_parity_plot([run("bf16", [3.0, 2.0], 2.0)], tmp_path / "parity.png")
    assert said.startswith("no plot") or (tmp_path / "parity.png").stat().st_size > 0, said


def _finished_metrics(path: pathlib.Path, a, recipe: str, nproc: int, steps: int) -> None:
    """A metrics file as train.py leaves it after a finished run with `a`'s sizes."""
    cmd = e2e_report.command(a, recipe, nproc, path.parent)
    m = MetricsFile(str(path), main=True)
    m.write("config", args=vars(e2e_report.parse_args_for_train(cmd)), world_size=nproc, device_name="GPU X",
            torch="2.x")
    m.write("summary", recipe=recipe, start_step=0, steps_run=steps, losses=[3.0] * steps, median_tokens_per_s=9.0,
            peak_memory_bytes=1.0, peak_memory_kind="peak GPU mem", val_loss=2.5)
    m.close()


def test_reuse_finished_reads_a_finished_run_with_the_same_sizes_only(tmp_path):
    a = e2e_report.parse_args(["--parity", "--recipes", "bf16,nvfp4", "--reuse-finished"])
    _finished_metrics(tmp_path / "nvfp4.jsonl", a, "nvfp4", nproc=1, steps=a.steps)
    got = e2e_report.finished_run(a, "nvfp4", 1, tmp_path)
    assert got is not None and got["status"] == "ok (reused)" and got["val_loss"] == 2.5, got
    assert got["device_name"] == "GPU X" and len(got["losses"]) == a.steps
    assert e2e_report.finished_run(a, "nvfp4", 2, tmp_path) is None, "another world size is another run"
    assert e2e_report.finished_run(a, "bf16", 1, tmp_path) is None, "no metrics file: run it"
    other = e2e_report.parse_args(["--parity", "--recipes", "nvfp4", "--d-model", "512"])
    assert e2e_report.finished_run(other, "nvfp4", 1, tmp_path) is None, "other sizes are another run"
    _finished_metrics(tmp_path / "nvfp4.jsonl", a, "nvfp4", nproc=1, steps=a.steps - 1)
    assert e2e_report.finished_run(a, "nvfp4", 1, tmp_path) is None, "a run cut short is not finished"


def test_scaling_runs_every_recipe_at_each_world_size_and_skips_those_above_the_gpus(tmp_path):
    a = e2e_report.parse_args(["--tiny", "--recipes", "bf16,fp8_tensorwise", "--scaling", "4,1,2,8"])
    todo = e2e_report.schedule(a, nproc=2, gpus=4)
    names = [e2e_report.run_name(a, t["recipe"], t["compiled"], t["nproc"]) for t in todo]
    assert names == ["bf16@1", "fp8_tensorwise@1", "bf16@2", "fp8_tensorwise@2", "bf16@4", "fp8_tensorwise@4",
                     "bf16@8", "fp8_tensorwise@8"], names
    skips = {e2e_report.run_name(a, t["recipe"], t["compiled"], t["nproc"]): t["skip"] for t in todo}
    assert skips["bf16@8"] == "needs 8 GPUs, 4 visible" and skips["bf16@4"] is None, skips
    assert all(t["skip"] is None for t in e2e_report.schedule(a, nproc=2, gpus=None)), "CPU: any world size"
    cmd = e2e_report.command(a, "bf16", 4, tmp_path)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and cmd[-1].endswith("bf16@4.jsonl"), cmd
    plain = e2e_report.parse_args(["--tiny", "--recipes", "bf16"])
    assert [t["nproc"] for t in e2e_report.schedule(plain, nproc=2, gpus=8)] == [2], "no --scaling: one world size"
    assert e2e_report.command(plain, "bf16", 2, tmp_path)[-1].endswith("/bf16.jsonl"), "no @N without --scaling"
    for bad in ("0,2", "1,x"):
        with pytest.raises(SystemExit):
            e2e_report.parse_args(["--scaling", bad])


def test_scaling_efficiency_is_per_process_speed_against_the_smallest_world_size():
    run = lambda base, n, tps: {"recipe": f"{base}@{n}", "base": base, "compiled": False, "nproc": n,
                                "losses": [2.0] * 4, "tokens_per_s": tps, "status": "ok"}
    rows = e2e_report.rows_for([run("bf16", 1, 100.0), run("fp8_tensorwise", 1, 130.0), run("bf16", 2, 180.0),
                                run("fp8_tensorwise", 2, 250.0), {"recipe": "bf16@8", "skip": "needs 8 GPUs",
                                                                  "nproc": 8}])
    assert [r.get("speed_vs_bf16") for r in rows[:4]] == pytest.approx([1.0, 1.3, 1.0, 250 / 180]), \
        "each world size against its own bf16"
    sc = {(r["recipe"], r["nproc"]): r for r in e2e_report.scaling_rows(rows)}
    assert set(sc) == {("bf16", 1), ("bf16", 2), ("fp8_tensorwise", 1), ("fp8_tensorwise", 2)}
    assert sc[("bf16", 2)]["per_process"] == 90.0 and sc[("bf16", 2)]["efficiency"] == pytest.approx(0.9)
    assert sc[("fp8_tensorwise", 2)]["efficiency"] == pytest.approx(125 / 130)
    assert "| bf16 | 2 | 180 | 90 | 90% (vs 1) | 1.00x |" in e2e_report.scaling_markdown(rows)


def test_size_7b_is_llama_2_7b_shaped_with_a_longer_limit(tmp_path):
    import model

    a = e2e_report.parse_args(["--size", "7b", "--recipes", "bf16"])
    assert (a.d_model, a.n_layers, a.n_heads, a.hidden, a.seq, a.batch) == (4096, 32, 32, 11008, 4096, 1)
    assert a.time_limit_s == 240.0, "start-up builds 6.5B parameters on the CPU of every rank"
    cfg = model.ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, hidden=a.hidden)
    assert 6.4e9 < cfg.num_params() < 6.6e9, cfg.num_params()
    assert all(v % 128 == 0 for v in (a.d_model, a.hidden, a.d_model // a.n_heads)), "FP8 / MX / NVFP4 blocks hold"
    assert e2e_report.parse_args(["--size", "7b", "--batch", "2"]).batch == 2, "sizes still override"
    with pytest.raises(SystemExit):
        e2e_report.parse_args(["--size", "7b", "--parity"])


@pytest.mark.distributed
def test_tiny_scaling_report_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e_report.py"), "--device", "cpu", "--tiny", "--scaling", "1,2",
           "--recipes", "bf16", "--steps", "3", "--out-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["recipe"]: r for r in json.loads((tmp_path / "report.json").read_text())["rows"]}
    assert set(rows) == {"bf16@1", "bf16@2"}, sorted(rows)
    assert rows["bf16@1"]["allgather_bytes"] == 0, "one rank: FSDP2 gathers nothing"
    assert rows["bf16@2"]["allgather_bytes"] > 0
    md = (tmp_path / "report.md").read_text()
    assert "Weak scaling (per-rank batch fixed):" in md and "| bf16 | 2 |" in md and "(vs 1)" in md


def test_header_states_the_model_train_py_builds_from_the_train_args():
    """--train-args that change the model (an MoE with its own hidden size, grouped-query attention) show in the
    header as train.py builds it."""
    import model
    a = e2e_report.parse_args(["--recipes", "bf16", "--train-args", "--moe 16 --top-k 2 --hidden 1024 --n-kv-heads 4"])
    line = e2e_report.describe(a, 2)[1]
    cfg = model.ModelConfig(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, hidden=1024, moe_experts=16,
                            moe_top_k=2)
    active = cfg.num_params() - 20 * 3 * 2048 * 1024 * (16 - 2)  # 14 of 16 experts idle per token and layer
    assert line.startswith(f"Model: 20 layers, d_model 2048, 16 heads (4 kv), MoE 16 experts top-2, expert hidden "
                           f"1024, {cfg.num_params() / 1e6:,.1f}M parameters ({active / 1e6:,.1f}M active per "
                           "token); seq 4096"), line
    dense = e2e_report.describe(e2e_report.parse_args(["--recipes", "bf16"]), 2)[1]
    assert dense.startswith("Model: 20 layers, d_model 2048, hidden 5632, 16 heads, 1,028.7M parameters; "), dense


def test_torchao_moe_row_with_an_moe_only_and_skipped_with_the_job_s_reason_without_cuda_or_torchao():
    """'all' plans the torchao_moe baseline when --train-args make an MoE (not for a dense model); on a machine
    without torchao or CUDA its row is skipped with train.py's own refusal, which names what is missing."""
    dense = e2e_report.plan(e2e_report.parse_args(["--device", "cpu", "--tiny"]))
    assert "torchao_moe" not in [r["recipe"] for r in dense], dense
    moe = e2e_report.plan(e2e_report.parse_args(["--device", "cpu", "--tiny", "--train-args", "--moe 2"]))
    row = next(r for r in moe if r["recipe"] == "torchao_moe")
    assert row["skip"] is not None and "torchao_moe" in row["skip"], row
    assert ("needs torchao" in row["skip"]) if _torchao_missing() else ("needs a CUDA device" in row["skip"]), row


@pytest.mark.parametrize("parse", ["e2e_report", "profile_step"])
def test_a_lone_train_flag_is_read_as_the_train_args_value(parse):
    """`--train-args "--compile"` (one train.py flag, no space) failed in argparse ("expected one argument")."""
    import profile_step
    parse_args = {"e2e_report": e2e_report.parse_args, "profile_step": profile_step.parse_args}[parse]
    a = parse_args(["--recipes", "bf16", "--train-args", "--compile"])
    assert a.train_args == "--compile", a.train_args
    assert parse_args(["--train-args", "--moe 16 --top-k 2"]).train_args == "--moe 16 --top-k 2"
