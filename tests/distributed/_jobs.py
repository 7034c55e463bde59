"""Jobs run by the spawned processes of the distributed tests (see _harness.spawn). A job compares what it ran
with its oracle on every rank and returns what it found (JSON-serialisable: lists of what differed, counters,
bytes, memory); the test that names the behaviour asserts on it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib
import sys

import torch
import torch.nn as nn

import hybridq
from hybridq import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer
from hybridq.distributed import GatheredWeight, HybridWeight, apply_hybrid_fsdp, precompute_scales
from hybridq.formats import COLUMNWISE, ROWWISE

# the shared test helpers live one level up; spawned ranks inherit this sys.path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import assert_parts_bitwise as assert_parts_equal, close_diff, parts_diff  # noqa: E402
from _format_cases import FORMATS, hybrid  # noqa: E402
from _models import TinyLM, loss_fn, make_batches, micro_seed, reference_run


def _fsdp(device: torch.device, world_size: int, mesh_shape=None):
    """fully_shard on a mesh of the job's device (1-D over all ranks, or (replicate, shard) = mesh_shape: HSDP),
    and the mixed-precision policy. The explicit mesh matters: without one, FSDP2 builds its default mesh on the
    accelerator, so a gloo job on a machine with GPUs would put the unsharded parameters on CUDA."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(device, mesh_shape or (1, world_size), world_size)
    return (functools.partial(fully_shard, mesh=mesh),
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def _mesh(device, mesh_shape, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    reps, shards = mesh_shape
    if reps == 1:
        return init_device_mesh(device.type, (world_size,))
    return init_device_mesh(device.type, (reps, shards), mesh_dim_names=("replicate", "shard"))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max |diff| {(a.float() - b.float()).abs().max().item():.3e}"


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
INVARIANCE_CASES = {  # formats from tests/_format_cases.py
    "fp8_e4m3_vocab": (FORMATS["fp8_e4m3"], (50257, 16)),
    "fp8_e5m2_odd": (FORMATS["fp8_e5m2"], (97, 32)),
    "fp8_one_row": (FORMATS["fp8_e4m3"], (1, 32)),
    "fp8_pow2": (FORMATS["fp8_e4m3_pow2"], (96, 32)),
    "fp8block_2d_vocab": (FORMATS["fp8blk_128x128_e4m3"], (50257, 16)),
    "fp8block_2d_split": (FORMATS["fp8blk_128x128_e4m3"], (300, 200)),
    "fp8block_1d_split": (FORMATS["fp8blk_1x128_e4m3"], (300, 64)),
    "mxfp8_vocab": (FORMATS["mxfp8_e4m3"], (50272, 32)),
    "mxfp8_split": (FORMATS["mxfp8_e4m3"], (160, 64)),
    "mxfp8_e5m2": (FORMATS["mxfp8_e5m2"], (96, 32)),
    "mxfp8_2d_split": (FORMATS["mxfp8_32x32_e4m3"], (96, 64)),
    "nvfp4_vocab": (FORMATS["nvfp4"], (50256, 16)),
    "nvfp4_split": (FORMATS["nvfp4"], (80, 32)),
    "nvfp4_2d_split": (FORMATS["nvfp4_16x16"], (80, 32)),
    "nvfp4_2d": (FORMATS["nvfp4_16x16"], (96, 64)),
    "nvfp4_rht": (FORMATS["nvfp4_rht"], (64, 32)),
    "identity_odd": (FORMATS["identity"], (97, 32)),
    "hyb_mxfp8_nvfp4": (hybrid("mxfp8_e4m3", "nvfp4"), (96, 64)),
    "hyb_fp8block_mxfp8": (hybrid("fp8blk_128x128_e4m3", "mxfp8_e4m3"), (160, 64)),
    "hyb_fp8_identity_odd": (hybrid("fp8_e4m3", "identity"), (97, 32)),
    "hyb_nvfp4_2d_fp8": (hybrid("nvfp4_16x16", "fp8_e5m2"), (80, 32)),
    "hyb_mxfp8_nvfp4_double": (hybrid("mxfp8_e4m3", "nvfp4", columnwise_source="rowwise_dequantized"), (96, 64)),
    "hyb_fp8_fp8block_1d": (hybrid("fp8_e4m3", "fp8blk_1x128_e4m3"), (300, 32)),
}


# Eight ranks cut nvfp4_rht's 64 rows into 8-row shards, which NVFP4's Hadamard transform (16 consecutive rows)
# cannot take: apply_hybrid_fsdp refuses that layout. The same format on 128 rows (16-row shards) stands in there.
REFUSED_AT = {8: {"nvfp4_rht": "nvfp4_rht_128_rows"}}
STAND_INS = {"nvfp4_rht_128_rows": (FORMATS["nvfp4_rht"], (128, 32))}


def invariance_names(world_size: int) -> list[str]:
    """The INVARIANCE_CASES a world of this size can shard, with the stand-ins of those it cannot."""
    swap = REFUSED_AT.get(world_size, {})
    return [swap.get(n, n) for n in INVARIANCE_CASES]


def _invariance_model(names, seed: int = 0):
    torch.manual_seed(seed)
    cases = {**INVARIANCE_CASES, **STAND_INS}
    layers = nn.ModuleList()
    for n in names:
        m, k = cases[n][1]
        lin = nn.Linear(k, m, bias=False)
        with torch.no_grad():  # rows spanning many magnitudes: per-tensor and per-block scales all differ
            lin.weight.mul_(torch.logspace(-2, 2, m).unsqueeze(1))
        layers.append(lin)
    by_index = {str(i): cases[n][0] for i, n in enumerate(names)}

    def qfactory(role):
        return by_index[role.name]() if role.tensor_type == "weight" else None

    return layers, hybridq.CustomRecipe(qfactory, name="invariance")


def _mesh_queries(fn) -> int:
    """The `DeviceMesh.size` / `get_local_rank` calls `fn()` makes (each ~25-70 us of host time on torch 2.11)."""
    from torch.distributed.device_mesh import DeviceMesh

    calls = [0]
    real = {name: getattr(DeviceMesh, name) for name in ("size", "get_local_rank")}

    def counting(f):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            return f(*args, **kwargs)
        return wrapped
    for name, f in real.items():
        setattr(DeviceMesh, name, counting(f))
    try:
        fn()
    finally:
        for name, f in real.items():
            setattr(DeviceMesh, name, f)
    return calls[0]


def job_invariance(rank, world_size, device, names=None, refused=()):
    """Unshards every INVARIANCE_CASES weight twice (the second time after an in-place update and
    precompute_scales) with reshard_after_forward=False, then forward-only; returns the gathered parts that
    differ from the one-device quantization of the full weight, the materialized directions, whether the
    quantized buffers were freed at reshard, and the counters. `refused`: cases whose unshard must raise; their
    messages under "refused" ("no error" where none was raised)."""
    fully_shard, mp = _fsdp(device, world_size)
    names = names or list(INVARIANCE_CASES)
    layers, recipe = _invariance_model(names)
    layers.to(device)
    full = [lin.weight.detach().clone() for lin in layers]
    apply_hybrid_fsdp(layers, recipe, on_incompatible="error")
    for lin in layers:
        fully_shard(lin, mp_policy=mp, reshard_after_forward=False)
    out = {"diffs": [], "not_gathered_weight": [], "materialized": {}, "freed": [], "precompute": None,
           "checked": 0, "refused": {}, "mesh_queries": None}
    for rnd in range(2):
        if rnd == 1:  # an optimizer-like in-place update, then the fused statistics reduction
            with torch.no_grad():
                for lin, w in zip(layers, full):
                    lin.weight.mul_(-1.5)
                    w.mul_(-1.5)
            out["precompute"] = dataclasses.asdict(precompute_scales(layers))  # (JSON)
            out["mesh_queries"] = _mesh_queries(lambda: precompute_scales(layers))  # (after every step in training)
        for i, (lin, w) in enumerate(zip(layers, full)):
            q = lin.weight_quantizer
            lin.unshard()
            gw = lin.weight
            if not isinstance(gw, GatheredWeight):
                out["not_gathered_weight"].append(f"{names[i]}: {type(gw).__name__}")
                lin.reshard()
                continue
            out["materialized"][f"{names[i]} round {rnd}"] = gw.materialized
            ref_r, ref_c = q.quantize_parts(w.to(torch.bfloat16), True, True)
            out["diffs"] += parts_diff(gw.part(ROWWISE), ref_r, f"{names[i]} rowwise (ws={world_size}, round {rnd})")
            out["diffs"] += parts_diff(gw.part(COLUMNWISE), ref_c,
                                       f"{names[i]} columnwise (ws={world_size}, round {rnd})")
            lin.reshard()
            out["checked"] += 2
        out["freed"].append(_owned_freed(layers))
    out["counters"] = {n: dict(st.counters) for n, st in _states(layers).items()}
    # forward-only gather with reshard_after_forward=True: rowwise only, columnwise left for backward
    for lin in layers:
        lin.set_reshard_after_forward(True)
    for i, (lin, w) in enumerate(zip(layers, full)):
        lin.unshard()
        out["materialized"][f"{names[i]} forward-only"] = lin.weight.materialized
        ref_r, _ = lin.weight_quantizer.quantize_parts(w.to(torch.bfloat16), True, False)
        out["diffs"] += parts_diff(lin.weight.part(ROWWISE), ref_r, f"{names[i]} rowwise-only")
        lin.reshard()
    for n in refused:  # the layout check runs before the all-gather, on every rank alike
        layers, recipe = _invariance_model([n])
        layers.to(device)
        apply_hybrid_fsdp(layers, recipe, on_incompatible="error")
        fully_shard(layers[0], mp_policy=mp)
        try:
            layers[0].unshard()
            out["refused"][n] = "no error"
        except ValueError as e:
            out["refused"][n] = str(e)
    return out


# ---- training equivalence -------------------------------------------------------------------------------

def run_training(rank, world_size, device, *, env_override=None, **kw):
    """env_override: set HYBRIDQ_BACKWARD_OVERRIDE for this run (recipes without their own override read it at
    forward / gather time) instead of passing the override to the recipe."""
    import os

    from hybridq.recipe import BACKWARD_OVERRIDE_ENV

    if env_override is None:
        return _run_training(rank, world_size, device, **kw)
    old = os.environ.get(BACKWARD_OVERRIDE_ENV)
    os.environ[BACKWARD_OVERRIDE_ENV] = env_override
    try:
        return _run_training(rank, world_size, device, **kw)
    finally:
        if old is None:
            del os.environ[BACKWARD_OVERRIDE_ENV]
        else:
            os.environ[BACKWARD_OVERRIDE_ENV] = old


def _run_training(rank, world_size, device, *, preset, mesh_shape=None, reshard_after_forward=True, accum=1,
                  recompute=False, precompute=True, steps=3, check_state_dict=False, check_clip=False,
                  memory=False, backward_override=None, offload=False, unsharded_accum=False, reuse_payload=True,
                  grad_rtol=None):
    """grad_rtol None: the whole run against one free-running replay, bitwise (2 shards, the 2x2 HSDP mesh).

    grad_rtol given (more than two shards, where the reduce-scatter sums in another order than the replay):
    every step is replayed from the parameters the sharded model holds at its start, so each step is checked
    on its own: its losses bitwise (the forward reads the same weights), its reduced gradients within
    grad_rtol x max |replay's| per tensor, and the sharded AdamW step bitwise equal to a plain AdamW fed the
    same gradients. (A free-running comparison cannot be tight: once a last-bit difference flips one weight's
    bf16 or quantized value, later steps differ by up to ~lr per element; see GRAD_RTOL in test_large_world.py.)"""
    mesh_shape = mesh_shape or (1, world_size)
    per_step = grad_rtol is not None
    fully_shard, mp = _fsdp(device, world_size, mesh_shape)
    torch.manual_seed(0)
    model = TinyLM()
    init = copy.deepcopy(model.state_dict())
    batches = make_batches(steps, world_size, accum)
    if per_step:  # the plain AdamW the sharded optimizer step must match
        master = {n: nn.Parameter(p.detach().clone().to(device)) for n, p in model.named_parameters()}
        master_opt = torch.optim.AdamW(master.values(), lr=1e-2, foreach=False)
        worst_grad = (0.0, "")
    else:
        ref_losses, ref_g0, ref_params = reference_run(init, preset, batches, mesh_shape=mesh_shape, device=device,
                                                       backward_override=backward_override)
    model.to(device)
    report = apply_hybrid_fsdp(model, hybridq.recipe(preset, backward_override=backward_override),
                               reuse_forward_payload=reuse_payload)
    extra = {}
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for blk in model.blocks:
        blk.recompute = recompute
        fully_shard(blk, mp_policy=mp, reshard_after_forward=reshard_after_forward, **extra)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    mem = []
    diffs = {"losses": [], "grads_step0": [], "params_final": [], "state_dict": [], "grads": [], "params": []}
    clip_norm = None
    for step in range(steps):
        if memory:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        if per_step:
            now = {n: p.full_tensor() for n, p in model.named_parameters()}
            ref_losses, ref_g0, _ = reference_run(now, preset, batches[step:step + 1], mesh_shape=mesh_shape,
                                                  device=device, backward_override=backward_override, first_step=step)
        for m in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(m == accum - 1)
                if unsharded_accum:  # keep parameters unsharded between accumulation micro-batches
                    model.set_reshard_after_backward(m == accum - 1)
            torch.manual_seed(micro_seed(step, rank, m))
            tok = batches[step][rank][m].to(device)
            loss = loss_fn(model(tok[:, :-1]), tok[:, 1:])
            loss.backward()
            ref = ref_losses[0 if per_step else step][rank][m]
            if not torch.equal(loss.detach(), ref.to(device)):
                diffs["losses"].append(f"step {step} micro {m}: loss {loss.item()!r} != reference {ref.item()!r}")
        if per_step:
            for n, p in model.named_parameters():
                g = p.grad.full_tensor()
                err, bad = close_diff(g, ref_g0[n], f"step {step} grad of {n}", grad_rtol)
                if err > worst_grad[0]:
                    worst_grad = (err, f"step {step} grad of {n}")
                if bad is not None:
                    diffs["grads"].append(bad)
                master[n].grad = g.clone()
            master_opt.step()
            master_opt.zero_grad(set_to_none=True)
        elif step == 0:
            for n, p in model.named_parameters():
                g = p.grad.full_tensor()
                if not torch.equal(g, ref_g0[n].to(device)):
                    diffs["grads_step0"].append(f"grad of {n}: {_max_diff(g, ref_g0[n].to(device))}")
        if check_clip and step == steps - 1:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)  # no clipping: grads kept
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            clip_norm = norm.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if per_step:
            for n, p in model.named_parameters():
                full = p.full_tensor()
                if not torch.equal(full, master[n].detach()):
                    diffs["params"].append(f"step {step}: sharded AdamW left parameter {n} "
                                           f"{_max_diff(full, master[n].detach())} from plain AdamW's")
        if precompute:
            precompute_scales(model)
        if memory:  # (allocated after the step, peak during the step)
            torch.cuda.synchronize()
            mem.append((torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)))
    if per_step:  # (compared after every step above)
        ref_params = {n: p.detach() for n, p in master.items()}
    else:
        for n, p in model.named_parameters():
            full = p.full_tensor()
            if not torch.equal(full, ref_params[n].to(device)):
                diffs["params_final"].append(f"parameter {n} after {steps} steps: "
                                             f"{_max_diff(full, ref_params[n].to(device))}")
    freed = _owned_freed(model)
    states = _states(model)
    total = {}
    for st in states.values():
        for k, v in st.counters.items():
            total[k] = total.get(k, 0) + v
    if check_state_dict:
        diffs["state_dict"] = _state_dict_diffs(model, ref_params, device)
    return {"preset": preset, "converted": len(report.converted), "wrapped": len(states), "counters": total,
            "memory": mem, "diffs": diffs, "freed": freed, "clip_norm": clip_norm,
            "reshard_after_forward": reshard_after_forward, "recompute": recompute,
            "worst_grad": worst_grad if per_step else None}


