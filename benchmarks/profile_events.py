"""profile_step.py's attribution of profiler events: kernel and op names to categories (pure) and one profiled
window's events to per-step numbers (time per category and per name, busy / idle, launches, the collectives by
kind, the time inside hybridq's autograd Functions)."""

from __future__ import annotations

import collections
import statistics

import torch

CATEGORIES = ("gemm", "hybridq", "norm", "attention", "optimizer", "collectives", "memcpy", "elementwise", "other")
LABELS = {"gemm": "GEMM", "hybridq": "hybridq quantize/dequantize", "norm": "norm kernels", "attention": "attention",
          "optimizer": "optimizer (foreach)", "collectives": "NCCL / collectives", "memcpy": "memcpy / memset / copies",
          "elementwise": "elementwise / reduction", "other": "other"}
# an op under one of these (CPU profile) counts for it, unless the op itself is a GEMM or a collective
STICKY = ("hybridq", "attention", "optimizer")


# ---- kernel names -> categories (pure) ------------------------------------------------------------

def categorize(name: str) -> str:
    """The category of a GPU kernel (or, on the CPU, an op) from its name alone. Order matters: FlashAttention
    kernels are cutlass kernels too, FSDP2's copy-in op names contain "all_gather"."""
    n = name.lower()
    # hybridq's norm kernels (RMSNorm, LayerNorm, norm + rowwise quantization: csrc/rms_norm.cu), or torch's
    if any(k in n for k in ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "::norm_")):
        return "norm"
    if "hybridq" in n:
        return "hybridq"
    # cudnn: torch's cuDNN SDPA backend also launches helper kernels (cudnn::fusion::...); the model has no conv
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn", "cudnn")):
        return "attention"
    if "memcpy" in n or "memset" in n or ("copy" in n and ("fsdp" in n or "multi_tensor_apply" in n)):
        return "memcpy"  # FSDP2's all-gather copy-in/out (a foreach copy on the GPU) is data movement, not optimizer
    if any(k in n for k in ("nccl", "c10d::", "gloo", "record_param_comms", "allgather", "all_gather",
                            "reduce_scatter", "reducescatter", "allreduce", "all_reduce")):
        return "collectives"
    if any(k in n for k in ("multi_tensor", "foreach", "adam", "optimizer.")):
        return "optimizer"
    if any(k in n for k in ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "splitkreduce", "_scaled_mm",
                            "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")):
        return "gemm"
    if any(k in n for k in ("at::native", "elementwise", "reduce_kernel", "reduction", "aten::", "triton", "vectorized", "unrolled")):
        return "elementwise"
    return "other"


COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "other")


def collective_kind(name: str) -> str:
    """Which collective a collectives-category kernel or op is (NCCL kernels: ncclDevKernel_AllGather_RING_LL, ...;
    CPU: c10d::_allgather_base_, FSDP::all_gather, ...)."""
    n = name.lower().replace("_", "")
    for key, kind in (("allgather", "all-gather"), ("reducescatter", "reduce-scatter"), ("allreduce", "all-reduce")):
        if key in n:
            return kind
    return "other"


def attribute(name: str, ancestors: list[str], hybridq_functions: frozenset[str] | set[str]) -> str:
    """The category of a CPU op given its enclosing ops (outermost first): the first sticky enclosing category
    (a hybridq autograd Function, attention, the optimizer step), so the reference quantization's element-wise
    ops count as hybridq and attention's math fallback as attention; but a collective stays a collective and a
    GEMM stays a GEMM unless it is attention's (a quantized Linear's GEMMs are GEMMs)."""
    own = categorize(name)
    if own == "collectives":
        return own
    for a in ancestors:
        c = "hybridq" if a in hybridq_functions else categorize(a)
        if c in STICKY and (own != "gemm" or c == "attention"):
            return c
    return "hybridq" if name in hybridq_functions else own


def hybridq_function_names() -> frozenset[str]:
    """Profiler event names of hybridq's autograd Functions (`Cls` for forward, `ClsBackward`) and of the custom
    ops a compiled Linear runs as (`hybridq::linear_forward`, `hybridq::linear_backward`)."""
    import hybridq  # noqa: F401  (imports every module that defines one)
    names, todo = set(), list(torch.autograd.Function.__subclasses__())
    while todo:
        c = todo.pop()
        todo += c.__subclasses__()
        if c.__module__.startswith("hybridq") and not c.__name__.endswith("Backward"):
            names |= {c.__name__, c.__name__ + "Backward"}
    return frozenset(names | {"hybridq::linear_forward", "hybridq::linear_backward"})


# ---- profile events -> per-step numbers ------------------------------------------------------------

STEP_MARK = "profile_step#"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def is_device_work(name: str) -> bool:
    """False for the device-side events that are not kernels, copies or sets: the GPU copies of record_function
    ranges (also filtered by name) and synchronization records, which would count waiting as work."""
    return not name.startswith((STEP_MARK, "Context Sync", "Stream Sync", "Event Sync", "Stream Wait",
                                "Device Sync"))


