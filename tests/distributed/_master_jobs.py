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


GROUPED_SHAPE = (3, 160, 288)  # E experts of SHAPE: fragments cut inside experts and across expert boundaries
GROUPED_FORMATS = ("fp8_e4m3", "fp8blk_128x128_e4m3", "mxfp8_e4m3", "nvfp4", "preset:mxfp8_fwd_nvfp4_bwd")


def job_grouped_fragments(rank, world_size, device):
    """A GroupedLinear's quantized experts refreshed from flat fragments of the whole `[E, out, in]` master: every
    expert equals quantizing its own slice of the bf16 master (its own amax), bitwise."""
    fails = []
    e, m, k = GROUPED_SHAPE
    n = e * m * k
    g = torch.Generator().manual_seed(11)
    master = (torch.randn(e, m, k, generator=g) * torch.tensor([1e-3, 1.0, 1e3]).view(e, 1, 1)).to(device)
    quantizers = weight_quantizers()
    for name in GROUPED_FORMATS:
        q = quantizers[name]()
        recipe = CustomRecipe(lambda role, q=q: q if role.tensor_type == "weight" else None, name="weight-only")
        layer = hybridq.GroupedLinear(e, k, m, recipe=recipe, dtype=torch.bfloat16, name="moe").to(device)
        hybridq.quantize_parameters(layer)
        p = layer.weight
        cuts = [m * k, m * k + 17, 2 * m * k - 5, 130 * k + 17, n - 3] + cut_points(n, k, seed=len(name))[-2:]
        for ci, c in enumerate(cuts):
            ranges = [(0, c), (c, n - c)] if ci % 2 == 0 else [(c, n - c), (0, c)]
            s, ln = ranges[rank]
            frag = master.reshape(-1)[s:s + ln].clone() if ln else None
            with torch.no_grad():
                p.copy_(torch.zeros_like(master, dtype=torch.bfloat16))
            hybridq.distributed.quantize_master_weights([p], [frag], [s if ln else None], group=None)
            for ex, (got, info) in enumerate(zip(p.experts, p._hybridq_param.experts)):
                want = info.quantizer.quantize(master[ex].to(torch.bfloat16), rowwise=True,
                                               columnwise=info.columnwise_stored)
                for d in ("rowwise", "columnwise"):
                    if want.has(d):
                        fails += parts_diff(got.part(d).map_tensors(lambda t: t.cpu()), want.part(d).map_tensors(
                            lambda t: t.cpu()), f"{name} expert {ex} {d} with fragments {ranges} (rank {rank})")
            if fails:
                return fails
    return fails


def job_zero_moe_training(rank, world_size, device, presets, steps=2, experts=3):
    """TinyMoE (a GroupedLinear and an expert module per block) with quantized parameters under ZeroAdamW vs the
    single-process replay of its FSDP2 run (test_fsdp_grouped's oracle): losses and final masters bitwise."""
    import _grouped_jobs

    fails = []
    for preset in presets:
        recipe = hybridq.recipe(preset)
        torch.manual_seed(0)
        model = _grouped_jobs.TinyMoE(experts)
        init = copy.deepcopy(model.state_dict())
        batches = _grouped_jobs._batches(steps, world_size)
        ref_losses, _, ref_params = _grouped_jobs._reference(init, recipe, batches, experts, 1e-2, device)
        hybridq.convert_linears(model, recipe)
        hybridq.convert_experts(model, recipe)
        for blk in model.blocks:
            blk.proj.recipe = recipe
        opt = hybridq.distributed.ZeroAdamW(model, lr=1e-2)
        model.to(torch.bfloat16)
        converted = hybridq.quantize_parameters(model)
        if not any(c.endswith("experts.w1") for c in converted):
            fails.append(f"{preset}: the expert modules' weights were not quantized ({converted})")
        opt.refresh()
        for step in range(steps):
            tok = batches[step][rank]
            torch.manual_seed(100 * step + rank)
            loss = _grouped_jobs._loss(model(tok[:, :-1]), tok[:, 1:])
            loss.backward()
            if not torch.equal(loss.detach(), ref_losses[step][rank]):
                fails.append(f"{preset} step {step}: loss {loss.item()!r} != FSDP2 {ref_losses[step][rank].item()!r}")
            opt.step()
            opt.zero_grad()
        masters = opt.full_masters()
        for name, want in ref_params.items():
            if not torch.equal(masters[name], want):
                fails.append(f"{preset}: master {name} after {steps} steps differs "
                             f"(max {(masters[name] - want).abs().max().item():.3e})")
    return fails


def _zero_model(preset, seed):
    torch.manual_seed(seed)
    model = TinyLM()
    hybridq.convert_linears(model, hybridq.recipe(preset))
    opt = hybridq.distributed.ZeroAdamW(model, lr=1e-2)
    model.to(torch.bfloat16)
    hybridq.quantize_parameters(model)
    opt.refresh()
    return model, opt


def job_zero_resume(rank, world_size, device, folder, preset="mxfp8_fwd_nvfp4_bwd"):
    """At world size 2: two steps, save `consolidated_state_dict()`, then a step on a batch every rank shares. At
    world size 1: load it into a differently initialised model; the shared-batch step gives the same loss and
    masters, bitwise (each rank's gradient is the same, so the 2-rank mean is that gradient exactly)."""
    import os

    fails = []
    shared = make_batches(1, 1, 1, seed=9)[0][0][0]
    path = os.path.join(folder, "zero.pt")
    if world_size == 2:
        model, opt = _zero_model(preset, seed=0)
        for step, per_rank in enumerate(make_batches(2, world_size, 1)):
            tok = per_rank[rank][0]
            loss_fn(model(tok[:, :-1]), tok[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        state = opt.consolidated_state_dict()
        if rank == 0:
            torch.save(state, path)
    else:
        model, opt = _zero_model(preset, seed=1)
        try:
            opt.load_state_dict({"world": 2, "masters": [], "adamw": {}})
            fails.append("a per-rank state of 2 ranks loaded at world size 1")
        except ValueError as e:
            if "consolidated_state_dict" not in str(e):
                fails.append(f"per-rank state of another world size: {e} (does not point to consolidated_state_dict)")
        state = torch.load(path, weights_only=True)
        opt.load_consolidated_state_dict(state)
        again = opt.consolidated_state_dict()
        for key in ("masters", "exp_avg", "exp_avg_sq"):
            for n, t in state[key].items():
                if not torch.equal(again[key][n], t):
                    fails.append(f"{key} of {n} after load_consolidated_state_dict differs from the saved one")
        if again["step"] != state["step"] or again["step"] != 2:
            fails.append(f"step {again['step']} after loading, saved {state['step']}")
    torch.manual_seed(5)  # stochastic rounding of NVFP4 gradients draws alike in both runs
    loss = loss_fn(model(shared[:, :-1]), shared[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    after = {"loss": loss.detach(), "masters": opt.full_masters()}
    if world_size == 2 and rank == 0:
        torch.save(after, os.path.join(folder, "after.pt"))
    elif world_size == 1:
        want = torch.load(os.path.join(folder, "after.pt"), weights_only=True)
        if not torch.equal(after["loss"], want["loss"]):
            fails.append(f"shared-batch loss {after['loss'].item()!r} at world size 1, {want['loss'].item()!r} at 2")
        fails += [f"master {n} after the shared-batch step differs at world size 1"
                  for n, t in want["masters"].items() if not torch.equal(after["masters"][n], t)]
    return fails
