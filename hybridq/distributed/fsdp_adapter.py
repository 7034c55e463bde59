"""The one place that reads FSDP2's private state (so a torch upgrade touches this file only).

What hybridq needs from FSDP2 beyond the public all-gather extension (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`): which FSDPParam and param group hold a weight, whether the group is in forward or
backward, whether it reshards after forward / backward, the sharded parameter (its version counter), and a way
to make FSDP2 allocate new all-gather outputs when the payload changes size. Everything is looked up
defensively: when an attribute is missing the callers fall back to a conservative constant payload.

Checked against torch 2.11 (one `_fsdp_param_group` per state) and 2.13 (`_fsdp_param_groups`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..enums import Phase
from ..torch_private import in_backward

__all__ = ["FSDPLink", "ReduceScatterComm", "custom_reduce_scatters", "in_backward", "later_params",
           "pending_post_all_gathers", "phase_of", "state_phase"]


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12 (grouped fully_shard)
    if groups is None:
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return [g for g in groups if g is not None]


class FSDPLink:
    """Weak references to the FSDPParam of a module's `weight` and to its param group."""

    def __init__(self, fsdp_param, group):
        self._param = weakref.ref(fsdp_param)
        self._group = weakref.ref(group)

    @classmethod
    def find(cls, roots, module: nn.Module, param_name: str = "weight") -> "FSDPLink | None":
        """The link of `module.<param_name>`, searched in the FSDP modules under `roots`; None if not found."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return None
        seen = set()
        for root in roots:
            if root is None:
                continue
            for m in root.modules():
                if id(m) in seen or not isinstance(m, FSDPModule):
                    continue
                seen.add(id(m))
                try:
                    groups = _param_groups(m._get_fsdp_state())
                except Exception:  # noqa: BLE001 - internals differ: fall back
                    continue
                for g in groups:
                    for p in getattr(g, "fsdp_params", ()):
                        info = getattr(p, "_module_info", None)
                        if info is not None and info.module is module and info.param_name == param_name:
                            return cls(p, g)
        return None

    @property
    def alive(self) -> bool:
        return self._param() is not None and self._group() is not None

    @property
    def group(self):
        return self._group()

    def phase(self) -> Phase:
        return phase_of(self._group())

    def reshard_after_forward(self) -> bool:
        return getattr(self._group(), "post_forward_mesh_info", None) is not None

    def unshard_state(self) -> tuple[Phase, bool, bool]:
        """(phase, reshard_after_forward, reshard_after_backward) of the unshard running now (one look-up of the
        group: asked at every all-gather)."""
        g = self._group()
        return (phase_of(g), getattr(g, "post_forward_mesh_info", None) is not None,
                getattr(g, "reshard_after_backward", True) is not False)

    def reshard_after_backward(self) -> bool:
        return getattr(self._group(), "reshard_after_backward", True) is not False

    def sharded_param(self):
        """FSDP2's sharded DTensor parameter (with CPU offload, the one whose local tensor stays on the CPU)."""
        return getattr(self._param(), "sharded_param", None)

    def renew_all_gather_outputs(self, inp: torch.Tensor, world_size: int) -> None:
        """New all-gather outputs for the all-gather input `inp` (the payload changed size); FSDP2 keeps them for the
        later unshards. At world size 1 allocated here, as FSDP2 would allocate them right after on the same stream
        (its world-1 unshard asks for the input and copies it in `wait_for_unshard`): left to FSDP2, an evaluation
        under `torch.inference_mode()` that gathers other buffers than training would make them inference tensors,
        which the next training unshard cannot copy into ([Note: hooks outside inference mode], weights.py). At world
        size above 1 FSDP2 allocates them in its copy-out (the hooks run on its copy-in stream)."""
        if world_size == 1:
            self._param().all_gather_outputs = [torch.empty(inp.numel(), dtype=inp.dtype, device=inp.device)]
        else:
            self._param().all_gather_outputs = []

    def gathers_as_bytes(self) -> bool:
        """Whether FSDP2 copies every all-gather input of this weight's param group as bytes, whatever 16-bit float
        view the weight hands it ([Note: 16-bit items], distributed/layout.py): the group holds a parameter without
        all-gather hooks whose all-gather dtype (`param_dtype`, else its own) is not float16, so the group's inputs
        differ in dtype and FSDP2 views each as uint8 (`_get_all_gather_input_metadatas` / `foreach_all_gather`,
        torch 2.11 and 2.13). Asked once per link (the group's parameters do not change); False where FSDP2's
        internals are not as expected."""
        hit = self.__dict__.get("_as_bytes")
        if hit is None:
            hit = self._as_bytes = _holds_other_dtype(self._group(), torch.float16)
        return hit


def _holds_other_dtype(group, dtype: torch.dtype) -> bool:
    """Whether `group` (an FSDPParamGroup) holds a parameter FSDP2 all-gathers itself (no all-gather hooks) in a
    dtype other than `dtype`."""
    for p in getattr(group, "fsdp_params", None) or ():
        try:
            local = p._sharded_local_tensor
            gather_dtype = p.param_dtype or p.orig_dtype
        except Exception:  # noqa: BLE001 - internals differ: this one does not count
            continue
        if not hasattr(local, "fsdp_pre_all_gather") and isinstance(gather_dtype, torch.dtype) \
                and gather_dtype != dtype:
            return True
    return False


