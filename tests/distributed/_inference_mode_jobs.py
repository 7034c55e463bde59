"""Jobs of test_fsdp_inference_mode.py: training steps with an evaluation forward between them, under
`torch.inference_mode()` or `torch.no_grad()` (the oracle)."""

from __future__ import annotations

import torch

import _grouped_jobs as grouped_jobs
from hybridq import apply_hybrid_fsdp

EXPERTS, SPLITS, WIDTH = 4, [32, 64, 32, 32], 128  # (whole blocks of every format: nothing kept in high precision)


def eval_between_steps(rank, world_size, device, preset: str, how: str) -> dict:
    """`_grouped_jobs._KeptPayloadModel` (a Linear and a GroupedLinear, each its own FSDP2 unit resharding after
    forward) in `preset`: a training step, an evaluation forward under `how` (`inference_mode` / `no_grad`), two more
    training steps. Returns the losses, the evaluation output and the parameters after the last step (full, CPU)."""
    fully_shard, mp = grouped_jobs._fsdp(device, world_size, 0)
    torch.manual_seed(0)
    model = grouped_jobs._KeptPayloadModel(EXPERTS, k=WIDTH, n=WIDTH).to(device)
    apply_hybrid_fsdp(model, preset)
    fully_shard(model.lin, mp_policy=mp)
    fully_shard(model.experts, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []

    def step():
        loss = model(torch.randn(sum(SPLITS), WIDTH, generator=g).to(device), SPLITS).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())

    step()
    x = torch.randn(sum(SPLITS), WIDTH, generator=g).to(device)
    with torch.inference_mode() if how == "inference_mode" else torch.no_grad():
        out = model(x, SPLITS)
    evaluated = out.float().cpu().clone()
    step()
    step()
    return {"losses": torch.stack(losses), "eval": evaluated,
            "params": [p.full_tensor().detach().float().cpu() for p in model.parameters()]}


def compared(rank, world_size, device, preset: str) -> dict:
    """`eval_between_steps` under inference_mode and under no_grad: what differs (names; empty: bitwise equal), or the
    error the inference_mode run raised."""
    try:
        got = eval_between_steps(rank, world_size, device, preset, "inference_mode")
    except Exception as e:  # (the error is the finding: returned, not raised, so every preset reports)
        return {"error": f"{type(e).__name__}: {e}"[:400], "differ": []}
    want = eval_between_steps(rank, world_size, device, preset, "no_grad")
    differ = [k for k in ("losses", "eval") if not torch.equal(got[k], want[k])]
    differ += [f"parameter {i}" for i, (a, b) in enumerate(zip(got["params"], want["params"])) if not torch.equal(a, b)]
    return {"error": None, "differ": differ}
