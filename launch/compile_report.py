"""What torch.compile made of the job's blocks (--compile): the graphs dynamo compiled and its graph breaks, read
from dynamo's counters after the first step. A block meant to compile whole that breaks -- e.g. on a construct the
installed torch's dynamo cannot trace: `bool(dict)` broke every MoE block on torch 2.11 while 2.13 traced it -- runs
partly eagerly and only slower, so the job prints it instead of leaving it silent. (The high-precision experts of
the bf16 / torchao MoE baselines run eagerly by design: their graph breaks are listed too.)"""

from __future__ import annotations

from collections import Counter

from torch._dynamo.utils import counters


def reset() -> None:
    """Forget earlier compiles of this process (a --compare run compiles each recipe's blocks anew)."""
    counters["graph_break"].clear()
    counters["stats"].clear()


def summary() -> dict:
    """{"compiled_graphs", "graph_breaks", "graph_break_reasons": {first line of a reason: count}} since reset()."""
    reasons: Counter = Counter()
    for reason, n in counters["graph_break"].items():
        reasons[str(reason).strip().splitlines()[0]] += n
    return {"compiled_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": sum(reasons.values()), "graph_break_reasons": dict(reasons)}


def line(recipe: str, s: dict) -> str:
    """One console line (and one per distinct reason) of `summary()`."""
    head = f"[{recipe}] torch.compile: {s['compiled_graphs']} graph(s), {s['graph_breaks']} graph break(s)"
    return "\n".join([head] + [f"    {n} x {reason}" for reason, n in s["graph_break_reasons"].items()])
