"""Jobs of test_precompute_scales_block_payload.py, run by spawned processes (see _harness.spawn): two FSDP2-sharded
GroupedLinears side by side under one root -- `a` (`out` rows per expert, the case's) and `b` (96 rows per expert: a
128x128 tile would span two experts, so its unshards take the per-expert payload and read reduced statistics) --
trained three steps with `precompute_scales` before every step, the batched block payload's switch set one way for
`precompute_scales` and one way for the unshards that follow (a flip between them), against the run with the switch
off throughout (the per-expert payload, every weight's statistics precomputed: the path before the batched payload)."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import torch
from torch.utils.checkpoint import checkpoint

import hybridq
from hybridq.distributed import apply_hybrid_fsdp, grouped_blocks_payload, precompute_scales
from hybridq.distributed import weights as weights_mod
from hybridq.torch_private import local_tensor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import tensor_diff  # noqa: E402
from _block_stacked_jobs import IN, _snapshot  # noqa: E402
from _fsdp_layer import spread_expert_magnitudes_  # noqa: E402

STEPS = 3
B_OUT = 96
# run name -> (switch during precompute_scales, switch during the unshards after it)
RUNS = {"per_expert": (False, False), "on": (True, True), "flip_off": (True, False), "flip_on": (False, True)}


class Pair(torch.nn.Module):
    """`a` and `b` side by side; `recompute`: under activation checkpointing, whose backward recompute reads the
    rowwise form nobody gathered for backward (a lazy gather, `gather_grouped_now`: the per-expert payload)."""

    def __init__(self, a, b, recompute: bool = False):
        super().__init__()
        self.a, self.b, self.recompute = a, b, recompute

    def forward(self, x, splits):
        if self.recompute:
            return checkpoint(self._body, x, splits, use_reentrant=False)
        return self._body(x, splits)

    def _body(self, x, splits):
        return torch.cat([self.a(x, splits), self.b(x, splits)], dim=-1)


def _model(preset: str, experts: int, out: int, recompute: bool, device, world_size: int) -> Pair:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    a = hybridq.GroupedLinear(experts, IN, out, recipe=preset, name="moe.a")
    b = hybridq.GroupedLinear(experts, IN, B_OUT, recipe=preset, name="moe.b")
    for lin in (a, b):
        spread_expert_magnitudes_(lin)
    root = Pair(a, b, recompute).to(device)
    apply_hybrid_fsdp(root, hybridq.recipe(preset), on_incompatible="error")
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for lin in (a, b):
        fully_shard(lin, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    return root


def _run(case: dict, at_precompute: bool, at_unshard: bool, rank: int, device, world_size: int) -> dict:
    root = _model(case["preset"], case.get("experts", 4), case.get("out", 256), case.get("recompute", False), device,
                  world_size)
    states = {n: local_tensor(getattr(root, n).weight)._hq for n in ("a", "b")}
    opt = torch.optim.SGD(root.parameters(), lr=0.5)
    e = root.a.weight.shape[0]
    splits = [(5 * g + 3) % 11 if g != 1 else 0 for g in range(e)]
    snaps: list = []
    real = weights_mod.GroupedHybridWeight._post_all_gather

    def post(self, outputs, metadata):  # (the real fill runs; its result is read after it)
        real(self, outputs, metadata)
        snaps.append(_snapshot(self._hq))
    weights_mod.GroupedHybridWeight._post_all_gather = post
    steps = []
    try:
        grouped_blocks_payload.set_stacked_block_payload(at_unshard)
        with torch.no_grad():  # (a first unshard sets the gather dtype, so precompute_scales' keys match from step 0)
            root.eval()
            root(torch.zeros(sum(splits), IN, dtype=torch.bfloat16, device=device), list(splits))
            root.reshard()
            root.train()
        warm = {n: dict(st.counters) for n, st in states.items()}  # (the counts below are the training steps')
        for step in range(STEPS):
            grouped_blocks_payload.set_stacked_block_payload(at_precompute)
            before = {n: st.stats for n, st in states.items()}
            pre = dataclasses.asdict(precompute_scales(root))
            # each weight's values this call reduced (it sets fresh views of its one reduced vector)
            fresh = {n: (st.stats.numel() if st.stats is not None and st.stats is not before[n] else 0)
                     for n, st in states.items()}
            grouped_blocks_payload.set_stacked_block_payload(at_unshard)
            snaps.clear()
            torch.manual_seed(100 + 10 * rank + step)
            x = torch.randn(sum(splits), IN, dtype=torch.bfloat16, device=device, requires_grad=True)
            y = root(x, list(splits))
            y.backward(torch.randn_like(y))
            grads = {n: local_tensor(getattr(root, n).weight.grad).detach().clone() for n in states}
            opt.step()
            opt.zero_grad()
            steps.append({"y": y.detach(), "dx": x.grad, "dw": grads, "snaps": snaps[:], "precompute": pre,
                          "fresh": fresh})
    finally:
        weights_mod.GroupedHybridWeight._post_all_gather = real
        grouped_blocks_payload.set_stacked_block_payload(True)
    kinds = ("stats_allreduce", "stats_precomputed", "stacked_block_payloads", "lazy_gathers")
    counters = {n: {k: st.counters.get(k, 0) - warm[n].get(k, 0) for k in kinds} for n, st in states.items()}
    return {"steps": steps, "counters": counters}


def _differences(a: dict, b: dict, where: str) -> list[str]:
    diffs = []
    for s, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
        at = f"{where} step {s}"
        for t in ("y", "dx"):
            d = tensor_diff(sa[t], sb[t], f"{at} {t}", nan_payload=True)
            if d:
                diffs.append(d)
        for n in sa["dw"]:
            d = tensor_diff(sa["dw"][n], sb["dw"][n], f"{at} dw of {n}", nan_payload=True)
            if d:
                diffs.append(d)
        if len(sa["snaps"]) != len(sb["snaps"]):
            diffs.append(f"{at}: {len(sa['snaps'])} all-gathers vs {len(sb['snaps'])}")
        for i, (ga, gb) in enumerate(zip(sa["snaps"], sb["snaps"])):
            if ga.keys() != gb.keys():
                diffs.append(f"{at} gather {i}: tensors {sorted(ga)} vs {sorted(gb)}")
                continue
            diffs += [d for d in (tensor_diff(ga[k], gb[k], f"{at} gather {i} {k}") for k in ga) if d]
    return diffs


def job_precompute_block_payload(rank, world_size, device, cases):
    """For each case (preset, out, experts, recompute): every RUNS run's per-step precompute result and the values
    each weight got, its counters, and its differences from the "per_expert" run (every gathered tensor, y, dx, dw),
    bitwise."""
    out = []
    for case in cases:
        runs = {name: _run(case, p, u, rank, device, world_size) for name, (p, u) in RUNS.items()}
        ref = runs["per_expert"]
        out.append({name: {"diffs": _differences(r, ref, f"{case} {name} rank {rank}") if name != "per_expert" else [],
                           "precompute": [s["precompute"] for s in r["steps"]],
                           "fresh": [s["fresh"] for s in r["steps"]], "counters": r["counters"]}
                    for name, r in runs.items()})
    return out
