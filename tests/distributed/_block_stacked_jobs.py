"""Jobs of the stacked block-format experts' gather tests (test_fsdp_grouped_block_stacked.py), run by spawned
processes (see _harness.spawn): a GroupedLinear whose `[E, out, in]` weight FSDP2 gathers quantized in a block
format, run train / eval / train (an SGD step in between: new values refilled into the same buffers) with the
stacked gather on and off; after every all-gather each expert's unsharded buffers are read and compared with a
quantization of that expert's full weight made here."""

from __future__ import annotations

import contextlib
import pathlib
import sys

import torch

import hybridq
from hybridq.distributed import grouped_blocks_batched
from hybridq.distributed import weights as weights_mod
from hybridq.torch_private import local_tensor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import tensor_diff  # noqa: E402
from _fsdp_layer import Root, shard_under_root, spread_expert_magnitudes_  # noqa: E402

IN = 128
STEPS = ("train", "eval", "train")


def _layer(preset: str, experts: int, out: int, nonfinite: bool, device, world_size: int) -> Root:
    torch.manual_seed(0)
    lin = hybridq.GroupedLinear(experts, IN, out, recipe=preset, name="moe.w1")
    spread_expert_magnitudes_(lin)
    with torch.no_grad():
        if nonfinite:
            lin.weight[1, 3, 5] = float("nan")
            lin.weight[experts - 1, 0, 1] = float("inf")
    return shard_under_root(lin, preset, device, world_size)


def _snapshot(st) -> dict:
    """Every expert's unsharded tensors of every materialized direction, copied ({(expert, direction, name): t})."""
    out = {}
    for g, est in enumerate(st.experts):
        for d, part in est.parts.items():
            if part is None or not est.materialized(d):
                continue
            for n, t in part.tensors().items():
                if t is not None:
                    out[(g, d, n)] = t.detach().clone()
    return out


def _oracle(lin, full: torch.Tensor, snap: dict) -> list[str]:
    """How the snapshot differs from each expert's full weight quantized here (the directions it holds)."""
    diffs = []
    qs = lin.weight_quantizers()
    for g in range(full.shape[0]):
        dirs = {d for (e, d, _) in snap if e == g}
        if not dirs:
            continue
        want = qs[g].quantize(full[g], rowwise="rowwise" in dirs, columnwise="columnwise" in dirs)
        for d in dirs:
            for n, t in want.part(d).tensors().items():
                if t is None:
                    continue
                got = snap.get((g, d, n))
                if got is None:
                    diffs.append(f"expert {g} {d} {n}: not held")
                    continue
                diff = tensor_diff(got, t.contiguous(), f"expert {g} {d} {n}")
                if diff:
                    diffs.append(diff)
    return diffs


def _step(root, lin, opt, mode: str, splits: list, seed: int, device) -> tuple:
    """One step of the layer under its root: "train" (forward, backward, optimizer step) or "eval" (no-grad forward,
    then the root resharded: its forward leaves it unsharded and the next step must read the shards); (y, dx, the
    weight's local gradient) -- None for eval's gradients."""
    torch.manual_seed(seed)
    x = torch.randn(sum(splits), IN, dtype=torch.bfloat16, device=device)
    if mode == "train":
        root.train()
        x.requires_grad_(True)
        y = root(x, list(splits))
        y.backward(torch.randn_like(y))
        grad = local_tensor(lin.weight.grad).detach().clone()
        opt.step()
        opt.zero_grad()
        return y.detach(), x.grad, grad
    root.eval()
    with torch.no_grad():
        y = root(x, list(splits))
    root.reshard()
    return y.detach(), None, None


def step_differences(a: dict, b: dict, where: str) -> list[str]:
    """How step `a` of one run differs from step `b` of another, bitwise: the output, the input and weight gradients
    ("y", "dx", "dw"; None where the step has none) and every all-gather's snapshot ("snaps")."""
    diffs = []
    for t in ("y", "dx", "dw"):
        if a[t] is not None:
            d = tensor_diff(a[t], b[t], f"{where} {t}", nan_payload=True)
            if d:
                diffs.append(d)
    if len(a["snaps"]) != len(b["snaps"]):
        diffs.append(f"{where}: {len(a['snaps'])} all-gathers vs {len(b['snaps'])}")
    for i, (ga, gb) in enumerate(zip(a["snaps"], b["snaps"])):
        if ga.keys() != gb.keys():
            diffs.append(f"{where} gather {i}: tensors {sorted(ga)} vs {sorted(gb)}")
            continue
        diffs += [d for d in (tensor_diff(ga[k], gb[k], f"{where} gather {i} {k}") for k in ga) if d]
    return diffs


@contextlib.contextmanager
def recording_fills(st, snaps: list, and_then=None):
    """Inside, after every fill of the grouped weight whose state is `st` (the real post-all-gather hook runs first),
    its `_snapshot` is appended to `snaps` and `and_then(metadata)` called where given."""
    real = weights_mod.GroupedHybridWeight._post_all_gather

    def post(self, outputs, metadata):
        real(self, outputs, metadata)
        if self._hq is st:
            snaps.append(_snapshot(st))
            if and_then is not None:
                and_then(metadata)
    weights_mod.GroupedHybridWeight._post_all_gather = post
    try:
        yield
    finally:
        weights_mod.GroupedHybridWeight._post_all_gather = real


