"""Jobs of test_sequence_plan.py (spawned; not a test module): what the sequence-parallel all-gather sends
(`sequence.gather_plan`: quantized rows, or the rows in bf16 when fewer bytes) and that the whole input's
quantization every rank ends with is bitwise the single device's either way."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import hybridq
import hybridq.distributed.sequence as seq_mod
import hybridq.nn.linear_function as hq_linear
from hybridq import Role
from hybridq.distributed import ColwiseParallel, PrepareModuleInput, sequence_gather_bytes
from hybridq.distributed.sequence import SequenceGather

from _compare import parts_diff, tensor_diff
from _tp_jobs import deterministic_recipe

PRESETS = ["fp8_tensorwise", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block_fwd_mxfp8_bwd",
           "fp8_fwd_high_precision_bwd"]


def shapes(world_size: int) -> list[tuple[tuple[int, ...], int]]:
    """[B, S, H] with B = 2 (each rank: 2 runs of 128 tokens) and [S, B, H] (a rank boundary inside 128-row
    blocks at 2 ranks)."""
    return [((2, 128 * world_size, 128), 1), ((48 * world_size, 1, 128), 0)]


class Sent:
    """Records what the sequence all-gathers send (dtype, bytes) while entered."""

    def __enter__(self):
        self.sent, self.orig = [], seq_mod.all_gather_single

        def recording(out, inp, group=None, **kw):
            self.sent.append((str(inp.dtype), inp.numel() * inp.element_size()))
            return self.orig(out, inp, group=group, **kw)
        seq_mod.all_gather_single = recording
        return self

    def __exit__(self, *exc):
        seq_mod.all_gather_single = self.orig


def _local(x: torch.Tensor, seq_dim: int, rank: int, world_size: int) -> torch.Tensor:
    n = x.shape[seq_dim] // world_size
    return x.narrow(seq_dim, rank * n, n).contiguous()


def job_gather(rank, world_size, device):
    """Per preset, dtype (bf16, fp32) and layout: the gathered parts against the single device's quantization of
    the whole input (both directions, bitwise), and the bytes sent against `sequence_gather_bytes`."""
    group = torch.distributed.group.WORLD
    out = {}
    for preset in PRESETS:
        q = deterministic_recipe(preset).quantizer(Role("linear", "input"))
        for dtype in (torch.bfloat16, torch.float32):
            for shape, sd in shapes(world_size):
                key = f"{preset}/{str(dtype)[6:]}/{shape}/seq{sd}"
                x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
                local = _local(x, sd, rank, world_size)
                g = SequenceGather.create(local, shape, sd, group, key)
                with Sent() as s:
                    got = g.quantize(q, local.reshape(-1, shape[-1]), True, key)
                want = q.quantize(x.reshape(-1, shape[-1]), rowwise=True, columnwise=True)
                diffs = []
                for d in ("rowwise", "columnwise"):
                    diffs += parts_diff(got.part(d), want.part(d), f"{key} {d}")
                table = sequence_gather_bytes(q, shape, sd, world_size, dtype=dtype)
                out[key] = {"diffs": diffs, "sent": s.sent, "table": {k: table[k] for k in ("forward", "sends",
                                                                                          "quantized_payload")}}
    return out


class OperandRecorder:
    """The dequantized input operand of every fprop and wgrad GEMM, by layer (what reaches the GEMM)."""

    def __enter__(self):
        self.seen, self.orig = {}, hq_linear.gemm

        def gemm(a, b, dtype, what):
            if what.startswith(("fprop of ", "wgrad of ")):
                self.seen.setdefault(what, (a if what.startswith("fprop") else b).dequantize_2d())
            return self.orig(a, b, dtype, what)
        hq_linear.gemm = gemm
        return self

    def __exit__(self, *exc):
        hq_linear.gemm = self.orig


class TwoReaders(nn.Module):
    """Two column-parallel layers reading one sequence-parallel input (as w1 / w3, or q / k / v)."""

    def __init__(self, d: int, out: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, out, bias=False), nn.Linear(d, out, bias=False)

    def forward(self, x):
        return self.a(x).float().square().sum() + self.b(x).float().square().sum()


def job_layers(rank, world_size, device):
    """bf16 column-parallel layers under sequence parallelism, against the single-device hybridq model: the
    fprop and wgrad input operands bitwise, one all-gather per step for both layers (no gather in backward)."""
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
        with OperandRecorder() as rec_r:
            ref(x).backward()
        with OperandRecorder() as rec_t, Sent() as s:
            tp(_local(x, sd, rank, world_size)).backward()
        diffs = []
        for what, want in rec_r.seen.items():
            d = tensor_diff(rec_t.seen.get(what, torch.empty(0)), want, f"{preset} {what} input operand")
            if d is not None:
                diffs.append(d)
        out[preset] = {"diffs": diffs, "sent": s.sent}
    return out


def job_all(rank, world_size, device):
    return {"gather": job_gather(rank, world_size, device), "layers": job_layers(rank, world_size, device)}
