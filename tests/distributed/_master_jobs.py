"""Jobs for test_master_weights.py: fragment quantization (quantize_master_weights) and ZeroAdamW, on spawned
process groups. Each job returns a list of failure messages (empty: everything held)."""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist

import hybridq
from hybridq.recipe import CustomRecipe

from _compare import parts_diff
from _format_cases import FORMATS
from _models import TinyLM, loss_fn, make_batches, micro_seed, reference_run

SHAPE = (160, 288)  # M: 5 MXFP8 / 10 NVFP4 blocks, 1.25 FP8 tiles; K: 9 / 18 blocks, 2.25 FP8 tiles


def weight_quantizers() -> dict:
    """Every plain format a weight can be rebuilt from fragments in, and the weight quantizer of every preset."""
    out = {n: f for n, f in FORMATS.items() if n not in ("fp8_e4m3_delayed", "nvfp4_sr")}
    for preset in hybridq.preset_names():
        if preset != "fp8_delayed":
            out[f"preset:{preset}"] = (lambda p: lambda: hybridq.recipe(p).quantizer(
                hybridq.Role("linear", "weight", "w")))(preset)
    return out


def _layer(q_factory, dtype):
    q = q_factory()
    recipe = CustomRecipe(lambda role: q if role.tensor_type == "weight" else None, name="weight-only")
    m, k = SHAPE
    lin = hybridq.Linear(k, m, bias=False, recipe=recipe, dtype=dtype, name="w")
    hybridq.quantize_parameters(lin)
    return lin


def cut_points(n: int, k: int, seed: int) -> list[int]:
    """Fragment boundaries: a block/tile/row-splitting one, row-aligned ones, tiny first fragments, random ones."""
    rng = random.Random(seed)
    fixed = [130 * k + 17, 64 * k, 0, 5, n - 3, 128 * k + 200]
    return fixed + [rng.randrange(1, n) for _ in range(3)]


def job_fragments(rank, world_size, device, dtype_name="bfloat16"):
    dtype = getattr(torch, dtype_name)
    fails = []
    m, k = SHAPE
    n = m * k
    g = torch.Generator().manual_seed(7)
    master = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)).to(device)  # per-block ranges differ
    master[3, 5] = 0.0
    for name, factory in weight_quantizers().items():
        lin = _layer(factory, dtype).to(device)
        p = lin.weight
        info = p._hybridq_param
        want = info.quantizer.quantize(master.to(dtype), rowwise=True, columnwise=info.columnwise_stored)
        for ci, c in enumerate(cut_points(n, k, seed=len(name))):
            ranges = [(0, c), (c, n - c)] if ci % 2 == 0 else [(c, n - c), (0, c)]  # odd cases: rank 0 owns the tail
            s, ln = ranges[rank]
            frag = master.reshape(-1)[s:s + ln].clone() if ln else None
            with torch.no_grad():
                p.copy_(torch.zeros_like(master, dtype=dtype))  # start from other bytes
            hybridq.distributed.quantize_master_weights([p], [frag], [s if ln else None], group=None)
            for d in ("rowwise", "columnwise"):
                if want.has(d) != p.has(d):
                    fails.append(f"{name} cut {c}: {d} present {p.has(d)}, expected {want.has(d)}")
                elif want.has(d):
                    fails += parts_diff(p.part(d).map_tensors(lambda t: t.cpu()), want.part(d).map_tensors(
                        lambda t: t.cpu()), f"{name} {d} with fragments {ranges} (rank {rank})")
            if fails:
                return fails
    return fails


def job_errors(rank, world_size, device):
    """What cannot work raises, naming the weight, with the parameter unchanged (every rank raises alike)."""
    fails = []
    m, k = SHAPE
    n = m * k
    master = torch.randn(m, k)
    lin = _layer(lambda: hybridq.MXFP8Quantizer(), torch.bfloat16)
    p = lin.weight
    before = p.rowwise.data.view(torch.uint8).clone()

    def expect(what, fn, *words):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            if not all(w in str(e) for w in words):
                fails.append(f"{what}: message {str(e)!r} lacks {words}")
        else:
            fails.append(f"{what}: no error")
        if not torch.equal(p.rowwise.data.view(torch.uint8), before):
            fails.append(f"{what}: the parameter changed")
    s = rank * (n // 2)
    gap = [(0, n // 2 - 1), (n // 2, n - n // 2)][rank]  # rank 0 stops one element short
    expect("gap", lambda: hybridq.distributed.quantize_master_weights(
        [p], [master.reshape(-1)[gap[0]:gap[0] + gap[1]]], [gap[0]]), "gap", "w")
    expect("too long", lambda: hybridq.distributed.quantize_master_weights(
        [p], [torch.zeros(n)], [s + 1]), "does not fit", "w")
    sr = _layer(lambda: hybridq.NVFP4Quantizer(stochastic_rounding=True), torch.bfloat16).weight
    expect("stochastic rounding", lambda: hybridq.distributed.quantize_master_weights(
        [sr], [master.reshape(-1)[s:s + n // 2]], [s]), "stochastic rounding", "w")
    # FSDP2's fully_shard on a model with quantized parameters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    expect("fully_shard", lambda: fully_shard(lin, mesh=mesh), "quantized weight of w", "fully_shard")
    return fails


def job_zero_training(rank, world_size, device, presets, steps=3):
    """TinyLM with quantized parameters under ZeroAdamW vs the FSDP2 run of the same recipe with torch AdamW (its
    single-process replay, bitwise equal to FSDP2 by test_fsdp): losses and final masters bitwise."""
    fails = []
    for preset in presets:
        torch.manual_seed(0)
        model = TinyLM()
        init = copy.deepcopy(model.state_dict())
        batches = make_batches(steps, world_size, 1)
        ref_losses, _, ref_params = reference_run(init, preset, batches, mesh_shape=(1, world_size), device=device)
        hybridq.convert_linears(model, hybridq.recipe(preset))
        opt = hybridq.distributed.ZeroAdamW(model, lr=1e-2)  # fp32 masters from the fp32 model
        model.to(torch.bfloat16)
        hybridq.quantize_parameters(model)
        opt.refresh()  # the model's weights from the masters (the quantized bf16 cast, as FSDP2 gathers)
        for step in range(steps):
            torch.manual_seed(micro_seed(step, rank, 0))
            tok = batches[step][rank][0]
            loss = loss_fn(model(tok[:, :-1]), tok[:, 1:])
            loss.backward()
            ref = ref_losses[step][rank][0]
            if not torch.equal(loss.detach(), ref):
                fails.append(f"{preset} step {step}: loss {loss.item()!r} != FSDP2 {ref.item()!r}")
            opt.step()
            opt.zero_grad()
        masters = opt.full_masters()
        for name, want in ref_params.items():
            if not torch.equal(masters[name], want):
                d = (masters[name] - want).abs().max().item()
                fails.append(f"{preset}: master {name} after {steps} steps differs (max {d:.3e})")
        if rank == 0:
            mem = hybridq.parameter_memory(model)
            if mem.after >= mem.before:
                fails.append(f"{preset}: quantized parameters take {mem.after} bytes, bf16 {mem.before}")
    return fails
