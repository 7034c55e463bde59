"""Jobs of test_grad_reduce.py (spawned; not a test module): the low-precision gradient reduce-scatter
(`apply_hybrid_fsdp(..., grad_reduce=...)`) called directly and inside FSDP2 training."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import hybridq
from hybridq.distributed.fsdp_adapter import custom_reduce_scatters
from hybridq.distributed.grad_reduce import (QuantizedReduceScatter, Wire, error_bound, grad_reduce_bytes,
                                             reduce_reference, wire_bytes_per_row)
from hybridq.formats import MXFP8Quantizer
from hybridq.formats.mxfp8 import BLOCK as MX_BLOCK

import _dcp_jobs
import _jobs
from _models import TinyLM, loss_fn, make_batches, micro_seed

WIRES = ("bf16", "mxfp8")
DIVIDE_FACTOR = 3.0  # not the world size (FSDP2 would pass AVG)


# ---- the wire as its specification says, chunk by chunk, through the format module ---------------------------

def spec_delivered(chunk: torch.Tensor, wire: str) -> torch.Tensor:
    """What the receiver gets of one fp32 chunk: bf16 rounding, or MXFP8 of 32-element blocks of the chunk
    zero-padded to whole blocks, a block holding inf / NaN arriving as NaN."""
    x = chunk.float()
    if wire == "bf16":
        return x.to(torch.bfloat16).float()
    n = x.numel()
    p = -(-n // MX_BLOCK) * MX_BLOCK
    xp = torch.nn.functional.pad(x, (0, p - n)).view(1, p)
    deq = MXFP8Quantizer()(xp).dequantize(torch.float32).view(-1)
    bad = (~torch.isfinite(xp.view(-1, MX_BLOCK))).any(dim=1).repeat_interleave(MX_BLOCK)
    return torch.where(bad, torch.full_like(deq, float("nan")), deq)[:n]


def spec_reduce(inputs: list[torch.Tensor], rank: int, wire: str, op_kind: str, factor: float) -> torch.Tensor:
    """Rank `rank`'s shard: the delivered chunks summed in rank order in fp32, then AVG / PREMUL_SUM / SUM."""
    w = len(inputs)
    n = inputs[0].numel() // w
    acc = None
    for x in inputs:
        d = spec_delivered(x.view(w, n)[rank], wire)
        acc = d.clone() if acc is None else acc + d
    return {"avg": lambda a: a / w, "premul": lambda a: a * factor, "sum": lambda a: a}[op_kind](acc)


def premul_sum(factor: float):
    """PREMUL_SUM(factor) as this torch's FSDP2 builds it: `ReduceOp.PREMUL_SUM(f)` on torch 2.13; on 2.11
    `ReduceOp.PREMUL_SUM` is not callable and FSDP2 calls `_make_nccl_premul_sum(f)` (an op without `.factor`)."""
    if callable(dist.ReduceOp.PREMUL_SUM):
        return dist.ReduceOp.PREMUL_SUM(factor)
    return dist._make_nccl_premul_sum(factor)


def _op(kind: str, factor: float):
    return {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM,
            "premul": premul_sum(factor) if kind == "premul" else None}[kind]


