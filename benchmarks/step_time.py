"""The training job's step time per recipe, each recipe in a fresh process without any profiler: wall and host time
per step (host = the time to issue a step; a step whose host time reaches its wall time is host-bound), medians, and
the ratio to bf16's wall time.

Host-bound steps are sensitive to what ran before them in a process (a profiler session, another recipe's compiled
graphs and allocations), so each recipe runs alone in its own Python process: `profile_step.time_recipe` (train.py's
`build` and `train_step`, --warmup steps, then --timed-steps steps; the collector as train.py runs it). The model and
flags are profile_step.py's (e.g. the MoE job at 4 of its 20 layers):

    python benchmarks/step_time.py --recipes bf16,fp8_tensorwise --n-layers 4 --hidden 1024 --train-args "--moe 16 --top-k 2"
    python benchmarks/step_time.py --recipes bf16,fp8_tensorwise --n-layers 4 --hidden 1024 --train-args "--moe 16 --top-k 2 --compile"
    python benchmarks/step_time.py --smoke --device cpu      # tiny model on the CPU
    python benchmarks/step_time.py --rounds 3 --recipes bf16,fp8_tensorwise ...   # 3 processes per recipe, interleaved

Compare ratios within one run: host speed differs between machines (up to 1.5x between instances of one GPU machine
kind) and between processes on one machine: a host-bound step's median moved 48.6 -> 67.0 ms host (1.16x -> 0.97x
of bf16) between two fresh processes of the same code on one H200 (2026-11-28). --rounds N runs every recipe N times,
each time in a fresh process, the order rotated per round, and gives each recipe's median over its processes and the
median (min-max) of the ratios taken within each round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import profile_step as ps
from fsdp_setup import exit_without_finalization

_RESULT = "step_time.py result: "


def one_recipe(argv: list[str]) -> int:
    """The child: time the one recipe of `argv` and print its result as a JSON line."""
    a = ps.parse_args(argv)
    world = ps.train.world_from_environment()
    targs = ps.train_args(a, world)
    env = ps.train.init_distributed(targs, world)
    res = ps.time_recipe(a.recipe_list[0], a, targs, env, ps.load_tokens())
    print(_RESULT + json.dumps({"recipe": a.recipe_list[0], **res["timed"], "device": str(env.device),
                                      "pid": os.getpid(), "process": res["process"]}), flush=True)
    return 0


def rounds_table(rounds: list[list[dict]]) -> str:
    """Each recipe's wall median per process (one per round), their median, the host median of those processes and
    the median (min-max) of the ratios to bf16 taken within each round."""
    import statistics
    names = [r["recipe"] for r in rounds[0]]
    lines = ["| recipe | wall ms per process | wall ms median | host ms median | ratio vs bf16 median (min-max) |",
             "|---|---|---|---|---|"]
    for name in names:
        mine = [next(r for r in rnd if r["recipe"] == name) for rnd in rounds]
        walls = [r["median_ms"] for r in mine]
        ratios = [next(r for r in rnd if r["recipe"] == ps.BASELINE)["median_ms"] / m["median_ms"]
                  for rnd, m in zip(rounds, mine)] if ps.BASELINE in names else []
        ratio = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        lines.append(f"| {name} | {' / '.join(f'{w:.1f}' for w in walls)} | {statistics.median(walls):.1f} | "
                     f"{statistics.median(r['host_median_ms'] for r in mine):.1f} | {ratio} |")
    return "\n".join(lines)


def round_order(recipes: list[str], r: int) -> list[str]:
    """Round r's order: the list rotated by r, so no recipe always runs first (right after the previous process)."""
    k = r % len(recipes)
    return recipes[k:] + recipes[:k]


def _pop_rounds(argv: list[str]) -> tuple[int, list[str]]:
    """(--rounds N, the other arguments: profile_step's)."""
    rounds, rest, i = 1, [], 0
    while i < len(argv):
        if argv[i] == "--rounds" and i + 1 < len(argv):
            rounds, i = int(argv[i + 1]), i + 2
            continue
        if argv[i].startswith("--rounds="):
            rounds = int(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    if rounds < 1:
        raise SystemExit(f"step_time.py: --rounds must be >= 1, got {rounds}")
    return rounds, rest


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["recipe"] == ps.BASELINE), None)
    lines = ["| recipe | wall ms median (min) | host ms median | ratio vs bf16 (wall) |", "|---|---|---|---|"]
    for r in results:
        ratio = f"{base['median_ms'] / r['median_ms']:.2f}x" if base else "-"
        lines.append(f"| {r['recipe']} | {r['median_ms']:.1f} ({r['min_ms']:.1f}) | {r['host_median_ms']:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        return one_recipe(argv[1:])
    n_rounds, argv = _pop_rounds(argv)
    a = ps.parse_args(argv)
    if a.json or a.trace_dir or any(x == "--steps" or x.startswith("--steps=") for x in argv):
        print("step_time.py: --json, --trace-dir and --steps are profile_step.py's (this script does not profile)",
              file=sys.stderr)
        return 2
    rest = [x for i, x in enumerate(argv) if not (x.startswith("--recipes") or argv[i - 1:i] == ["--recipes"])]
    rounds = []
    for r in range(n_rounds):
        results = []
        for recipe in round_order(a.recipe_list, r):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", *rest, "--recipes", recipe],
                               capture_output=True, text=True)
            lines = [l for l in p.stdout.splitlines() if l.startswith(_RESULT)]
            if p.returncode != 0 or not lines:
                print(f"step_time.py: {recipe} failed (exit {p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}",
                      file=sys.stderr)
                return 1
            results.append(json.loads(lines[0][len(_RESULT):]))
            print(f"[{recipe}] {results[-1]['n']} steps in a fresh process (pid {results[-1]['pid']}), no profiler, "
                  f"{results[-1]['device']}" + (f", round {r + 1}" if n_rounds > 1 else "")
                  + f": wall {results[-1]['median_ms']:.1f} ms, host {results[-1]['host_median_ms']:.1f} ms (medians); "
                  + ps.process_text(results[-1]["process"]), flush=True)
        rounds.append(sorted(results, key=lambda res: a.recipe_list.index(res["recipe"])))
    print(table(rounds[0]) if n_rounds == 1 else rounds_table(rounds))
    return 0


if __name__ == "__main__":
    exit_without_finalization(main())
