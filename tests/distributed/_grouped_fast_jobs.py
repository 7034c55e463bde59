"""Jobs of the grouped hooks' steady-state tests (test_fsdp_grouped_fast_hooks.py), run by spawned processes (see
_harness.spawn): a GroupedLinear whose `[E, out, in]` weight FSDP2 gathers quantized, run train / eval / train /
train (an SGD step after each train step) with the steady state (`grouped_fast`, [Note: grouped hooks' steady
state]) on and off; after every all-gather each expert's unsharded buffers are read."""

from __future__ import annotations

import pathlib
import sys

import torch

from hybridq.distributed import grouped_blocks_payload, grouped_fast
from hybridq.distributed import weights as weights_mod
from hybridq.torch_private import local_tensor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import tensor_diff  # noqa: E402
from _block_stacked_jobs import _layer, _step, recording_fills, step_differences  # noqa: E402

STEPS = ("train", "eval", "train", "train")


def _splits(e: int) -> list[int]:
    return [(5 * g + 3) % 11 if g != 1 else 0 for g in range(e)]  # (uneven counts, an expert without tokens)


def _run(case: dict, on: bool, rank: int, world_size: int, device) -> dict:
    was = grouped_fast.set_grouped_fast(on)
    try:
        root = _layer(case["preset"], case.get("experts", 4), case.get("out", 256), case.get("nonfinite", False),
                      device, world_size)
        lin = root.lin
        if not case.get("reshard", True):
            lin.set_reshard_after_forward(False)
        st = local_tensor(lin.weight)._hq
        opt = torch.optim.SGD(root.parameters(), lr=0.5)
        snaps: list = []
        steps = []
        with recording_fills(st, snaps):
            for step, mode in enumerate(STEPS):
                snaps.clear()
                y, dx, grad = _step(root, lin, opt, mode, _splits(lin.weight.shape[0]), 100 + 10 * rank + step,
                                    device)
                if mode != "train" and not case.get("reshard", True):
                    lin.reshard()
                steps.append({"y": y, "dx": dx, "dw": grad, "snaps": snaps[:]})
    finally:
        grouped_fast.set_grouped_fast(was)
    c = st.counters
    return {"steps": steps, "lanes_flagged": len(st.__dict__.get("pre_flags", {})),
            "reused": c.get("payload_reused", 0), "stacked_block_payloads": c.get("stacked_block_payloads", 0),
            "stacked_fills_kept": c.get("stacked_fills_kept", 0)}


def _differences(case: dict, a: dict, b: dict, rank: int) -> list[str]:
    """How run `a` (steady state on) differs from run `b` (off): outputs, gradients and every all-gather's
    snapshot, bitwise."""
    return [d for s, (sa, sb) in enumerate(zip(a["steps"], b["steps"]))
            for d in step_differences(sa, sb, f"{case} step {s} ({STEPS[s]}) rank {rank}, on vs off")]


def job_fast_hooks(rank, world_size, device, cases):
    """For each case (preset, experts, out, nonfinite, reshard): the steady state on and off; the differences of
    every output, gradient and gathered tensor, and what each run counted (lanes whose flags were kept, payloads
    reused by the backward unshard, stacked block payloads)."""
    out = []
    for case in cases:
        on = _run(case, True, rank, world_size, device)
        off = _run(case, False, rank, world_size, device)
        out.append({"diffs": _differences(case, on, off, rank),
                    "on": {k: v for k, v in on.items() if k != "steps"},
                    "off": {k: v for k, v in off.items() if k != "steps"},
                    "gathers": sum(len(s["snaps"]) for s in on["steps"])})
    return out


def _train(root, lin, opt, rank: int, step: int, device) -> None:
    _step(root, lin, opt, "train", _splits(lin.weight.shape[0]), 100 + 10 * rank + step, device)


def job_flags_follow_the_payload_switch(rank, world_size, device):
    """FP8 128x128 experts, steady state on: stacked block payloads built per train step while the stacked block
    payload's switch is on, after it is turned off, and after it is turned on again (the lanes' flags are kept across
    the turns: each must be asked again)."""
    root = _layer("fp8_block", 4, 256, False, device, world_size)
    lin = root.lin
    st = local_tensor(lin.weight)._hq
    opt = torch.optim.SGD(root.parameters(), lr=0.5)
    built = []
    was = grouped_fast.set_grouped_fast(True)
    try:
        for step, payload in enumerate((True, True, False, False, True)):
            grouped_blocks_payload.set_stacked_block_payload(payload)
            before = st.counters.get("stacked_block_payloads", 0)
            _train(root, lin, opt, rank, step, device)
            built.append(st.counters.get("stacked_block_payloads", 0) - before)
    finally:
        grouped_blocks_payload.set_stacked_block_payload(True)
        grouped_fast.set_grouped_fast(was)
    return {"built": built, "lanes_flagged": len(st.__dict__.get("pre_flags", {}))}


