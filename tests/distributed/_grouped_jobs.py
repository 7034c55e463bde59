"""Jobs of the grouped-weight (mixture-of-experts) FSDP2 tests, run by spawned processes (see _harness.spawn).
Each returns what differed from its single-device oracle (JSON-serialisable); the tests assert on it."""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import hybridq
from hybridq.distributed import apply_hybrid_fsdp, precompute_scales
from hybridq.distributed import GroupedGatheredWeight, GroupedHybridWeight
from hybridq.formats import COLUMNWISE, ROWWISE

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import parts_diff, tensor_diff  # noqa: E402
from _format_cases import FORMATS, hybrid  # noqa: E402

# name -> (weight quantizer factory, [E, out, in]); `out` even (FSDP2 shards dim 1 evenly only) and chosen so the
# dim-1 shard boundary (out / 2) splits 32-row MXFP8 blocks, 16-row NVFP4 blocks and 128-row / 128x128 FP8 blocks
GROUPED_CASES = {
    "fp8_e4m3": (FORMATS["fp8_e4m3"], (3, 50, 32)),
    "fp8_e5m2": (FORMATS["fp8_e5m2"], (4, 96, 32)),
    "fp8_e4m3_pow2": (FORMATS["fp8_e4m3_pow2"], (3, 96, 32)),
    "fp8blk_1x128_e4m3": (FORMATS["fp8blk_1x128_e4m3"], (3, 300, 64)),
    "fp8blk_1x128_e5m2": (FORMATS["fp8blk_1x128_e5m2"], (4, 160, 32)),
    "fp8blk_128x128_e4m3": (FORMATS["fp8blk_128x128_e4m3"], (3, 300, 200)),
    "mxfp8_e4m3": (FORMATS["mxfp8_e4m3"], (3, 160, 64)),
    "mxfp8_e5m2": (FORMATS["mxfp8_e5m2"], (4, 96, 32)),
    "mxfp8_32x32_e4m3": (FORMATS["mxfp8_32x32_e4m3"], (3, 96, 64)),
    "nvfp4": (FORMATS["nvfp4"], (3, 80, 32)),
    "nvfp4_16x16": (FORMATS["nvfp4_16x16"], (4, 80, 32)),
    "nvfp4_rht": (FORMATS["nvfp4_rht"], (3, 64, 32)),
    "identity": (FORMATS["identity"], (3, 98, 32)),
    "hyb_mxfp8_nvfp4": (hybrid("mxfp8_e4m3", "nvfp4"), (3, 96, 64)),
    "hyb_fp8block_mxfp8": (hybrid("fp8blk_128x128_e4m3", "mxfp8_e4m3"), (4, 160, 64)),
    "hyb_fp8_identity": (hybrid("fp8_e4m3", "identity"), (3, 50, 32)),
    "hyb_mxfp8_nvfp4_double": (hybrid("mxfp8_e4m3", "nvfp4", columnwise_source="rowwise_dequantized"), (3, 96, 64)),
}