def _state_dict_diffs(model, ref_params, device) -> list[str]:
    """state_dict holds plain tensors, the full state dict equals the reference parameters, and load_state_dict
    restores them: what did not hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    out = []
    sd = model.state_dict()
    for k, v in sd.items():
        local = v._local_tensor if isinstance(v, DTensor) else v
        if type(local) is not torch.Tensor:
            out.append(f"state_dict[{k}] holds {type(local).__name__}, not a plain tensor")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for k, v in full.items():
        if type(v) is not torch.Tensor or not torch.equal(v, ref_params[k].cpu()):
            out.append(f"full state_dict[{k}] ({type(v).__name__}) differs from the reference parameter")
    saved = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved)
    for n, p in model.named_parameters():
        if not torch.equal(p.full_tensor(), ref_params[n].to(device)):
            out.append(f"load_state_dict did not restore {n}")
    return out


def job_training(rank, world_size, device, configs, invariance=False, high_precision=None):
    out = {"runs": [run_training(rank, world_size, device, **cfg) for cfg in configs]}
    if invariance:
        out["invariance"] = job_invariance(rank, world_size, device)
    if high_precision:
        out["high_precision"] = job_high_precision(rank, world_size, device, **high_precision)
    return out


# ---- backward_override="high_precision": one Linear, input and weight gradients -------------------------------

HP_SHAPE = (160, 64)  # [N, K]: 80-row shards (split 32-row blocks)


def job_high_precision(rank, world_size, device, presets, steps=2):
    """For each preset and reshard_after_forward in (True, False), and once with the override from the environment:
    one FSDP2-sharded hybridq Linear with backward_override="high_precision". Every step, on every rank: output,
    input gradient and (reduced) weight gradient bitwise equal to the single-process hybridq Linear with the same
    override (bf16 weight, each rank's batch separately, gradients averaged in FSDP2's order), whose gradients are
    in turn bitwise those of nn.Linear (F.linear) on the same output gradient. Returns, per case, what differed
    ("diffs"), the bytes sent per step and gather_bytes_per_step's expectation, whether the unsharded buffers
    were freed at reshard, and the counters."""
    import os

    from hybridq.distributed import gather_bytes_per_step
    from hybridq.recipe import BACKWARD_OVERRIDE_ENV

    fully_shard, mp = _fsdp(device, world_size)
    n, k = HP_SHAPE
    cases = [(p, ra, False) for p in presets for ra in (True, False)] + [(presets[0], True, True)]
    out = {}
    for preset, ra, from_env in cases:
        name = f"{preset} reshard_after_forward={ra}{' (env)' if from_env else ''}"
        recipe = hybridq.recipe(preset, backward_override=None if from_env else "high_precision")
        if from_env:
            os.environ[BACKWARD_OVERRIDE_ENV] = "high_precision"
        try:
            torch.manual_seed(0)
            base = nn.Linear(k, n)
            with torch.no_grad():
                base.weight.mul_(torch.logspace(-1, 1, n).unsqueeze(1))
            master = copy.deepcopy(base)
            ref = hybridq.Linear.from_linear(copy.deepcopy(base), hybridq.recipe(preset,
                                             backward_override="high_precision"), name="ref").to(device, torch.bfloat16)
            model = nn.Sequential(base).to(device)
            apply_hybrid_fsdp(model, recipe, on_incompatible="error")
            fully_shard(model[0], mp_policy=mp, reshard_after_forward=ra)
            fully_shard(model, mp_policy=mp, reshard_after_forward=ra)
            lin = model[0]
            st = _states(model)["0"]
            before = st.counters["bytes_sent"]
            diffs = []
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step)
                xs = [torch.randn(32, k, generator=g).to(torch.bfloat16) for _ in range(world_size)]
                gys = [torch.randn(32, n, generator=g).to(torch.bfloat16) for _ in range(world_size)]
                x = xs[rank].detach().clone().to(device).requires_grad_(True)
                y = model(x)
                y.backward(gys[rank].to(device))
                # the single-process oracle: each rank's batch through the hybridq Linear (bf16 weight)
                with torch.no_grad():
                    ref.weight.copy_(master.weight.to(device))
                    ref.bias.copy_(master.bias.to(device))
                ref_dw = []
                for r in range(world_size):
                    # on the device under test: the GEMMs (native FP8 on GPU) must be the same ones
                    xr = xs[r].detach().clone().to(device).requires_grad_(True)
                    yr = ref(xr)
                    yr.backward(gys[r].to(device))
                    # ...whose gradients are those of an unquantized Linear for the same output gradient
                    xp = xs[r].detach().clone().to(device).requires_grad_(True)
                    wp = ref.weight.detach().clone().requires_grad_(True)
                    torch.nn.functional.linear(xp, wp, ref.bias.detach()).backward(gys[r].to(device))
                    if not (torch.equal(xr.grad, xp.grad) and torch.equal(ref.weight.grad, wp.grad)):
                        diffs.append(f"step {step} rank {r}: the one-device oracle's gradients are not nn.Linear's")
                    if r == rank:
                        if not torch.equal(y.detach(), yr.detach()):
                            diffs.append(f"step {step}: output {_max_diff(y.detach(), yr.detach())}")
                        if not torch.equal(x.grad, xr.grad):
                            diffs.append(f"step {step}: input grad {_max_diff(x.grad, xr.grad)}")
                    ref_dw.append(ref.weight.grad.float())
                    ref.zero_grad(set_to_none=True)
                want = ref_dw[0]
                for gr in ref_dw[1:]:
                    want = want + gr
                want = want / world_size if world_size > 1 else want
                got = lin.weight.grad.full_tensor()
                if not torch.equal(got, want.to(device)):
                    diffs.append(f"step {step}: weight grad {_max_diff(got, want.to(device))}")
                with torch.no_grad():  # a new weight every step (the gathered high-precision form must follow)
                    for p, pm in ((lin.weight, master.weight), (lin.bias, master.bias)):
                        p.add_(p.grad, alpha=-0.5)
                        pm.add_(p.grad.full_tensor().to(pm.device), alpha=-0.5)
                        p.grad = None
                    if world_size > 1 and not torch.equal(lin.weight.full_tensor().cpu(), master.weight):
                        diffs.append(f"step {step}: the sharded weight left the oracle's after the update")
            sent = (st.counters["bytes_sent"] - before) / steps
            expect = gather_bytes_per_step(lin.weight_quantizer, HP_SHAPE, world_size, reshard_after_forward=ra,
                                           backward_override="high_precision")
            out[name] = {"bytes_per_step": sent, "expected_bytes_per_step": expect.total, "diffs": diffs,
                         "freed": _owned_freed(model), "reshard_after_forward": ra, "counters": dict(st.counters)}
        finally:
            if from_env:
                del os.environ[BACKWARD_OVERRIDE_ENV]
    return out


# ---- op counts of the FSDP2 weight path ------------------------------------------------------------------

# [N, K] weights: 512 rows shard at 256 (every block aligned); 1376 rows shard at 688 (splits 128- and 32-row
# blocks); a 512 x 1376 weight (K not a multiple of 128)
OPCOUNT_SHAPES = ((512, 512), (1376, 512), (512, 1376))


def _opcount_model(device):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(k, n, bias=False) for n, k in OPCOUNT_SHAPES]).to(device)


def job_opcount(rank, world_size, device, presets, steps=3, precompute=True):
    """Per preset: ops per converted weight per step in the FSDP2 weight path (steps after the first), and the
    ops a plain unsharded hybridq Linear spends quantizing its weight for forward + backward."""
    from _opcount import OpCounter

    fully_shard, mp = _fsdp(device, world_size)
    out = {}
    x = torch.randn(256, OPCOUNT_SHAPES[0][1], generator=torch.Generator().manual_seed(1)).to(device)
    for preset in presets:
        model = _opcount_model(device)
        apply_hybrid_fsdp(model, hybridq.recipe(preset))
        for lin in model:
            fully_shard(lin, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        counter = None
        for step in range(steps):
            if step == 1:
                counter = OpCounter()
                counter.__enter__()
            model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if precompute:
                (counter.precompute_scales(model) if counter is not None else precompute_scales(model))
        counter.__exit__(None, None, None)
        fs = counter.summary(len(OPCOUNT_SHAPES), steps - 1)
        # the plain (unsharded) Linear: one quantization of the weight in both directions per step
        plain = _opcount_model(device)
        hybridq.convert_linears(plain, hybridq.recipe(preset))
        pc = OpCounter()
        with pc, torch.no_grad():
            for lin in plain:
                with pc.phase("plain_weight"):
                    lin.weight_quantizer.quantize(lin.weight.to(torch.bfloat16), rowwise=True,
                                                  columnwise=lin.recipe.backward_override is None)
        out[preset] = {"fsdp": fs, "plain": pc.summary(len(OPCOUNT_SHAPES), 1)}
    return out


# ---- tensor metadata of the gathered parts (what the CUDA kernels and native GEMMs read) --------------------

def _tensor_meta(t):
    if t is None:
        return None
    # the stride of a size-1 dim is never read
    stride = [None if n == 1 else st for n, st in zip(t.shape, t.stride())]
    return {"shape": list(t.shape), "stride": stride, "dtype": str(t.dtype),
            "contiguous": t.is_contiguous(), "aligned16": t.data_ptr() % 16 == 0 or t.numel() == 0,
            "storage_fits": t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()}


def _part_meta(part):
    return {n: _tensor_meta(t) for n, t in part.tensors().items()}


def _metadata_cases():
    """(name, weight quantizer factory, shape): every format of INVARIANCE_CASES (aligned and straddling shards),
    and every preset's weight quantizer on an aligned (512 rows) and a straddling (1376 rows: 688-row shards) weight."""
    from hybridq.recipe import preset_names

    cases = [(n, f, s) for n, (f, s) in INVARIANCE_CASES.items() if s[0] < 10000]
    for preset in preset_names():
        q0 = hybridq.recipe(preset).quantizer(hybridq.Role("linear", "weight"))
        if q0.is_stateful:
            continue
        for shape in ((512, 256), (1376, 256)):
            cases.append((f"{preset}_{shape[0]}", lambda p=preset: hybridq.recipe(p).quantizer(
                hybridq.Role("linear", "weight")), shape))
    return cases


