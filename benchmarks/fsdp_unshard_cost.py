"""What FSDP2's unshard and reshard cost on the host per unit and step, bf16 weights beside quantized ones, FSDP2's own
work apart from hybridq's all-gather hooks (issues 30 / 33: the quantized jobs are host-bound).

    python benchmarks/fsdp_unshard_cost.py --device cpu --recipes bf16,fp8_tensorwise,fp8_block
    python benchmarks/fsdp_unshard_cost.py --device cpu --train-args "--moe 16 --top-k 2" --n-layers 4
    torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_unshard_cost.py --device cpu   # gloo, world 2

The job is profile_step.py's (train.py's `build` and `train_step`: fully_shard per block and root, bf16 params).
Per recipe: --warmup steps, then three passes of --steps steps each:

  1. timers: `time.perf_counter` pairs around FSDP2's per-group unshard, wait_for_unshard and reshard, its per-param
     steps inside them (all-gather inputs, copy-in + all-gather, copy-out, init_unsharded_param, to_unsharded,
     free_unsharded_param) and hybridq's two hooks; each row is the time spent in that call *minus* the rows timed
     inside it (exclusive), so "FSDP2 own" rows hold FSDP2's work alone and the hooks' rows hybridq's;
  2. aten ops: a TorchDispatchMode counting every dispatched op in the innermost row (views apart);
  3. Python calls: cProfile, the calls per step of FSDP2's functions and of the storage resizes it makes
     (`UntypedStorage.resize_`: not an aten op; FSDP2 allocates and frees each inner tensor of a weight's unsharded
     form so, one resize each per unshard and per reshard).

Host speeds compare within one run only (the recipes run one after another in this process).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import os
import pstats
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile_step as ps  # noqa: E402 (adds launch/ to the path)
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import hybridq  # noqa: E402
from fsdp_setup import exit_without_finalization  # noqa: E402

_FSDP = "torch.distributed.fsdp._fully_shard."


def _rows():
    """(label, owner, attribute, kind): kind "method" / "property" (the getter) / "global" (a module global, patched
    where the caller looks it up)."""
    import importlib
    pg = importlib.import_module(_FSDP + "_fsdp_param_group")
    pm = importlib.import_module(_FSDP + "_fsdp_param")
    w = importlib.import_module("hybridq.distributed.weights")
    G, P = pg.FSDPParamGroup, pm.FSDPParam
    return [
        ("FSDP2 unshard (own)", G, "unshard", "method"),
        ("FSDP2 wait_for_unshard (own)", G, "wait_for_unshard", "method"),
        ("FSDP2 reshard (own)", G, "reshard", "method"),
        ("FSDP2 all_gather_inputs (own)", P, "all_gather_inputs", "property"),
        ("FSDP2 copy-in + all-gather (own)", pg, "foreach_all_gather", "global"),
        ("FSDP2 copy-out (own)", pg, "foreach_all_gather_copy_out", "global"),
        ("FSDP2 init_unsharded_param (own)", P, "init_unsharded_param", "method"),
        ("FSDP2 to_unsharded (own)", G, "_to_unsharded", "method"),
        ("FSDP2 free_unsharded_param (own)", P, "free_unsharded_param", "method"),
        ("hybridq pre-all-gather hook", w._PreAllGatherHook, "__call__", "method"),
        ("hybridq post-all-gather hook", w.HybridWeight, "fsdp_post_all_gather", "method"),
    ]


class Timers:
    """Exclusive host time per row: a call's time minus the time of the timed calls inside it."""

    def __init__(self):
        self.own = collections.Counter()
        self.calls = collections.Counter()
        self.stack: list[str] = ["other"]
        self._inner: list[float] = [0.0]

    def wrap(self, label, fn):
        t = self

        @functools.wraps(fn)
        def timed(*a, **k):
            t.stack.append(label)
            t._inner.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = t._inner.pop()
                t.stack.pop()
                t.own[label] += dt - inner
                t.calls[label] += 1
                t._inner[-1] += dt
        return timed


@contextlib.contextmanager
def patched(timers: Timers):
    undo = []
    for label, owner, attr, kind in _rows():
        orig = owner.__dict__[attr] if kind != "global" else getattr(owner, attr)
        if kind == "property":
            new = property(timers.wrap(label, orig.fget), orig.fset)
        else:
            new = timers.wrap(label, orig)
        setattr(owner, attr, new)
        undo.append((owner, attr, orig))
    try:
        yield
    finally:
        for owner, attr, orig in reversed(undo):
            setattr(owner, attr, orig)


class OpCount(TorchDispatchMode):
    """aten ops per innermost row of `timers` (views and storage swaps apart: no kernel)."""

    def __init__(self, timers: Timers):
        super().__init__()
        self.timers = timers
        self.kernels = collections.Counter()
        self.views = collections.Counter()
        self.names: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        label = self.timers.stack[-1]
        view = func.is_view or func.overloadpacket in (torch.ops.aten.set_, torch.ops.aten.detach,
                                                       torch.ops.aten.alias)
        (self.views if view else self.kernels)[label] += 1
        self.names[label][str(func)] += 1
        return func(*args, **(kwargs or {}))


