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

Taken only where it is known to match Triton's own launch: Triton 3.6 (the version this was written against), a
`JITFunction` (not the interpreter's), no pre-run hooks and no launch hooks (profilers such as proton add
them).
Elsewhere, and with `ENABLED` off (the tests compare both paths' bytes), every call is `kernel[grid](...)`.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU machines and CI have none
    import triton
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain
    from triton.runtime.jit import JITFunction as _JITFunction
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = _knobs = _HookChain = _JITFunction = None

SUPPORTED_TRITON = ("3.6",)  # the versions whose JITFunction.run this module reproduces
ENABLED = triton is not None and triton.__version__.startswith(SUPPORTED_TRITON)

_CACHE: dict = {}  # (kernel, key) -> (launcher, function handle, packed metadata, names of the keyword arguments)
_MAX_ENTRIES = 256  # (bounded: a key per shape class, not per shape; cleared whole if ever exceeded)
_I32 = (-0x80000000, 0x7FFFFFFF)


def arg_key(v) -> object:
    """What Triton's specialization of one argument depends on, as a hashable value."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() & 15 == 0)
    if isinstance(v, bool) or not isinstance(v, int):  # (bools, constexprs, None: by value)
        return v
    return (v == 1, v & 15 == 0, _I32[0] <= v <= _I32[1], v >= 0x8000000000000000)


def launch_key(args: tuple, kwargs: dict, device: int, debug: object = None) -> tuple:
    """The cache key of a launch with these positional arguments and keyword arguments (constexprs, options) on CUDA
    device index `device`; `debug`: Triton's debug / instrumentation knobs (compiled into the kernel)."""
    return (device, debug, tuple(kwargs.items()), tuple(map(arg_key, args)))


def _no_hook(hook) -> bool:
    """Whether a launch hook of Triton's knobs does nothing (an empty chain: Triton 3.6's default)."""
    return hook is None or (type(hook) is _HookChain and not hook.calls)


def _fast_path_ok(fn) -> bool:
    runtime = _knobs.runtime if ENABLED else None
    return (ENABLED and type(fn) is _JITFunction and not fn.pre_run_hooks
            and _no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook))


def launch(fn, grid: tuple, *args, **kwargs):
    """`fn[grid](*args, **kwargs)` -- non-constexpr arguments positional, constexprs and options (num_warps,
    num_stages) by keyword -- through the cached launcher where `_fast_path_ok`; returns the compiled kernel."""
    if not _fast_path_ok(fn):
        return fn[grid](*args, **kwargs)
    device = torch._C._cuda_getDevice()
    debug = (_knobs.runtime.debug, _knobs.compilation.instrumentation_mode)
    key = (fn, launch_key(args, kwargs, device, debug))
    hit = _CACHE.get(key)
    if hit is None:
        kernel = fn[grid](*args, **kwargs)  # (Triton's own path: compiles or finds the kernel, and launches it)
        names = fn.arg_names[len(args):]
        if not all(n in kwargs for n in names):  # (a parameter left to its default: Triton's path every time)
            return kernel
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = (kernel, kernel.run, kernel.function, kernel.packed_metadata, names)
        return kernel
    kernel, run, function, packed, names = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), function, packed, None, None, None, *args,
        *[kwargs[n] for n in names])
    return kernel


def cached_kernels() -> int:
    """How many (kernel, specialization) launchers are kept (tests)."""
    return len(_CACHE)
