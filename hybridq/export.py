"""`export_state_dict`: one file holding a hybridq model's high-precision weights, loadable by a plain nn.Module.

Under FSDP2 the weights are gathered (a collective: every rank calls it) and rank 0 writes the file. hybridq's own
state (the `delayed_scaling.*` keys of nn/delayed_state.py) is left out: it is training state, not weights, and a
plain module has no place for it.
"""

from __future__ import annotations

import os
import pathlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .nn.delayed_state import PREFIX as _DELAYED_PREFIX

__all__ = ["export_state_dict"]

FORMATS = ("auto", "safetensors", "torch")


def _safetensors_available() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def _is_distributed(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if _is_distributed(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if f".{_DELAYED_PREFIX}" in f".{k}":
            continue
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"export_state_dict: state_dict[{k!r}] is a {type(v).__name__}, not a tensor")
        if type(v) is not torch.Tensor:
            raise TypeError(f"export_state_dict: state_dict[{k!r}] is a {type(v).__name__}; expected a plain "
                            f"high-precision tensor (is the model's state_dict hook installed? apply_hybrid_fsdp "
                            f"installs it)")
        # own contiguous CPU storage: safetensors refuses shared storage (tied weights), and the file must not alias
        out[k] = v.detach().to("cpu").contiguous().clone()
    return out


def export_state_dict(model: nn.Module, path: str | os.PathLike, *, overwrite: bool = False,
                      format: str = "auto") -> pathlib.Path:
    """Write `model`'s weights as one high-precision `state_dict` file that a plain nn.Module (the same
    architecture with torch.nn.Linear layers) loads with `load_state_dict`.

    format: "safetensors" (needs the safetensors package; load with `safetensors.torch.load_file`), "torch"
    (`torch.save`; load with `torch.load(path, weights_only=True)`), or "auto": safetensors when installed, else
    torch. An existing file is never replaced unless `overwrite=True` (FileExistsError, checked before anything
    is gathered); the file is written under a temporary name and renamed, so an interrupted export leaves no
    partial file at `path`. Under FSDP2 every rank must call it (the weights are gathered); rank 0 writes.
    Returns the path.
    """
    if format not in FORMATS:
        raise ValueError(f"export_state_dict: format must be one of {FORMATS}, got {format!r}")
    if format == "safetensors" and not _safetensors_available():
        raise ImportError("export_state_dict: format='safetensors' needs the safetensors package "
                          "(pip install safetensors), or use format='torch'")
    use_st = format == "safetensors" or (format == "auto" and _safetensors_available())
    path = pathlib.Path(path)
    distributed = dist.is_available() and dist.is_initialized() and _is_distributed(model)
    main = not distributed or dist.get_rank() == 0
    verdict = [None]
    if main:
        if path.exists() and not overwrite:
            verdict[0] = f"export_state_dict: {path} exists; pass overwrite=True to replace it"
        elif not path.parent.is_dir():
            verdict[0] = f"export_state_dict: folder {path.parent} does not exist"
    if distributed:  # every rank stops on a refusal, before the collective
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise (FileNotFoundError if "does not exist" in verdict[0] else FileExistsError)(verdict[0])
    sd = _full_state_dict(model)
    if main:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            if use_st:
                import safetensors.torch

                safetensors.torch.save_file(sd, str(tmp))
            else:
                torch.save(sd, tmp)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    if distributed:
        dist.barrier()
    return path
