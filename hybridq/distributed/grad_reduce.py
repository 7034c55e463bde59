"""Low-precision gradient reduce-scatter for FSDP2: `apply_hybrid_fsdp(model, recipe, grad_reduce="bf16" | "mxfp8")`.

FSDP2 reduce-scatters each param group's flat gradient in `reduce_dtype` (fp32 in the usual mixed-precision
policy). With a low-precision wire every rank instead quantizes the W chunks of its flat gradient (chunk r is
what rank r owns), sends chunk r to rank r in one all-to-all, and each rank dequantizes the W chunks it
receives and sums them in fp32, in rank order 0, 1, ..., W-1, then applies FSDP2's reduce op (below). The
result is a function of the W inputs alone: re-running gives the same bits, and a replica that holds every
rank's input computes every rank's shard bitwise (`reduce_reference`).

Wires (`Wire`; bytes each rank sends per element of its flat gradient, against fp32's ring reduce-scatter,
which sends (W-1)/W of 4 bytes per element, as the all-to-all sends (W-1)/W of the wire's bytes):
  bf16   2 bytes: round to nearest even to bfloat16 (0.5x fp32).
  mxfp8  33/32 bytes: MXFP8 E4M3 (docs/numerics.md "MXFP8": blocks of 32 consecutive elements of a chunk, one
         E8M0 power-of-two scale each, rounded up so that nothing saturates), the chunk zero-padded to a
         multiple of 32 (~0.258x fp32). A block holding a NaN or an infinity is sent with the NaN scale byte:
         all its 32 elements arrive as NaN (MXFP8 alone would turn an infinity into NaN and zero its finite
         neighbours, a wrong finite value).

Error bound (asserted by tests/distributed/test_grad_reduce.py; `error_bound` computes it). For one element of
a shard, let g_i be rank i's fp32 input, d_i what the wire delivers of it, R the result and F FSDP2's fp32
reduce-scatter result (any summation order), D the divisor of the reduce op (AVG: W; PREMUL_SUM(f): 1/f;
SUM: 1), u = 2^-24:
    |d_i - g_i| <= eps * |g_i| + delta_i
        bf16:  eps = 2^-8, delta_i = 2^-134                      (finite |g_i| below bf16's overflow, 3.39e38)
        mxfp8: eps = 2^-4, delta_i = 2^-17 * a_i + 2^-137        (a_i = max|g_i| over the 32-element block)
    |R - F| <= ((eps + 3 W u) * sum_i |g_i| + sum_i delta_i) / D * (1 + 4u) + 2u |F|
The last terms cover the two fp32 summations (R's and F's) and the divisions. With bfloat16 parameters
(`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`), the gradients each rank computes are bfloat16 values:
the bf16 wire delivers them exactly (d_i = g_i) and only the summation order can differ from fp32's.

Non-finite values stay non-finite: bf16 keeps infinities and NaN as they are (and an fp32 value beyond bf16's
range becomes an infinity); mxfp8 delivers NaN for the whole block. Reduce ops: SUM, AVG (sum / W) and
PREMUL_SUM(f) (sum * f): exactly what FSDP2 asks of its reduce-scatter, so `set_gradient_divide_factor` and
`set_force_sum_reduction_for_comms` keep their meaning (on gloo FSDP2 never passes PREMUL_SUM with the force
flag; the wire handles all three on any backend).

[Note: installing the comm] FSDP2's hook is `FSDPModule.set_custom_reduce_scatter(comm)` (torch >= 2.9; torch
2.11 and 2.13 have the same `ReduceScatter` contract: `allocate(size, *, dtype, device)` and
`__call__(output_tensor, input_tensor, group, op, async_op=False)`), a method of the modules `fully_shard`
returns, while `apply_hybrid_fsdp` runs before `fully_shard`. `apply_hybrid_fsdp` therefore records the choice
on the model and registers a forward pre-hook on it; the first forward after `fully_shard` installs one comm
per param group of every FSDP module under the model (FSDP2's own root pre-forward runs first, and gradients
are only reduced in backward, after that forward), then removes the hook. The user calls nothing more than
docs/fsdp2.md shows, the choice survives any number of `fully_shard` calls in any order (nested blocks, then the
root), and a forward before `fully_shard` (nothing to install) leaves the hook armed. An FSDP module whose
reduce-scatter is already custom (the user's comm, symmetric memory, process-group allocation) is refused
with its name rather than overridden; an FSDP unit *enclosing* the model keeps FSDP2's fp32 reduce.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from ..formats.mxfp8 import BLOCK as MX_BLOCK
from ..formats.mxfp8 import MXFP8Part, MXFP8Quantizer
from .fsdp_adapter import ReduceScatterComm, custom_reduce_scatters

__all__ = ["Wire", "GRAD_REDUCE_VALUES", "parse_grad_reduce", "QuantizedReduceScatter", "grad_reduce_bytes",
           "reduce_reference", "error_bound", "wire_bytes_per_row"]

log = logging.getLogger("hybridq")


class Wire(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    MXFP8 = "mxfp8"


GRAD_REDUCE_VALUES = tuple(w.value for w in Wire)
_NAN_E8M0 = 255  # the E8M0 NaN scale byte
_U = 2.0 ** -24
_EPS = {Wire.FP32: 0.0, Wire.BF16: 2.0 ** -8, Wire.MXFP8: 2.0 ** -4}


def parse_grad_reduce(value, caller: str = "apply_hybrid_fsdp") -> Wire:
    """The wire for the `grad_reduce` argument (a string at the API boundary); ValueError naming the argument
    and the allowed values for anything else, and on a torch without FSDP2's custom reduce-scatter hook."""
    if isinstance(value, Wire):
        wire = value
    else:
        try:
            wire = Wire(value)
        except ValueError:
            raise ValueError(f"{caller}: grad_reduce={value!r} is not one of {', '.join(map(repr, GRAD_REDUCE_VALUES))} "
                             f"(the gradient reduce-scatter's wire format: fp32 is FSDP2's own reduce-scatter)") from None
    if wire is not Wire.FP32:
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_custom_reduce_scatter") or ReduceScatterComm is object:
            raise ValueError(f"{caller}: grad_reduce={wire.value!r} needs FSDP2's FSDPModule.set_custom_reduce_scatter "
                             f"(torch >= 2.9); torch {torch.__version__} lacks it. Use grad_reduce='fp32'.")
    return wire


