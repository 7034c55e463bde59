"""benchmarks/host_split.py: its timers count each call in the phase it ran in and leave every timed attribute as it
was; the CPU smoke run tables the recipes side by side with one all-gather hook call per hybridq Linear and unshard
(times are not checked)."""

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
