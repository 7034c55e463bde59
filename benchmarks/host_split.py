"""Where the host time of the training job's step goes, by category, the recipes side by side, without a profiler:
a `time.perf_counter` pair around each of FSDP2's per-group steps, hybridq's all-gather hooks, the compiled Linear's
gathered ops, the model's forward, backward, gradient clipping, the optimizer and `precompute_scales` (issue 33: the
compiled fp8 step with the quantized all-gather is host-bound).

    python benchmarks/host_split.py --recipes bf16,fp8_tensorwise --train-args "--compile --weight-gather quantized"
    python benchmarks/host_split.py --smoke --device cpu --train-args "--weight-gather quantized"

The job is profile_step.py's (train.py's `build` and `train_step`, the same model flags): per recipe --warmup steps,
then --timed-steps steps with the timers on. Each row is ms per step (and calls per step) of everything inside the
timed call, its callees included: rows nest ("FSDP2 wait_for_unshard" holds the all-gather hooks of a world of one;
"model forward" holds the forward hooks and ops; an "  of which" row is inside the row above it). F / B: the call
ran outside / inside autograd's backward. The recipes run one after another in this process (each job closed before
the next), so host speeds compare within one run only; a timer pair adds ~1 us per call. On a CPU the hybridq rows
include the reference kernels' compute (the "of which" rows show the quantize and derive parts).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile_step as ps  # noqa: E402 (adds launch/ to the path)
import torch  # noqa: E402

import hybridq  # noqa: E402
from hybridq.distributed import weights as hq_weights  # noqa: E402
from hybridq.nn import compiled_linear  # noqa: E402
from hybridq.nn.linear import Linear  # noqa: E402
from hybridq.torch_private import in_backward  # noqa: E402


def _fsdp_group_class():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return FSDPParamGroup


# (row label, owner, attribute, split by phase): the callables timed, looked up when the timers go on
TIMED = [
    ("FSDP2 pre_forward", _fsdp_group_class, "pre_forward", False),
    ("FSDP2 wait_for_unshard", _fsdp_group_class, "wait_for_unshard", True),
    ("hybridq pre-all-gather hook", lambda: hq_weights._PreAllGatherHook, "__call__", True),
    ("  of which: cast + quantize a dense shard (prepare_payload)", lambda: hq_weights, "prepare_payload", True),
    ("hybridq post-all-gather hook", lambda: hq_weights.HybridWeight, "fsdp_post_all_gather", True),
    ("  of which: derive a direction (complete_parts)", lambda: hq_weights, "complete_parts", True),
    ("FSDP2 post_forward", _fsdp_group_class, "post_forward", False),
    ("FSDP2 pre_backward", _fsdp_group_class, "pre_backward", False),
    ("FSDP2 post_backward", _fsdp_group_class, "post_backward", False),
    ("compiled Linear gathered op forward (body)", lambda: compiled_linear, "_forward", False),
    ("compiled Linear gathered op backward (body)", lambda: compiled_linear, "_backward_grads", False),
    ("backward (Tensor.backward)", lambda: torch.Tensor, "backward", False),
    ("clip_grad_norm_", lambda: torch.nn.utils, "clip_grad_norm_", False),
    ("hybridq.precompute_scales", lambda: hybridq, "precompute_scales", False),
]
FORWARD = "model forward"
OPTIMIZER = "optimizer.step"


@contextlib.contextmanager
def timers(targets, tot: dict, cnt: collections.Counter):
    """Every (label, owner, attribute, by phase) of `targets` (`owner()`: the module, class or instance holding the
    callable) wrapped in a timer adding to `tot[row]` (seconds) and `cnt[row]`; the attributes are as they were
    on exit, whatever happened (a class's own attribute put back as it was, one it inherited or an instance's
    method removed again)."""
    saved = []
    try:
        for label, owner, attr, phased in targets:
            obj = owner()
            own = vars(obj)
            saved.append((obj, attr, own[attr] if attr in own else None, attr in own))
            setattr(obj, attr, _timed(getattr(obj, attr), label, phased, tot, cnt))
        yield
    finally:
        for obj, attr, fn, had in reversed(saved):
            if had:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)


def _timed(fn, label: str, phased: bool, tot: dict, cnt: collections.Counter):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        row = label + ((" B" if in_backward() else " F") if phased else "")
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            tot[row] += time.perf_counter() - t0
            cnt[row] += 1
    return timed


def split(recipe: str, a, targs, env, tokens: torch.Tensor) -> dict:
    """The rows of `recipe` over --timed-steps steps after --warmup: {row: [ms per step, calls per step]}, and the
    steps' median host / wall ms and the job's hybridq Linears."""
    job = ps._Job(recipe, a, targs, env, tokens)
    tot: dict = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    starts: list[float] = []

    def forward_done(*_):
        tot[FORWARD] += time.perf_counter() - starts.pop()
        cnt[FORWARD] += 1

    hooks = [job.model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())),
             job.model.register_forward_hook(forward_done)]
    targets = TIMED + [(OPTIMIZER, lambda: job.optimizer, "step", False)]
    try:
        with timers(targets, tot, cnt):
            host, wall = job.run(a.timed_steps)
    finally:
        for h in hooks:
            h.remove()
    n = a.timed_steps
    rows = {k: [tot[k] * 1e3 / n, cnt[k] / n] for k in tot}
    res = {"rows": rows, "host_ms": statistics.median(host) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
           "linears": sum(isinstance(m, Linear) for m in job.model.modules())}
    job.close()
    return res


def table(results: dict) -> str:
    recipes = list(results)
    order = [FORWARD] + [f"{label}{s}" for label, _, _, phased in TIMED for s in ((" F", " B") if phased else ("",))]
    order.insert(order.index("backward (Tensor.backward)") + 1, OPTIMIZER)
    lines = ["| ms per step (calls) | " + " | ".join(recipes) + " |", "|---|" + "---|" * len(recipes),
             "| **step host (median)** | " + " | ".join(f"{results[r]['host_ms']:.1f}" for r in recipes) + " |",
             "| **step wall (median)** | " + " | ".join(f"{results[r]['wall_ms']:.1f}" for r in recipes) + " |"]
    for row in order:
        vals = [results[r]["rows"].get(row) for r in recipes]
        if any(v is not None for v in vals):
            lines.append(f"| {row} | " + " | ".join("-" if v is None else f"{v[0]:.2f} ({v[1]:g})" for v in vals)
                         + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    argv = sys.argv[1:] if argv is None else argv
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    a = ps.parse_args(argv)
    world = ps.train.world_from_environment()
    targs = ps.train_args(a, world)
    env = ps.train.init_distributed(targs, world)
    tokens = ps.load_tokens()
    dev = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU"
    results: dict = {}
    for r in a.recipe_list:  # (the table so far after each recipe: a run cut short keeps what it measured)
        results[r] = split(r, a, targs, env, tokens)
        print(f"host_split.py: {dev}, torch {torch.__version__}, {a.timed_steps} steps after {a.warmup}, train args "
              f"{a.train_args!r}; hybridq Linears: " + ", ".join(f"{r} {v['linears']}" for r, v in results.items()))
        print(table(results), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
