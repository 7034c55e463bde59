"""Jobs of test_sequence_plan.py (spawned; not a test module): what the sequence-parallel all-gathers send in forward
and in backward (`sequence.gather_plan`, [Note: sequence phases]), that the whole input's quantization every rank
ends with is bitwise the single device's either way, what a layer keeps for wgrad, and the layers' results against
the single device and against the forward-only gathers (the results before per-phase gathers), with activation
recompute and CPU offload."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

import hybridq
import hybridq.distributed.sequence as seq_mod
import hybridq.nn.linear_function as hq_linear
from hybridq import Role
from hybridq.distributed import ColwiseParallel, PrepareModuleInput, sequence_gather_bytes
from hybridq.distributed.sequence import SequenceGather
from hybridq.tensor import QuantizedTensor

from _compare import parts_diff, tensor_diff
from _tp_jobs import GemmRecorder, deterministic_recipe

PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block_fwd_mxfp8_bwd",
           "fp8_fwd_high_precision_bwd"]
TABLE_FIELDS = ("forward", "forward_sends", "backward", "backward_sends", "quantized_payload", "kept", "bf16_kept")


def shapes(world_size: int) -> list[tuple[tuple[int, ...], int]]:
    """[B, S, H] with B = 2 (each rank: 2 runs of 128 tokens) and [S, B, H] (a rank boundary inside 128-row
    blocks at 2 ranks)."""
    return [((2, 128 * world_size, 128), 1), ((48 * world_size, 1, 128), 0)]


class Sent:
    """Records what the sequence all-gathers hand to the collective (dtype, bytes) while entered: the payloads
    on the wire, counted at the call, not from the table's formula."""

    def __enter__(self):
        self.sent, self.orig = [], seq_mod.all_gather_single

        def recording(out, inp, group=None, **kw):
            self.sent.append([str(inp.dtype), inp.numel() * inp.element_size()])
            return self.orig(out, inp, group=group, **kw)
        seq_mod.all_gather_single = recording
        return self

    def __exit__(self, *exc):
        seq_mod.all_gather_single = self.orig


class ForwardOnly:
    """The forward-only gathers in place of per-phase ones (each rank's quantized directions in forward, the whole
    columnwise form kept for wgrad): the plan before per-phase gathers existed, for comparing results bitwise."""

    def __enter__(self):
        self.orig = seq_mod.gather_plan

        def plan(q, gather, local_rows, k, dtype, columnwise):
            p = self.orig(q, gather, local_rows, k, dtype, columnwise)
            if not p.per_phase:
                return p
            send, derive = seq_mod.sent_directions(q, k, dtype, True)
            return dataclasses.replace(p, send=send, derive=derive, nbytes=p.quantized_nbytes,
                                       backward_send=(), backward_nbytes=0)
        seq_mod.gather_plan = plan
        return self

    def __exit__(self, *exc):
        seq_mod.gather_plan = self.orig


def _local(x: torch.Tensor, seq_dim: int, rank: int, world_size: int) -> torch.Tensor:
    n = x.shape[seq_dim] // world_size
    return x.narrow(seq_dim, rank * n, n).contiguous()


def _nbytes(t) -> int:
    """Bytes of a quantized tensor's parts, a part's tensors, or a tensor."""
    if isinstance(t, QuantizedTensor):
        return t.nbytes_quantized()
    return t.nbytes() if callable(getattr(t, "nbytes", None)) else t.numel() * t.element_size()


def _table(q, shape, sd, world_size, dtype) -> dict:
    t = sequence_gather_bytes(q, shape, sd, world_size, dtype=dtype)
    return {f: getattr(t, f) for f in TABLE_FIELDS}


def job_gather(rank, world_size, device):
    """Per preset, dtype (bf16, fp32) and layout: the gathered parts (the forward's rowwise form, the columnwise
    form from the forward or from the backward gather of each rank's own form) against the single device's
    quantization of the whole input (bitwise), the bytes each phase's gather sent and what wgrad keeps, against
    `sequence_gather_bytes`."""
    group = torch.distributed.group.WORLD
    out = {}
    for preset in PRESETS:
        q = deterministic_recipe(preset).quantizer(Role("linear", "input"))
        for dtype in (torch.bfloat16, torch.float32):
            for shape, sd in shapes(world_size):
                key = f"{preset}/{str(dtype)[6:]}/{shape}/seq{sd}"
                x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
                x[(0,) * len(shape)] = 1e4  # (a tensor-wide scale set by rank 0's rows)
                local = _local(x, sd, rank, world_size)
                g = SequenceGather.create(local, shape, sd, group, key)
                with Sent() as fwd:
                    got = g.quantize(q, local.reshape(-1, shape[-1]), True, key)
                kept = g.local_for_wgrad(True)
                with Sent() as bwd:
                    col = got if kept is None else g.start_backward(kept)()
                want = q.quantize(x.reshape(-1, shape[-1]), rowwise=True, columnwise=True)
                diffs = parts_diff(got.part("rowwise"), want.part("rowwise"), f"{key} rowwise (forward)")
                diffs += parts_diff(col.part("columnwise"), want.part("columnwise"),
                                    f"{key} columnwise ({'backward' if kept is not None else 'forward'})")
                out[key] = {"diffs": diffs, "forward": fwd.sent, "backward": bwd.sent,
                            "kept": _nbytes(got.part("columnwise") if kept is None else kept),
                            "table": _table(q, shape, sd, world_size, dtype)}
    return out