def _params_after(link: FSDPLink) -> list:
    """The FSDPParams after `link`'s in its param group, in the group's order; empty where the internals are not
    found."""
    params, mine = getattr(link.group, "fsdp_params", None), link._param()
    if params is None or mine is None:
        return []
    for i, p in enumerate(params):
        if p is mine:
            return params[i + 1:]
    return []


def later_params(link: FSDPLink) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, parameter name, sharded local tensor) of every FSDPParam after `link`'s in its param group, in the
    group's order: the order in which FSDP2 asks them for their all-gather inputs (`_get_param_all_gather_inputs`
    loops over `FSDPParamGroup.fsdp_params`, torch 2.11 and 2.13). Empty where the internals are not found."""
    out = []
    for p in _params_after(link):
        info = getattr(p, "_module_info", None)
        try:
            local = p._sharded_local_tensor
        except Exception:  # noqa: BLE001 - internals differ: this one is left out
            continue
        if info is not None:
            out.append((info.module, info.param_name, local))
    return out


def pending_post_all_gathers(link: FSDPLink) -> list[tuple[torch.Tensor, object, tuple]]:
    """(sharded local tensor, all-gather metadata, all-gather outputs) of every FSDPParam after `link`'s in its param
    group whose post-all-gather hook is still to run in the unshard running now: FSDP2 keeps the metadata the
    pre-all-gather hook returned (`FSDPParam._extensions_data`) until that parameter's `init_unsharded_param` hands it
    to the post-all-gather hook and clears it, and every parameter's all-gather output is written (copy-out, or at
    world 1 the copy of its input) before the first of those calls (`FSDPParamGroup.wait_for_unshard`, torch 2.11 and
    2.13). Empty where the internals are not found."""
    out = []
    for p in _params_after(link):
        ext = getattr(p, "_extensions_data", None)
        metadata = getattr(ext, "all_gather_metadata", None)
        if metadata is None:
            continue
        try:
            sizes, outputs = ext.all_gather_input_sizes, p.all_gather_outputs
            if not (len(sizes) == 1 == len(outputs) and len(sizes[0]) == 1):
                outputs = p._unflatten_all_gather_outputs()  # (one 1-D input: its output as it is, no view)
            local = p._sharded_local_tensor
        except Exception:  # noqa: BLE001 - internals differ: this one is left to its own hook
            continue
        out.append((local, metadata, outputs))
    return out


# id(FSDP2 TrainingState member) -> (member, Phase) of the states that name a phase (an enum member's `.name` is two
# Python calls; asked at every all-gather of every weight)
_PHASE_OF_STATE: dict = {}


def state_phase(ts) -> Phase | None:
    """The phase an FSDP2 training state names (FORWARD; PRE_BACKWARD, POST_BACKWARD), None for the others."""
    hit = _PHASE_OF_STATE.get(id(ts))
    if hit is not None and hit[0] is ts:
        return hit[1]
    name = getattr(ts, "name", "")
    phase = Phase.BACKWARD if name in ("PRE_BACKWARD", "POST_BACKWARD") else (
        Phase.FORWARD if name == "FORWARD" else None)
    if phase is not None:
        _PHASE_OF_STATE[id(ts)] = (ts, phase)
    return phase


def training_state(group):
    """The FSDP2 param group's current TrainingState member (None without one)."""
    return getattr(group, "_training_state", None)


def reshard_flags(group) -> tuple[bool, bool]:
    """(reshard_after_forward, reshard_after_backward) of an FSDP2 param group, as FSDPLink.unshard_state reads them."""
    return (getattr(group, "post_forward_mesh_info", None) is not None,
            getattr(group, "reshard_after_backward", True) is not False)


def phase_of(group) -> Phase:
    """The group's training state, or (no group, or a state that names no phase) whether autograd is running."""
    if group is not None:
        phase = state_phase(training_state(group))
        if phase is not None:
            return phase
    return Phase.BACKWARD if in_backward() else Phase.FORWARD


try:  # the interface FSDP2's set_custom_reduce_scatter takes (torch >= 2.9: allocate() and __call__)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterComm
except ImportError:  # pragma: no cover - older torch: grad_reduce refuses before it gets here
    ReduceScatterComm = object


def custom_reduce_scatters(fsdp_module: nn.Module) -> list:
    """The reduce-scatter comms of `fsdp_module`'s param groups that are not FSDP2's default one (a custom comm,
    symmetric memory or process-group allocation set by the user, or one hybridq installed)."""
    try:
        groups = _param_groups(fsdp_module._get_fsdp_state())
    except Exception:  # noqa: BLE001 - internals differ: nothing known
        return []
    comms = [getattr(g, "_reduce_scatter_comm", None) for g in groups]
    return [c for c in comms if c is not None and type(c).__name__ != "DefaultReduceScatter"]
