"""Jobs of test_nonfinite_reductions.py: a NaN or an inf held by a rank other than 0 reaches every distributed
statistic reduction, and the distributed result must be the single-device one, non-finite included.

Each job returns {case key: [what differed]} (JSON-serialisable); the test naming the site asserts on its keys.
The non-finite value is put in the first row of rank 1's rows (a block or tile cut by the rank boundary where the
format has one, so cut-block statistics are exercised as well as the per-tensor ones)."""

from __future__ import annotations

import copy
import math
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import hybridq
from hybridq.distributed import apply_hybrid_fsdp, precompute_scales
from hybridq.formats._reduce import amax_all_reduce_
from hybridq.formats import COLUMNWISE, ROWWISE
from hybridq.formats._sharding import RowShard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import parts_diff, tensor_diff  # noqa: E402
from _format_cases import FORMATS, hybrid  # noqa: E402

VALUES = {"nan": float("nan"), "inf": float("inf")}
TP_VALUES = {**VALUES, "finite": 1.0}  # (tensor parallelism: also the finite case, which a misplaced scale breaks)
K = 256  # columns: every format's K blocks (up to 128x128 tiles) split evenly over 2 ranks


def _all_cases() -> dict:
    cases = {n: f for n, f in FORMATS.items() if not n.startswith("identity") and n != "fp8_e4m3_delayed"}
    cases["hyb_mxfp8_nvfp4"] = hybrid("mxfp8_e4m3", "nvfp4")
    cases["hyb_fp8_nvfp4_16x16"] = hybrid("fp8_e4m3", "nvfp4_16x16")
    # hybrids with per-axis statistics (a row's / a column's amax) on one side and on both sides
    axis = [n for n, f in FORMATS.items() if f().stats_per_axis]
    cases["hyb_axis_mxfp8"] = hybrid(axis[0], "mxfp8_e4m3")
    cases["hyb_axis_axis"] = hybrid(axis[0], axis[-1])
    return cases


def stat_formats() -> list[str]:
    """The deterministic formats (and two hybrids) whose quantization of a tensor split over ranks needs statistics
    reduced across the ranks: per-tensor / global amaxes, or the amaxes of blocks a boundary cuts."""
    cut = RowShard(300, 150, 150, (150,))
    return [n for n, f in _all_cases().items()
            if f().is_deterministic and f().shard_stats(torch.ones(150, K), cut) is not None]


def tensor_wide_formats() -> list[str]:
    """Those of them with a statistic spanning the whole tensor (per-tensor FP8 amax, NVFP4 global amax) or a whole
    axis of it (rowwise FP8: a row's amax spans its columns, a column's its rows)."""
    def wide(q) -> bool:
        return q.stats_per_axis or q.global_stats(torch.ones(16, K), True, True) is not None
    return [n for n in stat_formats() if wide(_all_cases()[n]())]


def rows_for(name: str) -> int:
    """M of a [M, K] case, chosen so the 2-rank boundary (M / 2) cuts the format's row blocks: 300 (boundary 150 in
    a 128-row block), MXFP8 160 (80: a 32-row block), NVFP4 80 (40: a 16-row block; M % 16 == 0 is its rule), NVFP4
    with the Hadamard transform 64 (its 16-row groups must not be cut)."""
    if "rht" in name:
        return 64
    return 80 if "nvfp4" in name else 160 if "mxfp8" in name else 300


def _recipe(name: str, tensor_type: str) -> hybridq.CustomRecipe:
    """Only `tensor_type` ("weight" / "input") quantized, in the case's format; the rest in high precision."""
    factory = _all_cases()[name]
    return hybridq.CustomRecipe(lambda role: factory() if role.tensor_type == tensor_type else None,
                                name=f"{name}-{tensor_type}")


def _poisoned(m: int, k: int, row: int, col: int, value: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)  # scales differ by block
    x[row, col] = value
    return x


def _nonfinite_diff(got: torch.Tensor, want: torch.Tensor, what: str) -> list[str]:
    """The non-finite patterns (NaN, +inf, -inf positions) equal."""
    out = []
    for kind, f in (("NaN", torch.isnan), ("+inf", lambda t: t == math.inf), ("-inf", lambda t: t == -math.inf)):
        g, w = f(got.float()), f(want.float())
        if not torch.equal(g, w):
            out.append(f"{what}: {kind} at {int(g.sum())} elements, one device has {int(w.sum())}")
    return out


