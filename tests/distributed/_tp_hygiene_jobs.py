"""Jobs of test_tp_hygiene.py (spawned gloo process groups): layouts tensor / sequence parallelism refuses on every
rank with a clear error, and the warnings a hybridq TP / SP step must not emit. Each returns what it found per
check (JSON-serialisable)."""

from __future__ import annotations

import pathlib
import sys
import warnings

import torch
import torch.nn as nn

import hybridq

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _tp_jobs  # noqa: E402

HYBRIDQ_DIR = str(pathlib.Path(hybridq.__file__).resolve().parent)


def _error(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and the message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": "no error"}


def _uneven_linear(rank, mesh, tokens):
    """A column-parallel hybridq Linear taking a sequence-sharded input, rank r holding tokens[r] tokens."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.distributed import ColwiseParallel

    m = nn.Sequential(nn.Linear(64, 64, bias=False))
    hybridq.convert_linears(m, hybridq.recipe("fp8_tensorwise"))
    parallelize_module(m, mesh, {"0": ColwiseParallel(input_layouts=Shard(1))})
    m(torch.randn(1, tokens[rank], 64, requires_grad=True)).to_local().sum().backward()


def _uneven_block(rank, mesh, tokens):
    """The sequence-parallel norm, then the quantized all-gather into a SwiGLU MLP (PrepareModuleInput)."""
    from torch.distributed.tensor.parallel import parallelize_module

    m = _tp_jobs.Block(64, 128)
    hybridq.convert_linears(m, hybridq.recipe("fp8_tensorwise"))
    parallelize_module(m, mesh, _tp_jobs.tp_plan(1))
    m(torch.randn(1, tokens[rank], 64, requires_grad=True)).sum().backward()


def _weight_rows_cut(mesh):
    """A column-parallel MXFP8 weight of 160 rows: 2 ranks split it at row 80, inside a 32-row block."""
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.distributed import ColwiseParallel

    m = nn.Sequential(nn.Linear(64, 160, bias=False))
    hybridq.convert_linears(m, hybridq.recipe("mxfp8"))
    before = m[0].weight
    err = _error(lambda: parallelize_module(m, mesh, {"0": ColwiseParallel()}))
    err["unchanged"] = m[0].weight is before and m[0].__dict__.get("_tensor_parallel") is None
    return err


def job_refusals(rank, world_size, device) -> dict:
    """Uneven sequence shards (5 tokens on rank 0, 3 on rank 1; and 3 / 5) and a column-parallel weight split
    inside a block: what every rank raised."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    return {"uneven_linear_5_3": _error(lambda: _uneven_linear(rank, mesh, (5, 3))),
            "uneven_linear_3_5": _error(lambda: _uneven_linear(rank, mesh, (3, 5))),
            "uneven_block_5_3": _error(lambda: _uneven_block(rank, mesh, (5, 3))),
            "even_block_4_4": _error(lambda: _uneven_block(rank, mesh, (4, 4))),
            "weight_rows_cut": _weight_rows_cut(mesh)}


WARNING_CASES = [("mlp", "fp8_tensorwise", None), ("mlp", "mxfp8", None), ("mlp", "nvfp4", None),
                 ("mlp", "mxfp8", "high_precision"), ("attention", "mxfp8_fwd_nvfp4_bwd", None)]


def job_warnings(rank, world_size, device) -> dict:
    """A tensor- and sequence-parallel block per case, forward and backward twice, every warning recorded (the
    harness's filters reset): the deprecation warnings (FutureWarning, DeprecationWarning) from anywhere, and
    any warning raised in hybridq's own files."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for block, preset, override in WARNING_CASES:
        cls, plan, _, _ = _tp_jobs.BLOCKS[block]
        torch.manual_seed(0)
        m = cls(128, 256).to(device)
        hybridq.convert_linears(m, _tp_jobs.deterministic_recipe(preset, override))
        parallelize_module(m, mesh, plan(1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            for step in range(2):
                x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(step)).to(device)
                m(x.requires_grad_()).float().square().mean().backward()
        bad = [w for w in seen if issubclass(w.category, (FutureWarning, DeprecationWarning))
               or str(pathlib.Path(w.filename).resolve()).startswith(HYBRIDQ_DIR)]
        out[f"{block}/{preset}/{override}"] = sorted({f"{w.category.__name__} at {w.filename}:{w.lineno}: "
                                                      f"{str(w.message)[:200]}" for w in bad})
    return out


def job_all(rank, world_size, device) -> dict:
    return {"refusals": job_refusals(rank, world_size, device), "warnings": job_warnings(rank, world_size, device)}