def _ancestors(e) -> list[str]:
    out, p = [], e.cpu_parent
    while p is not None:
        out.append(p.name)
        p = p.cpu_parent
    return out[::-1]


def summarize_events(events, device_type: str, top: int, hq_functions: frozenset[str]) -> dict:
    """Per-step numbers from torch.profiler's FunctionEvents of the profiled steps (each inside a
    `profile_step#i` range): kernel (CPU: op self) time per category and per name, busy / idle / launches."""
    from torch.autograd import DeviceType
    # the host-side ranges only: on CUDA the profiler also records each range's GPU copy (a user annotation on the
    # device timeline), which counted as a second step once and halved every per-step number
    steps = sorted((e for e in events if e.name.startswith(STEP_MARK) and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    n = max(len(steps), 1)
    windows = [(s.time_range.start, s.time_range.end) for s in steps]
    annotations = {e.name for e in events if getattr(e, "is_user_annotation", False)}

    def step_of(t: float) -> int | None:
        for i, (a, b) in enumerate(windows):
            if a <= t <= b:
                return i
        return None

    by_cat = collections.Counter()
    by_coll = collections.Counter()  # collectives by kind
    by_name: dict[str, list] = {}  # name -> [total us, calls, category]
    busy = [[] for _ in windows]
    launches = 0
    if device_type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and is_device_work(e.name)
                   and e.name not in annotations and not getattr(e, "is_user_annotation", False)]
        for k in kernels:
            i = step_of(k.time_range.start)
            if i is None:
                continue
            dur, cat = k.time_range.end - k.time_range.start, categorize(k.name)
            busy[i].append((k.time_range.start, k.time_range.end))
            launches += 1
            by_cat[cat] += dur
            if cat == "collectives":
                by_coll[collective_kind(k.name)] += dur
            row = by_name.setdefault(k.name, [0.0, 0, cat])
            row[0] += dur
            row[1] += 1
    else:  # CPU ops: self time, so nested ops count once; the step ranges themselves are left out
        for e in events:
            if e.device_type != DeviceType.CPU or e.name.startswith(STEP_MARK):
                continue
            i = step_of(e.time_range.start)
            if i is None:
                continue
            cat = attribute(e.name, [a for a in _ancestors(e) if not a.startswith(STEP_MARK)], hq_functions)
            dur = e.self_cpu_time_total
            launches += e.name.startswith("aten::")
            by_cat[cat] += dur
            if cat == "collectives":
                by_coll[collective_kind(e.name)] += dur
            row = by_name.setdefault(e.name, [0.0, 0, cat])
            row[0] += dur
            row[1] += 1
        for i, (a, b) in enumerate(windows):  # the CPU is never idle within its own step
            busy[i].append((a, b))
    # GPU time of the kernels launched from inside hybridq's autograd Functions (torch.profiler links each
    # kernel to the op that launched it): separates hybridq's own element-wise work from the model's
    inside = collections.Counter()
    if device_type == "cuda":
        for e in events:
            # ops only ("ns::name"): the profiler also hangs a kernel on its own records (Activity Buffer Request)
            if e.device_type == DeviceType.CPU and e.kernels and "::" in e.name \
                    and step_of(e.time_range.start) is not None \
                    and (e.name in hq_functions or any(a in hq_functions for a in _ancestors(e))):
                for k in e.kernels:
                    inside[categorize(k.name)] += k.duration
    # host time inside hybridq's autograd Functions: the outermost ones only (inclusive: their ops and launches)
    hq_host = sum(e.time_range.end - e.time_range.start for e in events
                  if e.name in hq_functions and step_of(e.time_range.start) is not None
                  and not any(a in hq_functions for a in _ancestors(e)))
    hq_calls = sum(1 for e in events if e.name in hq_functions and step_of(e.time_range.start) is not None)
    wall = [b - a for a, b in windows]
    busy_us = [union_us(iv) for iv in busy]
    kernel_total = sum(by_cat.values())
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "profiled_steps": len(steps),
        "categories_ms": {c: by_cat.get(c, 0.0) / n / 1e3 for c in CATEGORIES},
        "collectives_ms": {c: by_coll.get(c, 0.0) / n / 1e3 for c in COLLECTIVE_KINDS},
        "kernel_total_ms": kernel_total / n / 1e3,
        "step_wall_ms": statistics.fmean(wall) / 1e3 if wall else float("nan"),
        "busy_ms": statistics.fmean(busy_us) / 1e3 if busy_us else float("nan"),
        "idle_ms": statistics.fmean(w - b for w, b in zip(wall, busy_us)) / 1e3 if wall else float("nan"),
        "launches_per_step": launches / n,
        "inside_hybridq_functions_ms": {c: inside.get(c, 0.0) / n / 1e3 for c in CATEGORIES},
        "hybridq_host_ms": hq_host / n / 1e3,
        "hybridq_function_calls_per_step": hq_calls / n,
        "top": [{"name": k, "category": v[2], "total_ms_per_step": v[0] / n / 1e3, "calls_per_step": v[1] / n,
                 "avg_us": v[0] / max(v[1], 1)} for k, v in tops],
    }
