"""The README's sample of the main job's output (launch/readme_sample.py): the block it writes, the losses it reads
back, and the check that the README's losses are what the current code prints.

The check runs the README's command (`bash launch/run.sh`, 2 CPU processes) with `--stop-after 12`: the same run
(same --steps, so the same learning-rate schedule), stopped after 12 steps, whose losses are the first 12 of the
whole run; the README's losses at steps 1 and 12 (the loss curve's first columns and the summary's first loss) and
its model line are compared. ~1 minute on 2 idle cores, where the whole job takes ~4; the whole comparison is
`python launch/readme_sample.py --check`.
"""

from __future__ import annotations

import datetime
import io
import pathlib
import sys
from contextlib import redirect_stdout

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import readme_sample  # noqa: E402
from metrics import Printer, summarize  # noqa: E402

LOSSES = {"mxfp8_fwd_nvfp4_bwd": [5.53124, 4.1, 3.2234, 3.0, 2.9, 2.5891],
          "bf16": [5.53211, 4.2, 3.2189, 3.1, 2.8, 2.5584]}
MODEL = "model: 2 layers, d_model 128, hidden 352, heads 4/4 kv, vocab 256 (bytes), 0.47M params, untied head"


def _runs(losses: dict[str, list[float]]) -> dict[str, dict]:
    return {name: {"recipe": name, "start_step": 0, "steps_run": len(ls), "losses": ls, "final_loss": ls[-1],
                   "val_loss": ls[-1] - 0.05, "median_tokens_per_s": 1000.0, "median_step_s": 0.5,
                   "peak_memory_bytes": 2**28, "peak_memory_kind": "peak RSS", "allgather_bytes_per_step": 2**19,
                   "wall_s": 3.0} for name, ls in losses.items()}


def _job_stdout(runs: dict[str, dict]) -> str:
    """What the job prints, with the job's own summary code."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        print("hybridq 0.1.0, torch 2.13.0+cpu: 2 process(es), gloo on cpu, FSDP2 dp=2 tp=1; runs: a, b")
        print(MODEL)
        print("per-layer report, recipe mxfp8_fwd_nvfp4_bwd:")
        print("[bf16] step   6/6 | loss 2.5584")
        summarize(list(runs.values()), Printer(main=True, bar=False))
    return buf.getvalue()


def _readme(runs: dict[str, dict]) -> str:
    block = readme_sample.block(_job_stdout(runs), datetime.date(2026, 11, 27))
    return f"# hybridq\n\nintro\n\n{block}\n\nmore text\n"


def test_the_block_shows_header_summary_curve_and_gap():
    text = _readme(_runs(LOSSES))
    assert text.count(readme_sample.BEGIN) == 1 and text.count(readme_sample.END) == 1
    body = text[text.index(readme_sample.BEGIN):text.index(readme_sample.END)]
    for needle in (MODEL, "summary (", "loss curve:", "loss gap mxfp8_fwd_nvfp4_bwd - bf16"):
        assert needle in body, f"{needle!r} missing from the sample block:\n{body}"
    assert "per-layer report, recipe" not in body and "[bf16] step" not in body


def test_readme_losses_reads_back_what_the_job_printed():
    shown = readme_sample.readme_losses(_readme(_runs(LOSSES)))
    assert ("bf16", "step", 1, "5.5321") in shown  # the summary's first loss, 4 decimals
    assert ("mxfp8_fwd_nvfp4_bwd", "step", 3, "3.223") in shown  # the loss curve, 3 decimals
    assert ("bf16", "final loss", 6, "2.5584") in shown
    bad, n = readme_sample.compare(_readme(_runs(LOSSES)), _runs(LOSSES), MODEL)
    assert bad == [] and n == len(shown)


def test_compare_names_every_loss_that_differs():
    changed = {k: list(v) for k, v in LOSSES.items()}
    changed["bf16"][2] = 3.2401  # what a numerics change looks like at step 3 (the recipes' gap is ~0.5%)
    bad, _ = readme_sample.compare(_readme(_runs(LOSSES)), _runs(changed), MODEL)
    assert bad == ["bf16 step 3: README 3.219, the job prints 3.240"]


def test_compare_takes_the_difference_another_machines_cpu_kernels_make():
    """The same code printed 3.107 on one x86-64 machine and 3.102 on another (AVX2 / AVX-512 kernels) at step 12:
    within the tolerance; a difference of 1% is not."""
    other_cpu = {k: list(v) for k, v in LOSSES.items()}
    other_cpu["mxfp8_fwd_nvfp4_bwd"][2] = 3.2234 - 0.005
    bad, _ = readme_sample.compare(_readme(_runs(LOSSES)), _runs(other_cpu), MODEL)
    assert bad == [], bad
    other_cpu["mxfp8_fwd_nvfp4_bwd"][2] = 3.2234 * 1.01
    bad, _ = readme_sample.compare(_readme(_runs(LOSSES)), _runs(other_cpu), MODEL)
    assert len(bad) == 1 and bad[0].startswith("mxfp8_fwd_nvfp4_bwd step 3:"), bad


def test_compare_checks_only_the_steps_a_shortened_run_reached():
    short = {k: v[:3] for k, v in LOSSES.items()}  # --stop-after 3: no final or val loss to compare
    bad, n = readme_sample.compare(_readme(_runs(LOSSES)), _runs(short), MODEL)
    assert bad == [] and n == 2 * 4  # per run: the curve at steps 1, 2, 3 and the summary's first loss
    other_model = MODEL.replace("hidden 352", "hidden 384")
    bad, _ = readme_sample.compare(_readme(_runs(LOSSES)), _runs(short), other_model)
    assert len(bad) == 1 and bad[0].startswith("model: README"), bad


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(readme_sample.SampleError, match="no sample block"):
        readme_sample.readme_losses("# hybridq\n")


@pytest.mark.distributed
def test_readme_sample_matches_the_current_job(tmp_path):
    readme = readme_sample.README.read_text()
    stdout = readme_sample.run_job(["--stop-after", "12"], tmp_path / "metrics.jsonl")
    runs = readme_sample.job_runs(tmp_path / "metrics.jsonl")
    bad, n = readme_sample.compare(readme, runs, readme_sample.model_line(stdout))
    assert bad == [], ("README.md's sample output differs from what the main job prints now; regenerate it with "
                       "`python launch/readme_sample.py`:\n  " + "\n  ".join(bad))
    assert n >= 6, f"only {n} of the README's losses are within the 12 steps run: keep the loss curve's step 12"
