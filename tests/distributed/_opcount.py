"""Counting the tensor ops (each one a kernel launch on a GPU) that the FSDP2 weight path issues per converted weight
per training step (a test instrument, not part of the library): `fsdp_pre_all_gather` (statistics, shard quantization, payload packing), `fsdp_post_all_gather`
(unpacking, derivation, copies into the unsharded weight) and `precompute_scales`.

    with OpCounter(gpu_equivalent=True) as oc:
        ...training steps...
    print(oc.table())

`gpu_equivalent=True` counts a quantization the CUDA kernels take (a plain call, or per-tensor FP8 with reduced
statistics) as one op, like the fused kernel on a GPU, instead of the reference path's ops that run on CPU.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FUSED_TYPES = None


def _fused_on_gpu(q, kw) -> bool:
    """Whether hybridq.kernels.cuda_<format> would take this quantize_parts call on a CUDA tensor (see plain_kw)."""
    global _FUSED_TYPES
    from hybridq.formats import Float8BlockQuantizer, Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer

    if _FUSED_TYPES is None:
        _FUSED_TYPES = (Float8Quantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer)
    if type(q) not in _FUSED_TYPES:
        return False
    from hybridq.kernels.cuda import plain_kw

    return plain_kw(kw, ("amax", "stats", "shard") if type(q) is Float8Quantizer else ())


class OpCounter(TorchDispatchMode):
    """Counts aten ops by phase: kernels (non-view ops), views, bytes written by kernels, host constants
    (`torch.tensor(...)`), host syncs (`.item()`), collectives."""

    def __init__(self, gpu_equivalent: bool = True):
        super().__init__()
        self.gpu_equivalent = gpu_equivalent
        self.stack = ["other"]
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._fused_depth = 0
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._patches = contextlib.ExitStack()

    # -- phases -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def _wrap(self, owner, attr, name):
        orig = getattr(owner, attr)
        counter = self

        @functools.wraps(orig)
        def wrapped(*a, **k):
            with counter.phase(name):
                return orig(*a, **k)
        setattr(owner, attr, wrapped)
        self._patches.callback(setattr, owner, attr, orig)

    def _wrap_quantize(self):
        from hybridq.formats.base import Quantizer
        from hybridq.formats.hybrid import HybridQuantizer

        counter = self
        for cls in (Quantizer, HybridQuantizer):
            orig = cls.__dict__["quantize_parts"]

            def wrapped(q, x2d, rowwise, columnwise, _orig=orig, **kw):
                if (not counter.gpu_equivalent or counter._fused_depth or x2d.device.type == "meta"
                        or not _fused_on_gpu(q, kw)):
                    return _orig(q, x2d, rowwise, columnwise, **kw)
                counter._record("fused_quantize", x2d.numel() * (int(rowwise) + int(columnwise)))
                counter._fused_depth += 1
                try:
                    return _orig(q, x2d, rowwise, columnwise, **kw)
                finally:
                    counter._fused_depth -= 1
            setattr(cls, "quantize_parts", wrapped)
            self._patches.callback(setattr, cls, "quantize_parts", orig)

    def _wrap_unit_cast(self):
        """A unit batch's quantize (hybridq/kernels/fp8_tensors.py) as its CUDA op launches it: per 16 tensors one amax
        and one cast kernel."""
        from hybridq.kernels import fp8_tensors

        counter = self
        orig = fp8_tensors.quantize_fp8_tensors

        def wrapped(xs, *a, **k):
            if not counter.gpu_equivalent or counter._fused_depth or xs[0].device.type == "meta":
                return orig(xs, *a, **k)
            for i0 in range(0, len(xs), 16):
                counter._record("fused_quantize", sum(x.numel() * 4 for x in xs[i0:i0 + 16]))  # (amax: reads fp32)
                counter._record("fused_quantize", sum(x.numel() for x in xs[i0:i0 + 16]))  # (cast: writes fp8)
            counter._fused_depth += 1
            try:
                return orig(xs, *a, **k)
            finally:
                counter._fused_depth -= 1
        fp8_tensors.quantize_fp8_tensors = wrapped
        self._patches.callback(setattr, fp8_tensors, "quantize_fp8_tensors", orig)

    def __enter__(self):
        from hybridq.distributed import state, transport, unit_cast, weights

        self._wrap(weights.HybridWeight, "_pre_hook", "pre_all_gather")  # (what fsdp_pre_all_gather calls)
        self._wrap(weights.HybridWeight, "fsdp_post_all_gather", "post_all_gather")
        # the once-per-layout check of the shards' sharding rules (meta tensors: no kernel) is its own phase
        self._wrap(weights, "check_shard_layout", "layout_check")
        self._wrap(unit_cast, "_region", "layout_check")  # (likewise the unit batch's payload layout)
        self._wrap(state.WeightState, "reduced_stats", "pre_all_gather/stats")
        self._wrap(transport, "quantize_shard", "pre_all_gather/quantize")
        self._wrap(transport, "build_payload", "pre_all_gather/pack")
        self._wrap(weights, "assemble_parts", "post_all_gather/unpack")
        self._wrap(weights, "assemble_output", "post_all_gather/unpack")
        self._wrap_quantize()
        self._wrap_unit_cast()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def precompute_scales(self, model):
        from hybridq.distributed import precompute_scales

        with self.phase("precompute_scales"):
            return precompute_scales(model)

    # -- recording ------------------------------------------------------------------------------------
    def _record(self, kind: str, nbytes: int = 0):
        for name in self._names():
            c = self.counts[name]
            c[kind] += 1
            if kind in ("kernels", "fused_quantize"):
                c["launches"] += 1
                c["bytes"] += nbytes

    def _names(self):
        top = self.stack[-1]
        names = {top}
        if "/" in top:
            names.add(top.split("/")[0])
        return names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._fused_depth:
            return out
        ns = func.namespace
        for name in self._names():
            self.ops[name][str(func)] += 1
        if ns == "c10d":
            self._record("collectives")
        elif func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self._record("constants")
        elif func is torch.ops.aten._local_scalar_dense.default:
            self._record("syncs")
        elif func.is_view or func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                                      torch.ops.aten.reshape.default) or func.overloadpacket is torch.ops.aten.set_:
            # (set_: a storage swap, no kernel)
            self._record("views")
        else:
            nbytes = 0
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.device.type != "meta":
                    nbytes += t.numel() * t.element_size()
            self._record("kernels", nbytes)
        return out

    def summary(self, weights: int, steps: int) -> dict:
        """{phase: {kind: per weight per step}}."""
        div = max(weights * steps, 1)
        return {p: {k: v / div for k, v in c.items()} for p, c in self.counts.items()}


def launches_per_step(build, set_switch, phase: str, width: int) -> dict[bool, float]:
    """{switch on: launches of `phase` (e.g. "pre_all_gather") per training step}, a path's switch off and on
    (`set_switch(on)` returns the previous setting, restored after): for each, a model `build()` trained three SGD
    steps on inputs of `width` features, counted (GPU-equivalent) from the second step on (the steady state: the first
    step's unshards set up what the later ones reuse)."""
    launches = {}
    was = set_switch(False)
    try:
        for on in (False, True):
            set_switch(on)
            m = build()
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            counter = OpCounter()
            for step in range(3):
                if step == 1:
                    counter.__enter__()
                m(torch.randn(16, width)).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
            counter.__exit__(None, None, None)
            launches[on] = counter.counts[phase]["launches"] / 2
    finally:
        set_switch(was)
    return launches
