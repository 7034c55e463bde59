"""Jobs of test_fsdp_derived_replay.py, run by spawned processes (see _harness.spawn): two identical models of two
hybridq Linears under FSDP2 (each its own unit, under a root unit: forward and backward unshards alternate), one as
hybridq runs it (its backward unshards replayed: the columnwise form derived into FSDP2's allocation,
buffers.py [Note: replayed fill]), one whose weight states never record a fill (every unshard filled as usual: the
path the replay replaces). Both take the same steps -- AdamW updates between them, an eval forward, a change of
reshard_after_forward, a new recipe (new quantizer objects), a non-finite weight -- and every output, loss, gradient and every
gathered byte of every unshard is compared bitwise between them, the gathered columnwise form also with the
quantization of the full weight on one rank (its oracle)."""

from __future__ import annotations

import torch
import torch.nn as nn

import hybridq
from hybridq.distributed import HybridWeight
from hybridq.formats import COLUMNWISE

from _compare import parts_diff, tensor_diff
from _jobs import _fsdp, _states

IN, HID, OUT, ROWS = 128, 256, 128, 32


class _Body(nn.Module):
    def __init__(self, preset: str):
        super().__init__()
        self.fc1 = hybridq.Linear(IN, HID, recipe=preset, name="fc1")
        self.fc2 = hybridq.Linear(HID, OUT, recipe=preset, name="fc2")

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model(preset: str, device, world_size: int, replay: bool):
    from hybridq.distributed import apply_hybrid_fsdp

    torch.manual_seed(0)
    model = _Body(preset).to(device)
    apply_hybrid_fsdp(model, hybridq.recipe(preset), on_incompatible="error")
    fully_shard, mp = _fsdp(device, world_size)
    for lin in (model.fc1, model.fc2):
        fully_shard(lin, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if not replay:
        for st in _states(model).values():
            st.record_fill = lambda *args, **kwargs: None  # (no record: nothing is ever replayed)
    return model


class _Spy:
    """Every post-all-gather hook's result, per weight state: the bytes of each direction it filled (copies)."""

    def __init__(self):
        self.seen: dict[int, list] = {}
        self._orig = HybridWeight.fsdp_post_all_gather

    def __enter__(self):
        spy, orig = self, self._orig

        def hook(weight, outputs, metadata, param_dtype, *, out=None):
            result = orig(weight, outputs, metadata, param_dtype, out=out)
            st = weight._hq
            plan = metadata.plan
            spy.seen.setdefault(id(st), []).append(
                (plan.materialize, {d: st.parts[d].map_tensors(lambda t: t.detach().clone()) for d in plan.materialize}))
            return result

        HybridWeight.fsdp_post_all_gather = hook
        return self

    def __exit__(self, *exc):
        HybridWeight.fsdp_post_all_gather = self._orig


def _set_reshard(model, value: bool) -> None:
    for lin in (model.fc1, model.fc2):
        lin.set_reshard_after_forward(value)


def _steps() -> list[dict]:
    """The steps both models take, in order."""
    return ([{"train": True}] * 3 + [{"train": False}, {"train": True}, {"train": False}, {"train": True}]
            + [{"train": True, "reshard_after_forward": False}, {"train": True, "reshard_after_forward": False}]
            + [{"train": True, "reshard_after_forward": True}, {"train": True}]
            + [{"train": True, "recipe": True}, {"train": True}, {"train": True}]
            + [{"train": True, "non_finite": True}, {"train": True}])


def job_derived_replays(rank, world_size, device, cases: list) -> list:
    return [job_derived_replay(rank, world_size, device, **case) for case in cases]


def job_derived_replay(rank, world_size, device, preset: str) -> dict:
    models = {tag: _model(preset, device, world_size, replay=tag == "replay") for tag in ("replay", "usual")}
    opts = {tag: torch.optim.AdamW(m.parameters(), lr=3e-2, foreach=False) for tag, m in models.items()}
    diffs: list[str] = []
    per_step: list[dict] = []
    g = torch.Generator().manual_seed(100 + rank)
    for i, step in enumerate(_steps()):
        x = torch.randn(ROWS, IN, generator=g).to(device)
        results, counters = {}, {}
        for tag, model in models.items():
            if "reshard_after_forward" in step:
                _set_reshard(model, step["reshard_after_forward"])
            if step.get("recipe"):
                model.fc1.recipe = hybridq.recipe(preset)  # (new quantizers of the weight's format)
            if step.get("non_finite"):
                with torch.no_grad():
                    local = model.fc2.weight._local_tensor
                    local.view(-1)[0] = float("inf")
                    local.view(-1)[-1] = float("nan")
            before = {n: dict(st.counters) for n, st in _states(model).items()}
            with _Spy() as spy:
                if step["train"]:
                    y = model(x)
                    loss = y.float().square().mean()
                    loss.backward()
                    # (clones: on one rank full_tensor may be the parameter's own storage, which the step updates)
                    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
                    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
                    opts[tag].step()
                    opts[tag].zero_grad(set_to_none=True)
                else:
                    with torch.no_grad():
                        y = model(x)
                    loss, grads, full = y.float().square().mean(), {}, {}
            states = _states(model)
            seen = {n: spy.seen.get(id(st), []) for n, st in states.items()}
            counters[tag] = {n: {k: v - before[n].get(k, 0) for k, v in st.counters.items()
                                 if k in ("fill_replayed", "derived_in_place")} for n, st in states.items()}
            results[tag] = (y.detach(), loss.detach(), grads, full, seen, states)
        (y_a, l_a, g_a, full_a, seen_a, st_a), (y_b, l_b, g_b, _, seen_b, _) = results["replay"], results["usual"]
        what = f"step {i} {step}"
        for name, a, b in [("output", y_a, y_b), ("loss", l_a, l_b)] + [(f"grad of {n}", g_a[n], g_b[n]) for n in g_a]:
            bad = tensor_diff(a, b, f"{what}: {name}")
            if bad:
                diffs.append(bad)
        for n in seen_a:
            if len(seen_a[n]) != len(seen_b[n]):
                diffs.append(f"{what}: {n} unshards {len(seen_a[n])} (replay) vs {len(seen_b[n])} (usual)")
                continue
            for u, ((dirs_a, got), (dirs_b, want)) in enumerate(zip(seen_a[n], seen_b[n])):
                if dirs_a != dirs_b:
                    diffs.append(f"{what}: {n} unshard {u} filled {dirs_a} (replay) vs {dirs_b} (usual)")
                    continue
                for d in dirs_a:
                    diffs += parts_diff(got[d], want[d], f"{what}: {n} unshard {u} {d}, replay vs usual")
                if COLUMNWISE in dirs_a and full_a:  # the oracle: the full weight quantized on one rank
                    lin = getattr(models["replay"], n.split(".")[-1])
                    w = full_a[f"{n}.weight" if n else "weight"].to(torch.bfloat16)
                    oracle = lin.weight_quantizer.quantize_parts(w, False, True)[1]
                    diffs += parts_diff(got[COLUMNWISE], oracle, f"{what}: {n} unshard {u} columnwise vs the full "
                                                                 f"weight's quantization")
        per_step.append({"step": i, "counters": counters})
    return {"diffs": diffs, "per_step": per_step}
