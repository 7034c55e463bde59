"""benchmarks/bench_grouped.py runs on the CPU with --smoke (its smoke test; the numbers come from a GPU machine): one
table row per config and candidate (bf16 torch._grouped_mm, every preset's GroupedLinear, the per-expert path of
the presets the packed path takes, the nn.Linear loop), in order, ratios to bf16 torch._grouped_mm, and the JSON holds the same rows with the routing's token counts.
Its measurement order: each timed block right after untimed steps of the same candidate, the order rotated per round."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_grouped  # noqa: E402
HEADER = ["E x tokens x top-k x d_model x hidden", "candidate", "step ms", "TFLOP/s", "speed-up vs bf16",
          "per round (min-max)"]


def test_bench_grouped_smoke_prints_every_candidate_of_every_config(tmp_path):
    out = tmp_path / "grouped.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_grouped.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_grouped failed:\n{r.stdout}\n{r.stderr}"
    table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in r.stdout.splitlines()
             if line.startswith("|")]
    assert table[0] == HEADER, table[0]
    # a preset a packed path takes (per-tensor FP8; the block formats; NVFP4 and its hybrid) is also timed on the
    # per-expert path, right after it; per-tensor FP8 (the jagged path on the CPU) also on the padded packed path
    packed = {"fp8_tensorwise", "fp8_block", "mxfp8", "fp8_block_fwd_mxfp8_bwd", "nvfp4", "mxfp8_fwd_nvfp4_bwd"}
    jagged = {"fp8_tensorwise"}

    def rows(p):  # (block formats and NVFP4: also the packed path forced, whatever the automatic choice)
        return [p] + ([f"{p} (per-expert path)"] if p in packed else []) + (
            [f"{p} (packed path forced)"] if p in packed - jagged else []) + (
            [f"{p} (jagged path)", f"{p} (padded packed path)"] if p in jagged else [])
    names = ["bf16 torch._grouped_mm", *[n for p in hybridq.preset_names() for n in rows(p)],
             "bf16 nn.Linear per expert"]
    configs = ["4x48x2x64x96", "8x40x2x32x64"]
    body = table[2:]
    assert [(row[0], row[1]) for row in body] == [(c, n) for c in configs for n in names], \
        f"rows {[(row[0], row[1]) for row in body]}"
    for cfg, name, ms, _, ratio, spread in body:
        # (two decimals: a candidate 200x slower than bf16 on a loaded CPU prints 0.00x; the JSON has the ratio)
        assert float(ms) > 0 and ratio.endswith("x") and float(ratio[:-1]) >= 0, (cfg, name, ms, ratio)
        lo, hi = (float(v) for v in spread.rstrip("x").split("-"))
        assert lo <= hi, (cfg, name, spread)
        if name == "bf16 torch._grouped_mm":
            assert ratio == "1.00x" and spread == "1.00-1.00x", (cfg, ratio, spread)
    rows = json.loads(out.read_text())["rows"]
    assert [(x["config"], x["name"], f"{x['ms']:.3f}") for x in rows] == [(c, n, ms) for c, n, ms, *_ in body]
    for x in rows:
        assert sum(x["m_splits"]) == x["tokens"] * x["top_k"] and len(x["m_splits"]) == x["experts"], x
        assert x["ratio"] > 0 and len(x["round_ratios"]) == len(x["rounds_ms"]), x
        lo, hi = min(x["round_ratios"]), max(x["round_ratios"])  # (medians' ratio: between the rounds' extremes)
        assert lo * (1 - 1e-9) <= x["ratio"] <= hi * (1 + 1e-9), \
            f"{x['name']}: the median ratio {x['ratio']} lies outside its rounds' {x['round_ratios']}"


def test_bench_grouped_profile_prints_where_each_candidates_step_goes(tmp_path):
    """--profile N: after the timing, one table per config and candidate of the largest kernels (here: ops) with
    their time and calls per step, in the table's order; the JSON holds them."""
    out = tmp_path / "grouped.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_grouped.py"), "--smoke", "--configs",
                        "4x48x2x64x96", "--presets", "fp8_tensorwise", "--torchao", "", "--profile", "1", "--json",
                        str(out)], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_grouped --profile failed:\n{r.stdout}\n{r.stderr}"
    js = json.loads(out.read_text())
    names = [x["name"] for x in js["rows"]]
    assert [p["name"] for p in js["profiles"]] == names, "one profile per timed candidate, in order"
    for p in js["profiles"]:
        title = f"4x48x2x64x96 {p['name']}: {p['ms']:.3f} ms per step (ops' own CPU time, profiled)"
        assert title in r.stdout, f"no profile table titled {title!r}"
        assert p["top"] and all(t["ms"] > 0 and t["calls"] > 0 for t in p["top"]), p
        assert sum(t["ms"] for t in p["top"]) <= p["ms"] * (1 + 1e-9), p


