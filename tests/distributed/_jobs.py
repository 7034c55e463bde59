"""Jobs run by the spawned processes of the distributed tests (see _harness.spawn). Each asserts on every rank
and returns a small JSON-serialisable summary."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import hybridq
from hybridq import (Float8BlockQuantizer, Float8Quantizer, HybridQuantizer, IdentityQuantizer, MXFP8Quantizer,
                     NVFP4Quantizer)
from hybridq.distributed import GatheredWeight, HybridWeight, apply_hybrid_fsdp, precompute_scales
from hybridq.formats import COLUMNWISE, ROWWISE

from _models import TinyLM, loss_fn, make_batches, micro_seed, reference_run


def _fsdp():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh(device, mesh_shape, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    reps, shards = mesh_shape
    if reps == 1:
        return init_device_mesh(device.type, (world_size,))
    return init_device_mesh(device.type, (reps, shards), mesh_dim_names=("replicate", "shard"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_parts_equal(got, ref, what: str) -> None:
    assert type(got) is type(ref), f"{what}: {type(got).__name__} != {type(ref).__name__}"
    assert (got.rows, got.cols, got.columnwise) == (ref.rows, ref.cols, ref.columnwise), what
    assert got.meta() == ref.meta(), what
    for n in type(ref).tensor_fields:
        a, b = getattr(got, n), getattr(ref, n)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}.{n}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(_bits(a), _bits(b)), f"{what}.{n}: not bitwise equal to the unsharded quantization"


def _states(model):
    from torch.distributed.tensor import DTensor

    out = {}
    for name, mod in model.named_modules():
        w = mod._parameters.get("weight") if isinstance(mod, hybridq.Linear) else None
        local = w._local_tensor if isinstance(w, DTensor) else w
        if isinstance(local, HybridWeight):
            out[name] = local._hq
    return out


def _owned_freed(model) -> bool:
    return all(t.untyped_storage().nbytes() == 0
               for st in _states(model).values() for ts in st.owned.values() for t in ts)


# ---- sharding invariance ------------------------------------------------------------------------------

# name -> (weight quantizer factory, weight shape [M, K]). Shapes: uneven row counts (FSDP pads the last
# shard), an empty shard, and shard boundaries that split 128 / 32 / 16-row blocks and tiles.
INVARIANCE_CASES = {
    "fp8_e4m3_vocab": (lambda: Float8Quantizer(), (50257, 16)),
    "fp8_e5m2_odd": (lambda: Float8Quantizer("e5m2"), (97, 32)),
    "fp8_one_row": (lambda: Float8Quantizer(), (1, 32)),
    "fp8_pow2": (lambda: Float8Quantizer(power_2_scale=True), (96, 32)),
    "fp8block_2d_vocab": (lambda: Float8BlockQuantizer(block_dim=2), (50257, 16)),
    "fp8block_2d_split": (lambda: Float8BlockQuantizer(block_dim=2), (300, 200)),
    "fp8block_1d_split": (lambda: Float8BlockQuantizer(block_dim=1), (300, 64)),
    "mxfp8_vocab": (lambda: MXFP8Quantizer(), (50272, 32)),
    "mxfp8_split": (lambda: MXFP8Quantizer(), (160, 64)),
    "mxfp8_e5m2": (lambda: MXFP8Quantizer("e5m2"), (96, 32)),
    "mxfp8_2d_split": (lambda: MXFP8Quantizer(block_2d=True), (96, 64)),
    "nvfp4_vocab": (lambda: NVFP4Quantizer(), (50256, 16)),
    "nvfp4_split": (lambda: NVFP4Quantizer(), (80, 32)),
    "nvfp4_2d_split": (lambda: NVFP4Quantizer(block_2d=True), (80, 32)),
    "nvfp4_2d": (lambda: NVFP4Quantizer(block_2d=True), (96, 64)),
    "nvfp4_rht": (lambda: NVFP4Quantizer(rht=True), (64, 32)),
    "identity_odd": (lambda: IdentityQuantizer(), (97, 32)),
    "hyb_mxfp8_nvfp4": (lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()), (96, 64)),
    "hyb_fp8block_mxfp8": (lambda: HybridQuantizer(Float8BlockQuantizer(block_dim=2), MXFP8Quantizer()), (160, 64)),
    "hyb_fp8_identity_odd": (lambda: HybridQuantizer(Float8Quantizer(), IdentityQuantizer()), (97, 32)),
    "hyb_nvfp4_2d_fp8": (lambda: HybridQuantizer(NVFP4Quantizer(block_2d=True), Float8Quantizer("e5m2")), (80, 32)),
    "hyb_mxfp8_nvfp4_double": (lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(),
                                                       columnwise_source="rowwise_dequantized"), (96, 64)),
    "hyb_fp8_fp8block_1d": (lambda: HybridQuantizer(Float8Quantizer(), Float8BlockQuantizer(block_dim=1)), (300, 32)),
}


def _invariance_model(names, seed: int = 0):
    torch.manual_seed(seed)
    layers = nn.ModuleList()
    for n in names:
        m, k = INVARIANCE_CASES[n][1]
        lin = nn.Linear(k, m, bias=False)
        with torch.no_grad():  # rows spanning many magnitudes: per-tensor and per-block scales all differ
            lin.weight.mul_(torch.logspace(-2, 2, m).unsqueeze(1))
        layers.append(lin)
    by_index = {str(i): INVARIANCE_CASES[n][0] for i, n in enumerate(names)}

    def qfactory(role):
        return by_index[role.name]() if role.tensor_type == "weight" else None

    return layers, hybridq.CustomRecipe(qfactory, name="invariance")


def job_invariance(rank, world_size, device, names=None):
    fully_shard, mp = _fsdp()
    names = names or list(INVARIANCE_CASES)
    layers, recipe = _invariance_model(names)
    layers.to(device)
    full = [lin.weight.detach().clone() for lin in layers]
    apply_hybrid_fsdp(layers, recipe, on_incompatible="error")
    for lin in layers:
        fully_shard(lin, mp_policy=mp, reshard_after_forward=False)
    checked = 0
    for rnd in range(2):
        if rnd == 1:  # an optimizer-like in-place update, then the fused statistics reduction
            with torch.no_grad():
                for lin, w in zip(layers, full):
                    lin.weight.mul_(-1.5)
                    w.mul_(-1.5)
            info = precompute_scales(layers)
            assert world_size == 1 or info["all_reduces"] == 1, info
        for i, (lin, w) in enumerate(zip(layers, full)):
            q = lin.weight_quantizer
            lin.unshard()
            gw = lin.weight
            assert isinstance(gw, GatheredWeight), type(gw)
            assert gw.materialized == "rowwise+columnwise", (names[i], gw.materialized)
            ref_r, ref_c = q.quantize_parts(w.to(torch.bfloat16), True, True)
            assert_parts_equal(gw.part(ROWWISE), ref_r, f"{names[i]} rowwise (ws={world_size}, round {rnd})")
            assert_parts_equal(gw.part(COLUMNWISE), ref_c, f"{names[i]} columnwise (ws={world_size}, round {rnd})")
            lin.reshard()
            checked += 2
        assert _owned_freed(layers), "quantized unsharded buffers survived reshard"
    counters = {n: dict(st.counters) for n, st in _states(layers).items()}
    if world_size > 1:
        for n, c in counters.items():  # round 2 used the precomputed statistics
            assert c.get("stats_allreduce", 0) <= 1, (n, c)
    # forward-only gather with reshard_after_forward=True: rowwise only, columnwise left for backward
    for lin in layers:
        lin.set_reshard_after_forward(True)
    for i, (lin, w) in enumerate(zip(layers, full)):
        lin.unshard()
        shared = names[i].startswith("identity")  # one buffer serves both directions
        assert lin.weight.materialized == ("rowwise+columnwise" if shared else "rowwise"), \
            (names[i], lin.weight.materialized)
        ref_r, _ = lin.weight_quantizer.quantize_parts(w.to(torch.bfloat16), True, False)
        assert_parts_equal(lin.weight.part(ROWWISE), ref_r, f"{names[i]} rowwise-only")
        lin.reshard()
    return {"checked": checked, "counters": counters}


# ---- training equivalence -------------------------------------------------------------------------------

def run_training(rank, world_size, device, *, preset, mesh_shape=None, reshard_after_forward=True, accum=1,
                 recompute=False, precompute=True, steps=3, check_state_dict=False, check_clip=False,
                 memory=False, backward_override=None, offload=False, unsharded_accum=False):
    fully_shard, mp = _fsdp()
    mesh_shape = mesh_shape or (1, world_size)
    torch.manual_seed(0)
    model = TinyLM()
    init = copy.deepcopy(model.state_dict())
    batches = make_batches(steps, world_size, accum)
    ref_losses, ref_g0, ref_params = reference_run(init, preset, batches, mesh_shape=mesh_shape, device=device,
                                                   backward_override=backward_override)
    model.to(device)
    report = apply_hybrid_fsdp(model, hybridq.recipe(preset, backward_override=backward_override))
    mesh = _mesh(device, mesh_shape, world_size)
    extra = {}
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for blk in model.blocks:
        blk.recompute = recompute
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    mem = []
    for step in range(steps):
        if memory:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        for m in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(m == accum - 1)
                if unsharded_accum:  # keep parameters unsharded between accumulation micro-batches
                    model.set_reshard_after_backward(m == accum - 1)
            torch.manual_seed(micro_seed(step, rank, m))
            tok = batches[step][rank][m].to(device)
            loss = loss_fn(model(tok[:, :-1]), tok[:, 1:])
            loss.backward()
            ref = ref_losses[step][rank][m]
            assert torch.equal(loss.detach(), ref.to(device)), \
                f"{preset} step {step} micro {m}: loss {loss.item()!r} != reference {ref.item()!r}"
        if step == 0:
            for n, p in model.named_parameters():
                g = p.grad.full_tensor()
                assert torch.equal(g, ref_g0[n].to(device)), f"{preset}: grad of {n} differs (max " \
                    f"{(g - ref_g0[n].to(device)).abs().max().item():.3e})"
        if check_clip and step == steps - 1:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)  # no clipping: grads kept
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            assert torch.isfinite(norm) and norm > 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute:
            precompute_scales(model)
        if memory:  # (allocated after the step, peak during the step)
            torch.cuda.synchronize()
            mem.append((torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)))
    for n, p in model.named_parameters():
        full = p.full_tensor()
        assert torch.equal(full, ref_params[n].to(device)), \
            f"{preset}: parameter {n} after {steps} steps differs (max {(full - ref_params[n].to(device)).abs().max():.3e})"
    assert _owned_freed(model), "quantized unsharded buffers survived reshard"
    states = _states(model)
    assert states, "no weight was wrapped"
    total = {}
    for st in states.values():
        for k, v in st.counters.items():
            total[k] = total.get(k, 0) + v
    if not reshard_after_forward:
        assert total.get("gather_backward", 0) == 0, total
    if recompute and reshard_after_forward:
        assert total.get("lazy_gathers", 0) > 0, total
    if check_state_dict:
        _check_state_dict(model, ref_params, device)
    if memory:  # step 0 allocates the optimizer state; after that nothing may grow
        assert len(mem) >= 3 and mem[1:] == mem[1:2] * (len(mem) - 1), f"memory grows across steps: {mem}"
    return {"preset": preset, "converted": len(report.converted), "counters": total, "memory": mem}


def _check_state_dict(model, ref_params, device):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    sd = model.state_dict()
    for k, v in sd.items():
        local = v._local_tensor if isinstance(v, DTensor) else v
        assert type(local) is torch.Tensor, f"state_dict[{k}] holds {type(local).__name__}, not a plain tensor"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for k, v in full.items():
        assert type(v) is torch.Tensor and torch.equal(v, ref_params[k].cpu()), k
    saved = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved)
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), ref_params[n].to(device)), f"load_state_dict did not restore {n}"


def job_training(rank, world_size, device, configs, invariance=False):
    out = {"runs": [run_training(rank, world_size, device, **cfg) for cfg in configs]}
    if invariance:
        out["invariance"] = job_invariance(rank, world_size, device)
    return out