def _fsdp(device, world_size, dim):
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh(device.type, (world_size,))
    placement = None if dim == 0 else (lambda p: Shard(dim) if p.dim() == 3 else None)
    return (partial(fully_shard, mesh=mesh, shard_placement_fn=placement),
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def _grouped_layers(names, experts=None, seed=0):
    """One GroupedLinear per case, each expert at its own magnitude (per-expert statistics all differ)."""
    torch.manual_seed(seed)
    layers = nn.ModuleList()
    by_name = {}
    for i, n in enumerate(names):
        factory, (e, out, k) = GROUPED_CASES[n]
        e = experts or e
        by_name[str(i)] = factory
        layers.append(hybridq.GroupedLinear(e, k, out, recipe=_IDENT, name=str(i)))
        with torch.no_grad():
            layers[-1].weight.mul_(torch.logspace(-2, 2, out).unsqueeze(1) * torch.logspace(-3, 3, e).view(e, 1, 1))

    def qfactory(role):
        return by_name[role.name.split(".")[0]]() if role.tensor_type == "weight" else None

    return layers, hybridq.CustomRecipe(qfactory, name="grouped_invariance")


_IDENT = hybridq.CustomRecipe(lambda role: None, name="identity")


def _owned_freed(layers) -> bool:
    from torch.distributed.tensor import DTensor

    for lin in layers:
        w = lin._parameters["weight"]
        local = w._local_tensor if isinstance(w, DTensor) else w
        if isinstance(local, GroupedHybridWeight):
            for est in local._hq.experts:
                if not all(t.untyped_storage().nbytes() == 0 for ts in est.owned.values() for t in ts):
                    return False
    return True


def job_grouped_invariance(rank, world_size, device, dims=(0, 1), experts=(None, 4)):
    """For every GROUPED_CASES weight, Shard(0) and Shard(1), the cases' expert counts and E=4: unshard twice (the
    second time after an in-place update and precompute_scales) with reshard_after_forward=False, then forward-only
    with reshard_after_forward=True; every expert's gathered parts against the one-device quantization of that
    expert's full `[out, in]` weight. Returns the differences, materialized directions, whether the buffers were
    freed at reshard, the precompute result and the all-reduce counters."""
    out = {"diffs": [], "not_gathered": [], "materialized": {}, "freed": [], "precompute": [], "checked": 0,
           "allreduces": []}
    names = list(GROUPED_CASES)
    for dim in dims:
        for e_count in experts:
            fully_shard, mp = _fsdp(device, world_size, dim)
            layers, recipe = _grouped_layers(names, e_count)
            layers.to(device)
            full = [lin.weight.detach().clone() for lin in layers]
            apply_hybrid_fsdp(layers, recipe, on_incompatible="error")
            for lin in layers:
                fully_shard(lin, mp_policy=mp, reshard_after_forward=False)
            tag = f"Shard({dim}) E={'case' if e_count is None else e_count}"
            for rnd in range(2):
                if rnd == 1:
                    with torch.no_grad():
                        for lin, w in zip(layers, full):
                            lin.weight.mul_(-1.5)
                            w.mul_(-1.5)
                    out["precompute"].append(dataclasses.asdict(precompute_scales(layers)))  # (JSON)
                for i, (lin, w) in enumerate(zip(layers, full)):
                    lin.unshard()
                    gw = lin.weight
                    if not isinstance(gw, GroupedGatheredWeight):
                        out["not_gathered"].append(f"{names[i]} {tag}: {type(gw).__name__}")
                        lin.reshard()
                        continue
                    for e, ge in enumerate(gw.unbind(0)):
                        q = lin.expert_quantizers[e]["weight"]
                        ref_r, ref_c = q.quantize_parts(w[e].to(torch.bfloat16), True, True)
                        where = f"{names[i]} expert {e} ({tag}, ws={world_size}, round {rnd})"
                        out["diffs"] += parts_diff(ge.part(ROWWISE), ref_r, f"{where} rowwise")
                        out["diffs"] += parts_diff(ge.part(COLUMNWISE), ref_c, f"{where} columnwise")
                        out["checked"] += 2
                    out["materialized"][f"{names[i]} {tag} round {rnd}"] = gw._experts[0].materialized
                    lin.reshard()
                out["freed"].append(_owned_freed(layers))
            out["allreduces"].append({names[i]: dict(lin.weight._local_tensor._hq.counters).get("stats_allreduce", 0)
                                      for i, lin in enumerate(layers)})
            for lin in layers:
                lin.set_reshard_after_forward(True)
            for i, (lin, w) in enumerate(zip(layers, full)):
                lin.unshard()
                gw = lin.weight
                out["materialized"][f"{names[i]} {tag} forward-only"] = gw._experts[0].materialized
                for e, ge in enumerate(gw.unbind(0)):
                    ref_r, _ = lin.expert_quantizers[e]["weight"].quantize_parts(w[e].to(torch.bfloat16), True, False)
                    out["diffs"] += parts_diff(ge.part(ROWWISE), ref_r, f"{names[i]} expert {e} ({tag}) rowwise-only")
                lin.reshard()
    return out


def job_grouped_invariance_and_errors(rank, world_size, device):
    return {"invariance": job_grouped_invariance(rank, world_size, device, experts=(None,)),
            "errors": job_grouped_errors(rank, world_size, device)}


def job_grouped_errors(rank, world_size, device):
    """Set-up refusals that need a sharded weight: Shard(2) (along in_features) and a Shard(1) boundary the
    format's rule refuses (NVFP4's 16-row Hadamard groups cut by 24-row shards). Returns the messages."""
    from torch.distributed.tensor import Shard

    msgs = {}
    for what, dim, fmt, (e, out_f, k) in (("shard2", 2, "mxfp8_e4m3", (2, 64, 64)),
                                          ("rht_rows", 1, "nvfp4_rht", (2, 48, 32))):
        fully_shard, mp = _fsdp(device, world_size, 0)
        recipe = hybridq.CustomRecipe(lambda role, f=fmt: FORMATS[f]() if role.tensor_type == "weight" else None,
                                      name=fmt)
        lin = hybridq.GroupedLinear(e, k, out_f, recipe=recipe, name="moe.w1").to(device)
        apply_hybrid_fsdp(lin, recipe, on_incompatible="error")
        fully_shard(lin, mp_policy=mp, shard_placement_fn=lambda p, d=dim: Shard(d))
        try:
            lin.unshard()
            msgs[what] = None
        except ValueError as err:
            msgs[what] = str(err)
    return msgs


# ---- training: a tiny routed MoE, FSDP2 vs a single-process replay ------------------------------------------------

class Experts(nn.Module):
    """SwiGLU experts in the expert protocol (w1 / w3 / w2 `[E, out, in]`)."""

    hybridq_grouped_weights = ("w1", "w3", "w2")

    def __init__(self, e, d, h):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, h, d) / d ** 0.5)
        self.w3 = nn.Parameter(torch.randn(e, h, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, h) / h ** 0.5)

    def forward(self, x, m_splits):
        hid = F.silu(hybridq.grouped_mm(self, "w1", x, m_splits)) * hybridq.grouped_mm(self, "w3", x, m_splits)
        return hybridq.grouped_mm(self, "w2", hid, m_splits)


