"""Which phase of the training job's step the GPU waits for the host in, without a profiler: per phase (forward,
loss + backward, clipping + optimizer + precompute_scales) the host's time to issue it and the GPU's time to run it
(CUDA events recorded where the host passes each phase's end), and the GPU's lag behind the host at each phase end.

A step starts with the GPU idle (the previous step ended in a sync), so the GPU reaches the step's start event when
the host records it; the lag at a mark is (when the GPU reached the mark's event) - (when the host recorded it).
A lag near 0 at a phase's end means the GPU ran out of queued work in that phase: it waited for the host (the phase
is host-bound); a lag that grows over a phase means the host ran ahead (the phase is GPU-bound). The step's wall is
about the host's time up to the last host-bound phase plus the GPU's time after it. (profile_step.py's job:
train.py's `build` and `train_step`, the same flags.)

    python benchmarks/phase_times.py --recipes bf16,fp8_tensorwise --train-args=--compile
    python benchmarks/phase_times.py --recipes bf16,fp8_tensorwise --n-layers 4 --hidden 1024 --train-args "--moe 16 --top-k 2"
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile_step as ps  # noqa: E402 (adds launch/ to the path)
import torch  # noqa: E402

import hybridq  # noqa: E402
from fsdp_setup import exit_without_finalization  # noqa: E402

PHASES = ("forward", "loss + backward", "clip + optimizer + precompute")


class _Marks:
    """(host perf_counter, CUDA event) pairs recorded at each phase end of the current step."""

    def __init__(self):
        self.points: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.points.append((name, time.perf_counter(), ev))


def _after(fn, marks: _Marks, name: str):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        marks.mark(name)
        return out
    return wrapped


def phases(recipe: str, a, targs, env, tokens: torch.Tensor) -> dict:
    """Per phase: host ms, GPU ms and the lag at its end (medians over --timed-steps steps after --warmup)."""
    job = ps._Job(recipe, a, targs, env, tokens)
    marks = _Marks()
    hooks = [job.model.register_forward_pre_hook(lambda *_: marks.mark("start")),
             job.model.register_forward_hook(lambda *_: marks.mark(PHASES[0]))]
    backward, precompute = torch.Tensor.backward, hybridq.precompute_scales
    torch.Tensor.backward = _after(backward, marks, PHASES[1])
    hybridq.precompute_scales = _after(precompute, marks, PHASES[2])
    step = job.optimizer.step
    quantized = job.quantized
    if not quantized:  # (no precompute_scales: the optimizer's end is the step's)
        job.optimizer.step = _after(step, marks, PHASES[2])
    rows: dict = {p: {"host": [], "gpu": [], "lag": []} for p in PHASES}
    walls = []
    try:
        for _ in range(a.timed_steps):
            marks.points.clear()
            _, wall = job.run(1)
            walls.append(wall[0] * 1e3)
            start = [p for p in marks.points if p[0] == "start"][0]
            ends = [p for p in marks.points if p[0] in PHASES]
            prev = start
            for name, t, ev in ends:
                rows[name]["host"].append((t - prev[1]) * 1e3)
                rows[name]["gpu"].append(prev[2].elapsed_time(ev))
                rows[name]["lag"].append(start[2].elapsed_time(ev) - (t - start[1]) * 1e3)
                prev = (name, t, ev)
    finally:
        torch.Tensor.backward, hybridq.precompute_scales = backward, precompute
        if not quantized:
            job.optimizer.step = step
        for h in hooks:
            h.remove()
        job.close()
    return {"wall_ms": statistics.median(walls),
            "phases": {p: {k: statistics.median(v) if v else float("nan") for k, v in r.items()}
                       for p, r in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    a = ps.parse_args(sys.argv[1:] if argv is None else argv)
    world = ps.train.world_from_environment()
    targs = ps.train_args(a, world)
    env = ps.train.init_distributed(targs, world)
    if env.device.type != "cuda":
        raise SystemExit("phase_times.py measures the GPU's lag behind the host: it needs a CUDA device")
    tokens = ps.load_tokens()
    print(f"phase_times.py: {torch.cuda.get_device_name(env.device)}, torch {torch.__version__}, {a.timed_steps} steps "
          f"after {a.warmup}, train args {a.train_args!r}; ms per step (medians)\n")
    print("| recipe | step wall | " + " | ".join(f"{p}: host / GPU / lag at end" for p in PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for r in a.recipe_list:
        res = phases(r, a, targs, env, tokens)
        cells = [f"{v['host']:.1f} / {v['gpu']:.1f} / {v['lag']:.1f}" for v in res["phases"].values()]
        print(f"| {r} | {res['wall_ms']:.1f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    exit_without_finalization(main())