def _run(case: dict, on: bool, rank: int, world_size: int, device) -> dict:
    grouped_blocks_batched.set_stacked_block_gather(on)
    root = _layer(case["preset"], case.get("experts", 4), case.get("out", 256), case.get("nonfinite", False), device,
                  world_size)
    lin = root.lin
    st = local_tensor(lin.weight)._hq
    opt = torch.optim.SGD(root.parameters(), lr=0.5)
    snaps: list = []
    views: list = []  # (per all-gather: the directions filled, those whose experts are `[E, ...]` views of one buffer)

    def stacked_views(metadata):
        views.append((sorted(metadata.plan.materialize),
                      sorted(d for d in metadata.plan.materialize if st.stacked(d) is not None)))
    e = lin.weight.shape[0]
    splits = [(5 * g + 3) % 11 if g != 1 else 0 for g in range(e)]  # (uneven counts, an expert without tokens)
    results = []
    try:
        with recording_fills(st, snaps, stacked_views):
            for step, mode in enumerate(STEPS):
                full = lin.weight.full_tensor().detach().to(torch.bfloat16)
                snaps.clear()
                views.clear()
                y, dx, grad = _step(root, lin, opt, mode, splits, 100 + 10 * rank + step, device)
                results.append({"y": y, "dx": dx, "dw": grad, "snaps": snaps[:],
                                "oracle": [d for s in snaps for d in _oracle(lin, full, s)], "stacked": views[:]})
    finally:
        grouped_blocks_batched.set_stacked_block_gather(True)
    return {"steps": results, "fills": st.counters.get("stacked_block_fills", 0),
            "direct": st.counters.get("stacked_block_fills_direct", 0),
            "kept": st.counters.get("stacked_block_fills_kept", 0),
            "derived": st.counters.get("stacked_block_derived_direct", 0),
            "copy_items": sorted({t.element_size() for hit in st.__dict__.get("direct_copies", {}).values()
                                  for t, _ in hit[3]}),
            "columnwise_gathers": sum(1 for s in results for filled, _ in s["stacked"] if "columnwise" in filled)}


def job_stacked_blocks(rank, world_size, device, cases):
    """For each case (preset, experts, out, nonfinite): the stacked gather on and off; per step the oracle's
    differences, on-vs-off differences of y, dx, the weight gradient shard and every snapshot, the fill counter."""
    out = []
    for case in cases:
        on = _run(case, True, rank, world_size, device)
        off = _run(case, False, rank, world_size, device)
        diffs, oracle = [], []
        for s, (a, b) in enumerate(zip(on["steps"], off["steps"])):
            where = f"{case} step {s} ({STEPS[s]}) rank {rank}"
            oracle += [f"{where} on: {d}" for d in a["oracle"]] + [f"{where} off: {d}" for d in b["oracle"]]
            diffs += step_differences(a, b, f"{where}, on vs off")
        out.append({"diffs": diffs, "oracle": oracle, "fills_on": on["fills"], "fills_off": off["fills"],
                    "direct_on": on["direct"], "kept_on": on["kept"], "derived_on": on["derived"],
                    "columnwise_gathers_on": on["columnwise_gathers"], "copy_items_on": on["copy_items"],
                    "views_on": [v for s in on["steps"] for v in s["stacked"]],
                    "views_off": [v for s in off["steps"] for v in s["stacked"]],
                    "nonfinite_y": [bool((~torch.isfinite(s["y"].float())).any()) for s in on["steps"]]})
    return out


def counted_steps(case: dict, device, world_size: int, steps: int) -> dict:
    """The case's layer trained `steps` steps; the ops (_opcount.OpCounter, GPU-equivalent) per phase and step of the
    steps after the first."""
    from _opcount import OpCounter

    root = _layer(case["preset"], case.get("experts", 4), case.get("out", 256), False, device, world_size)
    e = root.lin.weight.shape[0]
    splits = [(5 * g + 3) % 11 for g in range(e)]
    x = torch.randn(sum(splits), IN, dtype=torch.bfloat16, device=device)
    counter = OpCounter()
    for step in range(steps):
        if step == 1:
            counter.__enter__()
        root(x, list(splits)).float().pow(2).mean().backward()
    counter.__exit__(None, None, None)
    return counter.summary(1, steps - 1)


def job_post_gather_ops(rank, world_size, device, cases, steps=3):
    """For each case: the ops (kernel launches, GPU-equivalent: _opcount.OpCounter) of the all-gather hooks per
    train step after the first, with the stacked gather on and off: {"on": {phase: launches}, "off": ...}."""
    out = []
    for case in cases:
        res = {}
        for on in (True, False):
            grouped_blocks_batched.set_stacked_block_gather(on)
            try:
                summary = counted_steps(case, device, world_size, steps)
            finally:
                grouped_blocks_batched.set_stacked_block_gather(True)
            res["on" if on else "off"] = {p: c.get("launches", 0.0) for p, c in summary.items()}
        out.append(res)
    return out