def _inputs(world_size: int, n: int, seed: int) -> list[torch.Tensor]:
    """Every rank's flat input (world_size chunks of n): magnitudes spread over 2^-30..2^30 per block, a zero
    block, fp32 subnormals, one chunk-straddling partial block (n % 32 != 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world_size):
        x = torch.randn(world_size * n, generator=g)
        x *= torch.exp2(torch.randint(-30, 31, (world_size * n // MX_BLOCK + 1,), generator=g).float()
                        ).repeat_interleave(MX_BLOCK)[:world_size * n]
        x[:MX_BLOCK] = 0.0
        x[MX_BLOCK:MX_BLOCK + 8] = torch.randn(8, generator=g) * 2.0 ** -140
        out.append(x)
    return out


def _fp32_reduce(x: torch.Tensor, op, group=None, factor: float | None = None) -> torch.Tensor:
    """FSDP2's fp32 reduce-scatter result (gloo has no PREMUL_SUM: sum, then `factor`, the one the op was built
    with: torch 2.11's op does not tell it)."""
    w = dist.get_world_size(group)
    out = torch.empty(x.numel() // w)
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        dist.reduce_scatter_tensor(out, x.clone(), op=dist.ReduceOp.SUM, group=group)
        return out * factor
    dist.reduce_scatter_tensor(out, x.clone(), op=op, group=group)
    return out


def job_comm(rank, world_size, device, n: int = 200):
    """The comm called as FSDP2 calls it, for each wire and reduce op: bitwise the specification on every rank
    (a replica of all inputs agrees), deterministic, within the stated bound of the fp32 reduce-scatter,
    bytes counted; non-finite inputs stay non-finite."""
    res = {"mismatch": [], "nondeterministic": [], "bound": [], "replica": [], "bytes": {}, "max_err": {},
           "nonfinite": []}
    group = dist.group.WORLD
    inputs = _inputs(world_size, n, seed=7)
    mine = inputs[rank]
    for wire in WIRES:
        for kind, factor in (("avg", 0.0), ("sum", 0.0), ("premul", 1.0 / 3.0)):
            op = _op(kind, factor)
            comm = QuantizedReduceScatter(Wire(wire), "direct")
            buf = comm.allocate((world_size * n,), dtype=torch.float32, device=device)
            buf.copy_(mine)
            out = torch.full((n,), float("nan"))
            comm(out, buf, group, op)
            again = torch.full((n,), float("nan"))
            comm(again, buf, group, op)
            where = f"{wire} {kind} rank {rank}"
            want = spec_reduce(inputs, rank, wire, kind, factor)
            if not torch.equal(out, want):
                res["mismatch"].append(f"{where}: max |diff| {(out - want).abs().max().item()!r}")
            if not torch.equal(out.view(torch.int32), again.view(torch.int32)):
                res["nondeterministic"].append(where)
            # a replica holding every rank's input computes every rank's shard: gather all outputs, compare
            every = [torch.empty(n) for _ in range(world_size)]
            dist.all_gather(every, out)
            rep = reduce_reference(inputs, Wire(wire), op)
            for r in range(world_size):
                if not torch.equal(every[r], rep[r]):
                    res["replica"].append(f"{where}: shard of rank {r} differs from the replica's")
            f32 = _fp32_reduce(buf, op, factor=factor)
            err = (out.double() - f32.double()).abs()
            bound = error_bound(inputs, f32, rank, Wire(wire), op)
            if not bool((err <= bound).all()):
                i = int((err - bound).argmax())
                res["bound"].append(f"{where}: element {i} error {err[i].item()!r} > bound {bound[i].item()!r}")
            res["max_err"][f"{wire} {kind}"] = [err.max().item(), (err / f32.double().abs().clamp_min(1e-30)).max().item(),
                                                (err / bound.clamp_min(1e-300)).max().item()]
            res["bytes"][f"{wire} {kind}"] = [comm.bytes_sent, comm.fp32_bytes, comm.calls,
                                              2 * (world_size - 1) * wire_bytes_per_row(n, Wire(wire))]
        # non-finite: rank 0 holds +inf, rank 1 NaN, the last rank -inf, each in a different block of chunk 0
        x = mine.clone()
        spots = [(0, 0, float("inf")), (1, 40, float("nan")), (world_size - 1, 70, float("-inf"))]
        for r, i, v in spots:
            if r == rank:
                x[i] = v
        out = torch.empty(n)
        QuantizedReduceScatter(Wire(wire), "nonfinite")(out, x, group, dist.ReduceOp.AVG)
        if rank == 0:
            for r, i, v in spots:
                if torch.isfinite(out[i]):
                    res["nonfinite"].append(f"{wire}: rank {r}'s {v} at element {i} arrived finite ({out[i].item()!r})")
            if wire == "bf16":
                if not (out[0] == float("inf") and torch.isnan(out[40]) and out[70] == float("-inf")):
                    res["nonfinite"].append(f"bf16: non-finite values changed: {out[[0, 40, 70]].tolist()}")
                if not bool(torch.isfinite(out[[i for i in range(n) if i not in (0, 40, 70)]]).all()):
                    res["nonfinite"].append("bf16: a finite element became non-finite")
            else:  # blocks 0, 1, 2 (elements 0-95) arrive NaN; the others stay finite
                nan = torch.isnan(out)
                if not (bool(nan[:96].all()) and bool(torch.isfinite(out[96:]).all())):
                    res["nonfinite"].append(f"mxfp8: NaN elements {nan.nonzero().view(-1).tolist()}, expected 0-95")
    return res


# ---- FSDP2 training -------------------------------------------------------------------------------------------

class CheckedComm:
    """Wraps the installed comm inside FSDP2: at every call, gathers all ranks' inputs, checks the output bitwise
    against the replica (`reduce_reference`) and within `error_bound` of the fp32 reduce-scatter (FSDP2's
    default, run on a copy), and records the reduce ops FSDP2 passed."""

    def __init__(self, inner: QuantizedReduceScatter, log: dict, divide_factor: float | None = None):
        self.inner, self.log = inner, log
        self.premul = None if divide_factor is None else 1.0 / divide_factor  # (FSDP2's PREMUL_SUM factor)

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        w = group.size()
        rank = dist.get_rank(group)
        every = torch.empty(w * input_tensor.numel(), dtype=input_tensor.dtype)
        dist.all_gather_into_tensor(every, input_tensor.contiguous(), group=group)
        inputs = list(every.view(w, -1))
        f32 = _fp32_reduce(input_tensor.float(), op, group, self.premul)
        self.inner(output_tensor, input_tensor, group, op, async_op)
        name = f"{self.inner.name} call {self.inner.calls}"
        if not torch.equal(output_tensor.float(), reduce_reference(inputs, self.inner.wire, op)[rank]):
            self.log["replica"].append(name)
        err = (output_tensor.double() - f32.double()).abs()
        bound = error_bound(inputs, f32, rank, self.inner.wire, op)
        if not bool((err <= bound).all()):
            self.log["bound"].append(f"{name}: max error / bound {(err / bound).max().item()!r}")
        self.log["worst"] = max(self.log["worst"], (err / bound.clamp_min(1e-300)).max().item())
        self.log["ops"].add(str(getattr(op, "op", op)))
        self.log["expected_sent"] += (w - 1) * wire_bytes_per_row(output_tensor.numel(), self.inner.wire)


def _train(rank, world_size, device, wire: str, steps: int, mesh_shape=None, check=True, preset="mxfp8",
           save_to=None, divide_factor: float | None = None):
    shard, mp = _jobs._fsdp(device, world_size, mesh_shape)  # (replicate, shard) mesh: HSDP
    torch.manual_seed(0)
    model = TinyLM()
    hybridq.apply_hybrid_fsdp(model, preset, grad_reduce=wire)
    for blk in model.blocks:
        shard(blk, mp_policy=mp)
    shard(model, mp_policy=mp)
    if divide_factor is not None:  # FSDP2 then passes PREMUL_SUM(1 / divide_factor) to the comm
        for m in (*model.blocks, model):
            m.set_gradient_divide_factor(divide_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    batches = make_batches(steps, world_size, 1)
    log = {"replica": [], "bound": [], "worst": 0.0, "ops": set(), "expected_sent": 0}
    losses = []
    for step in range(steps):
        torch.manual_seed(micro_seed(step, rank, 0))
        tok = batches[step][rank][0]
        loss = loss_fn(model(tok[:, :-1]), tok[:, 1:])
        if step == 0 and check and wire != "fp32":  # installed by the forward just run: wrap it
            for name, comm in model._hybridq_grad_reduce.comms.items():
                mod = model if name == "<model>" else model.get_submodule(name)
                mod.set_custom_reduce_scatter(CheckedComm(comm, log, divide_factor))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world_size)
    custom = {n: [type(c).__name__ for c in custom_reduce_scatters(m)]
              for n, m in model.named_modules() if hasattr(m, "set_custom_reduce_scatter")}
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    if save_to is not None:
        _dcp_jobs.save(model, opt, save_to)
    return model, opt, {"losses": losses, "log": log, "custom": custom, "bytes": grad_reduce_bytes(model),
                        "params": params}


def job_training(rank, world_size, device, steps: int = 3, hsdp: bool = False):
    """fp32 / bf16 / mxfp8 wires from the same start on the same batches; mxfp8 twice (determinism)."""
    runs = {}
    for wire in ("fp32", "bf16", "mxfp8", "mxfp8_again"):
        _, _, r = _train(rank, world_size, device, wire.split("_")[0], steps, check=wire != "mxfp8_again")
        runs[wire] = r
    out = {}
    base = runs["fp32"]
    for wire, r in runs.items():
        out[wire] = {"losses": r["losses"], "replica": r["log"]["replica"], "bound": r["log"]["bound"],
                     "worst": r["log"]["worst"], "ops": sorted(r["log"]["ops"]), "bytes": r["bytes"],
                     "expected_sent": r["log"]["expected_sent"], "custom": r["custom"],
                     "max_param_diff": max((r["params"][n] - base["params"][n]).abs().max().item()
                                           for n in base["params"])}
    out["deterministic"] = (runs["mxfp8"]["losses"] == runs["mxfp8_again"]["losses"] and all(
        torch.equal(runs["mxfp8"]["params"][n], runs["mxfp8_again"]["params"][n]) for n in base["params"]))
    if hsdp:
        _, _, r = _train(rank, world_size, device, "mxfp8", 2, mesh_shape=(2, world_size // 2))
        out["hsdp"] = {"replica": r["log"]["replica"], "bound": r["log"]["bound"], "ops": sorted(r["log"]["ops"]),
                       "calls": r["bytes"]["calls"], "losses": r["losses"]}
    # set_gradient_divide_factor: the op FSDP2 builds on this torch (torch 2.11's carries no `.factor`)
    _, _, r = _train(rank, world_size, device, "bf16", 2, divide_factor=DIVIDE_FACTOR)
    out["divide_factor"] = {"replica": r["log"]["replica"], "bound": r["log"]["bound"],
                            "ops": sorted(r["log"]["ops"]), "calls": r["bytes"]["calls"]}
    return out


def job_dcp(rank, world_size, device, folder: str):
    """Save after 2 mxfp8-wire steps, resume in a fresh model: the loaded parameters are bitwise the saved ones
    and the third step's loss bitwise that of the run that went on; the checkpoint holds the same keys as an
    fp32-wire one."""
    torch.manual_seed(0)

    def build(wire):
        model = _dcp_jobs.plain_model(0)
        hybridq.apply_hybrid_fsdp(model, _dcp_jobs.RECIPE, grad_reduce=wire)
        shard, mp = _jobs._fsdp(device, world_size)
        for block in model:
            shard(block, mp_policy=mp)
        shard(model, mp_policy=mp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build("mxfp8")
    for n in range(2):
        _dcp_jobs.step(model, opt, n, world_size, rank)
    path = os.path.join(folder, "ckpt")
    _dcp_jobs.save(model, opt, path)
    saved = [p.full_tensor() for p in model.parameters()]
    went_on = _dcp_jobs.step(model, opt, 2, world_size, rank)
    fresh, fresh_opt = build("mxfp8")
    _dcp_jobs.load(fresh, fresh_opt, path)
    same_params = all(torch.equal(a, b.full_tensor()) for a, b in zip(saved, fresh.parameters()))
    resumed = _dcp_jobs.step(fresh, fresh_opt, 2, world_size, rank)
    plain, plain_opt = build("fp32")
    _dcp_jobs.step(plain, plain_opt, 0, world_size, rank)
    keys = sorted(_dcp_jobs.full_state(fresh, fresh_opt)["model"])
    plain_keys = sorted(_dcp_jobs.full_state(plain, plain_opt)["model"])
    return {"went_on": went_on, "resumed": resumed, "same_params": same_params, "keys_equal": keys == plain_keys,
            "resumed_calls": grad_reduce_bytes(fresh)["calls"]}


def job_all(rank, world_size, device, folder: str, hsdp: bool):
    return {"comm": job_comm(rank, world_size, device),
            "training": job_training(rank, world_size, device, hsdp=hsdp),
            "dcp": job_dcp(rank, world_size, device, folder)}
