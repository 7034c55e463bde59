"""benchmarks/host_split.py: its timers count each call in the phase it ran in and leave every timed attribute as it
was; its rows nest as their indentation says; the CPU smoke runs table the recipes side by side with one all-gather
hook call per hybridq Linear (and per grouped weight of an MoE job) and unshard, every nested row inside its parent
(times are compared only child to parent, never to a bound)."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import host_split  # noqa: E402


class _Base:
    def inherited(self, x):
        return x + 1


class _Owner(_Base):
    def own(self, x):
        return x * 2


class _Other:
    def own(self, x):
        return x * 2


def _module_fn(x):
    return x - 1


def _holders():
    """(label, owner, attribute, call through the owner) of each kind of attribute the timers wrap."""
    mod = types.ModuleType("timed_module")
    mod.fn = _module_fn
    inst = _Other()
    return mod, inst, [
        ("a module's function", lambda: mod, "fn", lambda: mod.fn(3)),
        ("a class's own method", lambda: _Owner, "own", lambda: _Owner().own(3)),
        ("a method the class inherits", lambda: _Owner, "inherited", lambda: _Owner().inherited(3)),
        ("an instance's method", lambda: inst, "own", lambda: inst.own(3)),
    ]


def _state(mod, inst):
    return (vars(mod).get("fn"), vars(_Owner).get("own"), vars(_Owner).get("inherited"), vars(inst).get("own"))


@pytest.mark.parametrize("raise_inside", [False, True])
def test_timers_put_every_attribute_back(raise_inside):
    mod, inst, cases = _holders()
    before = _state(mod, inst)
    tot, cnt = collections.defaultdict(float), collections.Counter()
    with pytest.raises(RuntimeError) if raise_inside else __import__("contextlib").nullcontext():
        with host_split.timers([(label, owner, attr, False) for label, owner, attr, _ in cases], tot, cnt):
            results = [call() for *_, call in cases]
            if raise_inside:
                raise RuntimeError("inside")
    assert _state(mod, inst) == before, f"timed attributes not restored: {_state(mod, inst)} != {before}"
    assert [call() for *_, call in cases] == [2, 6, 4, 6]
    if not raise_inside:
        assert results == [2, 6, 4, 6], f"timed calls returned {results}"
        assert cnt == {label: 1 for label, *_ in cases}, f"calls counted: {dict(cnt)}"


class _CallsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        _PHASED.fn(0)
        return g


_PHASED = types.ModuleType("phased")
_PHASED.fn = _module_fn


def test_a_phased_timer_tells_forward_calls_from_backward_calls():
    tot, cnt = collections.defaultdict(float), collections.Counter()
    with host_split.timers([("fn", lambda: _PHASED, "fn", True)], tot, cnt):
        _PHASED.fn(0)
        x = torch.ones(2, requires_grad=True)
        _CallsInBackward.apply(x).sum().backward()
    assert cnt == {"fn F": 1, "fn B": 1}, f"calls counted: {dict(cnt)}"


def test_the_cpu_smoke_run_tables_the_recipes_with_one_hook_call_per_linear_and_unshard(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    out = tmp_path / "split.json"
    cmd = [sys.executable, "benchmarks/host_split.py", "--smoke", "--device", "cpu", "--recipes", "bf16,fp8_tensorwise",
           "--train-args=--weight-gather quantized", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| ms per step (calls) | bf16 | fp8_tensorwise |" in p.stdout, p.stdout
    res = json.loads(out.read_text())
    fp8, bf16 = res["fp8_tensorwise"], res["bf16"]
    assert fp8["linears"] > 0 and bf16["linears"] == 0, {r: v["linears"] for r, v in res.items()}
    pre_f = fp8["rows"]["hybridq pre-all-gather hook F"][1]
    post_f = fp8["rows"]["hybridq post-all-gather hook F"][1]
    assert pre_f == post_f == fp8["linears"], (
        f"forward all-gather hook calls per step: pre {pre_f}, post {post_f}; hybridq Linears {fp8['linears']}")
    assert not any(k.startswith("hybridq pre") for k in bf16["rows"]), bf16["rows"]
    for r, v in res.items():
        assert v["rows"]["model forward"][1] == 1 and v["rows"]["optimizer.step"][1] == 1, (r, v["rows"])


def test_every_indented_row_has_a_parent_one_level_up_and_the_eager_only_rows_exist():
    labels = [label for label, *_ in host_split.TIMED]
    assert len(set(labels)) == len(labels), f"duplicate row labels: {sorted(l for l in labels if labels.count(l) > 1)}"
    parents = host_split.parents(labels)
    for label in labels:
        d = host_split.depth(label)
        if d == 0:
            assert label not in parents, label
        else:
            assert label in parents and host_split.depth(parents[label]) == d - 1, (
                f"{label!r} (depth {d}) is inside {parents.get(label)!r}: a row is one level below its parent")
    assert host_split.EAGER_ONLY <= set(labels), host_split.EAGER_ONLY - set(labels)
    assert not any(t[0] in host_split.EAGER_ONLY for t in host_split.targets_for(compiled=True))
    assert host_split.targets_for(compiled=False) == host_split.TIMED


def _smoke(tmp_path, recipes: str, train_args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    out = tmp_path / "split.json"
    cmd = [sys.executable, "benchmarks/host_split.py", "--smoke", "--device", "cpu", "--recipes", recipes,
           f"--train-args={train_args}", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"| ms per step (calls) | {' | '.join(recipes.split(','))} |" in p.stdout, p.stdout
    return json.loads(out.read_text())


def _check_nesting(rows: dict) -> None:
    """Every row present whose parent row (same phase) is present took no longer than it: its calls run inside."""
    phased = {label: ph for label, _, _, ph in host_split.TIMED}
    parents = host_split.parents(list(phased))
    for label, parent in parents.items():
        for suffix in ((" F", " B") if phased[label] else ("",)):
            child, up = rows.get(label + suffix), rows.get(parent + (suffix if phased[parent] else ""))
            if child is not None and up is not None:
                assert child[0] <= up[0], f"{label + suffix!r} {child} is not inside {parent!r} {up}"


def _calls(rows: dict, label: str) -> float:
    return rows.get(label, [0.0, 0])[1]


DENSE_PRE = "  of which: dense weights (HybridWeight._pre_all_gather)"
GROUPED_PRE = "  of which: grouped weights (GroupedHybridWeight._pre_all_gather)"
GROUPED_POST = "  of which: grouped weights' fill (GroupedHybridWeight._post_all_gather)"


def test_the_eager_moe_smoke_run_splits_the_dense_and_grouped_hooks_and_times_the_moe_layer(tmp_path):
    res = _smoke(tmp_path, "bf16,fp8_tensorwise", "--moe 4 --top-k 2 --weight-gather quantized")
    fp8, bf16 = res["fp8_tensorwise"], res["bf16"]
    rows = fp8["rows"]
    assert fp8["linears"] > 0 and fp8["grouped"] == 3, {r: (v["linears"], v["grouped"]) for r, v in res.items()}
    counts = {k: _calls(rows, k + " F") for k in ("hybridq pre-all-gather hook", DENSE_PRE, GROUPED_PRE, GROUPED_POST)}
    assert counts == {"hybridq pre-all-gather hook": fp8["linears"] + 3, DENSE_PRE: fp8["linears"], GROUPED_PRE: 3,
                      GROUPED_POST: 3}, f"forward hook calls per step: {counts}"
    moe = {k: _calls(rows, k) for k in ("MoE layer forward (launch/model.py MoE.forward)",
                                        "  of which: router's dispatch (route)",
                                        "      of which: JaggedFP8Experts.forward", "JaggedFP8Experts.backward")}
    assert list(moe.values()) == [1, 1, 3, 3], f"MoE rows' calls per step (one MoE layer, 3 projections): {moe}"
    assert _calls(bf16["rows"], "  of which: router's dispatch (route)") == 1, bf16["rows"]
    assert not any("hook" in k or "Jagged" in k for k in bf16["rows"]), bf16["rows"]
    for v in res.values():
        _check_nesting(v["rows"])


def test_the_compiled_moe_smoke_run_times_the_grouped_ops_bodies_and_not_the_traced_layer(tmp_path):
    res = _smoke(tmp_path, "fp8_tensorwise", "--moe 4 --top-k 2 --weight-gather quantized --compile")
    rows = res["fp8_tensorwise"]["rows"]
    bodies = {k: _calls(rows, k) for k in ("compiled GroupedLinear op forward (body, jagged FP8)",
                                           "compiled GroupedLinear op backward (body, jagged FP8)",
                                           "  of which: jagged_forward", GROUPED_PRE + " F")}
    assert set(bodies.values()) == {3}, f"calls per step (3 grouped projections in the graph): {bodies}"
    assert not any(k in host_split.EAGER_ONLY for k in rows), f"traced rows timed under --compile: {list(rows)}"
    assert _calls(rows, "JaggedFP8Experts.backward") == 0, "the experts ran eagerly: not in the graph"
    _check_nesting(rows)
