"""The end-to-end report: the main job (launch/train.py under torchrun, FSDP2) at a size that fills the
GPUs, once per recipe -- bf16, every hybridq preset that runs under FSDP2, torchao float8 (tensorwise,
float8 all-gather) where torchao imports, and for an MoE (`--train-args "--moe E --top-k K"`) torchao_moe (torchao's
MoE training conversion of the experts: FP8 rowwise grouped GEMMs; CUDA only) -- and one markdown table: tokens/s, peak GPU memory, loss after the
steps done, loss gap vs bf16, and the exact command that reproduces each row.

    python benchmarks/e2e_report.py                      # 2 GPUs: ~1B-parameter model, seq 4096, fits ~9 minutes
    python benchmarks/e2e_report.py --dry-run            # print the commands only
    python benchmarks/e2e_report.py --device cpu --tiny  # CPU smoke test (2 gloo processes, tiny model)
    python benchmarks/e2e_report.py --compile            # every recipe eager and with train.py --compile, side by side
                                                         # (compiled presets with both --weight-gather modes)
    python benchmarks/e2e_report.py --compile --compiled-only --recipes bf16,fp8_tensorwise  # the compiled rows only
    python benchmarks/e2e_report.py --parity             # loss parity: ~127M model, 600 steps, every curve in parity.png
    python benchmarks/e2e_report.py --parity --reuse-finished --recipes bf16,nvfp4  # add runs to an earlier report
    python benchmarks/e2e_report.py --parity --no-baseline --recipes nvfp4           # one run, no bf16 (combine later)
    python benchmarks/e2e_report.py --scaling 1,2,4,8    # weak scaling: every recipe on 1, 2, 4 and 8 GPUs
    python benchmarks/e2e_report.py --size 7b            # a Llama-2-7B-shaped model (8 GPUs; sizes below)
    python benchmarks/e2e_report.py --train-args "--moe 8 --top-k 2 --hidden 1024"  # MoE: + the torchao_moe row

Default size (2x H200, 141 GB each): d_model 2048, 20 layers, 16 heads (head_dim 128), SwiGLU hidden 5632
(= 44 x 128), untied byte-level head: 1.03B parameters. seq 4096 x batch 4 sequences per rank = 16,384 tokens per
GPU per step (32,768 per step on 2 GPUs). Every dimension is a multiple of 128, so the 32-blocks of MXFP8 and
NVFP4, the FP8 128-blocks and torchao's multiple-of-16 rule all hold, and the tokens per rank are a multiple of
32. No activation recompute: activations of ~16k tokens x 20 layers plus the sharded fp32 params, grads and
AdamW state (~8 GB per GPU) stay well below 141 GB (batch 8 would likely fit too, but an OOM costs a device
run; raise --batch once the peak memory of a first report is known).

--size 7b: d_model 4096, 32 layers, 32 heads, SwiGLU hidden 11008 (Llama-2-7B's shape; byte vocabulary): 6.48B
parameters, seq 4096 x batch 1 per rank. Per GPU on 8 ranks: ~13 GB of sharded fp32 params, grads and AdamW
state, plus the activations of 4,096 tokens x 32 layers (no recompute; ~30 GB in bf16); every rank first builds
the whole model on the CPU (26 GB of host memory each, ~1 minute) and moves it to its GPU before sharding it
(26 GB there for a moment), hence the longer per-run limit. One GPU cannot hold it (~104 GB of states alone).

--scaling N1,N2,...: weak scaling -- every planned recipe once per world size, the per-rank batch fixed (so tokens
per step grow with the GPUs); a second table gives tokens/s per GPU and the scaling efficiency against the same
recipe at the smallest world size. A world size larger than the GPUs visible is a skipped row, so one command
serves a 2-, 4- or 8-GPU machine. Every row also shows the bytes rank 0 sends in all-gathers per step (FSDP2's
parameter gathers; train.py counts them: launch/comm.py).

Time: each run is a separate torchrun (~20-30 s of start-up: CUDA/NCCL init, 1B-parameter init on the CPU).
A run stops at --steps or at its time limit, whichever comes first: the limit is min(--time-limit-s, the
total budget left / runs left), so the whole report stays inside --total-budget-s (default 510 s, for one
~10-minute device command). A run stopped by its limit is killed; its row then comes from the step records of its
metrics file (train.py --metrics: JSON lines, flushed per step) and says how many steps it did. Losses are compared with
bf16 at the same step (mean of the last 10% of the steps both did), since the lr schedule is that of --steps
for every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # (its modules, also when imported from elsewhere)

# the report's parts (re-exported: the tests and multi_gpu_runs read them from here)
from e2e_plan import (BASELINE, HIGH_PRECISION_GATHER, NORM_BASELINE, TORCHAO, TORCHAO_MOE, command, glue_train_args,  # noqa: E402,F401
                      fsdp_rejection, label, plan, rel, run_name, schedule, show, torchao_moe_status, torchao_status,
                      train_flags, train_option, weight_gather)
from e2e_runs import finished_run, parse_args_for_train, run_one, step_records  # noqa: E402,F401
from e2e_table import (describe, markdown, rows_for, scaling_markdown, scaling_rows,  # noqa: E402,F401
                       write_parity_plot)

# the default (GPU) size and the --tiny (CPU smoke test) size
FULL = {"d_model": 2048, "n_layers": 20, "n_heads": 16, "hidden": 5632, "seq": 4096, "batch": 4, "steps": 30,
        "lr": 1e-3, "eval_batches": 2, "corpus_bytes": 0}
TINY = {"d_model": 64, "n_layers": 1, "n_heads": 2, "hidden": None, "seq": 64, "batch": 2, "steps": 4,
        "lr": 3e-3, "eval_batches": 1, "corpus_bytes": 0}
# --parity: a ~127M-parameter model trained long enough for loss gaps to mean something (600 steps with a 10%
# warm-up, the same data order for every recipe: batches are a pure function of seed, step and rank), on 20 MB of
# generated text: 600 x 16,384 tokens would go ~50 times over the shipped 200 KB corpus and measure memorization
PARITY = {"d_model": 768, "n_layers": 18, "n_heads": 12, "hidden": 2048, "seq": 1024, "batch": 16, "steps": 600,
          "lr": 1e-3, "eval_batches": 16, "corpus_bytes": 20_000_000}
PARITY_LIMITS = {"time_limit_s": 420.0, "total_budget_s": 3600.0}
# --size 7b: Llama-2-7B's shape (see the docstring for its memory)
LLAMA_7B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "hidden": 11008, "seq": 4096, "batch": 1, "steps": 20,
            "lr": 3e-4, "eval_batches": 1, "corpus_bytes": 0}
LLAMA_7B_LIMITS = {"time_limit_s": 240.0, "total_budget_s": 560.0}



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="all",
                   help=f"comma list of {BASELINE}, hybridq presets, {TORCHAO} and {TORCHAO_MOE}; 'all' (default): "
                        f"{BASELINE}, every preset, {TORCHAO}, and {TORCHAO_MOE} when --train-args make an MoE "
                        f"(--moe E). {BASELINE} always runs first (the loss-gap reference)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: the GPUs, else 2 on the CPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="passed to train.py")
    p.add_argument("--tiny", action="store_true", help="tiny model and 4 steps (CPU smoke test)")
    p.add_argument("--size", choices=["1b", "7b"], default=None,
                   help="the model on GPUs: 1b (default, sizes below) or 7b (Llama-2-7B's shape, for 8 GPUs)")
    p.add_argument("--scaling", default=None, metavar="N1,N2,...",
                   help="weak scaling: run every recipe on each of these world sizes (per-rank batch fixed); world "
                        "sizes above the visible GPUs are skipped rows")
    p.add_argument("--parity", action="store_true",
                   help=f"loss parity: a ~127M model for {PARITY['steps']} steps (sizes below), every run's loss curve "
                        f"in parity.png and the final / validation gaps vs bf16 in the table")
    for k in ("d_model", "n_layers", "n_heads", "hidden", "seq", "batch", "steps", "eval_batches", "corpus_bytes"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"default {FULL[k]} (tiny {TINY[k]}, parity {PARITY[k]}, 7b {LLAMA_7B[k]})")
    p.add_argument("--lr", type=float, default=None,
                   help=f"default {FULL['lr']} (tiny {TINY['lr']}, parity {PARITY['lr']}, 7b {LLAMA_7B['lr']})")
    p.add_argument("--train-args", default="", help="more train.py flags for every run (one string)")
    p.add_argument("--time-limit-s", type=float, default=None, help="per run, start-up included (default 90, "
                   f"--parity {PARITY_LIMITS['time_limit_s']:.0f})")
    p.add_argument("--total-budget-s", type=float, default=None, help="all runs together (default 510, --parity "
                   f"{PARITY_LIMITS['total_budget_s']:.0f})")
    p.add_argument("--min-run-s", type=float, default=None,
                   help="skip a run whose limit would be shorter (default 40 s on GPUs, 5 s on the CPU)")
    p.add_argument("--out-dir", default="e2e_report", help="logs, metrics JSON, report.md and report.json")
    p.add_argument("--dry-run", action="store_true", help="print the commands (and skipped rows) and exit")
    p.add_argument("--no-baseline", action="store_true",
                   help=f"do not run {BASELINE} (split a report over invocations, e.g. in parallel on one GPU for "
                        f"losses only: the gaps come from a later --reuse-finished invocation that finds {BASELINE})")
    p.add_argument("--reuse-finished", action="store_true",
                   help="a run whose metrics file in --out-dir holds a finished run of the same recipe and sizes is "
                        "read, not run again (split a long report, e.g. --parity, over several invocations; the "
                        "table then covers every finished run of this plan)")
    p.add_argument("--norm-baseline", action="store_true",
                   help=f"also run {NORM_BASELINE}: {BASELINE} with hybridq.RMSNorm swapped in (train.py --norms "
                        "hybridq), the presets' norm kernel without quantization")
    p.add_argument("--compile", action="store_true",
                   help="also run every recipe with train.py --compile (each block torch.compiled), side by side "
                        "with eager; compiled rows compare with bf16 compiled")
    p.add_argument("--compiled-only", action="store_true",
                   help="with --compile: the compiled runs only (no eager rows; one device call holds fewer 1B runs)")
    p.add_argument("--compile-mode", default=None, help="train.py --compile-mode for the compiled runs "
                   "(e.g. reduce-overhead: CUDA graphs)")
    a = p.parse_args(glue_train_args(argv))
    if a.compiled_only and not a.compile:
        p.error("--compiled-only: only with --compile")
    chosen = [f for f, on in (("--tiny", a.tiny), ("--parity", a.parity), ("--size", a.size)) if on]
    if len(chosen) > 1:
        p.error(f"{' and '.join(chosen)} choose different sizes: pass one (override sizes with --d-model etc.)")
    a.scaling = parse_world_sizes(p, a.scaling) if a.scaling is not None else None
    big = a.size == "7b"
    base = TINY if a.tiny else PARITY if a.parity else LLAMA_7B if big else FULL
    limits = (PARITY_LIMITS if a.parity else LLAMA_7B_LIMITS if big
              else {"time_limit_s": 90.0, "total_budget_s": 510.0})
    for k, v in {**base, **limits}.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def parse_world_sizes(p: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"--scaling takes world sizes like 1,2,4,8, got {text!r}")
    if not sizes or any(n < 1 for n in sizes):
        p.error(f"--scaling takes world sizes >= 1 like 1,2,4,8, got {text!r}")
    return sorted(set(sizes))


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    cuda = a.device != "cpu" and torch.cuda.is_available()
    nproc = a.nproc or (torch.cuda.device_count() if cuda else 2)
    min_run = a.min_run_s if a.min_run_s is not None else (40.0 if cuda else 5.0)
    out_dir = pathlib.Path(a.out_dir)
    if not out_dir.is_absolute():
        out_dir = ROOT / out_dir
    todo = schedule(a, nproc, torch.cuda.device_count() if cuda else None)
    header = describe(a, nproc)
    if a.dry_run:
        print("\n".join(header))
        for t in todo:
            name = run_name(a, t["recipe"], t["compiled"], t["nproc"])
            print(f"\n# {name}: skipped: {t['skip']}" if t["skip"] else
                  f"\n# {name}\n{show(command(a, t['recipe'], t['nproc'], out_dir, t['compiled']))}")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    print("\n".join(header), flush=True)
    t_start = time.perf_counter()
    results = []
    runnable = [t for t in todo if not t["skip"]]
    runnable_names = {run_name(a, t["recipe"], t["compiled"], t["nproc"]) for t in runnable}
    for t in todo:
        n = t["nproc"]
        name = run_name(a, t["recipe"], t["compiled"], n)
        if t["skip"]:
            results.append({"recipe": name, "skip": t["skip"], "nproc": n})
            continue
        done = finished_run(a, t["recipe"], n, out_dir, t["compiled"]) if a.reuse_finished else None
        if done is not None:
            print(f"\n=== {name}: reusing the finished run in {rel(out_dir / (name + '.jsonl'))}", flush=True)
            results.append(done)
            continue
        left = a.total_budget_s - (time.perf_counter() - t_start)
        runs_left = len(runnable) - sum(1 for r in results if r["recipe"] in runnable_names)  # this one included
        limit = min(a.time_limit_s, left / max(runs_left, 1))
        if limit < min_run:
            results.append({"recipe": name, "skip": f"total budget ({a.total_budget_s:.0f} s) spent", "nproc": n,
                            "command": show(command(a, t["recipe"], n, out_dir, t["compiled"]))})
            continue
        results.append(run_one(a, t["recipe"], n, out_dir, limit, t["compiled"]))
    rows = rows_for(results)
    ran = [r for r in results if not r.get("skip")]
    reused = sorted({f"{r['device_name']}, torch {r['torch']}" for r in ran if r.get("status") == "ok (reused)"})
    if reused and all(r.get("status") == "ok (reused)" for r in ran):  # nothing ran here: name where they ran
        header[0] = (f"End-to-end report, {datetime.date.today().isoformat()}: every row read from earlier runs "
                     f"({nproc} process(es) each) on {'; '.join(reused)}.")
    elif reused:
        header.append(f"Rows marked 'ok (reused)' were measured by an earlier invocation on: {'; '.join(reused)}.")
    header.append(f"Total wall time {time.perf_counter() - t_start:.0f} s (budget {a.total_budget_s:.0f} s, "
                  f"per run {a.time_limit_s:.0f} s); logs and metrics JSON in {out_dir}.")
    if a.parity:
        header.append(write_parity_plot([r for r in results if not r.get("skip")], out_dir / "parity.png"))
    md = markdown(rows, header)
    if a.scaling:
        md += "\n\nWeak scaling (per-rank batch fixed):\n\n" + scaling_markdown(rows)
    (out_dir / "report.md").write_text(md + "\n")
    (out_dir / "report.json").write_text(json.dumps({"args": vars(a), "nproc": nproc, "rows": rows}, indent=1))
    print("\n" + md + f"\n\nwrote {out_dir / 'report.md'} and {out_dir / 'report.json'}", flush=True)
    return 0 if all(r.get("skip") or r.get("status", "").startswith("ok") or r["status"].startswith("time limit")
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
