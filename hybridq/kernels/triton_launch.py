"""Launching hybridq's Triton kernels with less host time: the compiled kernel cached per specialization, its launcher
called directly.

`kernel[grid](...)` (Triton's `JITFunction.run`) binds the arguments, specializes each one, builds a cache key from
the specializations and the options, looks the kernel up, checks the globals it read and builds launch metadata on
every call: ~50-100 us of host time per launch on the GPU machine, ~60 launches per step of the MoE job. `launch`
does the same lookup from a key of its own -- for each argument what Triton specializes on (a tensor's dtype and
16-byte alignment, an integer's ==1 / multiple-of-16 / 32-bit range, a constexpr's or a bool's value), the options,
the device and Triton's debug knobs -- and calls the compiled kernel's launcher with the arguments as `JITFunction.run`
passes them. A key seen for the first time goes through `kernel[grid](...)` (compiling if Triton must) and its
compiled kernel is kept: the key is at least as fine as Triton's, so a kept kernel is the one Triton would pick.
Where the compiled kernel needs no scratch memory (global or profile: the grouped kernels need none), the launcher's C
function is called directly with the arguments its Python wrapper (`CudaLauncher.__call__`) would pass it, the two
scratch pointers None, as that wrapper passes them for a size of 0.

Taken only where it is known to match Triton's own launch: Triton 3.6 (the version this was written against), a
`JITFunction` (not the interpreter's), no pre-run hooks and no launch hooks (profilers such as proton add
them).
Elsewhere, and with the switch `ENABLED` off (HYBRIDQ_TRITON_CACHED_LAUNCH=0; the tests compare both paths' bytes),
every call is `kernel[grid](...)`.
"""

from __future__ import annotations

import torch

from ..switches import Switch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain
    from triton.runtime.jit import JITFunction as _JITFunction
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = _knobs = _HookChain = _JITFunction = None
try:  # (the NVIDIA backend's launcher: its C function is called directly where no scratch memory is needed)
    from triton.backends.nvidia.driver import CudaLauncher as _CudaLauncher
except Exception:  # noqa: BLE001
    _CudaLauncher = None

SUPPORTED_TRITON = ("3.6",)  # the versions whose JITFunction.run this module reproduces
SUPPORTED = triton is not None and triton.__version__.startswith(SUPPORTED_TRITON)  # (else Triton's launch only)
ENABLED = Switch("HYBRIDQ_TRITON_CACHED_LAUNCH")

# (id of the kernel, launch_key) -> (the kernel, its compiled kernel, the function called, the arguments before the
# kernel's, the constexprs' values after them); keyed by the kernel's id (a JITFunction hashes through its source
# hash, behind a lock), the kernel kept in the entry and compared
_CACHE: dict = {}
_MAX_ENTRIES = 256  # (bounded: a key per shape class, not per shape; cleared whole if ever exceeded)
_I32 = (-0x80000000, 0x7FFFFFFF)


def _arg_keys(args: tuple) -> tuple:
    """What Triton's specialization of each argument depends on, as hashable values: a tensor's dtype and 16-byte
    alignment; an int's ==1 / multiple of 16 / 32-bit / 64-bit unsigned classes; anything else (bools, constexprs,
    None) by value. (One comprehension, no call per argument: a launch has ~15.)"""
    return tuple([(v.dtype, v.data_ptr() & 15 == 0) if isinstance(v, torch.Tensor)
                  else (v == 1, v & 15 == 0, _I32[0] <= v <= _I32[1], v >= 0x8000000000000000)
                  if isinstance(v, int) and not isinstance(v, bool) else v
                  for v in args])


def arg_key(v) -> object:
    """What Triton's specialization of one argument depends on, as a hashable value."""
    return _arg_keys((v,))[0]


def launch_key(args: tuple, kwargs: dict, device: int, debug: object = None) -> tuple:
    """The cache key of a launch with these positional arguments and keyword arguments (constexprs, options) on CUDA
    device index `device`; `debug`: Triton's debug / instrumentation knobs (compiled into the kernel)."""
    return (device, debug, tuple(kwargs.items()), _arg_keys(args))


def _no_hook(hook) -> bool:
    """Whether a launch hook of Triton's knobs does nothing (an empty chain: Triton 3.6's default)."""
    return hook is None or (type(hook) is _HookChain and not hook.calls)


def _fast_path_ok(fn) -> bool:
    if not (ENABLED.on and SUPPORTED):
        return False
    runtime = _knobs.runtime
    return (type(fn) is _JITFunction and not fn.pre_run_hooks
            and _no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook))


def _entry(fn, kernel, names: tuple, kwargs: dict) -> tuple:
    """The cache entry of a compiled kernel (see `_CACHE`): the launcher's C function and the arguments it takes
    before the kernel's where the kernel needs no scratch memory, else the launcher itself (which allocates it)."""
    run = kernel.run
    consts = tuple(kwargs[n] for n in names)
    # launch_metadata, the enter and exit hooks: None (no hook installed: `_fast_path_ok`)
    tail = (kernel.packed_metadata, None, None, None)
    if (_CudaLauncher is not None and type(run) is _CudaLauncher and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        return (fn, kernel, run.launch, (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                                         *tail), consts)
    return fn, kernel, run, (kernel.function, *tail), consts


def launch(fn, grid: tuple, *args, **kwargs):
    """`fn[grid](*args, **kwargs)` -- non-constexpr arguments positional, constexprs and options (num_warps,
    num_stages) by keyword -- through the cached launcher where `_fast_path_ok`; returns the compiled kernel."""
    if not _fast_path_ok(fn):
        return fn[grid](*args, **kwargs)
    device = torch._C._cuda_getDevice()
    key = (id(fn), launch_key(args, kwargs, device, (_knobs.runtime.debug, _knobs.compilation.instrumentation_mode)))
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not fn:
        kernel = fn[grid](*args, **kwargs)  # (Triton's own path: compiles or finds the kernel, and launches it)
        names = fn.arg_names[len(args):]
        if not all(n in kwargs for n in names):  # (a parameter left to its default: Triton's path every time)
            return kernel
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = _entry(fn, kernel, names, kwargs)
        return kernel
    _, kernel, run, head, consts = hit
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device), *head,
        *args, *consts)
    return kernel


# [Note: launch plans]
# What a Triton launch passes besides its tensors -- the grid, the constexprs and options, scale shapes -- is a pure
# function of a few sizes and options, yet deriving it costs ~10 Python calls per launch (several launches per expert
# layer). Each kernel family keeps its plans in a dict of its own, per the arguments that make them (`kept_plan`),
# bounded: cleared whole past MAX_PLANS entries (a few call shapes per model; a slot count per routing at most).
MAX_PLANS = 256


def kept_plan(plans: dict, key: tuple, make, *args):
    """plans[key], made as make(*args) the first time (`key` must hold everything the plan depends on)."""
    hit = plans.get(key)
    if hit is None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        hit = plans[key] = make(*args)
    return hit


def config_key(config) -> tuple | None:
    """A benchmark's tile configuration (a sequence, or None: the default) as part of a plan's key."""
    return None if config is None else tuple(config)


def cached_kernels() -> int:
    """How many (kernel, specialization) launchers are kept (tests)."""
    return len(_CACHE)
