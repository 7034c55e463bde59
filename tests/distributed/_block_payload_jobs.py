"""Jobs of the batched block-format payload tests (test_fsdp_grouped_block_payload.py), run by spawned processes (see
_harness.spawn): a GroupedLinear whose `[E, out, in]` weight FSDP2 gathers quantized in a block format, run train /
eval / train (an SGD step in between) with the batched payload (`prepare_stacked_blocks`) on and off, under the
stacked receiver (`fill_stacked_blocks`) and under the per-expert one; after every all-gather each expert's unsharded
buffers are read and compared with a quantization of that expert's full weight made here."""

from __future__ import annotations

import torch

from hybridq.distributed import grouped_blocks_batched, grouped_blocks_payload
from hybridq.torch_private import local_tensor

from _block_stacked_jobs import STEPS, _layer, _oracle, _step, counted_steps, recording_fills, step_differences

# (payload, receiver): the batched payload against the per-expert one, under either receiver
RUNS = {"on": (True, True), "off": (False, True), "on_per_expert_fill": (True, False),
        "off_per_expert_fill": (False, False)}


def _run(case: dict, payload: bool, stacked_fill: bool, rank: int, device, world_size: int) -> dict:
    grouped_blocks_payload.set_stacked_block_payload(payload)
    grouped_blocks_batched.set_stacked_block_gather(stacked_fill)
    try:
        root = _layer(case["preset"], case.get("experts", 4), case.get("out", 256), case.get("nonfinite", False),
                      device, world_size)
        lin = root.lin
        if not case.get("reshard", True):  # (forward gathers every direction at once: both sent in one payload)
            lin.set_reshard_after_forward(False)
        st = local_tensor(lin.weight)._hq
        opt = torch.optim.SGD(root.parameters(), lr=0.5)
        snaps: list = []
        e = lin.weight.shape[0]
        splits = [(5 * g + 3) % 11 if g != 1 else 0 for g in range(e)]  # (uneven counts, an expert without tokens)
        steps = []
        with recording_fills(st, snaps):
            for step, mode in enumerate(STEPS):
                full = lin.weight.full_tensor().detach().to(torch.bfloat16)
                snaps.clear()
                y, dx, grad = _step(root, lin, opt, mode, splits, 100 + 10 * rank + step, device)
                if mode != "train" and not case.get("reshard", True):
                    lin.reshard()  # (an eval forward leaves the layer unsharded too without reshard_after_forward)
                steps.append({"y": y, "dx": dx, "dw": grad, "snaps": snaps[:],
                              "oracle": [d for s in snaps for d in _oracle(lin, full, s)]})
    finally:
        grouped_blocks_payload.set_stacked_block_payload(True)
        grouped_blocks_batched.set_stacked_block_gather(True)
    c = st.counters
    return {"steps": steps, "payloads": c.get("stacked_block_payloads", 0), "reused": c.get("payload_reused", 0),
            "sent": c.get("gather_forward", 0) + c.get("gather_backward", 0),
            "stats_allreduce": c.get("stats_allreduce", 0)}


def _differences(case: dict, a: dict, b: dict, rank: int, what: str) -> list[str]:
    """How run `a` differs from run `b`: outputs, gradients and every all-gather's snapshot, bitwise."""
    return [d for s, (sa, sb) in enumerate(zip(a["steps"], b["steps"]))
            for d in step_differences(sa, sb, f"{case} {what} step {s} ({STEPS[s]}) rank {rank}")]


def job_block_payload(rank, world_size, device, cases):
    """For each case (preset, experts, out, nonfinite, reshard: reshard_after_forward): the four RUNS; the oracle's
    differences of every run, the batched payload's differences from the per-expert one under each receiver, the
    counters of each run, whether each step's output of the batched run holds a non-finite value."""
    out = []
    for case in cases:
        runs = {name: _run(case, p, f, rank, device, world_size) for name, (p, f) in RUNS.items()}
        oracle = [f"{case} {name} step {s}: {d}" for name, r in runs.items()
                  for s, step in enumerate(r["steps"]) for d in step["oracle"]]
        diffs = (_differences(case, runs["on"], runs["off"], rank, "stacked fill")
                 + _differences(case, runs["on_per_expert_fill"], runs["off_per_expert_fill"], rank,
                                "per-expert fill"))
        out.append({"oracle": oracle, "diffs": diffs,
                    "counters": {name: {k: v for k, v in r.items() if k != "steps"} for name, r in runs.items()},
                    "nonfinite_y": [bool((~torch.isfinite(s["y"].float())).any()) for s in runs["on"]["steps"]]})
    return out


def job_pre_gather_ops(rank, world_size, device, cases, steps=3):
    """For each case: the ops of the pre-all-gather hook per train step after the first (_opcount.OpCounter,
    GPU-equivalent: a quantization the CUDA kernels take counts once), with the batched payload on and off:
    {"on": {"launches": ..., "fused_quantize": ...}, "off": ...}."""
    out = []
    for case in cases:
        res = {}
        for on in (True, False):
            grouped_blocks_payload.set_stacked_block_payload(on)
            try:
                pre = counted_steps(case, device, world_size, steps).get("pre_all_gather", {})
            finally:
                grouped_blocks_payload.set_stacked_block_payload(True)
            res["on" if on else "off"] = {k: pre.get(k, 0.0) for k in ("launches", "fused_quantize", "collectives")}
        out.append(res)
    return out