# ---- the wire: quantize W chunks into one byte row each, and back --------------------------------------------

def _padded(n: int, wire: Wire) -> int:
    return -(-n // MX_BLOCK) * MX_BLOCK if wire is Wire.MXFP8 else n


def wire_bytes_per_row(n: int, wire: Wire) -> int:
    """Bytes the wire sends for one chunk of `n` elements."""
    if wire is Wire.MXFP8:
        p = _padded(n, wire)
        return p + p // MX_BLOCK
    return n * (2 if wire is Wire.BF16 else 4)


def encode(x2d: torch.Tensor, wire: Wire) -> torch.Tensor:
    """uint8 `[R, wire_bytes_per_row(n)]`: row i is the fp32 row `x2d[i]` on the wire."""
    rows, n = x2d.shape
    x = x2d.float()
    if wire is Wire.FP32:
        return x.contiguous().view(torch.uint8)
    if wire is Wire.BF16:
        return x.to(torch.bfloat16).view(torch.uint8)
    p = _padded(n, wire)
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    part, _ = MXFP8Quantizer().quantize_parts(x, True, False)
    # a block holding inf / NaN: the NaN scale, so that all of it arrives non-finite (see the module docstring)
    bad = ~torch.isfinite(x).view(rows, p // MX_BLOCK, MX_BLOCK).all(dim=-1)
    scale = torch.where(bad, torch.full_like(part.scale, _NAN_E8M0), part.scale)
    return torch.cat([part.data.view(torch.uint8), scale], dim=1)


def decode(payload: torch.Tensor, n: int, wire: Wire) -> torch.Tensor:
    """fp32 `[R, n]` from `encode`'s bytes."""
    rows = payload.shape[0]
    if wire is Wire.FP32:
        return payload.view(torch.float32)
    if wire is Wire.BF16:
        return payload.view(torch.bfloat16).float()
    p = _padded(n, wire)
    part = MXFP8Part(rows=rows, cols=p, columnwise=False, data=payload[:, :p].contiguous().view(torch.float8_e4m3fn),
                     scale=payload[:, p:].contiguous())
    return part.dequantize_2d()[:, :n]


def _premul_factor(op):
    """The factor of a PREMUL_SUM ReduceOp (a float or a tensor), None if unreadable. torch 2.13's ReduceOp has
    `.factor`; torch 2.11's (what its FSDP2 builds with `_make_nccl_premul_sum`) has not, but on both its pickle
    state is `(op, factor)`."""
    factor = getattr(op, "factor", None)
    if factor is None:
        state = op.__getstate__() if hasattr(op, "__getstate__") else None
        factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
    return factor


def _op_factor(op, world_size: int) -> tuple[str, float | None]:
    """("div", W) for AVG, ("mul", f) for PREMUL_SUM(f), ("none", None) for SUM; ValueError for anything else."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) or a RedOpType
    if kind == dist.ReduceOp.SUM:
        return "none", None
    if kind == dist.ReduceOp.AVG:
        return "div", float(world_size)
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = _premul_factor(op)
        if factor is None:
            raise ValueError("hybridq grad_reduce: FSDP2 passed PREMUL_SUM without a readable factor on this torch; "
                             "call set_force_sum_reduction_for_comms(True) on the FSDP modules")
        return "mul", float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    raise ValueError(f"hybridq grad_reduce: reduce op {op} is not a sum (SUM, AVG, PREMUL_SUM)")


def reduce_received(received: torch.Tensor, op, world_size: int) -> torch.Tensor:
    """fp32 sum of the rows of `received` ([W, n]) in row order, then the reduce op's division or factor."""
    acc = received[0].clone()
    for i in range(1, received.shape[0]):
        acc += received[i]
    how, f = _op_factor(op, world_size)
    if how == "div":
        acc /= f
    elif how == "mul":
        acc *= f
    return acc


def reduce_reference(inputs: list[torch.Tensor], wire: Wire, op=dist.ReduceOp.AVG) -> list[torch.Tensor]:
    """Every rank's shard of the reduce-scatter of `inputs` (rank i's flat input, W chunks each) as the wire
    computes it, on one process: chunk by chunk through the wire, then the ordered fp32 sum."""
    w = len(inputs)
    n = inputs[0].numel() // w
    out = []
    for r in range(w):
        got = torch.stack([decode(encode(x.float().view(w, n)[r:r + 1], wire), n, wire)[0] for x in inputs])
        out.append(reduce_received(got, op, w))
    return out


def error_bound(inputs: list[torch.Tensor], fp32_result: torch.Tensor, rank: int, wire: Wire,
                op=dist.ReduceOp.AVG) -> torch.Tensor:
    """The module docstring's bound on |R - F| for every element of `rank`'s shard, from all ranks' inputs and
    F (FSDP2's fp32 result for that shard)."""
    w = len(inputs)
    n = inputs[0].numel() // w
    g = torch.stack([x.float().view(w, n)[rank] for x in inputs]).abs()  # [W, n]
    if wire is Wire.MXFP8:
        p = _padded(n, wire)
        a = torch.nn.functional.pad(g, (0, p - n)).view(w, -1, MX_BLOCK).amax(dim=-1)
        delta = (2.0 ** -17 * a.repeat_interleave(MX_BLOCK, dim=1)[:, :n] + 2.0 ** -137).sum(dim=0)
    elif wire is Wire.BF16:
        delta = torch.full((n,), w * 2.0 ** -134, dtype=torch.float64)
    else:
        delta = torch.zeros(n, dtype=torch.float64)
    how, f = _op_factor(op, w)
    d = {"div": f, "mul": 1.0 / f if f else float("inf"), "none": 1.0}[how]
    s = g.double().sum(dim=0)
    return (((_EPS[wire] + 3 * w * _U) * s + delta.double()) / d * (1 + 4 * _U)
            + 2 * _U * fp32_result.double().abs())


# ---- the FSDP2 comm -------------------------------------------------------------------------------------------

class QuantizedReduceScatter(ReduceScatterComm):
    """FSDP2 reduce-scatter comm (`set_custom_reduce_scatter`) sending `wire`: one all-to-all of the quantized
    chunks, an fp32 sum in rank order on the receiver. Counts what it sends: `bytes_sent` (this rank, the
    chunks for the other ranks) and `fp32_bytes` (what FSDP2's fp32 reduce-scatter sends for the same calls)."""

    def __init__(self, wire: Wire, name: str = ""):
        if wire is Wire.FP32:
            raise ValueError("QuantizedReduceScatter: the fp32 wire is FSDP2's own reduce-scatter; install nothing")
        self.wire = wire
        self.name = name
        self.bytes_sent = 0
        self.fp32_bytes = 0
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        if async_op:  # FSDP2 calls it synchronously on its reduce-scatter stream
            raise NotImplementedError(f"hybridq grad_reduce={self.wire.value!r} ({self.name}): async_op=True")
        w = group.size()
        n = output_tensor.numel()
        if input_tensor.numel() != w * n:
            raise ValueError(f"hybridq grad_reduce ({self.name}): input of {input_tensor.numel()} elements is not "
                             f"{w} chunks of the output's {n}")
        _op_factor(op, w)  # refuse a non-sum op before anything is sent
        payload = encode(input_tensor.view(w, n), self.wire)
        received = torch.empty_like(payload)
        dist.all_to_all_single(received, payload, group=group)
        output_tensor.copy_(reduce_received(decode(received, n, self.wire), op, w).view_as(output_tensor))
        self.bytes_sent += (w - 1) * payload.shape[1]
        self.fp32_bytes += (w - 1) * n * 4
        self.calls += 1
        return None


# ---- installation (see [Note: installing the comm]) -----------------------------------------------------------

@dataclasses.dataclass
class _Setup:
    wire: Wire
    handle: object = None
    comms: dict = dataclasses.field(default_factory=dict)  # FSDP module name -> its QuantizedReduceScatter
    warned: bool = False


def _install(model: nn.Module, setup: _Setup) -> int:
    """Install a comm on every FSDP module under `model` that has none yet; returns the number of FSDP modules."""
    from torch.distributed.fsdp import FSDPModule

    found = [(name or "<model>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    for name, m in found:
        if name in setup.comms:
            continue
        other = [c for c in custom_reduce_scatters(m) if not isinstance(c, QuantizedReduceScatter)]
        if other:
            raise ValueError(f"apply_hybrid_fsdp(grad_reduce={setup.wire.value!r}): the FSDP module {name} already "
                             f"has a custom reduce-scatter ({type(other[0]).__name__}: set_custom_reduce_scatter, "
                             f"symmetric memory or process-group allocation); use one or the other")
        comm = QuantizedReduceScatter(setup.wire, name)
        try:
            m.set_custom_reduce_scatter(comm)
        except ValueError as e:
            raise ValueError(f"apply_hybrid_fsdp(grad_reduce={setup.wire.value!r}): FSDP module {name}: {e}") from e
        setup.comms[name] = comm
    return len(found)


def arm_grad_reduce(model: nn.Module, wire: Wire) -> None:
    """Record `wire` on `model` and install it at the first forward after `fully_shard` (fp32: nothing)."""
    old = getattr(model, "_hybridq_grad_reduce", None)
    if old is not None and old.handle is not None:
        old.handle.remove()
    if wire is Wire.FP32:
        model._hybridq_grad_reduce = None
        return
    setup = _Setup(wire)

    def pre_forward(module, args):
        if _install(module, setup):
            setup.handle.remove()
            setup.handle = None
        elif not setup.warned:
            setup.warned = True
            log.warning("hybridq: grad_reduce=%r waits for fully_shard: no FSDP module under the model yet",
                        wire.value)

    setup.handle = model.register_forward_pre_hook(pre_forward)
    model._hybridq_grad_reduce = setup


def check_rearm(model: nn.Module, wire: Wire, caller: str = "apply_hybrid_fsdp") -> None:
    """A model whose comms are installed keeps its wire: ValueError (before any change) for another one."""
    old = getattr(model, "_hybridq_grad_reduce", None)
    if old is not None and old.comms and old.wire is not wire:
        raise ValueError(f"{caller}: the model already reduces gradients with grad_reduce={old.wire.value!r} "
                         f"(installed at its first forward); grad_reduce={wire.value!r} cannot replace it")


def grad_reduce_bytes(model: nn.Module) -> dict:
    """Bytes this rank has sent through the low-precision gradient reduce-scatter of `model` so far (a running
    total: take differences per step): {"wire", "sent", "fp32", "ratio", "calls"}; fp32 is what FSDP2's fp32
    reduce-scatter would have sent for the same calls. {"wire": "fp32", ...0} when nothing is installed."""
    setup = getattr(model, "_hybridq_grad_reduce", None)
    comms = list(setup.comms.values()) if setup is not None else []
    sent = sum(c.bytes_sent for c in comms)
    fp32 = sum(c.fp32_bytes for c in comms)
    return {"wire": setup.wire.value if setup is not None else "fp32", "sent": sent, "fp32": fp32,
            "ratio": sent / fp32 if fp32 else None, "calls": sum(c.calls for c in comms)}