def job_metadata(rank, world_size, device, steps=2, backward_override=None):
    """Forward (rowwise) and backward (what dgrad reads) gathers of every case, first and later iterations: every
    tensor of every gathered part has the shape, stride, dtype and contiguity of the same part quantized from the
    full weight on one device, and a 16-byte aligned data pointer. Returns the differences (empty = none)."""
    fully_shard, mp = _fsdp(device, world_size)
    cases = _metadata_cases()
    torch.manual_seed(0)
    layers = nn.ModuleList()
    by_index = {}
    for i, (name, factory, (m, k)) in enumerate(cases):
        lin = nn.Linear(k, m, bias=False)
        with torch.no_grad():
            lin.weight.mul_(torch.logspace(-2, 2, m).unsqueeze(1))
        layers.append(lin)
        by_index[str(i)] = factory
    recipe = hybridq.CustomRecipe(lambda role: by_index[role.name]() if role.tensor_type == "weight" else None,
                                  name="metadata", backward_override=backward_override)
    layers.to(device)
    full = [lin.weight.detach().clone() for lin in layers]
    apply_hybrid_fsdp(layers, recipe, on_incompatible="error")
    for lin in layers:
        fully_shard(lin, mp_policy=mp)
    diffs, checked = [], {"n": 0}

    def compare(i, direction, where):
        lin = layers[i]
        gw = lin.weight
        if not isinstance(gw, GatheredWeight):
            diffs.append(f"{cases[i][0]} {where}: weight is {type(gw).__name__}")
            return
        ref = lin.weight_quantizer.quantize_parts(full[i].to(torch.bfloat16), True, True)
        ref = ref[0] if direction == ROWWISE else ref[1]
        got = gw.part(direction)
        if ref is None or got is None:
            if (ref is None) != (got is None):
                diffs.append(f"{cases[i][0]} {where} {direction}: part {got!r} vs reference {ref!r}")
            return
        # the layout the CUDA quantize kernels produce (and the native GEMMs / dequantize kernels require):
        # contiguous, 16-byte aligned; the CPU reference path may return a transposed view for columnwise data
        a = _part_meta(got)
        b = {n: (None if t is None else _tensor_meta(t.contiguous())) for n, t in ref.tensors().items()}
        for n in b:
            if b[n] is not None:
                b[n]["aligned16"] = True
            if a[n] != b[n]:
                diffs.append(f"{cases[i][0]} {where} {direction}.{n}: gathered {a[n]} vs unsharded {b[n]}")
        diffs.extend(parts_diff(got, ref, f"{cases[i][0]} {where} {direction}"))
        checked["n"] += 1

    step_box = {"step": 0}
    bwd_dir = COLUMNWISE if backward_override is None else ROWWISE

    def fwd_hook(i):
        def hook(mod, args, out):
            if backward_override != "high_precision":
                compare(i, ROWWISE, f"forward step {step_box['step']}")
            out.register_hook(lambda g: (compare(i, bwd_dir, f"backward step {step_box['step']}")
                                         if backward_override != "high_precision" else None, g)[1])
        return hook

    for i, lin in enumerate(layers):
        lin.register_forward_hook(fwd_hook(i))
    for step in range(steps):
        step_box["step"] = step
        loss = 0
        for i, lin in enumerate(layers):
            x = torch.randn(16, lin.in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
            loss = loss + lin(x).float().square().mean()
        loss.backward()
        with torch.no_grad():  # a new weight every step (precomputed statistics on odd steps, fallback on even)
            for lin, w in zip(layers, full):
                lin.weight.mul_(-1.25)
                w.mul_(-1.25)
        if step % 2 == 0:
            precompute_scales(layers)
    return {"diffs": diffs, "checked": checked["n"]}


# ---- sharding rules checked when the layout is known ---------------------------------------------------------

# weight formats whose columnwise form (gathered for dgrad) has a sharding rule: NVFP4 with the Hadamard transform
# needs 16-row aligned shards; a [48, 64] weight on 2 ranks is split at row 24
LAYOUT_FORMATS = {
    "nvfp4_rht": lambda: NVFP4Quantizer(rht=True),
    "hybrid_mxfp8_nvfp4_rht": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
}
LAYOUT_SHAPE = (48, 64)


def _layout_case(rank, world_size, device, fmt, backward_override):
    fully_shard, mp = _fsdp(device, world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(LAYOUT_SHAPE[1], LAYOUT_SHAPE[0], bias=False)).to(device)
    make = LAYOUT_FORMATS[fmt]
    recipe = hybridq.CustomRecipe(lambda role: make() if role.tensor_type == "weight" else None,
                                  backward_override=backward_override, name="layout")
    apply_hybrid_fsdp(model, recipe)
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    x = torch.randn(4, LAYOUT_SHAPE[1], device=device)
    stage = "forward"
    try:
        loss = model(x).float().square().mean()
        stage = "backward"
        loss.backward()
        stage = "optimizer"
        opt.step()
        stage = "none"
    except ValueError as e:
        return {"raised_in": stage, "message": str(e), "params_unchanged": _unchanged(model, before)}
    return {"raised_in": stage, "message": "", "params_unchanged": _unchanged(model, before)}


def _unchanged(model, before) -> bool:
    return all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())


