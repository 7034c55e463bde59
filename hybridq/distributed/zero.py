"""`ZeroAdamW`: a small ZeRO-1 AdamW over flat fragments of fp32 master weights, for models whose weights are held
quantized (hybridq.quantized_model_init) or in a low-precision dtype.

Every parameter it optimizes is flattened into one virtual buffer (in `named_parameters()` order), split into
`world` contiguous ranges; each rank keeps the fp32 master and the AdamW state of its range only (so a range cuts
parameters, rows and blocks anywhere). A step all-reduces the gradients in fp32 (sum, then divided by the world
size: FSDP2's mean with reduce_dtype fp32), runs torch's AdamW (single-tensor implementation) on the owned
fragments, and refreshes the model's weights with `quantize_master_weights` (the cast and quantization of the
whole master, bitwise, on every rank).

It is a `torch.optim.Optimizer` with torch's AdamW semantics: one param group holding the model's parameters whose
`lr`, `betas`, `eps` and `weight_decay` LR schedulers may change (the next step reads them); a parameter whose
`.grad` is None on every rank is skipped (no weight decay, no moment update, its weight not rewritten), so a step
without a backward changes nothing; a parameter frozen when the optimizer is built is in the group all the same
and is trained once it has a gradient (as torch's optimizers step every parameter they were given). `state_dict()`
has torch's layout (`state` by parameter index, `param_groups`) with each rank's fragments under a rank-specific
key, so `torch.distributed.checkpoint` saves every rank's fragments and loads them back at the same world size;
`consolidated_state_dict()` resumes at another world size (both in `zero_state.py`).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..formats._sharding import cdiv
from ..nn.quantized_params import high_precision_init_value, quantized_param_info
from .fragments import FragmentLayout
from .master_weights import quantize_master_weights
from .zero_state import HYPER, ZeroStateDict

__all__ = ["ZeroAdamW"]



def _initial_master(p: torch.Tensor) -> torch.Tensor:
    """fp32 values to start the master from: the preserved initial value of a quantized parameter, else its
    dequantized form (lossy), else the parameter."""
    if quantized_param_info(p) is not None:
        init = high_precision_init_value(p)
        return (init if init is not None else p.dequantize()).detach().float().reshape(-1)
    return p.detach().float().reshape(-1)


class ZeroAdamW(ZeroStateDict, torch.optim.Optimizer):
    """`ZeroAdamW(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, group=None, params=None)`.

    Optimizes every parameter of `model` (frozen ones included, as torch's optimizers do with what they are
    given), or only `params` (parameters of `model`: e.g. `[p for p in model.parameters() if p.requires_grad]` to
    keep no master for a frozen backbone). Build it while the model still holds its high-precision values (e.g. fp32
    before `.to(bfloat16)` and `hybridq.quantize_parameters(model)`), or from a model built under
    `quantized_model_init(preserve_high_precision_init_val=True)`; otherwise the masters start from the dequantized
    weights. The masters are the weights' truth from then on: a step writes the masters of the parameters it
    updates into the model. Parameters are looked up by name at every step, so converting or quantizing them after
    construction is fine (shapes may not change). `refresh()` writes every master into the model."""

    hybridq_keeps_masters = True  # (its param group may hold quantized parameters: see quantized_params' guard)

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, group=None,
                 params: Iterable[nn.Parameter] | None = None):
        named = list(model.named_parameters())
        if params is not None:
            chosen = {id(p) for p in params}
            known = {id(p) for _, p in named}
            if chosen - known:
                raise ValueError(f"ZeroAdamW: {len(chosen - known)} of the given params are not parameters of the "
                                 f"model (it looks parameters up by name in the model at every step)")
            named = [(n, p) for n, p in named if id(p) in chosen]
        if not named:
            raise ValueError("ZeroAdamW: no parameters to optimize")
        self._building = True
        super().__init__([{"params": [p for _, p in named]}],
                         {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._building = False
        self.model = model
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        sizes = [p.numel() for _, p in named]
        total = sum(sizes)
        chunk = cdiv(total, self.world)
        bounds = [min(r * chunk, total) for r in range(self.world + 1)]
        self.offsets, self.layouts, self.starts, self.masters = [], [], [], []
        at = 0
        for (name, p), n in zip(named, sizes):
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
        self._mirror_state(self._params())

    # ---- the param group ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_building", False):
            raise NotImplementedError("ZeroAdamW holds one param group (the model's parameters, flattened into "
                                      "fragments at construction); build another ZeroAdamW for other parameters")
        super().add_param_group(param_group)

    def _params(self) -> list[torch.Tensor]:
        """The model's current parameters by name (and the param group's list updated to them: converting or
        quantizing a parameter replaces the object)."""
        named = dict(self.model.named_parameters())
        out = []
        for n, shape in zip(self.names, self.shapes):
            p = named.get(n)
            if p is None or tuple(p.shape) != shape:
                raise RuntimeError(f"ZeroAdamW: parameter {n!r} {shape} is no longer in the model (or changed shape)")
            out.append(p)
        self.param_groups[0]["params"][:] = out
        return out

    def _mirror_state(self, params: list[torch.Tensor]) -> None:
        """`self.state` (torch's per-parameter state) as views of this rank's fragments: an entry per parameter,
        empty where this rank owns no fragment, so that torch.distributed.checkpoint's state_dict helpers see an
        initialised optimizer and never run their zero-gradient initialisation step."""
        self.state.clear()
        for p, m in zip(params, self.masters):
            entry = {} if m is None else {"master_fragment": m, **self.inner.state.get(m, {})}
            self.state[p] = entry

    def _sync_hyperparameters(self) -> None:
        group = self.param_groups[0]
        self.inner.param_groups[0].update({k: group[k] for k in HYPER})

    # ---- the step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on the parameters that have a gradient on some rank (the mean over ranks, a missing
        gradient counting as zero); the others are left as they are. Returns `closure()`'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        for n, p in zip(self.names, params):  # (before any communication or change)
            if p.grad is not None and tuple(p.grad.shape) != tuple(p.shape):
                raise ValueError(f"ZeroAdamW: the gradient of {n!r} has shape {tuple(p.grad.shape)}, the parameter "
                                 f"{tuple(p.shape)}")
        device = params[0].device
        stepped = self._stepped(params, device)
        if not any(stepped):  # (the same decision on every rank: nothing to communicate or write)
            return loss
        grads = self._reduced_grads(params, stepped, device)
        for i, m in enumerate(self.masters):
            if m is not None:
                m.grad = grads[i]
        self._sync_hyperparameters()
        self.inner.step()
        for m in self.masters:
            if m is not None:
                m.grad = None  # (views of the reduced buffer: do not keep it alive until zero_grad)
        chosen = [i for i, s in enumerate(stepped) if s]
        self._refresh([params[i] for i in chosen], chosen)
        self._mirror_state(params)
        return loss

    def _stepped(self, params: list[torch.Tensor], device) -> list[bool]:
        """Which parameters have a gradient on some rank (one small all-reduce)."""
        mine = [p.grad is not None for p in params]
        if self.world == 1:
            return mine
        flags = torch.tensor(mine, dtype=torch.float32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        return [v > 0 for v in flags.tolist()]

    def _reduced_grads(self, params: list[torch.Tensor], stepped: list[bool], device) -> list[torch.Tensor | None]:
        """This rank's fragment of each stepped parameter's mean gradient (fp32), None for the others: the stepped
        parameters' gradients packed into one buffer, all-reduced."""
        at, where = 0, []
        for p, s in zip(params, stepped):
            where.append(at if s else None)
            at += p.numel() if s else 0
        flat = torch.zeros(at, dtype=torch.float32, device=device)
        for p, w in zip(params, where):
            if w is not None and p.grad is not None:
                flat[w:w + p.numel()] = p.grad.detach().reshape(-1).float()
        if self.world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.world
        return [None if m is None or w is None else flat[w + s:w + s + m.numel()].to(m.device)
                for m, s, w in zip(self.masters, self.starts, where)]

    def _refresh(self, params: list[torch.Tensor], indices: list[int]) -> None:
        quantize_master_weights(params, [self.masters[i] for i in indices], [self.starts[i] for i in indices],
                                self.group, layouts=[self.layouts[i] for i in indices])

    def refresh(self, params: list[torch.Tensor] | None = None) -> None:
        """Write every master into the model's weights: quantized parameters re-quantized, others cast."""
        params = params if params is not None else self._params()
        self._refresh(params, list(range(len(params))))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._params()  # (the group's list is the model's current parameters)
        super().zero_grad(set_to_none=set_to_none)
        for m in self.masters:
            if m is not None:
                m.grad = None