def _parts(got, want, what: str) -> list[str]:
    """Quantized parts bitwise equal, NaN positions equal (NaN payloads are not part of the contract)."""
    return (parts_diff(got.part(ROWWISE) if got.has(ROWWISE) else None,
                       want.part(ROWWISE) if want.has(ROWWISE) else None, f"{what} rowwise", nan_payload=True)
            + parts_diff(got.part(COLUMNWISE) if got.has(COLUMNWISE) else None,
                         want.part(COLUMNWISE) if want.has(COLUMNWISE) else None, f"{what} columnwise",
                         nan_payload=True))


# ---- the reduction helper itself -------------------------------------------------------------------------------

def job_reduce_helper(rank, world_size, device) -> dict:
    """amax_all_reduce_ against torch.amax of the magnitudes of every rank's values on one device: NaN (either
    sign, a payload) on a non-zero rank, +-inf, -0.0, subnormals, negative values; every float dtype; in place on a
    view and on a non-contiguous tensor; integers refused."""
    nan, inf = float("nan"), float("inf")
    tiny = torch.finfo(torch.float32).tiny / 4  # a subnormal
    neg_nan = torch.tensor([nan]).neg().item()  # sign bit set (what x86 produces for 0/0)
    rows = {  # every rank's value
        "nan on rank 1": [1.0, nan], "nan on rank 0": [nan, 1.0], "negative nan on rank 1": [2.0, neg_nan],
        "nan and inf": [inf, nan], "+inf on rank 1": [3.0, inf], "-inf on rank 1": [-3.0, -inf],
        "-0.0 and +0.0": [-0.0, 0.0], "-0.0 only": [-0.0, -0.0], "subnormals": [tiny, 2 * tiny],
        "negatives": [-5.0, -7.0], "zeros": [0.0, 0.0],
    }
    table = torch.tensor([v[:world_size] for v in rows.values()], dtype=torch.float64)
    out = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        values = table.to(dtype)
        want = values.abs().amax(dim=1)
        for layout in ("contiguous", "strided"):
            mine = values[:, rank].contiguous().to(device)
            if layout == "strided":  # every other element of a longer tensor
                mine = torch.stack([mine, torch.full_like(mine, 9.0)], dim=1)[:, 0]
            got = amax_all_reduce_(mine).cpu()
            diffs = [d for i, name in enumerate(rows)
                     if (d := tensor_diff(got[i:i + 1], want[i:i + 1], f"{name} ({dtype}, {layout})",
                                          nan_payload=True)) is not None]
            out[f"float/{dtype}/{layout}"] = diffs + ([] if got.dtype == dtype else [f"dtype became {got.dtype}"])
    # in place on a view (the delayed-scaling history slot), a NaN's payload kept
    payload = torch.tensor(nan).view(torch.int32).add(5).item()
    hist = torch.zeros(4, device=device)
    hist[0] = torch.tensor(payload, dtype=torch.int32).view(torch.float32) if rank == 1 else 1.0
    amax_all_reduce_(hist[:1])
    bits = hist[:1].cpu().view(torch.int32).item()
    out["view/payload"] = [] if bits == payload else [f"history slot bits {bits:#x}, rank 1 held {payload:#x}"]
    try:
        amax_all_reduce_(torch.ones(2, dtype=torch.int64, device=device))
        out["int64"] = ["an integer tensor was reduced"]
    except TypeError as e:
        out["int64"] = [] if "floating-point" in str(e) else [f"message {e}"]
    return out


# ---- FSDP2: gathered weights, precompute_scales, forward / backward -----------------------------------------------