def job_flags_belong_to_their_lane(rank, world_size, device):
    """FP8 128x128 experts, steady state on: after two train steps, every kept flag entry is replaced by one made for
    another lane object (what an entry left under a reused id would be) saying the block payload does not apply;
    the next train step's payloads: built by the stacked block payload (the lane's own flags asked anew) or not."""
    from hybridq.distributed.grouped_fast import PreFlags

    root = _layer("fp8_block", 4, 256, False, device, world_size)
    lin = root.lin
    st = local_tensor(lin.weight)._hq
    opt = torch.optim.SGD(root.parameters(), lr=0.5)
    was = grouped_fast.set_grouped_fast(True)
    try:
        for step in range(2):
            _train(root, lin, opt, rank, step, device)
        kept = st.__dict__["pre_flags"]
        stale = 0
        for key, flags in list(kept.items()):
            other = object()  # (another lane)
            kept[key] = PreFlags(other, flags.switch, flags.stacked, False, flags.tail)
            stale += 1
        before = st.counters.get("stacked_block_payloads", 0)
        _train(root, lin, opt, rank, 2, device)
        built = st.counters.get("stacked_block_payloads", 0) - before
    finally:
        grouped_fast.set_grouped_fast(was)
    return {"stale_entries": stale, "built": built}


def job_no_quantizer_comparisons(rank, world_size, device, preset):
    """The experts' quantizer comparisons (`__eq__` of the quantizer class) during the all-gather hooks of train
    steps 2 and 3 (the steady state), with the steady state on and off."""
    out = {}
    for on in (True, False):
        was = grouped_fast.set_grouped_fast(on)
        root = _layer(preset, 4, 256, False, device, world_size)
        lin = root.lin
        opt = torch.optim.SGD(root.parameters(), lr=0.5)
        cls = type(lin.weight_quantizers()[0])
        real_eq, count, hooks = cls.__eq__, [0], [False]

        def eq(self, other):
            if hooks[0]:
                count[0] += 1
            return real_eq(self, other)
        pre, post = weights_mod.GroupedHybridWeight._pre_all_gather, weights_mod.GroupedHybridWeight._post_all_gather

        def counted(fn):
            def call(*a, **k):
                hooks[0] = True
                try:
                    return fn(*a, **k)
                finally:
                    hooks[0] = False
            return call
        cls.__eq__ = eq
        try:
            _train(root, lin, opt, rank, 0, device)
            weights_mod.GroupedHybridWeight._pre_all_gather = counted(pre)
            weights_mod.GroupedHybridWeight._post_all_gather = counted(post)
            for step in (1, 2):
                _train(root, lin, opt, rank, step, device)
        finally:
            cls.__eq__ = real_eq
            weights_mod.GroupedHybridWeight._pre_all_gather, weights_mod.GroupedHybridWeight._post_all_gather = pre, post
            grouped_fast.set_grouped_fast(was)
        out["on" if on else "off"] = count[0]
    return out


def job_kept_fill_follows_the_stacked_views(rank, world_size, device):
    """Per-tensor FP8 experts, steady state on: the stacked fills run again from the kept copies per train step;
    then the state's stacked views are made anew (new view objects of the same buffers, as after buffers are
    re-made) and one more train step runs: how many fills ran from kept copies in it, and whether its buffers are
    bitwise those of a fill asking everything (the same step with the steady state off on a twin layer)."""
    out = {}
    for on in (True, False):
        was = grouped_fast.set_grouped_fast(on)
        try:
            root = _layer("fp8_tensorwise", 4, 256, False, device, world_size)
            lin = root.lin
            st = local_tensor(lin.weight)._hq
            opt = torch.optim.SGD(root.parameters(), lr=0.5)
            kept = []
            for step in range(3):
                if step == 2:
                    st.__dict__.pop("stacked_views", None)
                before = st.counters.get("stacked_fills_kept", 0)
                snaps = []
                with recording_fills(st, snaps):
                    _train(root, lin, opt, rank, step, device)
                kept.append(st.counters.get("stacked_fills_kept", 0) - before)
        finally:
            grouped_fast.set_grouped_fast(was)
        out["on" if on else "off"] = {"kept": kept, "snaps": snaps}
    diffs = []
    for i, (a, b) in enumerate(zip(out["on"]["snaps"], out["off"]["snaps"])):
        diffs += [d for d in (tensor_diff(a[k], b[k], f"step 2 gather {i} {k}") for k in a) if d]
    if len(out["on"]["snaps"]) != len(out["off"]["snaps"]):
        diffs.append(f"{len(out['on']['snaps'])} all-gathers on, {len(out['off']['snaps'])} off")
    return {"kept_on": out["on"]["kept"], "kept_off": out["off"]["kept"], "diffs": diffs}


def job_alloc_after_new_buffers(rank, world_size, device, preset):
    """Steady state on: after two train steps the experts' stacked buffers are made anew and freed (as FSDP2 frees
    them at reshard); `alloc_slabs` of every direction then: bytes of each new slab's storage against its size."""
    was = grouped_fast.set_grouped_fast(True)
    try:
        root = _layer(preset, 4, 256, False, device, world_size)
        lin = root.lin
        st = local_tensor(lin.weight)._hq
        opt = torch.optim.SGD(root.parameters(), lr=0.5)
        for step in range(2):
            _train(root, lin, opt, rank, step, device)
        dirs = ("rowwise", "columnwise")
        st.alloc_slabs(dirs)  # (its sizes kept for the old slabs)
        st._stack_buffers()
        for slab, _ in st.slabs:
            slab.untyped_storage().resize_(0)
        st.alloc_slabs(dirs)
        return [[slab.untyped_storage().nbytes(), slab.numel() * slab.element_size()] for slab, _ in st.slabs]
    finally:
        grouped_fast.set_grouped_fast(was)