def job_layout_errors(rank, world_size, device, cases):
    """For each (format, backward_override): where the first ValueError came from ("forward", "backward",
    "optimizer", or "none"), its message, and whether the parameters are untouched."""
    return {f"{fmt}/{override}": _layout_case(rank, world_size, device, fmt, override) for fmt, override in cases}


# ---- FSDP2's "returned a view tensor" warning --------------------------------------------------------------

def readme_model(width: int = 64, hidden: int = 256, blocks: int = 2) -> nn.Sequential:
    """The model of docs/fsdp2.md's example: blocks of Linear -> GELU -> Linear (no bias), each block its own FSDP2
    unit, so each unit returns a Linear's output."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden, bias=False), nn.GELU(),
                                         nn.Linear(hidden, width, bias=False)) for _ in range(blocks)])


def job_view_warnings(rank, world_size, device, converted: bool):
    """FSDP2 warnings about units returning a view tensor during two training steps of `readme_model` on a
    [batch, seq, width] input (with apply_hybrid_fsdp or without)."""
    import warnings

    fully_shard, mp = _fsdp(device, world_size)
    torch.manual_seed(0)
    model = readme_model().to(device)
    if converted:
        apply_hybrid_fsdp(model, hybridq.recipe("mxfp8_fwd_nvfp4_bwd"))
    for block in model:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x = torch.randn(2, 16, 64, device=device)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            precompute_scales(model)
    return {"view_warnings": [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]}
