"""Jobs of the FSDP2-gathered block-format experts tests (test_fsdp_grouped_blocks.py), run by spawned processes
(see _harness.spawn): a GroupedLinear whose `[E, out, in]` weight FSDP2 gathers quantized, run on the packed path
(host counts) or the device-count path, against the per-expert path on the same gathered weight."""

from __future__ import annotations

import pathlib
import sys

import torch

import hybridq
from hybridq.distributed import apply_hybrid_fsdp
from hybridq.nn import grouped as grouped_mod

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import tensor_diff  # noqa: E402
from _fsdp_layer import spread_expert_magnitudes_  # noqa: E402

E, IN, OUT = 4, 128, 256  # OUT a multiple of 128: no 128x128 weight tile spans two experts (the packed weight)
# (out 96: 128x128 tiles would span two experts, MXFP8's 32-row columnwise blocks not: each expert's own tiles)

# each rank's routing: uneven, an expert without tokens on every rank, counts no block multiple
SPLITS = {0: [5, 0, 17, 9], 1: [0, 12, 3, 20]}


def _layer(preset: str, device: torch.device, world_size: int, nonfinite: bool, out: int,
           plain: list | None = None) -> hybridq.GroupedLinear:
    """The layer under FSDP2 (the quantized all-gather); `plain` gets an unsharded copy of it holding the weight FSDP2
    gathers (bf16, its param_dtype) as a plain parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    lin = hybridq.GroupedLinear(E, IN, out, recipe=preset, name="moe.w1")
    with torch.no_grad():
        spread_expert_magnitudes_(lin)
        if nonfinite:
            lin.weight[2, 3, 5] = float("nan")
    lin.to(device)
    if plain is not None:
        plain.append(hybridq.GroupedLinear.from_parameters(
            torch.nn.Parameter(lin.weight.detach().to(torch.bfloat16).clone()), recipe=preset, name="moe.w1"))
    apply_hybrid_fsdp(lin, hybridq.recipe(preset), on_incompatible="error")
    mesh = init_device_mesh(device.type, (world_size,))
    fully_shard(lin, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                               reduce_dtype=torch.float32))
    return lin


def _step(lin, x, dy, splits, counts: str) -> dict:
    """One forward + backward: output, input gradient, this rank's shard of the weight gradient, the output's
    autograd node (which path ran)."""
    x = x.detach().clone().requires_grad_(True)
    lin.weight.grad = None
    m = torch.tensor(splits, device=x.device) if counts == "device" else list(splits)
    e, n, k = lin.weight.shape
    saved = []

    def pack(t):  # (FP8 tensors as large as the experts' weight kept for backward: a copy of the gathered bytes)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and t.numel() >= e * n * k:
            saved.append(f"{t.dtype} {tuple(t.shape)}")
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lin(x, m)
    node = type(y.grad_fn).__name__
    y.backward(dy)
    grad = lin.weight.grad
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    return {"y": y.detach(), "dx": x.grad, "dw": grad.detach().clone(), "node": node, "saved_fp8": saved}


def job_gathered_blocks(rank, world_size, device, cases):
    """For each case (preset, counts "host" / "device", nonfinite, out features): the packed run (`packed_path` on) against the
    per-expert run (off), both on the FSDP2-gathered weight: differences of y, dx, the weight gradient shard, and the
    packed run's autograd node. "device" counts on the CPU force the device-count path (there `device_path_runs` says
    no and a CPU tensor's counts are read as a list: its per-expert GEMMs on the host counts run, the reference of its
    GPU kernels)."""
    out = []
    for case in cases:
        out_features = case.get("out", OUT)
        lin = _layer(case["preset"], device, world_size, case.get("nonfinite", False), out_features)
        splits = SPLITS[rank % 2]
        torch.manual_seed(100 + rank)
        x = torch.randn(sum(splits), IN, dtype=torch.bfloat16).to(device)
        dy = torch.randn(sum(splits), out_features, dtype=torch.bfloat16).to(device)
        if case.get("nonfinite"):
            x[-1, 7] = float("inf")  # (expert 3's last token on both ranks)
        real = grouped_mod.device_path_runs, grouped_mod.checked_m_splits
        if case["counts"] == "device" and device.type == "cpu":
            grouped_mod.device_path_runs = lambda *a, **k: True
            grouped_mod.checked_m_splits = lambda m, *a: m  # (a CPU tensor kept as one, as a CUDA one is)
        try:
            packed = _step(lin, x, dy, splits, case["counts"])
        finally:
            grouped_mod.device_path_runs, grouped_mod.checked_m_splits = real
        lin.packed_path = False
        per_expert = _step(lin, x, dy, splits, case["counts"])
        where = f"{case} rank {rank}"
        diffs = [d for d in (tensor_diff(packed[t], per_expert[t], f"{where} {t}", nan_payload=True)
                             for t in ("y", "dx", "dw")) if d]
        nonfinite = {t: bool((~torch.isfinite(packed[t].float())).any()) for t in ("y", "dx", "dw")}
        out.append({"diffs": diffs, "node": packed["node"], "per_expert_node": per_expert["node"],
                    "nonfinite": nonfinite, "saved_fp8": packed["saved_fp8"]})
    return out


def job_gathered_vs_plain(rank, world_size, device, cases):
    """World 1 (the GPU's oracle: its grouped GEMMs are not those of the per-expert path, whose cuBLAS GEMMs sum in
    another order): for each case (preset, counts), the packed run on the FSDP2-gathered weight against the packed run
    of an unsharded copy holding the gathered weight's values as a plain bf16 parameter -- the same kernels on the same
    quantized bytes (sharding invariance): differences of y, dx, dW, and both runs' autograd nodes."""
    out = []
    for case in cases:
        plain = []
        lin = _layer(case["preset"], device, world_size, False, case.get("out", OUT), plain)
        splits = SPLITS[rank % 2]
        torch.manual_seed(100 + rank)
        x = torch.randn(sum(splits), IN, dtype=torch.bfloat16).to(device)
        dy = torch.randn(sum(splits), case.get("out", OUT), dtype=torch.bfloat16).to(device)
        got = _step(lin, x, dy, splits, case["counts"])
        want = _step(plain[0], x, dy, splits, case["counts"])
        want["dw"] = want["dw"].float()  # (FSDP2 reduces the bf16 gradient in fp32: exact on one rank)
        where = f"{case} rank {rank}"
        diffs = [d for d in (tensor_diff(got[t], want[t], f"{where} {t}", nan_payload=True)
                             for t in ("y", "dx", "dw")) if d]
        out.append({"diffs": diffs, "node": got["node"], "plain_node": want["node"]})
    return out
