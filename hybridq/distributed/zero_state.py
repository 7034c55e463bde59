"""ZeroAdamW's state: whole tensors gathered from every rank's fragments, the per-rank `state_dict` (torch's
optimizer layout, for torch.distributed.checkpoint at the same world size) and the consolidated state (any world
size). A mixin of `ZeroAdamW` (zero.py), which owns the fragments (`masters`, `starts`, `layouts`), the inner AdamW
and the step."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..formats._sharding import cdiv
from ..nn.quantized_params import quantized_param_info

__all__ = ["HYPER", "ZeroStateDict"]

HYPER = ("lr", "betas", "eps", "weight_decay")  # what the step reads from the param group
_LAYOUT_KEYS = ("zero_world", "zero_names", "zero_shapes")  # the saved layout (param group entries)


def _current_value(p: torch.Tensor) -> torch.Tensor:
    """The parameter's values now, as flat fp32 (a quantized parameter dequantized)."""
    return (p.dequantize() if quantized_param_info(p) is not None else p).detach().float().reshape(-1)


class ZeroStateDict:
    """ZeroAdamW's state dicts (see the module docstring)."""

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
