"""`ZeroAdamW`: a small ZeRO-1 AdamW over flat fragments of fp32 master weights, for models whose weights are held
quantized (hybridq.quantized_model_init) or in a low-precision dtype.

Every trainable parameter is flattened into one virtual buffer (in `named_parameters()` order), split into
`world` contiguous ranges; each rank keeps the fp32 master and the AdamW state of its range only (so a range cuts
parameters, rows and blocks anywhere). A step all-reduces the gradients in fp32 (sum, then divided by the world
size: FSDP2's mean with reduce_dtype fp32), runs torch's AdamW (single-tensor implementation) on the owned
fragments, and refreshes the model's weights with `quantize_master_weights` (the cast and quantization of the
whole master, bitwise, on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..formats._sharding import cdiv
from ..nn.quantized_params import high_precision_init_value, quantized_param_info
from .fragments import FragmentLayout
from .master_weights import quantize_master_weights

__all__ = ["ZeroAdamW"]


def _initial_master(p: torch.Tensor) -> torch.Tensor:
    """fp32 values to start the master from: the preserved initial value of a quantized parameter, else its
    dequantized form (lossy), else the parameter."""
    if quantized_param_info(p) is not None:
        init = high_precision_init_value(p)
        return (init if init is not None else p.dequantize()).detach().float().reshape(-1)
    return p.detach().float().reshape(-1)


class ZeroAdamW:
    """`ZeroAdamW(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, group=None)`.

    Build it while the model still holds its high-precision values (e.g. fp32 before `.to(bfloat16)` and
    `hybridq.quantize_parameters(model)`), or from a model built under `quantized_model_init(
    preserve_high_precision_init_val=True)`; otherwise the masters start from the dequantized weights. Parameters
    are looked up by name at every step, so converting or quantizing them after construction is fine (shapes may
    not change). `refresh()` writes the masters into the model (also done by every `step()`)."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, group=None):
        self.model = model
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("ZeroAdamW: the model has no trainable parameters")
        self.names = [n for n, _ in params]
        self.shapes = [tuple(p.shape) for _, p in params]
        sizes = [p.numel() for _, p in params]
        total = sum(sizes)
        chunk = cdiv(total, self.world)
        bounds = [min(r * chunk, total) for r in range(self.world + 1)]
        self.offsets, self.layouts, self.starts, self.masters = [], [], [], []
        at = 0
        for (name, p), n in zip(params, sizes):
            ranges = []
            for r in range(self.world):
                lo, hi = max(bounds[r], at), min(bounds[r + 1], at + n)
                ranges.append((lo - at, hi - lo) if hi > lo else (0, 0))
            self.layouts.append(FragmentLayout(n, tuple(ranges)))
            s, ln = ranges[self.rank]
            self.offsets.append(at)
            self.starts.append(s if ln else None)
            self.masters.append(nn.Parameter(_initial_master(p)[s:s + ln].clone()) if ln else None)
            at += n
        self.total = total
        owned = [m for m in self.masters if m is not None]
        self.inner = torch.optim.AdamW(owned or [nn.Parameter(torch.zeros(0))], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, foreach=False)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups  # (learning-rate schedules set "lr" here)

    def _params(self) -> list[torch.Tensor]:
        named = dict(self.model.named_parameters())
        out = []
        for n, shape in zip(self.names, self.shapes):
            p = named.get(n)
            if p is None or tuple(p.shape) != shape:
                raise RuntimeError(f"ZeroAdamW: parameter {n!r} {shape} is no longer in the model (or changed shape)")
            out.append(p)
        return out

    @torch.no_grad()
    def step(self) -> None:
        params = self._params()
        device = params[0].device
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        for p, at in zip(params, self.offsets):
            if p.grad is not None:
                flat[at:at + p.numel()] = p.grad.detach().reshape(-1).float()
        if self.world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.world
        for m, s, at in zip(self.masters, self.starts, self.offsets):
            if m is not None:
                m.grad = flat[at + s:at + s + m.numel()].to(m.device)
        self.inner.step()
        self.refresh(params)

    def refresh(self, params: list[torch.Tensor] | None = None) -> None:
        """Write the masters into the model's weights: quantized parameters re-quantized, others cast."""
        quantize_master_weights(params if params is not None else self._params(), self.masters, self.starts,
                                self.group, layouts=self.layouts)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None
        for m in self.masters:
            if m is not None:
                m.grad = None

    def _gather(self, pieces: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Whole per-parameter tensors from every rank's per-fragment pieces (an all-gather of the flat buffer)."""
        mine = torch.cat([p.detach().float().reshape(-1) for p in pieces if p is not None] or [torch.zeros(0)])
        chunk = cdiv(self.total, self.world)
        if self.world > 1:
            buf = torch.nn.functional.pad(mine, (0, chunk - mine.numel()))
            out = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(out, buf, group=self.group)
            flat = torch.cat(out)[:self.total]
        else:
            flat = mine
        return {n: flat[at:at + _numel(shape)].view(shape).clone()
                for n, shape, at in zip(self.names, self.shapes, self.offsets)}

    def full_masters(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole fp32 master (an all-gather; for checkpoints and tests)."""
        return self._gather(self.masters)

    def state_dict(self) -> dict:
        """This rank's fragments and AdamW state (the same world size loads it; `consolidated_state_dict` for
        another)."""
        return {"world": self.world, "masters": [None if m is None else m.detach().clone() for m in self.masters],
                "adamw": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["world"] != self.world:
            raise ValueError(f"ZeroAdamW: state saved with {state['world']} ranks, this run has {self.world}; save "
                             f"consolidated_state_dict() to resume at another world size")
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                if m is not None:
                    m.copy_(saved)
        self.inner.load_state_dict(state["adamw"])
        self.refresh()

    def consolidated_state_dict(self) -> dict:
        """The optimizer's whole state independent of the world size (a collective: every rank gets it): each
        parameter's fp32 master and AdamW moments by name, the step count and the hyperparameters."""
        states = [None if m is None else self.inner.state.get(m, {}) for m in self.masters]

        def moment(key: str) -> dict[str, torch.Tensor]:
            return self._gather([None if m is None else st.get(key, torch.zeros_like(m))
                                 for m, st in zip(self.masters, states)])
        steps = [float(st["step"]) for st in states if st and "step" in st]
        step = torch.tensor(max(steps, default=0.0))
        if self.world > 1:  # (a rank may own no fragment)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        return {"masters": self.full_masters(), "exp_avg": moment("exp_avg"), "exp_avg_sq": moment("exp_avg_sq"),
                "step": float(step), "hyperparameters": hyper}

    def load_consolidated_state_dict(self, state: dict) -> None:
        """Resume from `consolidated_state_dict()` saved at any world size: this rank takes its fragments of every
        master and moment, then the model's weights are refreshed. Raises (nothing changed) on a parameter missing
        or of another shape."""
        for n, shape in zip(self.names, self.shapes):
            for key in ("masters", "exp_avg", "exp_avg_sq"):
                t = state[key].get(n)
                if t is None or tuple(t.shape) != shape:
                    raise ValueError(f"ZeroAdamW: the consolidated state's {key} of {n!r} is "
                                     f"{None if t is None else tuple(t.shape)}, the parameter is {shape}")
        with torch.no_grad():
            for n, m, s in zip(self.names, self.masters, self.starts):
                if m is None:
                    continue
                m.copy_(state["masters"][n].reshape(-1)[s:s + m.numel()])
                self.inner.state[m] = {
                    "step": torch.tensor(state["step"], dtype=torch.float32),
                    "exp_avg": state["exp_avg"][n].reshape(-1)[s:s + m.numel()].clone().to(m.device),
                    "exp_avg_sq": state["exp_avg_sq"][n].reshape(-1)[s:s + m.numel()].clone().to(m.device)}
            self.inner.param_groups[0].update(state["hyperparameters"])
        self.refresh()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
