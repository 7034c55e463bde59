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
`consolidated_state_dict()` resumes at another world size.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..formats._sharding import cdiv
from ..nn.quantized_params import high_precision_init_value, quantized_param_info
from .fragments import FragmentLayout
from .master_weights import quantize_master_weights

__all__ = ["ZeroAdamW"]

HYPER = ("lr", "betas", "eps", "weight_decay")  # what the step reads from the param group
_LAYOUT_KEYS = ("zero_world", "zero_names", "zero_shapes")  # the saved layout (param group entries)


def _initial_master(p: torch.Tensor) -> torch.Tensor:
    """fp32 values to start the master from: the preserved initial value of a quantized parameter, else its
    dequantized form (lossy), else the parameter."""
    if quantized_param_info(p) is not None:
        init = high_precision_init_value(p)
        return (init if init is not None else p.dequantize()).detach().float().reshape(-1)
    return p.detach().float().reshape(-1)


def _current_value(p: torch.Tensor) -> torch.Tensor:
    """The parameter's values now, as flat fp32 (a quantized parameter dequantized)."""
    return (p.dequantize() if quantized_param_info(p) is not None else p).detach().float().reshape(-1)


class ZeroAdamW(torch.optim.Optimizer):
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

    # ---- whole tensors (consolidated state, tests) --------------------------------------------------------
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

    def _steps(self) -> list[float]:
        """Each parameter's AdamW step count (0: never stepped), the same on every rank (a MAX all-reduce: a rank
        may own no fragment of it)."""
        mine = [float(self.inner.state[m]["step"]) if m is not None and "step" in self.inner.state.get(m, {})
                else 0.0 for m in self.masters]
        steps = torch.tensor(mine, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
        return steps.tolist()

    # ---- per-rank state (same world size; torch.distributed.checkpoint) -----------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer layout: `state[i]` (i: the parameter's index in the group) holds, under the key
        `rank{r}`, this rank's fragment of the master, the AdamW moments and the step count (zeros and 0 for a
        parameter never stepped, so a fresh optimizer's state_dict is a complete template for
        `torch.distributed.checkpoint.load`); `param_groups` the hyperparameters and the layout. Loads at the same
        world size; `consolidated_state_dict()` for another."""
        key = f"rank{self.rank}"
        state = {}
        for i, m in enumerate(self.masters):
            if m is None:
                state[i] = {}
                continue
            st = self.inner.state.get(m, {})
            state[i] = {key: {"master": m.detach().clone(),
                              "exp_avg": st["exp_avg"].clone() if "exp_avg" in st else torch.zeros_like(m),
                              "exp_avg_sq": st["exp_avg_sq"].clone() if "exp_avg_sq" in st else torch.zeros_like(m),
                              "step": torch.tensor(float(st["step"]) if "step" in st else 0.0)}}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group.update(zero_world=self.world, zero_names=list(self.names), zero_shapes=[list(s) for s in self.shapes],
                     params=list(range(len(self.names))))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load `state_dict()` of the same model at the same world size (also its form after
        torch.distributed.checkpoint's helpers, keyed by parameter name). Everything is checked first (world size,
        parameter names and shapes, each fragment's size, step counts); on any mismatch it raises ValueError and
        nothing changes. Then the model's weights are refreshed from the masters. A frozen parameter the state
        leaves out (as torch.distributed.checkpoint's set_state_dict does, after loading the model) keeps its
        weight: its master restarts from it, without moments (as a fresh torch AdamW would hold it)."""
        try:
            plan, left_out, hyper, error = *self._check_state_dict(state_dict), None
        except ValueError as e:
            error = e
        if self.world > 1:  # every rank refuses if one does (the others would go on into refresh's collectives)
            failed = torch.tensor([float(error is not None)])
            flags = [torch.zeros(1) for _ in range(self.world)]
            dist.all_gather(flags, failed, group=self.group)
            ranks = [r for r, f in enumerate(flags) if f.item()]
            if ranks and error is None:
                raise ValueError(f"ZeroAdamW.load_state_dict: rank(s) {ranks} refused the state (see their "
                                 f"errors); nothing was loaded")
        if error is not None:
            raise error
        params = self._params()
        with torch.no_grad():
            for i, (m, fragment) in enumerate(zip(self.masters, plan)):
                if i in left_out and m is not None:
                    m.copy_(_current_value(params[i])[self.starts[i]:self.starts[i] + m.numel()])
                    self.inner.state.pop(m, None)
                if fragment is None:  # (no fragment here, or left out)
                    continue
                master, exp_avg, exp_avg_sq, step = fragment
                m.copy_(master)
                if step > 0:
                    self.inner.state[m] = {"step": torch.tensor(step, dtype=torch.float32),
                                           "exp_avg": exp_avg.to(m.device, torch.float32, copy=True),
                                           "exp_avg_sq": exp_avg_sq.to(m.device, torch.float32, copy=True)}
                else:
                    self.inner.state.pop(m, None)  # never stepped: no state, as torch's AdamW
            self.param_groups[0].update(hyper)
        loaded = [i for i in range(len(params)) if i not in left_out]
        self._refresh([params[i] for i in loaded], loaded)
        self._mirror_state(params)

    def _check_state_dict(self, sd: Mapping[str, Any]) -> tuple[list, set[int], dict]:
        """(per parameter: (master, exp_avg, exp_avg_sq, step) of this rank's fragment, or None), the indices of
        the frozen parameters the state leaves out, and the hyperparameters of a per-rank state dict, after every
        check (ValueError naming what differs)."""
        where = "ZeroAdamW.load_state_dict"
        if not isinstance(sd, Mapping):
            raise ValueError(f"{where}: expected a dict from ZeroAdamW.state_dict(), got {type(sd).__name__}")
        if "world" in sd and "param_groups" not in sd:  # (the per-rank layout of earlier hybridq versions)
            if sd["world"] != self.world:
                raise ValueError(f"{where}: state saved with {sd['world']} ranks, this run has {self.world}; save "
                                 f"consolidated_state_dict() to resume at another world size")
            raise ValueError(f"{where}: a state dict of an earlier ZeroAdamW ('world'/'masters'/'adamw'); load a "
                             f"consolidated_state_dict() instead")
        groups = sd.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1 or not isinstance(sd.get("state"), Mapping):
            raise ValueError(f"{where}: expected 'state' and one param group (ZeroAdamW.state_dict()), got keys "
                             f"{sorted(sd)}")
        group = groups[0]
        missing = [k for k in (*_LAYOUT_KEYS, *HYPER, "params") if k not in group]
        if missing:
            raise ValueError(f"{where}: the param group lacks {missing}: not a ZeroAdamW state dict")
        if group["zero_world"] != self.world:
            raise ValueError(f"{where}: state saved with {group['zero_world']} ranks, this run has {self.world}; "
                             f"save consolidated_state_dict() to resume at another world size")
        names, shapes = list(group["zero_names"]), [tuple(s) for s in group["zero_shapes"]]
        if names != self.names or shapes != self.shapes:
            diff = [f"{a!r} {sa}" if (a, sa) != (b, sb) else None
                    for a, sa, b, sb in zip(names, shapes, self.names, self.shapes)]
            first = next((i for i, d in enumerate(diff) if d is not None), min(len(names), len(self.names)))
            saved = f"{names[first]!r} {shapes[first]}" if first < len(names) else "nothing"
            mine = f"{self.names[first]!r} {self.shapes[first]}" if first < len(self.names) else "nothing"
            raise ValueError(f"{where}: the state is of another model: {len(names)} parameters saved, "
                             f"{len(self.names)} here; parameter {first} is {saved} there, {mine} here")
        keys = list(group["params"])
        if len(keys) != len(self.names):
            raise ValueError(f"{where}: the param group lists {len(keys)} parameters, the state {len(self.names)}")
        rank_key = f"rank{self.rank}"
        plan, left_out = [], set()
        params = self._params()
        for i, (k, m, n) in enumerate(zip(keys, self.masters, self.names)):
            if k not in sd["state"] and not params[i].requires_grad:
                # torch.distributed.checkpoint's set_state_dict passes no state for a frozen parameter (as for
                # torch's optimizers): its fragment and moments stay as they are
                plan.append(None)
                left_out.add(i)
                continue
            entry = sd["state"].get(k, {})
            mine = entry.get(rank_key) if isinstance(entry, Mapping) else None
            if m is None:
                if mine:
                    raise ValueError(f"{where}: the state holds a fragment of {n!r} for rank {self.rank}, which owns "
                                     f"none in this layout")
                plan.append(None)
                continue
            if not isinstance(mine, Mapping):
                raise ValueError(f"{where}: no fragment of {n!r} for rank {self.rank} in the state")
            tensors = []
            for part in ("master", "exp_avg", "exp_avg_sq"):
                t = mine.get(part)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(m.shape) or not t.is_floating_point():
                    got = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
                    raise ValueError(f"{where}: the {part} fragment of {n!r} (rank {self.rank}) is {got}; this "
                                     f"rank's fragment has {m.numel()} fp32 elements ({tuple(m.shape)})")
                tensors.append(t)
            step = mine.get("step")
            step = (float(step) if isinstance(step, torch.Tensor) and step.numel() == 1
                    else float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None)
            if step is None or not step >= 0 or step != int(step):
                raise ValueError(f"{where}: the step count of {n!r} (rank {self.rank}) is {mine.get('step')!r}, "
                                 f"not a count >= 0")
            plan.append((*tensors, step))
        hyper = {k: v for k, v in group.items() if k not in ("params", *_LAYOUT_KEYS)}
        return plan, left_out, hyper

    # ---- consolidated state (any world size) --------------------------------------------------------------
    def consolidated_state_dict(self) -> dict:
        """The optimizer's whole state independent of the world size (a collective: every rank gets it): each
        parameter's fp32 master, AdamW moments and step count by name (`steps`; 0: never stepped) and the
        hyperparameters."""
        states = [None if m is None else self.inner.state.get(m, {}) for m in self.masters]

        def moment(key: str) -> dict[str, torch.Tensor]:
            return self._gather([None if m is None else st.get(key, torch.zeros_like(m))
                                 for m, st in zip(self.masters, states)])
        steps = self._steps()
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"masters": self.full_masters(), "exp_avg": moment("exp_avg"), "exp_avg_sq": moment("exp_avg_sq"),
                "step": max(steps), "steps": dict(zip(self.names, steps)), "hyperparameters": hyper}

    def load_consolidated_state_dict(self, state: dict) -> None:
        """Resume from `consolidated_state_dict()` saved at any world size: this rank takes its fragments of every
        master and moment, then the model's weights are refreshed. Raises (nothing changed) on a parameter missing
        or of another shape, or a step count that is not one. (A state without per-parameter `steps`, from an
        earlier version, gives every parameter its `step`.)"""
        steps = state.get("steps")
        for n, shape in zip(self.names, self.shapes):
            for key in ("masters", "exp_avg", "exp_avg_sq"):
                t = state[key].get(n)
                if t is None or tuple(t.shape) != shape:
                    raise ValueError(f"ZeroAdamW: the consolidated state's {key} of {n!r} is "
                                     f"{None if t is None else tuple(t.shape)}, the parameter is {shape}")
            s = state["step"] if steps is None else steps.get(n)
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not s >= 0 or s != int(s):
                raise ValueError(f"ZeroAdamW: the consolidated state's step count of {n!r} is {s!r}")
        if not isinstance(state.get("hyperparameters", {}), dict):
            raise ValueError("ZeroAdamW: the consolidated state's hyperparameters are not a dict")
        with torch.no_grad():
            for n, m, s in zip(self.names, self.masters, self.starts):
                if m is None:
                    continue
                m.copy_(state["masters"][n].reshape(-1)[s:s + m.numel()])
                step = float(state["step"] if steps is None else steps[n])
                if step == 0:
                    self.inner.state.pop(m, None)
                    continue
                self.inner.state[m] = {
                    "step": torch.tensor(step, dtype=torch.float32),
                    "exp_avg": state["exp_avg"][n].reshape(-1)[s:s + m.numel()].clone().to(m.device),
                    "exp_avg_sq": state["exp_avg_sq"][n].reshape(-1)[s:s + m.numel()].clone().to(m.device)}
            self.param_groups[0].update(state.get("hyperparameters", {}))
        params = self._params()
        self.refresh(params)
        self._mirror_state(params)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