class MoEBlock(nn.Module):
    def __init__(self, e, d, h):
        super().__init__()
        self.e = e
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, e, bias=False)
        self.experts = Experts(e, d, h)
        self.proj = hybridq.GroupedLinear(e, d, d, recipe=_IDENT, name="proj")
        self.recompute = False

    def forward(self, x):
        if self.recompute:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)

    def _body(self, x):
        b, t, d = x.shape
        flat = self.norm(x).reshape(-1, d)
        probs = self.router(flat).float().softmax(-1)
        weight, idx = probs.max(-1)  # top-1
        order = torch.argsort(idx, stable=True)
        splits = torch.bincount(idx, minlength=self.e).tolist()
        xs = flat[order]
        ys = self.proj(self.experts(xs, splits), splits)
        out = torch.empty_like(ys).index_copy(0, order, ys)
        return x + (out * weight.unsqueeze(-1).to(out.dtype)).reshape(b, t, d)


class TinyMoE(nn.Module):
    def __init__(self, e=3, vocab=67, d=64, h=96, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(e, d, h) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tok):
        x = self.emb(tok)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batches(steps, ranks, seed=1, vocab=67):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (2, 17), generator=g) for _ in range(ranks)] for _ in range(steps)]


def _reference(init, recipe, batches, e, lr, device):
    master = TinyMoE(e).to(device)
    master.load_state_dict(init)
    work = TinyMoE(e).to(device)
    work.load_state_dict(init)
    hybridq.convert_linears(work, recipe)
    hybridq.convert_experts(work, recipe)
    for blk in work.blocks:
        blk.proj.recipe = recipe
    work.to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, foreach=False)
    losses, grads0 = [], None
    for step, per_rank in enumerate(batches):
        with torch.no_grad():
            for pw, pm in zip(work.parameters(), master.parameters()):
                pw.copy_(pm)
        rank_grads, step_losses = [], []
        for r, tok in enumerate(per_rank):
            tok = tok.to(device)
            torch.manual_seed(100 * step + r)  # stochastic rounding draws from the global generator
            loss = _loss(work(tok[:, :-1]), tok[:, 1:])
            loss.backward()
            rank_grads.append({n: p.grad.float() for n, p in work.named_parameters()})
            work.zero_grad(set_to_none=True)
            step_losses.append(loss.detach())
        losses.append(step_losses)
        full = {}
        for n in rank_grads[0]:  # FSDP2's order: the sum over ranks, then the division
            total = rank_grads[0][n]
            for g in rank_grads[1:]:
                total = total + g[n]
            full[n] = total / len(rank_grads) if len(rank_grads) > 1 else total
        if step == 0:
            grads0 = {n: g.clone() for n, g in full.items()}
        for n, p in master.named_parameters():
            p.grad = full[n]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads0, {n: p.detach().clone() for n, p in master.named_parameters()}