def _fsdp_layer(name: str, value: float, device, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = rows_for(name)
    full = _poisoned(m, K, m // world_size, 5, value)
    lin = nn.Linear(K, m, bias=False)
    with torch.no_grad():
        lin.weight.copy_(full)
    layers = nn.ModuleList([lin]).to(device)
    apply_hybrid_fsdp(layers, _recipe(name, "weight"), on_incompatible="error")
    fully_shard(layers[0], mesh=init_device_mesh(device.type, (world_size,)), reshard_after_forward=False)
    return layers[0], full.to(device)


def _gathered_diffs(lin, full, what: str) -> list[str]:
    from hybridq.distributed import GatheredWeight

    lin.unshard()
    try:
        gw = lin.weight
        if not isinstance(gw, GatheredWeight):
            return [f"{what}: the unsharded weight is a {type(gw).__name__}"]
        want = lin.weight_quantizer.quantize(full, rowwise=True, columnwise=True)
        diffs = []
        for d in (ROWWISE, COLUMNWISE):
            diffs += parts_diff(gw.part(d), want.part(d), f"{what} {d}", nan_payload=True)
        return diffs
    finally:
        lin.reshard()


def _counter(lin, name: str) -> int:
    return dict(lin.weight._local_tensor._hq.counters).get(name, 0)


def job_fsdp(rank, world_size, device, formats: list[str]) -> dict:
    """Per format and value: the FSDP2-gathered weight (statistics all-reduced at the gather) and the gather after
    precompute_scales (one fused reduction) against the one-device quantization of the full weight; then the
    issue's repro, forward and backward: outputs and input gradients non-finite exactly where one device has them."""
    out = {}
    for name in formats:
        for vname, value in VALUES.items():
            lin, full = _fsdp_layer(name, value, device, world_size)
            key = f"{name}/{vname}"
            out[f"gather/{key}"] = _gathered_diffs(lin, full, f"{name} gathered, {vname} on rank 1")
            if not _counter(lin, "stats_allreduce"):
                out[f"gather/{key}"].append("no statistics all-reduce ran at the gather")
            precompute_scales(nn.ModuleList([lin]))
            out[f"precompute/{key}"] = _gathered_diffs(lin, full, f"{name} gathered after precompute_scales")
            if not _counter(lin, "stats_precomputed"):
                out[f"precompute/{key}"].append("the gather did not use the precomputed statistics")
            ref = hybridq.Linear(K, full.shape[0], bias=False, recipe=_recipe(name, "weight"), name="ref").to(device)
            with torch.no_grad():
                ref.weight.copy_(full)
            x = torch.randn(8, K, generator=torch.Generator().manual_seed(3)).to(device)
            xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
            yr, yd = ref(xr), lin(xd)
            yr.sum().backward()
            yd.sum().backward()
            out[f"forward/{key}"] = (_nonfinite_diff(yd.detach(), yr.detach(), f"{name} output ({vname} on rank 1)")
                                     + _nonfinite_diff(xd.grad, xr.grad, f"{name} input grad ({vname} on rank 1)"))
    return out


# ---- tensor and sequence parallelism ---------------------------------------------------------------------------

class OperandRecorder:
    """The dequantized operands of every GEMM of the hybridq Linears (fprop, dgrad, wgrad), by GEMM name."""

    def __init__(self):
        import hybridq.nn.linear_function as hq_linear

        self.module, self.seen = hq_linear, {}

    def __enter__(self):
        orig = self.orig = self.module.gemm

        def gemm(a, b, dtype, what):
            self.seen.setdefault(what, (a.dequantize_2d(), b.dequantize_2d()))
            return orig(a, b, dtype, what)
        self.module.gemm = gemm
        return self

    def __exit__(self, *exc):
        self.module.gemm = self.orig


def piece_of(whole: torch.Tensor, piece: torch.Tensor, index: int) -> torch.Tensor:
    """The `index`-th equal chunk of `whole` along the one dim where its shape differs from `piece`'s."""
    dims = [i for i, (a, b) in enumerate(zip(whole.shape, piece.shape)) if a != b]
    if not dims:
        return whole
    n = piece.shape[dims[0]]
    return whole.narrow(dims[0], index * n, n)


def _operand_diffs(got: dict, want: dict, operands: list[tuple[str, int]], index: int, what: str) -> list[str]:
    """Each (GEMM, operand) recorded by the parallel run against its piece of the single-device one (bitwise,
    NaN positions equal)."""
    out = []
    for gemm_name, i in operands:
        if gemm_name not in got or gemm_name not in want:
            out.append(f"{what}: {gemm_name} not run ({sorted(got)} / {sorted(want)})")
            continue
        g, w = got[gemm_name][i], want[gemm_name][i]
        d = tensor_diff(g, piece_of(w, g, index), f"{what} {gemm_name} operand {'ab'[i]}", nan_payload=True)
        if d is not None:
            out.append(d)
    return out


def _tp_case(name, value, device, mesh, rank, world_size, site):
    """One hybridq Linear, single-device and parallel, the non-finite value in rank 1's piece of the quantized
    operand; returns what differed in the GEMM operands, the output and the input gradient."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.distributed import ColwiseParallel, RowwiseParallel

    m = rows_for(name)
    torch.manual_seed(0)
    if site == "tp_weight_rows":  # column-parallel: rank 1 holds weight rows [128, 256) (whole blocks and tiles)
        lin, tensor, style, x = nn.Linear(K, 256, bias=False), "weight", ColwiseParallel(), torch.randn(8, K)
        w = _poisoned(256, K, 256 // world_size, 5, value)
        operands = [("fprop of 0", 1), ("dgrad of 0", 1)]
    elif site == "tp_weight_columns":  # row-parallel: rank 1 holds weight columns [K/2, K)
        lin, tensor, style, x = nn.Linear(K, m, bias=False), "weight", RowwiseParallel(), torch.randn(8, K)
        w = _poisoned(m, K, 3, K // world_size + 5, value)
        operands = [("fprop of 0", 1), ("dgrad of 0", 1)]
    elif site == "tp_input_columns":  # row-parallel: rank 1 holds the input's columns [K/2, K)
        lin, tensor, style, w = nn.Linear(K, 64, bias=False), "input", RowwiseParallel(), None
        x = _poisoned(m, K, 3, K // world_size + 5, value, seed=1)
        operands = [("fprop of 0", 0), ("wgrad of 0", 1)]
    else:  # "sp_input": sequence-parallel input [S, 1, K] sharded along S, rank 1 holds tokens [m/2, m)
        lin, tensor, style, w = nn.Linear(K, 64, bias=False), "input", ColwiseParallel(input_layouts=Shard(0)), None
        x = _poisoned(m, K, m // world_size, 5, value, seed=1).unsqueeze(1)
        operands = [("fprop of 0", 0), ("wgrad of 0", 1)]
    if w is not None:
        with torch.no_grad():
            lin.weight.copy_(w)
    recipe = _recipe(name, tensor)
    ref = nn.Sequential(lin).to(device)
    par = copy.deepcopy(ref)
    hybridq.convert_linears(ref, recipe)
    hybridq.convert_linears(par, recipe)
    parallelize_module(par, mesh, {"0": style})
    x = x.to(device)
    xr = x.clone().requires_grad_()
    with OperandRecorder() as rec_r:
        yr = ref(xr)
        yr.float().sum().backward()
    if site in ("tp_weight_columns", "tp_input_columns"):  # a row-parallel layer takes its K columns
        xl = x.chunk(world_size, dim=-1)[rank]
    elif site == "sp_input":
        xl = x.chunk(world_size, dim=0)[rank]
    else:
        xl = x
    xl = xl.clone().requires_grad_()
    with OperandRecorder() as rec_p:
        yl = par(xl)
        if hasattr(yl, "to_local"):
            yl = yl.to_local()
        yl.float().sum().backward()
    what = f"{name} {site} ({value} on rank 1)"
    diffs = _operand_diffs(rec_p.seen, rec_r.seen, operands, rank, what)
    diffs += _nonfinite_diff(yl.detach(), piece_of(yr.detach(), yl, rank), f"{what} output")
    dx = xl.grad
    if site == "tp_weight_rows":  # a replicated input's gradient: every rank holds a partial sum
        dx = dx.clone()
        dist.all_reduce(dx)
    diffs += _nonfinite_diff(dx, piece_of(xr.grad, dx, rank), f"{what} input grad")
    return diffs


TP_SITES = ("tp_weight_rows", "tp_weight_columns", "tp_input_columns", "sp_input")


def job_tensor_parallel(rank, world_size, device, formats: list[str]) -> dict:
    """Per format, value and site: column-parallel weight rows, row-parallel weight and input columns, the
    sequence-parallel input all-gather."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    return {f"{site}/{name}/{vname}": _tp_case(name, value, device, mesh, rank, world_size, site)
            for name in formats for vname, value in TP_VALUES.items() for site in TP_SITES}


# ---- master weights: quantize_master_weights and ZeroAdamW ----------------------------------------------------

MASTER_SHAPE = (160, 288)


def _quantized_layer(name: str, dtype=torch.bfloat16):
    m, k = MASTER_SHAPE
    lin = hybridq.Linear(k, m, bias=False, recipe=_recipe(name, "weight"), dtype=dtype, name="w")
    hybridq.quantize_parameters(lin)
    return lin


def _weight_diffs(p, full: torch.Tensor, what: str) -> list[str]:
    info = p._hybridq_param
    want = info.quantizer.quantize(full.to(p.dtype), rowwise=True, columnwise=info.columnwise_stored)
    return _parts(p, want, what)


def job_master_weights(rank, world_size, device, formats: list[str]) -> dict:
    """Per format and value: fragments of the fp32 master cut mid-block (rank 1's holding the value) quantized
    with quantize_master_weights, and a ZeroAdamW whose rank-1 master fragment holds it, refreshed into the model;
    the quantized weight against quantizing the whole master on one device."""
    out = {}
    m, k = MASTER_SHAPE
    n = m * k
    cut = 130 * k + 17  # inside a 128-row tile, a 32-row and a 16-row block
    for name in formats:
        for vname, value in VALUES.items():
            master = _poisoned(m, k, 0, 0, 0.0, seed=7).to(device)
            master.view(-1)[cut + 3] = value
            lin = _quantized_layer(name).to(device)
            s, ln = [(0, cut), (cut, n - cut)][rank]
            hybridq.distributed.quantize_master_weights([lin.weight], [master.reshape(-1)[s:s + ln].clone()], [s])
            out[f"master/{name}/{vname}"] = _weight_diffs(lin.weight, master, f"{name} fragments ({vname} on rank 1)")

            model = nn.Sequential(_quantized_layer(name)).to(device)
            opt = hybridq.distributed.ZeroAdamW(model)
            frag = opt.masters[0]
            if rank == 1:
                with torch.no_grad():
                    frag.view(-1)[frag.numel() // 2] = value
            opt.refresh()
            whole = opt.full_masters()["0.weight"].to(device)
            held = torch.isnan(whole) if value != value else torch.isinf(whole)
            diffs = [] if bool(held.any()) else [f"the gathered master holds no {vname}"]
            out[f"zero/{name}/{vname}"] = diffs + _weight_diffs(model[0].weight, whole,
                                                                f"{name} ZeroAdamW ({vname} in rank 1's master)")
    return out


# ---- grouped (mixture-of-experts) weights ----------------------------------------------------------------------

def job_grouped(rank, world_size, device, formats: list[str]) -> dict:
    """Per format, value and FSDP2 placement (Shard(0): experts; Shard(1): rows of every expert): a GroupedLinear
    whose rank-1 piece holds the value, gathered (statistics of all experts reduced together) and gathered after
    precompute_scales, every expert against its one-device quantization."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from hybridq.distributed import GroupedGatheredWeight

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    experts, k = 3, 64  # (a narrow K keeps the 3-expert cases cheap; every format takes it)
    for name in formats:
        m = rows_for(name)
        for vname, value in VALUES.items():
            for dim in (0, 1):
                layer = hybridq.GroupedLinear(experts, k, m, recipe=hybridq.CustomRecipe(lambda r: None), name="g")
                with torch.no_grad():
                    layer.weight.copy_(torch.stack([_poisoned(m, k, 0, 0, 0.0, seed=e) for e in range(experts)]))
                    if dim == 0:  # 3 experts on 2 ranks: rank 1 holds expert 2
                        layer.weight[2, 7, 5] = value
                    else:  # rank 1 holds rows [m/2, m) of every expert
                        layer.weight[1, m // world_size, 5] = value
                full = layer.weight.detach().clone().to(device)
                layers = nn.ModuleList([layer]).to(device)
                apply_hybrid_fsdp(layers, _recipe(name, "weight"), on_incompatible="error")
                place = None if dim == 0 else (lambda p: Shard(1) if p.dim() == 3 else None)
                partial(fully_shard, mesh=mesh, shard_placement_fn=place)(layer, reshard_after_forward=False)
                for how in ("gather", "precompute"):
                    if how == "precompute":
                        precompute_scales(layers)
                    diffs = []
                    layer.unshard()
                    gw = layer.weight
                    if not isinstance(gw, GroupedGatheredWeight):
                        diffs.append(f"the unsharded weight is a {type(gw).__name__}")
                    else:
                        for e, ge in enumerate(gw.unbind(0)):
                            ref_r, ref_c = layer.expert_quantizers[e]["weight"].quantize_parts(full[e], True, True)
                            where = f"{name} expert {e} Shard({dim}) {how} ({vname} on rank 1)"
                            diffs += parts_diff(ge.part(ROWWISE), ref_r, f"{where} rowwise", nan_payload=True)
                            diffs += parts_diff(ge.part(COLUMNWISE), ref_c, f"{where} columnwise", nan_payload=True)
                    layer.reshard()
                    out[f"grouped_{how}/{name}/{vname}/Shard({dim})"] = diffs
    return out


# ---- delayed scaling: the amax history --------------------------------------------------------------------------

def job_delayed(rank, world_size, device) -> dict:
    """Delayed-scaling FP8 with amax_reduction_group: rank 1's cast sees the value; after the update (the
    quantizer's own and the batched update_delayed_scaling) the history and the scale are those of one device that
    cast all the ranks' tensors at once, and so is the next cast."""
    from hybridq import Float8Quantizer

    out = {}
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    for vname, value in VALUES.items():
        xs_v = [x.clone() for x in xs]
        xs_v[1][4, 4] = value
        nxt = torch.randn(32, 64, generator=torch.Generator().manual_seed(99)).to(device)
        for how in ("update", "update_delayed_scaling"):
            ref = Float8Quantizer(scaling="delayed", amax_history_len=4)
            q = Float8Quantizer(scaling="delayed", amax_history_len=4, amax_reduction_group=dist.group.WORLD)
            ref.quantize(torch.cat(xs_v).to(device))  # one device casts what the ranks cast
            q.quantize(xs_v[rank].to(device))
            for qq in (ref, q):
                qq.update() if how == "update" else hybridq.update_delayed_scaling([qq])
            what = f"fp8 delayed {how} ({vname} on rank 1)"
            diffs = [d for d in (tensor_diff(q.amax_history.cpu(), ref.amax_history.cpu(), f"{what} amax_history",
                                             nan_payload=True),
                                 tensor_diff(q.scale.cpu(), ref.scale.cpu(), f"{what} scale", nan_payload=True))
                     if d is not None]
            diffs += _parts(q.quantize(nxt), ref.quantize(nxt), f"{what} next cast")
            out[f"delayed_{how}/{vname}"] = diffs
    return out


def job_all(rank, world_size, device, formats: list[str], tensor_wide: list[str]) -> dict:
    """Every 2-rank site in one spawn: `formats` where statistics of cut blocks are reduced too (FSDP2 gathers,
    precompute_scales, tensor and sequence parallelism), `tensor_wide` elsewhere (master weights, grouped experts)."""
    out = {}
    for job, names in ((job_fsdp, formats), (job_tensor_parallel, formats), (job_master_weights, tensor_wide),
                       (job_grouped, tensor_wide)):
        out.update(job(rank, world_size, device, formats=names))
    out.update(job_delayed(rank, world_size, device))
    out.update({f"helper/{k}": v for k, v in job_reduce_helper(rank, world_size, device).items()})
    return out


# ---- FSDP2 x tensor parallelism (dp2 x tp2) ---------------------------------------------------------------------

# Refused at parallelize_module under FSDP2 x TP (a piece cut along both dims), with what the error must say.
REFUSED_UNDER_FSDP_TP = {"hyb_axis_mxfp8": "per-axis statistics (a row's or a column's amax) on one side only"}


def _refusal_diffs(par, mesh, name: str) -> list[str]:
    """parallelize_module refuses the format before anything changes, naming the layer, the format and the rule."""
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.distributed import ColwiseParallel

    before = par[0].weight
    try:
        parallelize_module(par, mesh["tp"], {"0": ColwiseParallel()})
    except NotImplementedError as e:
        msg, q = str(e), par[0].weight_quantizer
        diffs = [f"{name}: the refusal does not say {w!r}: {msg}"
                 for w in (par[0].name, q.describe(), REFUSED_UNDER_FSDP_TP[name]) if w not in msg]
        if par[0].weight is not before or getattr(par[0], "_tensor_parallel", None) is not None:
            diffs.append(f"{name}: the layer changed before the refusal")
        return diffs
    return [f"{name}: FSDP2 x TP was not refused"]


def job_fsdp_tp(rank, world_size, device, formats: list[str]) -> dict:
    """A column-parallel and a row-parallel Linear under a dp2 x tp2 mesh (apply_hybrid_fsdp, parallelize_module
    over "tp", fully_shard over "dp"), the value in a piece of both weights held by rank 3 (dp 1, tp 1): every
    rank's fprop and dgrad weight operands (a TP piece gathered over dp, per-tensor statistics reduced over dp and
    tp) against its piece of the single-device model's, and the outputs' non-finite pattern."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.distributed import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh["tp"].get_local_rank()
    d, h = K, 2 * K  # w0 [512, 256]: rank 3 holds rows [384, 512); w1 [256, 512]: columns [256, 512), rows [128, 256)
    out = {}
    for name in formats:
        for vname, value in VALUES.items():
            ref = nn.Sequential(nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False))
            with torch.no_grad():
                ref[0].weight.copy_(_poisoned(h, d, 384 + 1, 5, value, seed=2))
                ref[1].weight.copy_(_poisoned(d, h, 128 + 1, 256 + 5, value, seed=3))
            ref.to(device)
            par = copy.deepcopy(ref)
            recipe = _recipe(name, "weight")
            hybridq.convert_linears(ref, recipe)
            apply_hybrid_fsdp(par, recipe, on_incompatible="error")
            if name in REFUSED_UNDER_FSDP_TP:
                out[f"fsdp_tp/{name}/{vname}"] = _refusal_diffs(par, mesh, name)
                continue
            parallelize_module(par, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
            fully_shard(par, mesh=mesh["dp"])
            x = torch.randn(8, d, generator=torch.Generator().manual_seed(4)).to(device)
            with OperandRecorder() as rec_r:
                yr = ref(x.clone().requires_grad_())
                yr.float().sum().backward()
            with OperandRecorder() as rec_p:
                yp = par(x.clone().requires_grad_())
                yp = yp.full_tensor() if hasattr(yp, "full_tensor") else yp
                yp.float().sum().backward()
            what = f"{name} dp2 x tp2 ({vname} on rank 3)"
            diffs = _operand_diffs(rec_p.seen, rec_r.seen, [(f"{g} of {n}", 1) for g in ("fprop", "dgrad")
                                                            for n in ("0", "1")], tp_rank, what)
            out[f"fsdp_tp/{name}/{vname}"] = diffs + _nonfinite_diff(yp.detach(), yr.detach(), f"{what} output")
    return out


def job_loss_window(rank, world_size, device) -> dict:
    """train.py's loss read (launch/trainer.StepWindow: the window's losses in one SUM all-reduce): a loss that is NaN
    or inf on the last rank only is NaN / inf on every rank after the read; finite steps are the ranks' mean."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "launch"))
    import trainer
    w = trainer.StepWindow(trainer.Env(rank, world_size, device, "gloo", None))
    last = rank == world_size - 1
    per_step = {1: float(rank), 2: float("nan") if last else 1.0, 3: float("inf") if last else 1.0,
                4: float("-inf") if last else float("inf")}
    rows = []
    for n, v in per_step.items():
        rows += w.step_issued(n, torch.tensor(v, device=device), lr=0.0, sent={}, close=True, read_now=n == 4)
    return {"read": {str(r[0]): repr(r[1]) for r in rows}}
