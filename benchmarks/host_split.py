"""Where the host time of the training job's step goes, by category, the recipes side by side, without a profiler:
a `time.perf_counter` pair around each of FSDP2's per-group steps, hybridq's all-gather hooks (dense and grouped
weights apart), the compiled Linear's and GroupedLinear's op bodies, the eager MoE layer (router, experts, the
grouped autograd Functions), the jagged FP8 experts' kernels, the model's forward, backward, gradient clipping, the
optimizer and `precompute_scales` (issue 33: the compiled fp8 step with the quantized all-gather is host-bound;
issue 30: the MoE job's).

    python benchmarks/host_split.py --recipes bf16,fp8_tensorwise --train-args "--compile --weight-gather quantized"
    python benchmarks/host_split.py --recipes fp8_tensorwise,bf16 --n-layers 4 --hidden 1024 \
        --train-args "--moe 16 --top-k 2 --compile --weight-gather quantized" [--cprofile 2]
    python benchmarks/host_split.py --smoke --device cpu --train-args "--weight-gather quantized"

The job is profile_step.py's (train.py's `build` and `train_step`, the same model flags): per recipe --warmup steps,
then --timed-steps steps with the timers on (and with --cprofile N, N more steps under cProfile, timers off: its top
functions by own and cumulative time). Each row is ms per step (and calls per step) of everything inside the timed
call, its callees included: rows nest ("FSDP2 wait_for_unshard" holds the all-gather hooks of a world of one;
"model forward" holds the forward hooks and ops; a row indented one level more -- "  of which", a dot per level in
the table -- is inside the nearest row above it with less indentation; top-level rows may overlap). F / B: the call
ran outside / inside autograd's backward. Under --compile the MoE layer's own rows (EAGER_ONLY) are not timed:
torch.compile traces them into the block's graph. The recipes run one after another in this process (each job
closed before the next), so host speeds compare within one run only; a timer pair adds ~1 us per call. On a CPU the
hybridq rows include the reference kernels' compute (the "of which" rows show the quantize and derive parts).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
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
from hybridq.nn.expert_layers import converted_experts  # noqa: E402
from hybridq.nn.linear import Linear  # noqa: E402
from hybridq.torch_private import in_backward  # noqa: E402
from fsdp_setup import exit_without_finalization  # noqa: E402


def _fsdp_group_class():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return FSDPParamGroup


def _jagged_kernels_class():
    """The class of the jagged FP8 experts' kernels the run's device takes: the registered CUDA ones, else the
    reference (the CPU)."""
    from hybridq import dispatch
    from hybridq.gemm import JaggedFP8Kernels
    k = dispatch.jagged_fp8_kernels("cuda") if torch.cuda.is_available() else None
    return type(k) if k is not None else JaggedFP8Kernels


def _model():
    return sys.modules["model"]  # (launch/model.py, imported by train.py)


def _cls(module: str, name: str):
    return lambda: getattr(importlib.import_module(module), name)


def _mod(module: str):
    return lambda: importlib.import_module(module)


# (row label, owner, attribute, split by phase): the callables timed, looked up when the timers go on. A row indented
# by two more spaces ("  of which") is inside the nearest row above it with less indentation: every call it times
# runs inside a call that row times (its ms <= that row's). A top-level row may overlap another top-level row (e.g.
# the kernels' rows are inside both the eager autograd Functions' and the compiled ops' bodies).
_W = "hybridq.distributed.weights"
_GPB, _GB = "hybridq.nn.grouped_packed_blocks", "hybridq.kernels.grouped_blocks"
TIMED = [
    ("FSDP2 pre_forward", _fsdp_group_class, "pre_forward", False),
    ("FSDP2 wait_for_unshard", _fsdp_group_class, "wait_for_unshard", True),
    ("hybridq pre-all-gather hook", _cls(_W, "_PreAllGatherHook"), "__call__", True),
    ("  of which: dense weights (HybridWeight._pre_all_gather)", _cls(_W, "HybridWeight"), "_pre_all_gather", True),
    ("    of which: cast + quantize a dense shard (prepare_payload)", _mod(_W), "prepare_payload", True),
    ("    of which: a unit's weights cast + quantized at once (unit_cast._prepare_unit)",
     _mod("hybridq.distributed.unit_cast"), "_prepare_unit", True),
    ("  of which: grouped weights (GroupedHybridWeight._pre_all_gather)", _cls(_W, "GroupedHybridWeight"),
     "_pre_all_gather", True),
    ("    of which: experts quantized batched (prepare_batched)", _mod(_W), "prepare_batched", True),
    ("    of which: experts quantized one by one (prepare_grouped)", _mod(_W), "prepare_grouped", True),
    ("    of which: block experts' stacked payload (prepare_stacked_blocks)", _mod(_W), "prepare_stacked_blocks", True),
    ("      of which: the tile payload kernel (_tile_into_slots)", _mod("hybridq.distributed.grouped_blocks_payload"),
     "_tile_into_slots", True),
    ("hybridq post-all-gather hook", _cls(_W, "HybridWeight"), "fsdp_post_all_gather", True),
    ("  of which: dense weights' fill (HybridWeight._post_all_gather)", _cls(_W, "HybridWeight"), "_post_all_gather",
     True),
    ("    of which: replayed fill, a derived direction in place (replay_fill)",
     _cls("hybridq.distributed.buffers", "UnshardedBuffers"), "replay_fill", True),
    ("  of which: grouped weights' fill (GroupedHybridWeight._post_all_gather)", _cls(_W, "GroupedHybridWeight"),
     "_post_all_gather", True),
    ("    of which: stacked per-tensor FP8 experts (fill_stacked)", _mod(_W), "fill_stacked", True),
    ("    of which: batched experts (fill_batched)", _mod(_W), "fill_batched", True),
    ("    of which: stacked block experts (fill_stacked_blocks)", _mod(_W), "fill_stacked_blocks", True),
    ("  of which: derive a direction (complete_parts)", _mod(_W), "complete_parts", True),
    ("FSDP2 post_forward", _fsdp_group_class, "post_forward", False),
    ("FSDP2 pre_backward", _fsdp_group_class, "pre_backward", False),
    ("FSDP2 post_backward", _fsdp_group_class, "post_backward", False),
    # (the gathered forward op's whole body: its call site's plan reused, or `_forward` planning it)
    ("compiled Linear gathered op forward (body)", _mod("hybridq.nn.compiled_linear"), "_gathered_forward", False),
    ("compiled Linear gathered op backward (body)", _mod("hybridq.nn.compiled_linear"), "_backward_grads", False),
    # the MoE layer, eager (under --compile these are traced into the graph: not timed, see EAGER_ONLY)
    ("MoE layer forward (launch/model.py MoE.forward)", lambda: _model().MoE, "forward", False),
    ("  of which: router's dispatch (route)", _model, "route", False),
    ("  of which: experts (Experts.forward)", lambda: _model().Experts, "forward", False),
    ("    of which: GroupedLinear.forward", _cls("hybridq.nn.grouped", "GroupedLinear"), "forward", False),
    ("      of which: JaggedFP8Experts.forward", _cls("hybridq.nn.grouped_jagged", "JaggedFP8Experts"), "forward",
     False),
    ("      of which: DeviceBlockExperts.forward", _cls("hybridq.nn.grouped_device_blocks", "DeviceBlockExperts"),
     "forward", False),
    ("      of which: PackedBlockExperts.forward", _cls("hybridq.nn.grouped_packed_blocks", "PackedBlockExperts"),
     "forward", False),
    ("JaggedFP8Experts.backward", _cls("hybridq.nn.grouped_jagged", "JaggedFP8Experts"), "backward", False),
    ("DeviceBlockExperts.backward", _cls("hybridq.nn.grouped_device_blocks", "DeviceBlockExperts"), "backward", False),
    ("PackedBlockExperts.backward", _cls("hybridq.nn.grouped_packed_blocks", "PackedBlockExperts"), "backward", False),
    # the compiled experts' op bodies (the eager code the custom ops run, hybridq/nn/compiled_grouped*.py)
    ("compiled GroupedLinear op forward (body, jagged FP8)", _mod("hybridq.nn.compiled_grouped"), "_run_forward",
     False),
    ("  of which: jagged_forward", _mod("hybridq.nn.compiled_grouped"), "jagged_forward", False),
    ("compiled GroupedLinear input quantize op (body, jagged FP8)", _mod("hybridq.nn.compiled_grouped"),
     "_run_input_quantize", False),
    ("compiled GroupedLinear op backward (body, jagged FP8)", _mod("hybridq.nn.compiled_grouped"), "_run_backward",
     False),
    ("  of which: jagged_backward", _mod("hybridq.nn.compiled_grouped"), "jagged_backward", False),
    ("compiled GroupedLinear gathered experts read (_held)", _mod("hybridq.nn.compiled_grouped"), "_held", True),
    ("compiled block GroupedLinear op forward (body)", _mod("hybridq.nn.compiled_grouped_blocks"), "_run_forward",
     False),
    ("compiled block GroupedLinear input quantize op (body)", _mod("hybridq.nn.compiled_grouped_blocks"),
     "_run_input_quantize", False),
    ("compiled block GroupedLinear op backward (body)", _mod("hybridq.nn.compiled_grouped_blocks"), "_run_backward",
     False),
    # inside both the eager Functions and the compiled bodies
    ("token groups (TokenGroups.build)", _cls("hybridq.nn.grouped_jagged", "TokenGroups"), "build", True),
    ("gathered experts' stacked form (HeldFP8Experts.form)", _cls("hybridq.nn.grouped_jagged", "HeldFP8Experts"),
     "form", True),
    ("jagged FP8 kernels: quantize", _jagged_kernels_class, "quantize", True),
    ("jagged FP8 kernels: grouped GEMM (fprop, dgrad)", _jagged_kernels_class, "mm", True),
    ("jagged FP8 kernels: wgrad", _jagged_kernels_class, "wgrad", False),
    ("block experts: slot layout (SlotLayout.build)", _cls("hybridq.nn.grouped_packed", "SlotLayout"), "build", True),
    ("block experts: gathered weight read (GatheredExpertWeights)", _cls(_GPB, "GatheredExpertWeights"), "__init__",
     True),
    ("block experts: gathered weight joined (GatheredExpertWeights.whole)", _cls(_GPB, "GatheredExpertWeights"),
     "whole", True),
    ("block experts: grouped slot quantize (grouped_slots.quantize)", _mod("hybridq.kernels.grouped_slots"),
     "quantize", True),
    ("  of which: Triton launches (slot_quantize)", _mod("hybridq.kernels.triton_slot_quantize"), "slot_quantize",
     True),
    ("block experts: grouped GEMM fprop / dgrad (grouped_blocks.mm)", _mod(_GB), "mm", True),
    # (FSDP2's gathered experts read in place: the launch row below is inside this one where the job gathers them)
    ("block experts: grouped GEMM fprop / dgrad, stacked experts (grouped_blocks.mm_stacked)", _mod(_GB), "mm_stacked",
     True),
    ("  of which: Triton launch (grouped_block_mm)", _mod("hybridq.kernels.triton_grouped_blocks"),
     "grouped_block_mm", True),
    ("block experts: grouped GEMM wgrad (grouped_blocks.wgrad)", _mod(_GB), "wgrad", False),
    ("  of which: Triton launch (grouped_block_wgrad)", _mod("hybridq.kernels.triton_grouped_blocks"),
     "grouped_block_wgrad", False),
    ("backward (Tensor.backward)", lambda: torch.Tensor, "backward", False),
    ("clip_grad_norm_", lambda: torch.nn.utils, "clip_grad_norm_", False),
    ("hybridq.precompute_scales", lambda: hybridq, "precompute_scales", False),
]
# rows whose callables torch.compile traces into the block's graph: with --compile they are not wrapped (a timer
# inside a traced function would change the graph, and a replaced function fails dynamo's guards: a recompile)
EAGER_ONLY = frozenset({"MoE layer forward (launch/model.py MoE.forward)", "  of which: router's dispatch (route)",
                        "  of which: experts (Experts.forward)", "    of which: GroupedLinear.forward"})
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


def depth(label: str) -> int:
    """How deep a row nests: two spaces of indentation per level."""
    return (len(label) - len(label.lstrip(" "))) // 2


def parents(labels: list[str]) -> dict[str, str]:
    """row -> the row it is inside: the nearest row above it with less indentation (top-level rows: none)."""
    out, stack = {}, []
    for label in labels:
        while stack and depth(stack[-1]) >= depth(label):
            stack.pop()
        if stack:
            out[label] = stack[-1]
        stack.append(label)
    return out


def targets_for(compiled: bool) -> list[tuple]:
    """The TIMED rows a run wraps: all of them eager; under --compile not the EAGER_ONLY ones."""
    return [t for t in TIMED if not (compiled and t[0] in EAGER_ONLY)]


def split(recipe: str, a, targs, env, tokens: torch.Tensor) -> dict:
    """The rows of `recipe` over --timed-steps steps after --warmup: {row: [ms per step, calls per step]}, the
    steps' median host / wall ms, the job's hybridq Linears and GroupedLinears; with --cprofile N, the top functions
    of N more steps under cProfile (timers off)."""
    job = ps._Job(recipe, a, targs, env, tokens)
    tot: dict = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    starts: list[float] = []

    def forward_done(*_):
        tot[FORWARD] += time.perf_counter() - starts.pop()
        cnt[FORWARD] += 1

    hooks = [job.model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())),
             job.model.register_forward_hook(forward_done)]
    targets = targets_for(targs.compile) + [(OPTIMIZER, lambda: job.optimizer, "step", False)]
    try:
        with timers(targets, tot, cnt):
            host, wall = job.run(a.timed_steps)
    finally:
        for h in hooks:
            h.remove()
    n = a.timed_steps
    rows = {k: [tot[k] * 1e3 / n, cnt[k] / n] for k in tot}
    res = {"rows": rows, "host_ms": statistics.median(host) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
           "linears": sum(isinstance(m, Linear) for m in job.model.modules()),
           "grouped": sum(len(converted_experts(m)) for m in job.model.modules())}
    if a.cprofile:
        res["cprofile"] = cprofile_steps(job, a.cprofile, a.cprofile_top)
    job.close()
    return res


def cprofile_steps(job, steps: int, top: int) -> str:
    """`steps` more steps of `job` under cProfile: the top functions by own time and by cumulative time (ms per
    step; cProfile's own overhead inflates both, the order is what it is for)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    try:
        job.run(steps)
    finally:
        prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return f"(cProfile of {steps} steps: times are totals over them)\n" + out.getvalue()


def row_order() -> list[str]:
    """The table's rows: each top-level row with the rows inside it, phase by phase (a phased block: its forward
    calls, then its backward calls); the optimizer after the backward."""
    blocks: list[list[tuple]] = []
    for t in TIMED:
        if depth(t[0]) == 0:
            blocks.append([])
        blocks[-1].append(t)
    order = [FORWARD]
    for block in blocks:
        phases = (" F", " B") if block[0][3] else ("",)
        for i, ph in enumerate(phases):
            order += [label + (ph if phased else "") for label, _, _, phased in block if phased or i == 0]
        if block[0][0] == "backward (Tensor.backward)":
            order.append(OPTIMIZER)
    return order


def _shown(row: str) -> str:
    """A row's label in the table (markdown drops leading spaces: a dot per level instead)."""
    return "· " * depth(row) + row.lstrip(" ")


def table(results: dict) -> str:
    recipes = list(results)
    lines = ["| ms per step (calls) | " + " | ".join(recipes) + " |", "|---|" + "---|" * len(recipes),
             "| **step host (median)** | " + " | ".join(f"{results[r]['host_ms']:.1f}" for r in recipes) + " |",
             "| **step wall (median)** | " + " | ".join(f"{results[r]['wall_ms']:.1f}" for r in recipes) + " |"]
    for row in row_order():
        vals = [results[r]["rows"].get(row) for r in recipes]
        if any(v is not None for v in vals):
            lines.append(f"| {_shown(row)} | "
                         + " | ".join("-" if v is None else f"{v[0]:.2f} ({v[1]:g})" for v in vals) + " |")
    return "\n".join(lines)


def _take(argv: list[str], flag: str, default, kind):
    """(the value of `flag VALUE` in argv, or `default`; argv without them): this script's own flags, the rest are
    profile_step.py's."""
    if flag not in argv:
        return default, argv
    i = argv.index(flag)
    return kind(argv[i + 1]), argv[:i] + argv[i + 2:]


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    argv = sys.argv[1:] if argv is None else argv
    out, argv = _take(argv, "--json", None, str)
    cprof, argv = _take(argv, "--cprofile", 0, int)
    cprof_top, argv = _take(argv, "--cprofile-top", 30, int)
    a = ps.parse_args(argv)
    a.cprofile, a.cprofile_top = cprof, cprof_top
    world = ps.train.world_from_environment()
    targs = ps.train_args(a, world)
    env = ps.train.init_distributed(targs, world)
    tokens = ps.load_tokens()
    dev = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU"
    results: dict = {}
    for r in a.recipe_list:  # (the table so far after each recipe: a run cut short keeps what it measured)
        results[r] = split(r, a, targs, env, tokens)
        print(f"host_split.py: {dev}, torch {torch.__version__}, {a.timed_steps} steps after {a.warmup}, train args "
              f"{a.train_args!r}; hybridq Linears / GroupedLinears: "
              + ", ".join(f"{r} {v['linears']} / {v['grouped']}" for r, v in results.items()))
        print(table(results), flush=True)
        if "cprofile" in results[r]:
            print(f"\n## {r}: cProfile\n{results[r]['cprofile']}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    exit_without_finalization(main())