def _diff(a, b):
    return f"max |diff| {(a.float() - b.float()).abs().max().item():.3e}"


def run_moe_training(rank, world_size, device, *, preset, dim, experts, steps=2, lr=1e-2, reshard_after_forward=True,
                     backward_override=None, recompute=False):
    """A few AdamW steps of TinyMoE under FSDP2 (experts sharded along `dim`): every step's loss, the first step's
    gradients and the final parameters against the single-process replay; returns what differed."""
    recipe = hybridq.recipe(preset, backward_override=backward_override)
    torch.manual_seed(0)
    model = TinyMoE(experts)
    init = copy.deepcopy(model.state_dict())
    batches = _batches(steps, world_size)
    ref_losses, ref_g0, ref_params = _reference(init, recipe, batches, experts, lr, device)
    model.to(device)
    report = apply_hybrid_fsdp(model, recipe)
    fully_shard, mp = _fsdp(device, world_size, dim)
    for blk in model.blocks:
        blk.recompute = recompute
        fully_shard(blk, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    diffs = {"losses": [], "grads_step0": [], "params_final": []}
    where = (f"{preset} Shard({dim}) E={experts} reshard_after_forward={reshard_after_forward} "
             f"override={backward_override} recompute={recompute}")
    for step in range(steps):
        tok = batches[step][rank].to(device)
        torch.manual_seed(100 * step + rank)
        loss = _loss(model(tok[:, :-1]), tok[:, 1:])
        loss.backward()
        want = ref_losses[step][rank]
        d = tensor_diff(loss.detach(), want.to(device), f"{where} step {step} loss")
        if d:
            diffs["losses"].append(d)
        if step == 0:
            for n, p in model.named_parameters():
                d = tensor_diff(p.grad.full_tensor(), ref_g0[n].to(device), f"{where} grad of {n}")
                if d:
                    diffs["grads_step0"].append(d)
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_scales(model)
    for n, p in model.named_parameters():
        d = tensor_diff(p.full_tensor(), ref_params[n].to(device), f"{where} parameter {n} after {steps} steps")
        if d:
            diffs["params_final"].append(d)
    wrapped = [n for n, p in model.named_parameters() if isinstance(p._local_tensor, GroupedHybridWeight)]
    counters = {}
    for n, p in model.named_parameters():
        if isinstance(p._local_tensor, GroupedHybridWeight):
            for k, v in p._local_tensor._hq.counters.items():
                counters[k] = counters.get(k, 0) + v
    return {"where": where, "diffs": diffs, "wrapped": wrapped, "converted": report.converted, "counters": counters}


def job_moe_training(rank, world_size, device, configs):
    return {"runs": [run_moe_training(rank, world_size, device, **cfg) for cfg in configs]}


# ---- the batched gather of per-tensor FP8 experts: ops per unshard independent of the expert count ------------------

class _KernelCounter(TorchDispatchMode):
    """Counts the ops that are kernels on a GPU (not views, not collectives), by name."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func.namespace == "c10d" or func in _NOT_KERNELS
                or func.overloadpacket is torch.ops.aten.set_):
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out


_NOT_KERNELS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.reshape.default)

# the per-tensor FP8 cases of the one case list whose experts gather batched
BATCHED_FP8 = [n for n in GROUPED_CASES if n in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3_pow2")]


def job_batched_gather(rank, world_size, device, experts=(4, 8), out_features=48, in_features=32):
    """Per-tensor FP8 experts (`BATCHED_FP8`), Shard(0) and (world > 1) Shard(1), `experts` experts: the ops of one
    steady-state unshard (the second; rowwise gathered, columnwise derived) by name and its Python calls, every
    expert's gathered parts against the one-device quantization of its full weight (differences listed), and the
    weight-sized FP8 tensors a forward on the gathered weight saves for backward."""
    out = {"ops": {}, "diffs": [], "checked": 0, "calls": {}, "saved_fp8": {}, "copied": {},
           "device": torch.device(device).type}
    for name in BATCHED_FP8:
        factory = GROUPED_CASES[name][0]
        for dim in ((0, 1) if world_size > 1 else (0,)):
            for e_count in experts:
                fully_shard, mp = _fsdp(device, world_size, dim)
                torch.manual_seed(e_count)
                lin = hybridq.GroupedLinear(e_count, in_features, out_features, recipe=_IDENT, name="moe.w1")
                with torch.no_grad():
                    lin.weight.mul_(torch.logspace(-3, 3, e_count).view(e_count, 1, 1))
                    lin.weight[-1, 0, 0] = float("nan") if e_count > 4 else lin.weight[-1, 0, 0]
                lin.to(device)
                full = lin.weight.detach().clone()
                recipe = hybridq.CustomRecipe(lambda role, f=factory: f() if role.tensor_type == "weight" else None,
                                              name=name)
                apply_hybrid_fsdp(lin, recipe, on_incompatible="error")
                fully_shard(lin, mp_policy=mp, reshard_after_forward=False)
                lin.unshard()
                lin.reshard()
                with _KernelCounter() as kc:
                    lin.unshard()
                out["ops"][f"{name} Shard({dim}) E={e_count}"] = kc.ops
                for e, ge in enumerate(lin.weight.unbind(0)):
                    ref_r, ref_c = lin.expert_quantizers[e]["weight"].quantize_parts(full[e].to(torch.bfloat16),
                                                                                    True, True)
                    where = f"{name} expert {e} (Shard({dim}), E={e_count}, ws={world_size})"
                    out["diffs"] += parts_diff(ge.part(ROWWISE), ref_r, f"{where} rowwise")
                    out["diffs"] += parts_diff(ge.part(COLUMNWISE), ref_c, f"{where} columnwise")
                    out["checked"] += 1
                lin.reshard()
                out["calls"][f"{name} Shard({dim}) E={e_count}"] = _python_calls(lin.unshard)  # (steady state)
                case = f"{name} Shard({dim}) E={e_count}"
                out["saved_fp8"][case], out["copied"][case] = _saved_weight_copies(lin, factory, device)
                lin.reshard()
    return out


def _python_calls(fn) -> int:
    """Python function calls made by `fn()` (the host work of, e.g., one unshard)."""
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event == "call"
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


class _GemmOperands:
    """The jagged path's kernels (the real ones, delegated to) recording, for each grouped GEMM of forward (fprop) and
    backward (dgrad), whether its expert operand `b` and their scales `b_scale_inv` are read where the unshard put
    them: views of the gathered weight's stacked buffers (`GroupedWeightState.slabs`), not copies."""

    def __init__(self, kernels, state):
        self._k, self._state, self.reads = kernels, state, []

    def __getattr__(self, name):
        return getattr(self._k, name)

    def mm(self, a, a_scale_inv, b, b_group_stride, b_row_stride, n, b_scale_inv, *args, **kwargs):
        slabs = {slab.untyped_storage().data_ptr() for slab, _ in self._state.slabs}
        self.reads.append({"data": b.untyped_storage().data_ptr() in slabs,
                           "scale_inv": b_scale_inv.untyped_storage().data_ptr() in slabs})
        return self._k.mm(a, a_scale_inv, b, b_group_stride, b_row_stride, n, b_scale_inv, *args, **kwargs)


def _saved_weight_copies(lin, factory, device) -> tuple[list, list]:
    """The FP8 tensors as large as the experts' weight that a forward of `lin` (its weight unsharded; every tensor in
    the weight's per-tensor FP8 format: the jagged path) saves for backward (dtype, shape), then runs the backward
    (dgrad reads the gathered columnwise form); and, per grouped GEMM of the weight (fprop, dgrad), whether its
    experts' data and scales were read in place (`_GemmOperands`; None: the jagged path did not run)."""
    from hybridq.nn import grouped as grouped_mod

    lin.recipe = hybridq.CustomRecipe(lambda role: factory(), name="all_fp8")
    e, n, k = lin.weight.shape
    splits = [3 * i + 1 for i in range(e)]
    x = torch.randn(sum(splits), k, device=device, dtype=torch.bfloat16, requires_grad=True)
    saved, recorders = [], []

    def pack(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and t.numel() >= e * n * k:
            saved.append((str(t.dtype), list(t.shape)))
        return t

    real = grouped_mod.jagged_fp8_kernels

    def recording(*args, **kwargs):
        kernels = real(*args, **kwargs)
        if kernels is None:  # (no jagged kernels for these shapes here: the per-expert path runs)
            return None
        recorders.append(_GemmOperands(kernels, lin.weight._hq))
        return recorders[-1]
    grouped_mod.jagged_fp8_kernels = recording
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = lin(x, splits)
        y.float().sum().backward()
    finally:
        grouped_mod.jagged_fp8_kernels = real
    return saved, ([r for rec in recorders for r in rec.reads] if recorders else None)


class _KeptPayloadModel(nn.Module):
    """A Linear and a GroupedLinear (per-tensor FP8 everywhere: the jagged path reads the gathered experts in place),
    each its own FSDP2 unit that reshards after forward, so backward unshards them again."""

    def __init__(self, experts: int, k: int = 32, n: int = 48):
        super().__init__()
        self.lin = nn.Linear(k, k, bias=False)
        self.experts = hybridq.GroupedLinear(experts, k, n, recipe=_IDENT, name="moe.w1")

    def forward(self, x, splits):
        return self.experts(self.lin(x), splits)


def _kept_payload_run(rank, world_size, device, *, reuse: bool, scale_between: float | None, experts: int = 4):
    """One forward + backward of `_KeptPayloadModel` under FSDP2 (Shard(0)); with `scale_between`, every weight is
    multiplied in place by it between the forward and the backward (the backward unshard must gather the new values).
    Returns (input gradient, each weight's gathered counters)."""
    fully_shard, mp = _fsdp(device, world_size, 0)
    torch.manual_seed(0)
    model = _KeptPayloadModel(experts).to(device)
    with torch.no_grad():
        model.experts.weight.mul_(torch.logspace(-2, 2, experts, device=device).view(experts, 1, 1))
    apply_hybrid_fsdp(model, "fp8_tensorwise", reuse_forward_payload=reuse)
    fully_shard(model.lin, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model.experts, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp)
    splits = [3 * e + 5 for e in range(experts)]
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(sum(splits), 32, generator=g).to(device).requires_grad_(True)
    y = model(x, splits)
    if scale_between is not None:
        with torch.no_grad():
            for p in (model.lin.weight, model.experts.weight):
                p.mul_(scale_between)
    y.float().square().sum().backward()
    counters = {name: dict(local_tensor_state(p).counters)
                for name, p in (("lin", model.lin.weight), ("experts", model.experts.weight))}
    return x.grad.detach().cpu(), counters


def local_tensor_state(p):
    from hybridq.torch_private import local_tensor

    return local_tensor(p)._hq


def job_kept_payload(rank, world_size, device):
    """A forward unshard's payload kept for the backward unshard (reuse_forward_payload, the default) of a Linear and
    a grouped weight: the input gradient equals the one of a run that quantizes again in backward, with the weights
    unchanged and with the weights doubled in place between forward and backward (the kept payload is then stale: it
    must not be used); and how often each weight reused the payload or gathered in backward."""
    out = {"diffs": [], "counters": {}}
    grads = []
    for scale in (None, 2.0):
        dx_kept, counters = _kept_payload_run(rank, world_size, device, reuse=True, scale_between=scale)
        dx_again, _ = _kept_payload_run(rank, world_size, device, reuse=False, scale_between=scale)
        diff = tensor_diff(dx_kept, dx_again, f"input gradient, weights x{scale} between forward and backward, "
                                              f"payload kept vs quantized again")
        out["diffs"] += [diff] if diff else []
        out["counters"][str(scale)] = counters
        grads.append(dx_again)
    out["update_changes_gradient"] = not torch.equal(*grads)  # (else the stale case would not be seen)
    return out