class OperandRecorder(GemmRecorder):
    """The dequantized input operand of every fprop and wgrad GEMM, by layer (what reaches the GEMM; the eager
    FP8 fast path off meanwhile, as GemmRecorder's)."""

    def __enter__(self):
        super().__enter__()

        def gemm(a, b, dtype, what):
            if what.startswith(("fprop of ", "wgrad of ")):
                self.seen.setdefault(what, (a if what.startswith("fprop") else b).dequantize_2d())
            return self.orig(a, b, dtype, what)
        hq_linear.gemm = gemm
        return self


class TwoReaders(nn.Module):
    """Two column-parallel layers reading one sequence-parallel input (as w1 / w3, or q / k / v)."""

    def __init__(self, d: int, out: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, out, bias=False), nn.Linear(d, out, bias=False)

    def forward(self, x):
        return self.a(x), self.b(x)


def _loss(ya, yb):
    return ya.float().square().sum() + yb.float().square().sum()


def _kept_bytes(model, x) -> int:
    """Bytes of the distinct tensors the model's forward saves for backward (x needs no gradient: only what wgrad
    reads is saved)."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def _tp_step(tp, xl, how: str):
    """(outputs, input grad, weight grads) of one forward + backward of the tensor-parallel model, and the sequence
    gathers sent in forward and in backward. how: "plain", "recompute" (non-reentrant activation checkpointing)
    or "offload" (hybridq.CPUOffload copying every saved tensor)."""
    xl = xl.clone().requires_grad_()
    with Sent() as fwd:
        if how == "recompute":
            ya, yb = checkpoint(tp, xl, use_reentrant=False)
        elif how == "offload":
            offload = hybridq.CPUOffload(pin_memory=False, copy_cpu_tensors=True)
            with offload.layer():
                ya, yb = tp(xl)
        else:
            ya, yb = tp(xl)
    with Sent() as bwd:
        _loss(ya, yb).backward()
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in (tp.a.weight, tp.b.weight)]
    for p in tp.parameters():
        p.grad = None
    outs = [y.to_local() if hasattr(y, "to_local") else y for y in (ya, yb)]
    return [o.detach() for o in outs], xl.grad, grads, fwd.sent, bwd.sent


def job_layers(rank, world_size, device):
    """bf16 column-parallel layers sharing one sequence-parallel input, against the single-device hybridq model:
    fprop and wgrad input operands, outputs and weight gradients bitwise; with the per-phase plan, against the
    forward-only gathers (the results before per-phase gathers): outputs, input and weight gradients bitwise, also
    with activation recompute and CPU offload; the gathers of each phase (one per phase for both layers) and the
    bytes the layers keep for wgrad, against `sequence_gather_bytes`."""
    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for preset in PRESETS:
        shape, sd = shapes(world_size)[0]
        torch.manual_seed(0)
        out_features = 128 * world_size  # whole 128-row weight blocks on every rank (fp8_block)
        ref = TwoReaders(shape[-1], out_features).to(torch.bfloat16)
        tp = TwoReaders(shape[-1], out_features).to(torch.bfloat16)
        tp.load_state_dict(ref.state_dict())
        r = deterministic_recipe(preset)
        for m in (ref, tp):
            hybridq.convert_linears(m, r)
        # one sequence-sharded DTensor for both layers (hybridq's PrepareModuleInput keeps it sharded)
        parallelize_module(tp, mesh, PrepareModuleInput(input_layouts=(Shard(sd),), desired_input_layouts=(Replicate(),)))
        parallelize_module(tp, mesh, {"a": ColwiseParallel(), "b": ColwiseParallel()})
        x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        xl = _local(x, sd, rank, world_size)
        xr = x.clone().requires_grad_()
        with OperandRecorder() as rec_r:
            yr = ref(xr)
            _loss(*yr).backward()
        with OperandRecorder() as rec_t:
            outs, dx, grads, fwd, bwd = _tp_step(tp, xl, "plain")
        diffs = []

        def cmp(got, want, what):
            d = tensor_diff(got, want, f"{preset} {what}")
            if d is not None:
                diffs.append(d)
        if len(rec_r.seen) != 4:
            diffs.append(f"{preset}: not every fprop and wgrad GEMM of the single device seen: {list(rec_r.seen)}")
        for what, want in rec_r.seen.items():
            cmp(rec_t.seen.get(what, torch.empty(0)), want, f"{what} input operand")
        n = out_features // world_size
        for name, got, want in zip("ab", outs, yr):
            cmp(got, want.detach()[..., rank * n:(rank + 1) * n], f"output of {name}")
        for name, got, lin in zip("ab", grads, (ref.a, ref.b)):
            cmp(got, lin.weight.grad[rank * n:(rank + 1) * n], f"weight grad of {name}")
        table = _table(tp.a.input_quantizer, shape, sd, world_size, torch.bfloat16)
        runs, kept_forward_only = {}, None
        if table["backward"]:  # (per phase: the forward-only plans run as before)
            for how in ("recompute", "offload"):
                runs[how] = _tp_step(tp, xl, how)
            with ForwardOnly():
                runs["forward_only"] = _tp_step(tp, xl, "plain")
                kept_forward_only = _kept_bytes(tp, xl)
        for how, (o, g_x, g_w, _, _) in runs.items():
            for name, got, want in zip("ab", o, outs):
                cmp(got, want, f"output of {name} ({how} vs plain)")
            cmp(g_x, dx, f"input grad ({how} vs plain)")
            for name, got, want in zip("ab", g_w, grads):
                cmp(got, want, f"weight grad of {name} ({how} vs plain)")
        out[preset] = {"diffs": diffs, "forward": fwd, "backward": bwd, "kept": _kept_bytes(tp, xl),
                       "kept_forward_only": kept_forward_only, "table": table,
                       **{how: [r[3], r[4]] for how, r in runs.items()}}
    return out


def job_all(rank, world_size, device):
    return {"gather": job_gather(rank, world_size, device), "layers": job_layers(rank, world_size, device)}