def _python_calls(prof: cProfile.Profile, steps: int) -> dict[str, float]:
    """FSDP2's functions (and the storage resizes) by calls per step."""
    st = pstats.Stats(prof)
    out = {}
    for (fname, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        if "fsdp/_fully_shard" in fname:
            out[f"{os.path.basename(fname)}:{name}"] = nc / steps
        elif name in ("<method 'resize_' of 'torch._C.StorageBase' objects>",
                      "<method 'untyped_storage' of 'torch._C.TensorBase' objects>"):
            out[name] = nc / steps
    return out


def measure(recipe: str, a, targs, env, tokens) -> dict:
    job = ps._Job(recipe, a, targs, env, tokens)
    from hybridq.distributed.weights import HybridWeight
    from hybridq.torch_private import local_tensor
    weights = sum(isinstance(local_tensor(p), HybridWeight) for p in job.model.parameters())
    groups = sum(1 for m in job.model.modules() if hasattr(m, "_get_fsdp_state"))
    timers = Timers()
    with patched(timers):
        job.run(1)  # (the patched functions warm)
        timers.own.clear()
        timers.calls.clear()
        job.run(a.steps)
        timed = {k: (v * 1e6 / a.steps, timers.calls[k] / a.steps) for k, v in timers.own.items()}
        ops = OpCount(timers)
        with ops:
            job.run(a.steps)
    prof = cProfile.Profile()
    prof.enable()
    job.run(a.steps)
    prof.disable()
    job.close()
    return {"weights": weights, "groups": groups, "us": timed,
            "kernels": {k: v / a.steps for k, v in ops.kernels.items()},
            "views": {k: v / a.steps for k, v in ops.views.items()},
            "op_names": {k: dict(v) for k, v in ops.names.items()}, "python": _python_calls(prof, a.steps)}


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="bf16,fp8_tensorwise,fp8_block")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--train-args", default="--reshard-after-forward always",
                   help="more train.py flags (default: every block resharded after forward, so each weight is "
                        "unsharded once per direction -- train.py's default keeps the last block gathered)")
    p.add_argument("--ops", action="store_true", help="also list the aten ops of each row")
    a = p.parse_args(argv)
    world = ps.train.world_from_environment()
    targs = ps.train_args(a, world)
    env = ps.train.init_distributed(targs, world)
    if not env.main:
        sys.stdout = open(os.devnull, "w")
    tokens = ps.load_tokens()
    recipes = [r for r in a.recipes.split(",") if r]
    res = {r: measure(r, a, targs, env, tokens) for r in recipes}
    print(f"fsdp_unshard_cost.py: torch {torch.__version__}, hybridq {hybridq.__version__}, {a.device}, world {world}; "
          f"d_model {a.d_model}, layers {a.n_layers}, hidden {a.hidden}, train args {a.train_args!r}; {a.steps} steps; "
          + ", ".join(f"{r}: {v['weights']} hybridq weights, {v['groups']} FSDP units" for r, v in res.items()))
    labels = [lab for lab, *_ in _rows()]
    print("| per step: host us exclusive (calls) / aten kernels + views | " + " | ".join(recipes) + " |")
    print("|---|" + "---|" * len(recipes))
    for lab in labels:
        cells = []
        for r in recipes:
            us, n = res[r]["us"].get(lab, (0.0, 0))
            cells.append(f"{us:.0f} ({n:g}) / {res[r]['kernels'].get(lab, 0):g} + {res[r]['views'].get(lab, 0):g}")
        print(f"| {lab} | " + " | ".join(cells) + " |")
    fs = [lab for lab in labels if lab.startswith("FSDP2")]
    print("| **FSDP2 own, total** | " + " | ".join(
        f"{sum(res[r]['us'].get(l, (0, 0))[0] for l in fs):.0f} / "
        f"{sum(res[r]['kernels'].get(l, 0) for l in fs):g} + {sum(res[r]['views'].get(l, 0) for l in fs):g}"
        for r in recipes) + " |")
    names = sorted({k for r in recipes for k in res[r]["python"]})
    print("\n| Python calls per step | " + " | ".join(recipes) + " |")
    print("|---|" + "---|" * len(recipes))
    for n in names:
        vals = [res[r]["python"].get(n, 0) for r in recipes]
        if len(set(vals)) > 1:  # (only what differs between the recipes)
            print(f"| {n} | " + " | ".join(f"{v:g}" for v in vals) + " |")
    if a.ops:
        for r in recipes:
            print(f"\n{r}: aten ops per step by row")
            for lab in fs:
                ops = res[r]["op_names"].get(lab)
                if ops:
                    print(f"  {lab}: " + ", ".join(f"{k} {v / a.steps:g}" for k, v in sorted(ops.items())))
    return 0


if __name__ == "__main__":
    exit_without_finalization(main())