@pytest.mark.parametrize("warm_steps", [0, 1, 2])
def test_each_timed_block_follows_warm_steps_of_its_own_candidate_in_an_order_rotated_per_round(warm_steps):
    """What ran right before a timed block is the same candidate's untimed steps, never another candidate's, and no
    candidate is timed in the same place every round."""
    log = []
    steps = {n: (lambda n=n: log.append(("step", n))) for n in ("bf16", "a", "b", "c")}

    def timer(step):
        log.append(("timed", None))
        place = len(log)
        step()
        return float(place)

    times = bench_grouped.measure(steps, timer, rounds=5, warm_steps=warm_steps)
    names = list(steps)
    want = []
    for r in range(5):
        for n in names[r % 4:] + names[:r % 4]:
            want += [("step", n)] * warm_steps + [("timed", None), ("step", n)]
    assert log == want, f"calls {log}\n!= {want}"
    assert {n: len(v) for n, v in times.items()} == {n: 5 for n in names}, f"rounds timed per candidate: {times}"
    # (the timer's value is its call's place in the log: each candidate's values are its own blocks')
    timed_at = [i + 1 for i, e in enumerate(log) if e[0] == "timed"]
    owner = [log[i][1] for i in timed_at]
    for n in names:
        assert times[n] == [float(i) for i, o in zip(timed_at, owner) if o == n], f"{n}: {times[n]}"


def test_bench_grouped_rejects_a_negative_warm_step_count():
    with pytest.raises(SystemExit):
        bench_grouped.main(["--smoke", "--warm-steps", "-1"])


def test_each_step_takes_the_next_routing_in_turn():
    """--routings N: a candidate's steps take the N (x, dy, route) inputs in turn, starting over after the last."""
    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, route):
            seen.append(route)
            return x * self.w

    x, dy = torch.ones(3, requires_grad=True), torch.ones(3)
    routes = [[1, 2], [3, 0], [0, 3]]
    step = bench_grouped.make_step(Recorder(), [(x, dy, r) for r in routes])
    for _ in range(7):
        step()
    assert seen == routes * 2 + routes[:1], f"routes taken: {seen}"
    assert x.grad is not None and x.grad.eq(1).all(), f"x.grad not reset between steps: {x.grad}"


def test_bench_grouped_routings_keep_the_tokens_and_vary_the_counts(tmp_path):
    """The N seeded routings route the same tokens (every one sums to tokens x top-k) with counts that differ; the
    smoke run with --routings 3 times every candidate and records the count of routings."""
    assert len({tuple(bench_grouped.routed_splits(8, 40, 2, seed=i)) for i in range(3)}) == 3, "routings repeat"
    assert all(sum(bench_grouped.routed_splits(8, 40, 2, seed=i)) == 80 for i in range(3))
    out = tmp_path / "grouped.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_grouped.py"), "--smoke", "--configs",
                        "4x48x2x64x96", "--presets", "fp8_tensorwise", "--torchao", "", "--routings", "3", "--json",
                        str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"bench_grouped --routings failed:\n{r.stdout}\n{r.stderr}"
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(x["routings"] == 3 and x["ms"] > 0 for x in rows), rows


def test_bench_grouped_rejects_a_routing_count_below_one():
    with pytest.raises(SystemExit):
        bench_grouped.main(["--smoke", "--routings", "0"])
